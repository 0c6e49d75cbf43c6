"""`--log tensorboard`: metrics.jsonl's numbers as TensorBoard scalars, read back with TensorBoard's own reader."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from train_helpers import STEPS_PER_EPOCH_64, tiny

from attnlab.errors import ConfigError
from attnlab.train import train


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    pytest.importorskip("tensorboard")  # in the test extra; the missing-package tests below need no package
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_metrics_and_probes(tmp_path):
    from attnlab.analysis import training_probe

    cfg = tiny(tmp_path, log="tensorboard", probe_every=10, probe_images=8)
    result = train(cfg, probe=training_probe)
    run = tmp_path / result["name"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    scalars = _scalars(run / "tensorboard")
    ends = [STEPS_PER_EPOCH_64 * m["epoch"] for m in lines]  # epoch scalars at the step that ends the epoch
    for key, tag in [("train_loss", "train/loss"), ("train_acc", "train/top1"), ("top1", "test/top1"),
                     ("test_loss", "test/loss"), ("lr", "train/lr"), ("img_per_s", "train/img_per_s")]:
        assert [s for s, _ in scalars[tag]] == ends, tag
        assert [v for _, v in scalars[tag]] == pytest.approx([m[key] for m in lines], rel=1e-6), tag
    probes = [p for m in lines for p in m["probes"]]
    assert [p["step"] for p in probes] == list(range(10, 2 * STEPS_PER_EPOCH_64 + 1, 10))
    for key in probes[0]:
        if key != "step":
            assert [s for s, _ in scalars[f"probe/{key}"]] == [p["step"] for p in probes], key
            assert [v for _, v in scalars[f"probe/{key}"]] == pytest.approx([p[key] for p in probes], rel=1e-6), key


def test_without_tensorboard_the_run_stops_before_training(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install attnlab\[tensorboard\]"):
        train(tiny(tmp_path, log="tensorboard"))
    assert list(tmp_path.iterdir()) == []


def test_cli_without_tensorboard_is_one_line(tmp_path, monkeypatch):
    from cli_runner import in_process

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: importing it fails
    run = in_process(["train", "--recipe", "demo", "--log", "tensorboard", "--runs-dir", tmp_path])
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "pip install attnlab[tensorboard]" in run.stderr, run.stderr
