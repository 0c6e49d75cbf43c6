"""The synthetic shapes set: a real COCO dataset, the same for the same seed, every annotation what the image shows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("pycocotools")
from pycocotools import mask as mask_utils  # noqa: E402

from attnlab.data.coco import build_shapes  # noqa: E402
from attnlab.data.shapes import ShapesOptions, generate_shapes  # noqa: E402
from attnlab.errors import DatasetError  # noqa: E402

SMALL = ShapesOptions(seed=3, train_images=24, val_images=4, image_size=64, min_size=8, max_size=24,
                      empty_fraction=0.2)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return generate_shapes(tmp_path_factory.mktemp("shapes") / "set", SMALL)


def _load(root, split="train"):
    return json.loads((root / "annotations" / f"instances_{split}.json").read_text())


def test_annotations_are_what_the_image_shows(shapes):
    data = _load(shapes)
    assert [c["name"] for c in data["categories"]] == ["square", "disk", "triangle"]
    assert len(data["images"]) == 24
    by_image = {}
    for ann in data["annotations"]:
        m = mask_utils.decode(ann["segmentation"]).astype(bool)
        ys, xs = np.nonzero(m)
        assert ann["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1]
        assert ann["area"] == m.sum() and ann["iscrowd"] == 0
        by_image.setdefault(ann["image_id"], []).append((ann, m))
    for image_id, anns in by_image.items():
        pixels = np.asarray(Image.open(shapes / "train" / f"{image_id:06d}.png"))
        assert pixels.shape == (64, 64, 3)
        masks = np.stack([m for _, m in anns])
        assert masks.sum(0).max() == 1  # visible parts: an occluded pixel belongs to the shape on top only
        background = ~masks.any(0)
        for _, m in anns:  # shapes are brighter than the dark background in their strongest channel
            strongest = pixels[m].mean(0).argmax()
            assert pixels[m][:, strongest].mean() > pixels[background][:, strongest].mean() + 30
    assert len(by_image) < 24  # some images have no object
    assert {a["category_id"] for a in data["annotations"]} == {1, 2, 3}
    sides = [max(a["bbox"][2:]) for a in data["annotations"]]
    assert min(sides) <= 14 and max(sides) >= 18  # several sizes
    assert any(len(v) > 1 for v in by_image.values())  # several objects per image


def test_same_seed_same_set_other_seed_other_set(shapes, tmp_path):
    again = generate_shapes(tmp_path / "again", SMALL)
    assert _load(again) == _load(shapes)
    assert (again / "train" / "000005.png").read_bytes() == (shapes / "train" / "000005.png").read_bytes()
    other = generate_shapes(tmp_path / "other", ShapesOptions(**{**SMALL.__dict__, "seed": 4}))
    assert _load(other)["annotations"] != _load(shapes)["annotations"]


def test_kept_when_the_same_rewritten_when_not(tmp_path):
    root = generate_shapes(tmp_path / "s", SMALL)
    stamp = (root / "annotations" / "instances_val.json").stat().st_mtime_ns
    generate_shapes(root, SMALL)
    assert (root / "annotations" / "instances_val.json").stat().st_mtime_ns == stamp
    generate_shapes(root, ShapesOptions(**{**SMALL.__dict__, "val_images": 2}))
    assert len(_load(root, "val")["images"]) == 2


def test_a_foreign_folder_is_not_overwritten(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(DatasetError):
        generate_shapes(tmp_path / "mine", SMALL)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_read_through_the_coco_path(tmp_path):
    options = {k: v for k, v in SMALL.__dict__.items()}
    train = build_shapes(True, data_dir=tmp_path, **options)
    val = build_shapes(False, data_dir=tmp_path, **options)
    [folder] = (tmp_path / "shapes").iterdir()  # one folder per set of options
    assert folder.name.startswith("seed3-") and (folder / "generator.json").is_file()
    assert train.num_classes == 3 and len(train) == 24 and len(val) == 4
    image, target = train[0]
    assert image.shape == (3, 64, 64) and ((target["labels"] >= 1) & (target["labels"] <= 3)).all()
    other = build_shapes(False, data_dir=tmp_path, **{**options, "val_images": 2})
    assert len(other) == 2 and len(build_shapes(False, data_dir=tmp_path, **options)) == 4


def test_a_set_another_process_wrote_meanwhile_is_kept_under_its_readers(tmp_path, monkeypatch):
    # DDP ranks and a grid's runs generate together: the one that finishes second must not remove the first one's
    # set (which its readers already use) to put its own copy in place
    import attnlab.data.shapes as shapes

    root, write = tmp_path / "s", shapes._write_split
    first = []

    def other_process_finishes_first(*args):
        if not first:
            first.append(True)
            generate_shapes(root, SMALL)
            (root / "in use").touch()  # a reader's view of the set
        write(*args)

    monkeypatch.setattr(shapes, "_write_split", other_process_finishes_first)
    assert generate_shapes(root, SMALL) == root
    assert (root / "in use").exists() and json.loads((root / "generator.json").read_text())["seed"] == SMALL.seed
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary copy left
