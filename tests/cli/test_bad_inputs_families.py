"""Issue 39: the contracts of the first families kept by language modelling, detection and video. Each refusal is
one line on stderr, exit code 2, no traceback, nothing made (``attnlab.cli.main`` in this process, read as a real
process: tests/cli/test_bad_inputs.py checks that the two agree); the bad inputs are files generated here. Runs
that a case needs are trained once per module for a step or two on a few bytes or clips."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
from cli_runner import in_process
from test_bad_inputs import _listing


def refused(argv, cwd, expected: str, command: str = "train"):
    """Run ``attnlab ARGV`` in ``cwd``: one stderr line holding ``expected``, exit 2, ``cwd`` unchanged."""
    before = _listing(cwd)
    proc = in_process([str(a) for a in argv], cwd)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"attnlab {command}: error: ") and expected in lines[0], lines[0]
    assert _listing(cwd) == before
    return lines[0]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A finished 1-step byte-level run on a 4 KB text file (the file lies beside the run, in ``corpus.txt``)."""
    from attnlab.train import RECIPES, train

    root = tmp_path_factory.mktemp("lm39")
    (root / "corpus.txt").write_bytes(bytes(range(32, 127)) * 44)
    cfg = dataclasses.replace(RECIPES["lm_demo"], dataset="text", data_dir=str(root / "corpus.txt"), block_size=8,
                              batch_size=2, max_steps=1, eval_every=1, eval_iters=1, probe_every=0, warmup_steps=0,
                              runs_dir=str(root / "runs"), name="lm", progress=False)
    train(cfg)
    return root / "runs" / "lm"


@pytest.fixture(scope="module")
def video_run(tmp_path_factory) -> Path:
    """A finished 1-epoch timesformer_tiny run on 16 moving-digit clips."""
    from attnlab.train import RECIPES, train

    root = tmp_path_factory.mktemp("video39")
    cfg = dataclasses.replace(RECIPES["moving_digits"], epochs=1, data_options={"num_train": 16, "num_test": 4},
                              runs_dir=str(root / "runs"), name="video", progress=False)
    train(cfg)
    return root / "runs" / "video"


# ---- 10 and 12: flags and models of another family, refused before anything is built ------------------------------
@pytest.mark.parametrize("argv, expected", [
    ("--recipe detect_demo --z-loss 0.1", "--z-loss (config key 'z_loss', 0.1 here) applies to lm runs only, and "
                                          "dataset shapes makes this a detect run"),
    ("--recipe moving_digits --block-size 32", "--block-size (config key 'block_size', 32 here) applies to lm runs"),
    ("--recipe lm --video-metric mean_class_accuracy", "applies to video runs only, and dataset stdlib makes this a "
                                                       "lm run"),
    ("--recipe detect_demo --eval-iters 3", "--eval-iters (config key 'eval_iters', 3 here) applies to lm runs"),
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
def test_finished_run_without_intact_weights_says_to_delete_result_json(lm_run, tmp_path):
    run = tmp_path / "lm"
    shutil.copytree(lm_run, run)
    for weights in run.glob("checkpoint*.safetensors"):
        weights.write_bytes(b"garbage" * 40)
    refused(["sample", run], tmp_path, "the run had finished, so delete its result.json and run `attnlab train "
                                       f"--resume {run}`, which trains it again from the start", "sample")


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
