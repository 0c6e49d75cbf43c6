"""Issue 47: the video LLM family's bad inputs, each one line on stderr with exit code 2 and nothing made (the
pattern of tests/cli/test_bad_inputs_families.py): every conversation is checked before the first step, naming the
item's index and file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_bad_inputs_families import refused


def _data(root: Path, items: list[dict] | None = None) -> Path:
    """root/train.json and root/val.json over two frame folders of 4 grey 16 x 16 frames."""
    for clip in ("a", "b"):
        (root / clip).mkdir(parents=True, exist_ok=True)
        for i in range(1, 5):
            Image.fromarray(np.full((16, 16), 40 * i, np.uint8)).save(root / clip / f"img_{i:05d}.png")
    good = {"video": "a", "category": "motion", "conversations": [
        {"from": "human", "value": "<video>\nWhich?\nA. up\nB. down\nC. left\nD. right"}, {"from": "gpt", "value": "B"}]}
    (root / "val.json").write_text(json.dumps([good]))
    (root / "train.json").write_text(json.dumps(items if items is not None else [good, good]))
    return root


def _argv(root: Path, *extra) -> list:
    return ["train", "--recipe", "vlm_demo", "--dataset", "video_qa", "--data-dir", root,
            "--data-options", "{num_frames: 4, image_size: 16}", "--encoder-pretrain-steps", "0", *extra]


def _turns(human="<video>\nWhich?\nA. x\nB. y", gpt="A", role="gpt"):
    return [{"from": "human", "value": human}, {"from": role, "value": gpt}]


@pytest.mark.parametrize("item, expected", [
    ({"video": "missing", "conversations": _turns()}, "item 1 of"),
    ({"video": "b", "conversations": _turns(role="bot")}, "unknown role"),
    ({"video": "b", "conversations": _turns(human="Which?")}, "holds 0 <video>/<image> placeholders"),
    ({"image": "a/img_00001.png", "video": "b", "conversations": _turns()}, "must name one 'video'"),
    ({"video": "b", "conversations": []}, "has no 'conversations' list"),
])
def test_a_bad_item_is_one_line_naming_it(tmp_path, item, expected):
    root = _data(tmp_path / "d", [dict(json.loads((_data(tmp_path / "d") / "val.json").read_text())[0]), item])
    line = refused(_argv(root, "--runs-dir", tmp_path / "runs"), tmp_path, expected)
    assert "item 1 of" in line and "train.json" in line


def test_unreadable_frame_and_over_long_sequence_are_refused(tmp_path):
    root = _data(tmp_path / "d")
    refused(_argv(root, "--runs-dir", tmp_path / "runs", "--model-options", "{block_size: 40}"), tmp_path,
            "more than the decoder's 40; use fewer frames")
    (root / "a" / "img_00002.png").write_bytes(b"not a png")
    refused(_argv(root, "--runs-dir", tmp_path / "runs"), tmp_path, "item 0 of")


def test_wrong_model_and_options_are_refused(tmp_path):
    root = _data(tmp_path / "d")
    refused(_argv(root, "--model", "vit_cifar"), tmp_path, "trains a video language model (vlm family); use one of viscop")
    refused(_argv(root, "--eval-mode", "vote"), tmp_path, "likelihood, generate")
    refused(_argv(root, "--probe-layers", "9"), tmp_path, "probe layers must be distinct block indices from 0 to 3")
    refused(_argv(root, "--attn", "ns"), tmp_path, "take one attention term (standard or dna")
    refused(["train", "--recipe", "demo", "--num-probes", "4"], tmp_path, "belongs to the vlm family")
