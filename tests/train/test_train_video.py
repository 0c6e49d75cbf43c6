"""The video task through the one trainer: moving digits and frame folders, views averaged in evaluation, the
headline metric, an exact resume after SIGKILL, and (slow) that the set is learnt by attention across frames while a
space-only model, blind to frame order, cannot tell opposite directions apart."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import forked
import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import ARM_KILL, weights

from attnlab.train import RECIPES, train
from attnlab.train.run import Run

SMALL = {"num_train": 64, "num_test": 32}


def _cfg(runs_dir, **overrides):
    base = dict(epochs=1, runs_dir=str(runs_dir), progress=False, data_options=dict(SMALL))
    base.update(overrides)
    return RECIPES["moving_digits"].replace(**base)


def frame_clips(root, classes=("jump", "walk"), per_class=3, frames=10, size=(20, 24), seed=0):
    """``root/train`` and ``root/val``, one folder of numbered PNG frames per clip (random grey pixels)."""
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for c in classes:
            for k in range(per_class):
                folder = root / split / c / f"clip{k}"
                folder.mkdir(parents=True)
                for i in range(1, frames + 1):
                    Image.fromarray(rng.integers(0, 255, size, dtype=np.uint8)).save(folder / f"img_{i:05d}.png")
    return root


def test_moving_digits_run_reports_the_video_metrics(tmp_path):
    result = train(_cfg(tmp_path, video_metric="mean_class_accuracy"))
    assert result["task"] == "video" and result["metric"] == "mean_class_accuracy"
    keys = [k for k in result if k in ("mean_class_accuracy", "top1", "top5", "test_loss")]
    assert keys[0] == "mean_class_accuracy" and set(keys) == {"mean_class_accuracy", "top1", "top5", "test_loss"}
    record = json.loads((tmp_path / result["name"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["clips_per_s"] > 0 and 0 <= record["mean_class_accuracy"] <= 100
    run = Run.open(tmp_path / result["name"])
    assert run.task.name == "video" and run.info.num_frames == 8


def test_views_are_averaged_as_probabilities(tmp_path):
    """The task's evaluation of a model on a split of 2 clips x 3 crops equals the mean of each view's softmax."""
    data = frame_clips(tmp_path / "data")
    cfg = _cfg(tmp_path / "runs", dataset="video", data_dir=str(data), data_options=dict(
        num_frames=4, image_size=16, in_chans=1, clips=2, crops=3), batch_size=2)
    run = Run(cfg)
    model = run.task.build_model().eval()
    got = run.task.evaluate(model, device=torch.device("cpu"), amp_dtype=None)
    test = run.task.test_set()
    probs, labels = [], []
    for i in range(len(test)):
        views, label = test[i]
        assert views.shape == (6, 1, 4, 16, 16)
        with torch.no_grad():
            probs.append(torch.stack([model(v[None])[0].softmax(-1) for v in views]).mean(0))
        labels.append(label)
    probs, labels = torch.stack(probs), torch.tensor(labels)
    top1 = 100 * (probs.argmax(1) == labels).double().mean().item()
    loss = -probs.gather(1, labels[:, None]).log().mean().item()
    assert got["top1"] == pytest.approx(top1) and got["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert run.task.inputs(2).shape == (2, 1, 4, 16, 16)


def test_eval_of_a_video_run_prints_its_task_metrics_over_the_views(tmp_path, capsys):
    """`attnlab eval RUN` on a run whose test clips come in several views: the task's own evaluation (views
    averaged), not the image protocol; the image-only flags are refused in one line."""
    from attnlab.cli import main

    data = frame_clips(tmp_path / "data")
    cfg = _cfg(tmp_path / "runs", dataset="video", data_dir=str(data), batch_size=2, data_options=dict(
        num_frames=4, image_size=16, in_chans=1, clips=2, crops=3), name="clips")
    train(cfg)
    run = Run.open(tmp_path / "runs" / "clips")
    want = run.task.evaluate(run.load_model(), device=torch.device("cpu"), amp_dtype=None)
    capsys.readouterr()
    assert main(["eval", str(run.dir)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["task"] == "video" and got["top1"] == pytest.approx(want["top1"])
    assert got["mean_class_accuracy"] == pytest.approx(want["mean_class_accuracy"])
    assert main(["eval", str(run.dir), "--noise", "0.5"]) == 2
    assert "--noise applies to image and sequence classification runs" in capsys.readouterr().err


# Runs in a process of its own (tests/forked.py): argv = runs_dir, data_dir, kill_at (training forward count at which
# the process SIGKILLs itself; 0 = never). Every random part of the video recipe is on: temporal jitter, scale jitter,
# crop and flip in 2 DataLoader workers, drop-path.
SCRIPT = ARM_KILL + textwrap.dedent("""
    runs_dir, data_dir = sys.argv[1], sys.argv[2]
    cfg = RECIPES["moving_digits"].replace(
        dataset="video", data_dir=data_dir, augment="recipe", epochs=2, batch_size=2,
        drop_path=0.2, num_workers=2, runs_dir=runs_dir, progress=False, resume=True,
        data_options={"num_frames": 4, "image_size": 16, "in_chans": 1, "crops": 1})
    print(json.dumps(train(cfg)))
""")


def _run(runs_dir, data_dir, kill_at: int) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-c", SCRIPT, str(runs_dir), str(data_dir), str(kill_at)],
                      capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_gives_identical_weights(tmp_path):
    data = frame_clips(tmp_path / "data")  # 6 training clips: 3 steps of 2 per epoch
    whole = _run(tmp_path / "whole", data, 0)
    assert whole.returncode == 0, whole.stderr
    result = json.loads(whole.stdout.strip().splitlines()[-1])
    name = result["name"]

    killed = _run(tmp_path / "cut", data, 3 + 2)  # epoch 2, step 2: the first epoch's checkpoint exists
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = tmp_path / "cut" / name
    assert not (run / "result.json").exists()
    assert torch.load(run / "trainer_state.pt", weights_only=True)["epoch"] == 1

    resumed = _run(tmp_path / "cut", data, 0)
    assert resumed.returncode == 0, resumed.stderr
    again = json.loads(resumed.stdout.strip().splitlines()[-1])
    w_whole, w_cut = weights(tmp_path / "whole" / name / "checkpoint.safetensors"), weights(run / "checkpoint.safetensors")
    assert w_whole.keys() == w_cut.keys() and all(torch.equal(w_whole[k], w_cut[k]) for k in w_whole)
    for key in ("top1", "top5", "mean_class_accuracy", "test_loss"):
        assert again[key] == result[key]
    lines = lambda d: [json.loads(x) for x in (d / name / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    drop = ("epoch_seconds", "clips_per_s")
    assert [{k: v for k, v in m.items() if k not in drop} for m in lines(tmp_path / "cut")] == \
           [{k: v for k, v in m.items() if k not in drop} for m in lines(tmp_path / "whole")]


@pytest.mark.slow
def test_attention_across_frames_learns_the_set_and_space_only_cannot_tell_opposites(tmp_path):
    data = {"num_train": 1024, "num_test": 256}
    divided = train(_cfg(tmp_path, epochs=4, data_options=data))
    # 4 directions: chance is 25%, and telling only the axis of motion (what frames seen as a set show) is 50%
    assert divided["top1"] > 60, divided

    space = train(_cfg(tmp_path, epochs=4, data_options=data, model_options={"attention": "space_only"},
                       name="space_only"))
    run = Run.open(tmp_path / "space_only")
    model = run.load_model("cpu").eval()
    clips = run.task.inputs(256)
    with torch.no_grad():  # a clip and its time reversal (a clip of the opposite direction) look the same to it
        torch.testing.assert_close(model(clips), model(clips.flip(2)), rtol=1e-4, atol=1e-4)
    assert space["top1"] <= 50 + 1e-9  # so at most one of each opposite pair can be right
