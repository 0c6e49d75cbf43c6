"""Issue 39: the contracts of the first families kept by language modelling, detection and video. Each refusal is
one line on stderr, exit code 2, no traceback, nothing made (``attnlab.cli.main`` in this process, read as a real
process: tests/cli/test_bad_inputs.py checks that the two agree); the bad inputs are files generated here. Runs
that a case needs are trained once per module for a step or two on a few bytes or clips."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cli_runner import in_process
from test_bad_inputs import _listing
from attnlab.attention.nystrom import NystromAttention


def _files(root: Path) -> dict:
    """The listing of tests/cli/test_bad_inputs.py without the directories' times (a run's lock, taken and let go
    by a refused resume, touches its directory)."""
    return {k: v if not v[0] else True for k, v in _listing(root).items()}


def refused(argv, cwd, expected: str, command: str = "train"):
    """Run ``attnlab ARGV`` in ``cwd``: one stderr line holding ``expected``, exit 2, ``cwd`` unchanged."""
    before = _files(cwd)
    proc = in_process([str(a) for a in argv], cwd)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"attnlab {command}: error: ") and expected in lines[0], lines[0]
    assert _files(cwd) == before
    return lines[0]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A finished 1-step byte-level run on a 4 KB text file (the file lies beside the run, in ``corpus.txt``)."""
    from attnlab.train import RECIPES, train

    root = tmp_path_factory.mktemp("lm39")
    (root / "corpus.txt").write_bytes(bytes(range(32, 127)) * 44)
    cfg = RECIPES["lm_demo"].replace(dataset="text", data_dir=str(root / "corpus.txt"), block_size=8,
                              batch_size=2, max_steps=1, eval_every=1, eval_iters=1, probe_every=0, warmup_steps=0,
                              runs_dir=str(root / "runs"), name="lm", progress=False)
    train(cfg)
    return root / "runs" / "lm"


@pytest.fixture(scope="module")
def video_run(tmp_path_factory) -> Path:
    """A finished 1-epoch timesformer_tiny run on 16 moving-digit clips."""
    from attnlab.train import RECIPES, train

    root = tmp_path_factory.mktemp("video39")
    cfg = RECIPES["moving_digits"].replace(epochs=1, data_options={"num_train": 16, "num_test": 4},
                                           runs_dir=str(root / "runs"), name="video", progress=False)
    train(cfg)
    return root / "runs" / "video"


# ---- 10 and 12: flags and models of another family, refused before anything is built ------------------------------
@pytest.mark.parametrize("argv, expected", [
    ("--recipe detect_demo --z-loss 0.1", "config key 'z_loss' (--z-loss) belongs to the lm family; detect_demo "
                                          "trains a detector (dataset shapes, the detect family), which does not read "
                                          "it; drop it."),
    ("--recipe moving_digits --block-size 32", "config key 'block_size' (--block-size) belongs to the lm family"),
    ("--recipe lm --video-metric mean_class_accuracy", "belongs to the video family; lm trains a language model "
                                                       "(dataset stdlib, the lm family)"),
    ("--recipe detect_demo --eval-iters 3", "config key 'eval_iters' (--eval-iters) belongs to the lm family"),
    ("--recipe moving_digits --model gpt_tiny", "model gpt_tiny is a language model (lm family), but dataset "
                                                "moving_digits trains a video model (video family); use one of "
                                                "timesformer_tiny, timesformer_base"),
    ("--recipe lm --model vitdet_tiny", "model vitdet_tiny is a detector (detect family), but dataset stdlib trains "
                                        "a language model (lm family); use one of gpt_tiny, gpt_mini, gpt2_small"),
    ("--recipe detect_demo --model seq_listops", "model seq_listops is a sequence classifier (sequence family)"),
    ("--recipe demo --model timesformer_tiny", "use one of vit_cifar, swin_cifar, vit_digits, a timm ViT/DeiT/Swin"),
])
def test_flag_or_model_of_another_family_is_one_line(argv, expected, tmp_path):
    refused(["train", *argv.split()], tmp_path, expected)


# ---- 3: sample ------------------------------------------------------------------------------------------------------
def test_sample_refuses_a_vanishing_temperature_and_takes_raw_bytes(lm_run, tmp_path):
    refused(["sample", lm_run, "--temperature", "1e-300"], tmp_path, "--temperature 1e-300 is below 1e-06",
            "sample")
    proc = in_process(["sample", lm_run, "--prompt", "\udcffa", "--max-new-tokens", "2", "--temperature", "0"])
    assert proc.returncode == 0, proc.stderr  # a byte-level model takes the byte \xff itself


def test_sample_prompt_that_is_not_utf8_is_one_line_for_a_tokenizer():
    from attnlab.data.lm import _utf8
    from attnlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"the prompt holds the byte b'\\xff' at position 1, which is not valid"):
        _utf8("a\udcff")
    assert _utf8("déf") == "déf"


# ---- 4: analyze relevance on a video run ----------------------------------------------------------------------------
def test_relevance_on_a_video_run_is_one_line(video_run, tmp_path):
    refused(["analyze", video_run, "--what", "relevance", "--images", "2", "--out", tmp_path / "a"], tmp_path,
            "relevance explains an image classifier's logits over one image's patches; this model takes inputs of "
            "5 dimensions", "analyze")


# ---- 9: advice that does not loop -----------------------------------------------------------------------------------
def test_finished_run_without_intact_weights_is_trained_again_by_resume(lm_run, tmp_path):
    """Every weights file of a finished run damaged: the refusal's advice (`train --resume`) trains it again from
    the start, with one note, and then eval reads it; the result is the one the run had (training is seeded)."""
    import json

    run = tmp_path / "lm"
    shutil.copytree(lm_run, run)
    before = json.loads((run / "result.json").read_text())
    for weights in run.glob("checkpoint*.safetensors"):
        weights.write_bytes(b"garbage" * 40)
    line = refused(["sample", run], tmp_path, f"the run had finished, so run `attnlab train --resume {run}`, which "
                                              "trains it again from the start", "sample")
    assert "delete" not in line
    again = in_process(["train", "--resume", run, "--no-progress"], tmp_path)
    assert again.returncode == 0, again.stderr
    notes = [x for x in again.stderr.splitlines() if x.strip()]
    assert len(notes) == 1 and "had finished, but none of its weights files is intact" in notes[0], again.stderr
    after = json.loads((run / "result.json").read_text())
    assert after["val_loss"] == before["val_loss"]
    proc = in_process(["eval", run], tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["val_loss"] == before["val_loss"], proc.stderr


def test_finished_run_with_intact_weights_is_still_skipped_by_resume(lm_run, tmp_path):
    run = tmp_path / "lm"
    shutil.copytree(lm_run, run)
    stamp = (run / "checkpoint.safetensors").stat().st_mtime_ns
    proc = in_process(["train", "--resume", run, "--no-progress"], tmp_path)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    assert (run / "checkpoint.safetensors").stat().st_mtime_ns == stamp


# ---- shapes: a killed generation leaves no hidden folder -------------------------------------------------------------
def test_shapes_generation_interrupted_or_killed_leaves_no_temporary_folder(tmp_path, monkeypatch):
    pytest.importorskip("pycocotools")
    from attnlab.data import shapes

    opt = shapes.ShapesOptions(train_images=2, val_images=1, image_size=32, min_size=4, max_size=8)
    root = shapes.set_dir(tmp_path, opt)
    root.parent.mkdir(parents=True)
    dead = root.with_name(f".{root.name}.tmp{2**22 + 12345}")  # above Linux's pid_max default: no such process
    dead.mkdir()

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(shapes, "_write_split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        shapes.generate_shapes(root, opt)
    assert os.listdir(root.parent) == []  # its own folder removed, and the dead process's


# ---- 1, 2, 6: COCO images and annotations checked before training --------------------------------------------------
def _png(size=(48, 40), mode="RGB") -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, 200 if mode != "RGB" else (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


def _write_coco(root: Path, *, images=None, annotations=None, files=None, raw=None) -> Path:
    """A COCO set in ``root`` with splits t and v (two 48 x 40 images each, one square per image); ``images`` and
    ``annotations`` replace the train split's lists, ``files`` its image files, ``raw`` its whole json text."""
    import json

    for split in ("t", "v"):
        (root / split).mkdir(parents=True)
        (root / "annotations").mkdir(exist_ok=True)
        imgs = [{"id": i, "file_name": f"{i}.png", "width": 48, "height": 40} for i in (1, 2)]
        anns = [{"id": i, "image_id": i, "category_id": 1, "bbox": [4, 6, 10, 10], "iscrowd": 0,
                 "segmentation": [[4, 6, 14, 6, 14, 16, 4, 16]]} for i in (1, 2)]
        names = {img["file_name"]: _png() for img in imgs}
        if split == "t":
            imgs, anns = images or imgs, annotations or anns
            names.update(files or {})
        for name, data in names.items():
            (root / split / name).write_bytes(data)
        text = raw if split == "t" and raw is not None else json.dumps(
            {"images": imgs, "annotations": anns, "categories": [{"id": 1, "name": "square"}]})
        (root / "annotations" / f"instances_{split}.json").write_text(text)
    return root


def _ann(**change):
    return {"id": 1, "image_id": 1, "category_id": 1, "bbox": [4, 6, 10, 10], "iscrowd": 0,
            "segmentation": [[4, 6, 14, 6, 14, 16, 4, 16]], **change}


def _rle(counts, size=(40, 48)):
    return {"size": list(size), "counts": counts}


COCO_CASES = [
    ("not-an-image", dict(files={"1.png": b"not an image at all"}), "COCO image file", "1.png is not a readable image"),
    ("other-size", dict(files={"1.png": _png((40, 48))}), "is 40 x 48 pixels, but instances_t.json gives it width 48",
     ""),
    ("16-bit", dict(files={"1.png": _png(mode="I;16")}), "has I;16 pixels (more than 8 bits per sample)", ""),
    ("top-level-list", dict(raw="[1, 2]"), "does not hold a JSON object at its top level", ""),
    ("duplicate-ann-id", dict(annotations=[_ann(), _ann(image_id=2)]), "lists annotation id 1 twice", ""),
    ("duplicate-image-id", dict(images=[{"id": 1, "file_name": "1.png", "width": 48, "height": 40}] * 2),
     "lists image id 1 twice", ""),
    ("nan-box", dict(annotations=[_ann(bbox=[4, 6, float("nan"), 10])]), "has bbox [4, 6, nan, 10]", "finite numbers"),
    ("rle-wrong-size", dict(annotations=[_ann(segmentation=_rle([1920], (48, 40)))]),
     "its RLE size [48, 40] is not the image's [height, width] [40, 48]", ""),
    ("rle-bad-counts", dict(annotations=[_ann(segmentation=_rle([5, 10]))]), "its RLE counts cover 15 pixels", ""),
    ("rle-bad-string", dict(annotations=[_ann(segmentation=_rle("\x7f\x7f"))]), "its RLE counts cannot be read", ""),
    ("no-size", dict(images=[{"id": 1, "file_name": "1.png"}, {"id": 2, "file_name": "2.png", "width": 48,
                                                               "height": 40}]), "has width None and height None", ""),
]


@pytest.mark.parametrize("change, expected, more", [pytest.param(*c[1:], id=c[0]) for c in COCO_CASES])
def test_coco_set_is_checked_before_training(change, expected, more, tmp_path):
    pytest.importorskip("pycocotools")
    from attnlab.data import build_dataset
    from attnlab.errors import DatasetError

    root = _write_coco(tmp_path / "c", **change)
    with pytest.raises(DatasetError) as err:
        build_dataset("coco", True, data_dir=root, train_split="t", val_split="v", image_size=64)
    assert expected in str(err.value) and more in str(err.value) and "\n" not in str(err.value), err.value


def test_coco_image_of_another_size_stops_train_before_the_run_directory(tmp_path):
    pytest.importorskip("pycocotools")
    _write_coco(tmp_path / "c", files={"2.png": _png((48, 41))})
    refused(["train", "--recipe", "detect_demo", "--dataset", "coco", "--data-dir", "c", "--data-options",
             "{image_size: 64, train_split: t, val_split: v}"], tmp_path,
            "2.png is 48 x 41 pixels, but instances_t.json gives it width 48 and height 40")


@pytest.mark.parametrize("augment", ["none", "recipe"])
@pytest.mark.parametrize("bbox, side", [([4, 6, 0, 10], "width"), ([4, 6, 10, 0], "height")])
def test_coco_box_of_zero_width_or_height_is_refused_naming_the_annotation(bbox, side, augment, tmp_path):
    """torchvision's detection models refuse a box without area: the set is refused in one line naming the file,
    the annotation and the remedy, with or without the recipe's jitter."""
    pytest.importorskip("pycocotools")
    _write_coco(tmp_path / "c", annotations=[_ann(id=7, bbox=bbox), _ann(id=2, image_id=2)])
    refused(["train", "--recipe", "detect_demo", "--dataset", "coco", "--data-dir", "c", "--data-options",
             "{train_split: t, val_split: v, image_size: 64}", "--augment", augment, "--epochs", "1"], tmp_path,
            f"instances_t.json: annotation 7 has bbox {bbox!r}, of {side} 0, which torchvision's detection models "
            "refuse; give the object a positive width and height, remove the annotation, or pass the data option "
            "empty_boxes: drop")


def test_coco_zero_width_box_is_left_out_of_the_targets_when_asked(tmp_path):
    """empty_boxes: drop trains as torchvision's references train (COCO 2017's train split holds two such boxes):
    the box is left out of the targets."""
    pytest.importorskip("pycocotools")
    from attnlab.data import build_dataset

    root = _write_coco(tmp_path / "c", annotations=[_ann(bbox=[4, 6, 0, 10]), _ann(id=2, image_id=2)])
    for augment in ("none", "recipe"):
        train = build_dataset("coco", True, data_dir=root, train_split="t", val_split="v", image_size=64,
                              masks=False, augment=augment, empty_boxes="drop")
        kept = train[1][1]["boxes"]  # the recipe's jitter may crop the other image's box away: no count then
        assert train[0][1]["boxes"].shape == (0, 4) and (augment != "none" or kept.shape == (1, 4))
        assert bool((kept[:, 2:] > kept[:, :2]).all())


def test_rle_counts_read_as_pycocotools_writes_them():
    pytest.importorskip("pycocotools")
    import numpy as np
    from pycocotools import mask as mask_utils

    from attnlab.data.coco import rle_counts

    mask = np.zeros((7, 5), dtype=np.uint8)
    mask[1:4, 2:5] = 1
    counts = rle_counts(mask_utils.encode(np.asfortranarray(mask))["counts"].decode())
    runs, flat = [], mask.flatten(order="F").tolist()
    value, start = 0, 0
    for i, v in enumerate(flat + [2]):
        if v != value:
            runs.append(i - start)
            value, start = v, i
    assert counts == runs and sum(counts) == 35


# ---- 5, 6: video clips checked when built ---------------------------------------------------------------------------
def _frames(root: Path, clip: str, n: int = 3, **special: bytes) -> None:
    """A frame folder ``root/clip`` of ``n`` 16 x 16 grey PNGs; ``special`` replaces frames by name."""
    (root / clip).mkdir(parents=True)
    for i in range(1, n + 1):
        name = f"img_{i:05d}.png"
        (root / clip / name).write_bytes(special.get(name.replace(".", "_"), _png((16, 16), "L")))


VIDEO_CASES = [
    ("frame-not-an-image", {"img_00002_png": b"not a frame"}, {}, "file", "img_00002.png is not a readable image"),
    ("frame-other-size", {"img_00003_png": _png((16, 17), "L")}, {},
     "frame img_00003.png of clip", "is 16 x 17 pixels, but img_00001.png is 16 x 16"),
    ("frame-16-bit", {"img_00001_png": _png((16, 16), "I;16")}, {}, "has I;16 pixels", ""),
    ("lists-missing", {}, {"lists": "splits"}, "video lists folder", "splits does not exist"),
]


@pytest.mark.parametrize("special, options, expected, more", [pytest.param(*c[1:], id=c[0]) for c in VIDEO_CASES])
def test_video_frames_are_checked_when_the_split_is_built(special, options, expected, more, tmp_path):
    from attnlab.data import build_dataset
    from attnlab.errors import DatasetError

    _frames(tmp_path / "v", "train/a/c", **special)
    _frames(tmp_path / "v", "val/a/c")
    with pytest.raises(DatasetError) as err:
        build_dataset("video", True, data_dir=tmp_path / "v", in_chans=1, image_size=16, **options)
    assert expected in str(err.value) and more in str(err.value), err.value


@pytest.mark.parametrize("lines, expected", [
    ("train/a/c 0\ntrain/b/c -1\n", "line 2: label -1 is negative"),
    ("train/a/c 0\ntrain/b/c walk\n", "line 2: label 'walk' is a name, but other lines give class indices"),
])
def test_video_list_labels_are_indices_or_names(lines, expected, tmp_path):
    from attnlab.data import build_dataset
    from attnlab.errors import DatasetError

    _frames(tmp_path / "v", "train/a/c")
    _frames(tmp_path / "v", "train/b/c")
    (tmp_path / "v" / "train.csv").write_text(lines)
    (tmp_path / "v" / "val.csv").write_text("train/a/c 0\n")
    with pytest.raises(DatasetError, match=expected):
        build_dataset("video", True, data_dir=tmp_path / "v", in_chans=1, image_size=16)


def test_video_empty_class_folder_and_uneven_crop_are_refused(tmp_path):
    from attnlab.data import build_dataset
    from attnlab.errors import DatasetError

    _frames(tmp_path / "v", "train/a/c")
    (tmp_path / "v" / "train" / "b").mkdir()
    _frames(tmp_path / "v", "val/a/c")
    with pytest.raises(DatasetError, match=r"class folder .*train/b holds no clips"):
        build_dataset("video", True, data_dir=tmp_path / "v", in_chans=1, image_size=16)
    refused(["train", "--recipe", "moving_digits", "--data-options", "{image_size: 20, num_train: 8}"], tmp_path,
            "the video image_size 20 is not a multiple of timesformer_tiny's patch size 8")


# ---- 5, 6: token files and corpora checked before the first step ---------------------------------------------------
def _bins(folder: Path, train, val=None, dtype="uint16", meta: dict | None = None) -> Path:
    import pickle

    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    np.asarray(train, dtype=dtype).tofile(folder / "train.bin")
    np.asarray(val if val is not None else list(range(40)) * 3, dtype=dtype).tofile(folder / "val.bin")
    if meta is not None:
        (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    return folder


def test_nanogpt_id_past_the_vocabulary_is_found_before_training(tmp_path):
    ids = [1, 2, 3] * 200 + [64] + [4] * 200  # one id past meta.pkl's 64, far from the first batches
    _bins(tmp_path / "d", ids, meta={"vocab_size": 64})
    refused(["train", "--recipe", "lm_demo", "--dataset", "nanogpt", "--data-dir", "d", "--block-size", "8"],
            tmp_path, "train.bin holds token id 64, outside its vocabulary of 64 (0 to 63)")


def test_nanogpt_uint32_file_read_as_uint16_is_refused_and_read_with_dtype(tmp_path):
    from attnlab.data import build_dataset
    from attnlab.errors import DatasetError

    folder = _bins(tmp_path / "d", list(range(1, 300)), list(range(1, 100)), dtype="uint32", meta={"vocab_size": 300})
    with pytest.raises(DatasetError, match="looks like a uint32 file .* give the data option dtype: uint32"):
        build_dataset("nanogpt", True, data_dir=folder)
    train = build_dataset("nanogpt", True, data_dir=folder, dtype="uint32")
    assert train.tokens[:3].tolist() == [1, 2, 3] and len(train) == 299


def test_tokenizer_corpus_that_is_not_utf8_is_refused(tmp_path):
    pytest.importorskip("tokenizers")
    from tests.data.test_lm import write_tokenizer

    from attnlab.data import build_dataset
    from attnlab.errors import DatasetError

    write_tokenizer(tmp_path / "tokenizer.json", ["[UNK]", "caf", "the"])
    (tmp_path / "c.txt").write_bytes("the café\n".encode("latin-1") * 20)
    with pytest.raises(DatasetError, match=r"c.txt is not UTF-8 \(byte 0xe9 at offset 7\), and the tokenizer reads"):
        build_dataset("text", True, data_dir=tmp_path / "c.txt", tokenizer=str(tmp_path / "tokenizer.json"))


# ---- 8: a run opens from anywhere; moved data is given with --data-dir, a tokenizer with --tokenizer -----------------
def test_run_records_absolute_paths_and_opens_from_another_directory(lm_run, tmp_path):
    import json

    import yaml

    cfg = yaml.safe_load((lm_run / "config.yaml").read_text())
    assert os.path.isabs(cfg["run"]["data_dir"]) and cfg["run"]["data_dir"].endswith("corpus.txt")
    (tmp_path / "elsewhere").mkdir()
    out = in_process(["eval", lm_run], tmp_path / "elsewhere")
    assert out.returncode == 0, out.stderr
    moved = tmp_path / "moved.txt"
    shutil.copy(cfg["run"]["data_dir"], moved)
    again = in_process(["eval", lm_run, "--data-dir", moved], tmp_path / "elsewhere")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["val_loss"] == json.loads(out.stdout)["val_loss"]
    refused(["sample", lm_run, "--tokenizer", "t.json"], tmp_path, f"and {lm_run} trained on bytes; drop it",
            "sample")


def test_byte_level_run_samples_without_its_corpus(lm_run, tmp_path):
    run = tmp_path / "runs" / "lm"
    shutil.copytree(lm_run, run)
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("corpus.txt", "gone.txt"))
    proc = in_process(["sample", run, "--max-new-tokens", "3"], tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("content", [b"\xff\xfe not json", b"[1, 2]", b'{"corpus.txt": 3}', b"[" * 100_000],
                         ids=["bytes", "list", "number", "nested"])
def test_a_damaged_data_json_is_one_line_and_eval_still_runs(lm_run, tmp_path, content):
    run = tmp_path / "runs" / "lm"
    shutil.copytree(lm_run, run)
    (run / "data.json").write_bytes(content)
    (run / "result.json").unlink()  # as if stopped: resume reads the record
    refused(["train", "--resume", run], tmp_path, "data.json cannot be read")
    proc = in_process(["eval", run], tmp_path)  # a reader measures what is there; the record only adds a warning
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


# ---- 7: a run records its data; what resume, eval and sample read again must be it --------------------------------
def _tokenizer_run(tmp_path, words=("[UNK]", "the", "cat", "sat", "on", "mat")) -> Path:
    """A finished 2-step run through a word-level tokenizer (tok.json) on c.txt, both in ``tmp_path``."""
    from tests.data.test_lm import write_tokenizer

    write_tokenizer(tmp_path / "tok.json", list(words))
    (tmp_path / "c.txt").write_text("the cat sat on the mat " * 60)
    argv = ["train", "--recipe", "lm_demo", "--dataset", "text", "--data-dir", "c.txt", "--data-options",
            "{tokenizer: tok.json}", "--block-size", "8", "--batch-size", "2", "--max-steps", "2", "--eval-every",
            "1", "--eval-iters", "1", "--probe-every", "0", "--no-progress", "--name", "t"]
    done = in_process(argv, tmp_path)
    assert done.returncode == 0, done.stderr
    return tmp_path / "runs" / "t"


def _readers(run, cwd):
    """(eval's stdout, sample's stdout) of ``run``, each checked to succeed without a word on stderr."""
    out = []
    for command in (["eval", run], ["sample", run, "--prompt", "the cat", "--max-new-tokens", "4",
                                    "--temperature", "0"]):
        proc = in_process(command, cwd)
        assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
        out.append(proc.stdout)
    return out


def _rewrite_keeping_stamp(path: Path, data: bytes) -> None:
    """Replace a file's content by ``data`` of the same size, its modification time kept (rsync -t, cp -p)."""
    st = path.stat()
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("replacement", ["same-size", "larger"])
def test_a_replaced_tokenizer_changes_nothing_eval_and_sample_print(replacement, tmp_path):
    """The run keeps a copy of its tokenizer.json: eval and sample read it, so replacing the original (by one of
    the same size with other ids, or by a larger one) gives what they gave before, without a word."""
    pytest.importorskip("tokenizers")
    from tests.data.test_lm import write_tokenizer

    run = _tokenizer_run(tmp_path)
    assert (run / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    before = _readers(run, tmp_path)
    words = ["[UNK]", "cat", "the", "sat", "on", "mat"] + (["dog", "ran", "far"] if replacement == "larger" else [])
    write_tokenizer(tmp_path / "tok.json", words)
    assert _readers(run, tmp_path) == before


@pytest.mark.parametrize("replacement", ["same-size", "larger"])
def test_a_replaced_tokenizer_without_the_runs_copy_is_one_line_naming_it(replacement, tmp_path):
    """A run without its copy (written before runs kept one, or the copy removed): eval and sample refuse in one
    line that names the tokenizer, not config.yaml or the checkpoint."""
    pytest.importorskip("tokenizers")
    from tests.data.test_lm import write_tokenizer

    run = _tokenizer_run(tmp_path)
    (run / "tokenizer.json").unlink()
    words = ["[UNK]", "cat", "the", "sat", "on", "mat"] + (["dog", "ran", "far"] if replacement == "larger" else [])
    write_tokenizer(tmp_path / "tok.json", words)
    for command in (["eval", run], ["sample", run, "--prompt", "the"]):
        line = refused(command, tmp_path, "differs from what", command[0])
        assert "(tokenizer.json: was sha256 " in line and "config.yaml" not in line, line


def test_resume_refuses_a_replaced_tokenizer_and_records_an_accepted_one(tmp_path):
    import json

    from tests.data.test_lm import write_tokenizer

    pytest.importorskip("tokenizers")
    run = _tokenizer_run(tmp_path)
    recorded = json.loads((run / "data.json").read_text())
    assert set(recorded) == {"text corpus", "tokenizer.json", "recorded as"} and \
        recorded["tokenizer.json"].startswith("sha256 ") and recorded["recorded as"] == "content hashes"
    write_tokenizer(tmp_path / "tok.json", ["[UNK]", "cat", "the", "sat", "on", "mat"])  # same size, other ids
    (run / "result.json").unlink()  # as if stopped after its first evaluation
    refused(["train", "--resume", run], tmp_path, "its data differs from what it trained on, as recorded in "
            "data.json (tokenizer.json: was sha256 ")
    accepted = in_process(["train", "--resume", run, "--accept-data-change"], tmp_path)
    assert accepted.returncode == 0, accepted.stderr
    assert json.loads((run / "data.json").read_text())["tokenizer.json"] != recorded["tokenizer.json"]
    assert (run / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()  # the copy follows
    assert "accept_data_change: false" in (run / "config.yaml").read_text()


def test_a_corpus_rewritten_with_its_size_and_time_is_one_line_for_eval_and_resume(lm_run, tmp_path):
    """The same size and modification time, other bytes: eval and resume read the content's hash, and refuse in
    one line naming the corpus; a copy of the corpus given with --data-dir is the same data."""
    import json
    import yaml

    run = tmp_path / "runs" / "lm"
    shutil.copytree(lm_run, run)
    corpus = Path(yaml.safe_load((run / "config.yaml").read_text())["run"]["data_dir"])
    copy = tmp_path / "copy.txt"
    shutil.copy(corpus, copy)
    proc = in_process(["eval", run, "--data-dir", copy], tmp_path)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    value = json.loads(proc.stdout)["val_loss"]
    _rewrite_keeping_stamp(copy, copy.read_bytes()[::-1])
    line = refused(["eval", run, "--data-dir", copy], tmp_path, "the data eval would read differs from what", "eval")
    assert "(text corpus: was 4180 bytes, sha256 " in line and "give --data-dir where it lies now" in line, line
    (run / "result.json").unlink()
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace(str(corpus), str(copy)))
    refused(["train", "--resume", run], tmp_path, "its data differs from what it trained on, as recorded in "
            "data.json (text corpus: was 4180 bytes, sha256 ")
    _rewrite_keeping_stamp(copy, corpus.read_bytes())
    proc = in_process(["eval", run], tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["val_loss"] == value, proc.stderr


def test_sample_with_a_missing_or_other_tokenizer_is_one_line(tmp_path):
    pytest.importorskip("tokenizers")
    from tests.data.test_lm import write_tokenizer

    run = _tokenizer_run(tmp_path)
    refused(["sample", run, "--tokenizer", "MISSING.json"], tmp_path, "--tokenizer MISSING.json does not exist; give "
            f"the tokenizer.json {run} trained with (the run keeps a copy: drop --tokenizer)", "sample")
    write_tokenizer(tmp_path / "other.json", ["[UNK]", "cat", "the", "sat", "on", "mat"])
    refused(["sample", run, "--tokenizer", "other.json"], tmp_path, "(tokenizer.json: was sha256 ", "sample")
    proc = in_process(["sample", run, "--tokenizer", "tok.json", "--prompt", "the", "--max-new-tokens", "2"], tmp_path)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


@pytest.fixture(scope="module")
def frames_run(tmp_path_factory) -> Path:
    """A finished 1-epoch timesformer_tiny run on frame folders: classes run and walk, two clips each per split
    (the data lies in ``v`` beside ``runs``)."""
    from attnlab.train import RECIPES, train

    root = tmp_path_factory.mktemp("frames45")
    for split in ("train", "val"):
        for cls in ("run", "walk"):
            for clip in ("c0", "c1"):
                _frames(root / "v", f"{split}/{cls}/{clip}", n=2)
    cfg = RECIPES["moving_digits"].replace(dataset="video", data_dir=str(root / "v"), epochs=1,
                              batch_size=2, data_options={"num_frames": 2, "image_size": 16, "in_chans": 1,
                                                          "crops": 1},
                              runs_dir=str(root / "runs"), name="video", progress=False)
    train(cfg)
    return root / "runs" / "video"


@pytest.mark.parametrize("change", ["class-added", "class-renamed", "frame-replaced"])
def test_video_data_changed_since_training_is_one_line_for_eval(frames_run, change, tmp_path):
    """A class folder added (more classes than the model has outputs), renamed (the class order, so every label,
    shifts) or a frame replaced with its size and time kept: eval refuses in one line naming what changed."""
    import yaml

    root = tmp_path / "copy"
    shutil.copytree(frames_run.parent.parent, root)
    run, data = root / "runs" / "video", root / "v"
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace(str(frames_run.parent.parent), str(root)))
    assert yaml.safe_load(cfg.read_text())["run"]["data_dir"] == str(data)
    proc = in_process(["eval", run], tmp_path)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr  # the copy is the data it trained on
    if change == "class-added":
        for split in ("train", "val"):
            _frames(data, f"{split}/jump/c0", n=2)
        expected = "(classes: was run, walk, is now jump, run, walk"
    elif change == "class-renamed":
        for split in ("train", "val"):
            (data / split / "walk").rename(data / split / "amble")
        expected = "(classes: was run, walk, is now amble, run"
    else:
        frame = data / "val" / "run" / "c0" / "img_00001.png"
        _rewrite_keeping_stamp(frame, bytes(255 - b for b in frame.read_bytes()))
        expected = "(evaluation clips: was 4 clips, sha256 "
    line = refused(["eval", run], tmp_path, "the data eval would read differs from what", "eval")
    assert expected in line and "config.yaml" not in line, line


def test_renamed_video_class_folder_changes_the_recorded_classes(tmp_path):
    from attnlab.data.registry import data_changes, data_fingerprint

    for split in ("train", "val"):
        _frames(tmp_path / "v", f"{split}/run/c")
        _frames(tmp_path / "v", f"{split}/walk/c")
    before = data_fingerprint("video", data_dir=tmp_path / "v")
    for split in ("train", "val"):
        (tmp_path / "v" / split / "walk").rename(tmp_path / "v" / split / "amble")
    changes = data_changes(before, data_fingerprint("video", data_dir=tmp_path / "v"))
    assert changes.startswith("classes: was run, walk, is now amble, run; training clips: was 2 clips"), changes


def test_nanogpt_and_coco_fingerprints_name_the_files(tmp_path):
    pytest.importorskip("pycocotools")
    from attnlab.data.registry import data_fingerprint

    _bins(tmp_path / "d", [1, 2, 3] * 10, meta={"vocab_size": 8})
    assert set(data_fingerprint("nanogpt", data_dir=tmp_path / "d")) == {"train.bin", "val.bin", "meta.pkl"}
    _write_coco(tmp_path / "c")
    coco = data_fingerprint("coco", data_dir=tmp_path / "c", train_split="t", val_split="v")
    assert coco["instances_t.json"].startswith("sha256 ") and coco["t/"].startswith("2 files, content sha256 ")
    image = next((tmp_path / "c" / "t").iterdir())
    _rewrite_keeping_stamp(image, image.read_bytes()[:-1] + b"\0")  # a replaced image: same count, size and time
    assert data_fingerprint("coco", data_dir=tmp_path / "c", train_split="t", val_split="v")["t/"] != coco["t/"]
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "c", moved)  # a copy elsewhere, every file's time new: the same data
    assert data_fingerprint("coco", data_dir=moved, train_split="t", val_split="v") == \
        data_fingerprint("coco", data_dir=tmp_path / "c", train_split="t", val_split="v")


def test_a_large_token_file_is_hashed_by_sampled_blocks(tmp_path, monkeypatch):
    """Past WHOLE bytes a file is hashed by SAMPLES blocks spread from its start to its end (a 17 GB nanoGPT file
    costs a 4 MiB read): a change in its last block changes the stamp; the stamp says it is sampled."""
    from attnlab.data import registry

    monkeypatch.setattr(registry, "WHOLE", 1 << 12)
    monkeypatch.setattr(registry, "BLOCK", 1 << 8)
    path = tmp_path / "train.bin"
    data = bytearray(range(256)) * 64
    path.write_bytes(bytes(data))
    stamp = registry.content_stamp(path)
    assert stamp.startswith("16384 bytes, sampled sha256 ")
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert registry.content_stamp(path) != stamp and registry.content_stamp(tmp_path / "gone") == "missing"


def test_a_replaced_frame_changes_the_recorded_clips(tmp_path):
    from attnlab.data.registry import data_fingerprint

    for split in ("train", "val"):
        _frames(tmp_path / "v", f"{split}/run/c")
    before = data_fingerprint("video", data_dir=tmp_path / "v")
    frame = sorted((tmp_path / "v" / "train" / "run" / "c").iterdir())[0]
    frame.write_bytes(frame.read_bytes() + b"\0")
    after = data_fingerprint("video", data_dir=tmp_path / "v")
    assert after["training clips"] != before["training clips"] and after["evaluation clips"] == before["evaluation clips"]


def test_a_term_the_detector_cannot_take_is_its_own_reason_not_the_datas(tmp_path):
    """The plan's check forward finds that nystrom takes no relative-position bias; the line is the term's reason,
    not "check the options against the data" (the data is not the cause)."""
    line = refused(["train", "--recipe", "detect_demo", "--attn", "nystrom", "--epochs", "1"], tmp_path,
                   NystromAttention.capabilities.bias)
    assert "--model-options '{rel_pos: false}'" in line and "against the data" not in line


def test_a_large_token_file_that_passed_its_id_check_is_not_read_again(tmp_path, monkeypatch):
    """The check reads every id (a minute for OpenWebText's 9B tokens); a file that passed is remembered by path,
    size, time, vocabulary and dtype, so a resume or an evaluation does not read it again, while a rewritten file
    and a file that failed are checked each time."""
    import os

    import numpy as np

    from attnlab.data import lm

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(lm, "REMEMBERED", 0)
    path = tmp_path / "train.bin"
    np.asarray([1, 2, 3, 4] * 20, dtype="uint16").tofile(path)
    reads = []

    class Counted(np.ndarray):
        def __getitem__(self, index):
            reads.append(index)
            return super().__getitem__(index)

    def tokens():
        return np.memmap(path, dtype="uint16", mode="r").view(Counted)

    lm.check_token_ids(tokens(), 8, path, "uint16")
    assert reads
    reads.clear()
    lm.check_token_ids(tokens(), 8, path, "uint16")
    assert not reads  # remembered
    lm.check_token_ids(tokens(), 7, path, "uint16")
    assert reads  # another vocabulary is checked again
    reads.clear()
    np.asarray([1, 2, 9, 4] * 20, dtype="uint16").tofile(path)  # rewritten with an id past the vocabulary
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    for _ in range(2):
        with pytest.raises(Exception, match="holds token id 9, outside its vocabulary of 8"):
            lm.check_token_ids(tokens(), 8, path, "uint16")


@pytest.mark.parametrize("spec,words", [
    ("dna(backend=kernel)", "DnAAttention's kernel backend cannot run a training step: the fused DnA kernel is "
                            "forward-only"),
    ("ns(backend=kernel)", "NSTransform's kernel backend is forward-only"),
    ("performer(features=16,backend=kernel)", "PerformerAttention's kernel backend cannot run a training step"),
])
def test_a_forced_backend_that_cannot_train_is_refused_before_the_run(spec, words, tmp_path):
    """The C kernels are forward-only: forcing one for training is one line before anything is written."""
    line = refused(["train", "--model", "vit_digits", "--dataset", "digits", "--epochs", "1", "--warmup-epochs", "0",
                    "--attn", spec,
                    "--runs-dir", tmp_path / "runs"], tmp_path, words)
    assert "use backend=auto for training" in line


@pytest.mark.parametrize("spec", ["ns", "standard"])
def test_a_model_without_attention_is_named_as_such_not_by_an_argument_the_user_did_not_give(spec, tmp_path):
    """timm's resnet18 takes no img_size, which attnlab gives every image model; the line says why resnet18 cannot
    be a run of attnlab (no attention module to convert), not that img_size is not its argument."""
    line = refused(["train", "--model", "resnet18", "--attn", spec, "--epochs", "1", "--warmup-epochs", "0",
                    "--runs-dir", tmp_path / "runs"], tmp_path,
                   "model resnet18 (ResNet) has no attention module attnlab converts")
    assert "img_size" not in line and "use one of vit_cifar, swin_cifar, vit_digits" in line


def test_a_record_of_sizes_and_times_from_before_content_hashes_is_not_compared(lm_run, tmp_path):
    """data.json written before content hashes (sizes and modification times, no "recorded as" entry) cannot be
    compared with today's fingerprint: eval measures, and a resume records the data again, in the new form."""
    import json

    run = tmp_path / "runs" / "lm"
    shutil.copytree(lm_run, run)
    (run / "data.json").write_text(json.dumps({"corpus.txt": "4180 bytes, modified 2026-12-01T00:00:00+00:00"}))
    proc = in_process(["eval", run], tmp_path)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    (run / "result.json").unlink()
    proc = in_process(["train", "--resume", run, "--no-progress"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "data.json").read_text())["recorded as"] == "content hashes"
