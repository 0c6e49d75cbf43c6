"""The error contract for the video task's flags and files, as the bad-input table of test_bad_inputs.py runs them:
each case is `python -m attnlab train ...` in a fresh directory, one line on stderr, exit 2, no traceback, nothing
left behind (the run directory is made only once the data has loaded)."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from test_bad_inputs import case, finished_run, run_case  # noqa: F401  (finished_run: the fixture)
from test_bad_inputs import test_bad_input_is_one_line_exit_2_nothing_made as check_case


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (16, 16), 90).save(buf, format="PNG")
    return buf.getvalue()


def clips(*frames: int, split: str = "train", cls: str = "a") -> dict:
    """One frame folder ``v/<split>/<cls>/c`` holding the given frame numbers."""
    base = f"v/{split}/{cls}/c"
    return {"v": None, f"v/{split}": None, f"v/{split}/{cls}": None, base: None,
            **{f"{base}/img_{n:05d}.png": png() for n in frames}}


def merged(*parts: dict) -> dict:
    out: dict = {}
    for p in parts:
        out.update(p)
    return out


VIDEO = "train --recipe timesformer --model timesformer_tiny --data-dir".split()
TRAIN = [*VIDEO, "v", "--batch-size", "1", "--data-options", "{in_chans: 1, image_size: 16}"]  # a list: the mapping is one word
OK = merged(clips(1, 2, 3), clips(1, 2, 3, split="val"))
CASES = [
    case("video-no-data", [*VIDEO, "nowhere"],
         "video data folder", slow=True),
    case("video-frame-gap", TRAIN, "has a gap: frame 2 is missing", files=merged(clips(1, 3), clips(1, 2, split="val")),
         slow=True),
    case("video-class-outside", TRAIN, "is not a class of the training split",
         files=merged(clips(1, 2), clips(1, 2, split="val", cls="b")), slow=True),
    case("video-undecodable", TRAIN, "bad.mp4 cannot be opened by PyAV",
         files=merged(OK, {"v/train/a/bad.mp4": b"\x00not a video" * 40}), slow=True),
    case("video-list-label", [*VIDEO, "v", "--batch-size", "1"],
         "line 2: label 7 is outside the 1 classes",
         files=merged(OK, {"v/train.csv": b"train/a/c 0\n", "v/val.csv": b"val/a/c 0\nval/a/c 7\n"}), slow=True),
    case("video-crops-option", [*VIDEO, "v", "--data-options", "{crops: 2}"],
         "in_chans and crops take 1 or 3", files=OK, slow=True),
    case("video-metric-choice", "train --recipe moving_digits --video-metric mca",
         "'video_metric' is 'mca', but it must be one of top1, mean_class_accuracy"),
    case("digits-speed-canvas", ["train", "--recipe", "moving_digits", "--data-options", "{speed: 3}"],
         "needs image_size of at least 29", slow=True),
    case("digits-mixup", "train --recipe moving_digits --mixup-prob 0.5 --mixup 0.8",
         "belongs to the image family; moving_digits trains a video model (dataset moving_digits, the video family)"),
]


@pytest.mark.parametrize("argv,expected,files,damage", CASES)
def test_video_bad_input_is_one_line_exit_2_nothing_made(argv, expected, files, damage, tmp_path, finished_run):
    check_case(argv, expected, files, damage, tmp_path, finished_run)
