"""COCO-format datasets: targets as torchvision's detectors take them, ViTDet's jitter, and the error contract."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("pycocotools")

from attnlab.data.coco import (  # noqa: E402
    CocoInstances,
    check_same_categories,
    collate,
    detection_transforms,
    to_device,
)
from attnlab.errors import DatasetError  # noqa: E402

torch.set_num_threads(1)


def _coco(tmp_path, *, categories=None, annotations=None, images=None, write_images=True, name="instances.json"):
    """Three 40x48 images: 1 has a square (cat 9) and a bar (cat 5), 2 only a crowd region, 3 nothing."""
    folder = tmp_path / "images"
    folder.mkdir(exist_ok=True)
    images = images or [{"id": i, "file_name": f"{i}.png", "width": 48, "height": 40} for i in (1, 2, 3)]
    if write_images:
        for img in images:
            Image.fromarray(np.full((40, 48, 3), 30 * img["id"], dtype=np.uint8)).save(folder / img["file_name"])
    if annotations is None:
        annotations = [
            {"id": 1, "image_id": 1, "category_id": 9, "bbox": [4, 6, 10, 10], "area": 100, "iscrowd": 0,
             "segmentation": [[4, 6, 14, 6, 14, 16, 4, 16]]},
            {"id": 2, "image_id": 1, "category_id": 5, "bbox": [20, 2, 20, 5], "area": 100, "iscrowd": 0,
             "segmentation": [[20, 2, 40, 2, 40, 7, 20, 7]]},
            {"id": 3, "image_id": 2, "category_id": 5, "bbox": [0, 0, 30, 30], "area": 900, "iscrowd": 1,
             "segmentation": [[0, 0, 30, 0, 30, 30, 0, 30]]},
        ]
    categories = categories if categories is not None else [{"id": 5, "name": "bar"}, {"id": 9, "name": "square"}]
    path = tmp_path / name
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return folder, path


def test_targets_as_torchvision_takes_them(tmp_path):
    ds = CocoInstances(*_coco(tmp_path), transforms=detection_transforms(False, 64))
    assert len(ds) == 3 and ds.num_classes == 2
    assert ds.label_to_category == [0, 5, 9]  # categories sorted by id; label 0 is the background
    image, target = ds[0]
    assert image.dtype == torch.float32 and image.shape == (3, 40, 48)
    assert image.max() == pytest.approx(30 / 255)
    assert target["image_id"] == 1
    # COCO's [x, y, w, h] -> XYXY; labels: square (9) -> 2, bar (5) -> 1
    assert target["boxes"].tolist() == [[4, 6, 14, 16], [20, 2, 40, 7]]
    assert target["labels"].tolist() == [2, 1]
    assert target["masks"].shape == (2, 40, 48) and target["masks"].dtype == torch.uint8
    # the polygon of the 10 x 10 square rasterises to the 100 pixels of its box
    rows, cols = torch.nonzero(target["masks"][0], as_tuple=True)
    assert (rows.min(), rows.max(), cols.min(), cols.max()) == (6, 15, 4, 13) and len(rows) == 100
    for index in (1, 2):  # a crowd region only, and no annotation at all: empty targets
        _, target = ds[index]
        assert target["boxes"].shape == (0, 4) and target["labels"].shape == (0,)
        assert target["masks"].shape == (0, 40, 48)


def test_large_scale_jitter_makes_a_square_canvas(tmp_path):
    torch.manual_seed(0)
    ds = CocoInstances(*_coco(tmp_path), transforms=detection_transforms(True, 64, jitter=(0.1, 2.0)))
    for _ in range(6):
        image, target = ds[0]
        assert image.shape == (3, 64, 64) and target["masks"].shape[-2:] == (64, 64)
        boxes = target["boxes"]
        assert len(boxes) == len(target["labels"]) == len(target["masks"])
        assert ((boxes[:, 2:] > boxes[:, :2]).all() and (boxes >= 0).all() and (boxes <= 64).all())
    _, empty = ds[2]
    assert empty["boxes"].shape == (0, 4)


def test_flip_and_fit_by_hand(tmp_path):
    # jitter (1, 1): resized to fit the 96 canvas (x 2, as the image is 40 x 48), then padded; flip always.
    # The canvas is padded with the mean pixel, the image placed at random: find it by its own pixels.
    ds = CocoInstances(*_coco(tmp_path), transforms=detection_transforms(True, 96, jitter=(1.0, 1.0), flip=1.0))
    image, target = ds[0]
    assert image.shape == (3, 96, 96)
    rows, cols = torch.nonzero((image[0] - 30 / 255).abs() < 0.02, as_tuple=True)
    top, left = int(rows.min()), int(cols.min())
    assert (int(rows.max()) - top + 1, int(cols.max()) - left + 1) == (80, 96)
    pad = image[:, 0 if top else 95, 0]
    torch.testing.assert_close(pad, torch.tensor([124, 116, 104]) / 255, atol=1e-6, rtol=0)  # ImageNet's mean
    square = [4, 6, 14, 16]  # flipped in a width of 48 -> x from 48 - 14 to 48 - 4, then scaled by 2
    want = [2 * (48 - square[2]) + left, 2 * square[1] + top, 2 * (48 - square[0]) + left, 2 * square[3] + top]
    assert target["boxes"][0].tolist() == pytest.approx(want)


def test_collate_and_device(tmp_path):
    ds = CocoInstances(*_coco(tmp_path), transforms=detection_transforms(False, 64))
    images, targets = collate([ds[0], ds[2]])
    assert isinstance(images, list) and isinstance(targets, list) and len(images) == 2
    images, targets = to_device(images, targets, torch.device("cpu"))
    assert type(images[0]) is torch.Tensor and type(targets[0]["boxes"]) is torch.Tensor
    assert targets[1]["boxes"].shape == (0, 4) and targets[0]["image_id"] == 1


def test_a_detector_trains_on_an_image_without_objects(tmp_path):
    from attnlab.data.coco import detection_loss
    from attnlab.models import build_detector

    ds = CocoInstances(*_coco(tmp_path), transforms=detection_transforms(True, 128))
    model = build_detector("vitdet_tiny", num_classes=2).train()
    images, targets = to_device(*collate([ds[2]]), torch.device("cpu"))
    loss, parts = detection_loss(model, images, targets)
    assert torch.isfinite(loss) and parts["loss_box_reg"] == 0.0 and parts["loss_mask"] == 0.0
    loss.backward()


# ---- the error contract: checked when the dataset is built ---------------------------------------------------
def _one_sentence(err):
    text = str(err.value)
    assert "\n" not in text and text.endswith(".")
    return text


def test_missing_images(tmp_path):
    folder, path = _coco(tmp_path)
    (folder / "2.png").unlink()
    (folder / "3.png").unlink()
    with pytest.raises(DatasetError) as err:
        CocoInstances(folder, path)
    assert "2 of the 3 images" in _one_sentence(err) and "2.png" in str(err.value)


@pytest.mark.parametrize("change, words", [
    (dict(annotations=[]), "no annotations at all"),
    (dict(categories=[]), "no categories"),
    (dict(categories=[{"id": 5, "name": "bar"}]), "category_id 9"),
    (dict(annotations=[{"id": 1, "image_id": 7, "category_id": 5, "bbox": [0, 0, 1, 1]}]), "image_id 7"),
    (dict(annotations=[{"id": 1, "image_id": 1, "category_id": 5, "bbox": [0, 0, -1, 1]}]), "bbox"),
    (dict(annotations=[{"id": 1, "image_id": 1, "category_id": 5, "bbox": [0, 0, 1, 1], "segmentation": []}]),
     "no usable segmentation"),
])
def test_malformed_annotations(tmp_path, change, words):
    with pytest.raises(DatasetError) as err:
        CocoInstances(*_coco(tmp_path, **change))
    assert words in _one_sentence(err)


def test_boxes_only_needs_no_segmentation_nor_crowd_flags(tmp_path):
    annotations = [{"id": 1, "image_id": 1, "category_id": 5, "bbox": [2, 3, 4, 5]}]
    ds = CocoInstances(*_coco(tmp_path, annotations=annotations), masks=False)
    _, target = ds[0]
    assert target["boxes"].tolist() == [[2, 3, 6, 8]] and "masks" not in target
    assert ds.coco.anns[1]["iscrowd"] == 0 and ds.coco.anns[1]["area"] == 20  # what COCOeval reads


def test_unreadable_files(tmp_path):
    folder, path = _coco(tmp_path)
    with pytest.raises(DatasetError) as err:
        CocoInstances(folder, tmp_path / "nope.json")
    assert "does not exist" in _one_sentence(err)
    path.write_text("{not json")
    with pytest.raises(DatasetError) as err:
        CocoInstances(folder, path)
    assert "not valid JSON" in _one_sentence(err)
    path.write_text(json.dumps({"images": [{"id": 1}], "annotations": [{"id": 1}]}))
    with pytest.raises(DatasetError) as err:
        CocoInstances(folder, path)
    _one_sentence(err)
    with pytest.raises(DatasetError) as err:
        CocoInstances(tmp_path / "no_folder", _coco(tmp_path, name="again.json")[1])
    assert "does not exist" in _one_sentence(err)


def test_splits_must_share_categories(tmp_path):
    train = CocoInstances(*_coco(tmp_path, name="train.json"))
    val = CocoInstances(*_coco(tmp_path, name="val.json", categories=[{"id": 5, "name": "bar"},
                                                                      {"id": 9, "name": "cube"}]))
    check_same_categories(train, train)
    with pytest.raises(DatasetError) as err:
        check_same_categories(train, val)
    assert "different categories" in _one_sentence(err)
