"""Nothing lost: a damaged latest checkpoint falls back to the previous epoch, run files follow the umask, and a
run killed before its first checkpoint continues with `attnlab train --resume RUN_DIR`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from train_helpers import STEPS_PER_EPOCH_64, tiny, weights

import attnlab.data
from attnlab.cli import main
from attnlab.train import train


class Interrupt(Exception):
    pass


def _once(at: int):
    """An on_train_forward callback that raises Interrupt at training forward ``at``, the first time only."""
    fired = [False]

    def fn(count, output):
        if count == at and not fired[0]:
            fired[0] = True
            raise Interrupt

    return fn


def _same_weights(a, b) -> bool:
    wa, wb = weights(a / "checkpoint.safetensors"), weights(b / "checkpoint.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_from_the_previous_checkpoint_when_the_latest_is_garbage(tmp_path, on_train_forward, capsys):
    full = train(tiny(tmp_path / "full", epochs=3))
    on_train_forward(_once(2 * STEPS_PER_EPOCH_64 + 1))  # epoch 3, step 1: checkpoints of epochs 1 and 2 exist
    with pytest.raises(Interrupt):
        train(tiny(tmp_path / "cut", epochs=3))
    run = tmp_path / "cut" / full["name"]
    assert torch.load(run / "trainer_state.prev.pt", weights_only=True)["epoch"] == 1
    (run / "checkpoint.safetensors").write_bytes(os.urandom(4096))
    capsys.readouterr()

    resumed = train(tiny(tmp_path / "cut", epochs=3, resume=True))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.safetensors" in err[0] and "epoch 1" in err[0], err
    # epochs 2 and 3 trained again from epoch 1's state: the uninterrupted run's weights, bit for bit
    assert _same_weights(tmp_path / "full" / full["name"], run)
    assert resumed["top1"] == full["top1"]
    assert [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert torch.load(run / "trainer_state.prev.pt", weights_only=True)["epoch"] == 2


def test_run_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        result = train(tiny(tmp_path, epochs=1))
    finally:
        os.umask(old)
    run = tmp_path / result["name"]
    assert run.stat().st_mode & 0o777 == 0o750
    names = {p.name: p.stat().st_mode & 0o777 for p in run.iterdir()}
    assert set(names) == {"config.yaml", "metrics.jsonl", "checkpoint.safetensors", "trainer_state.pt", "result.json"}
    assert set(names.values()) == {0o640}, names


TINY = ["--recipe", "demo", "--epochs", "1", "--batch-size", "64", "--no-progress"]


@pytest.mark.parametrize("killed", ["downloading data", "in epoch 1"])
def test_train_resume_run_dir_after_a_kill_before_the_first_checkpoint(tmp_path, monkeypatch, on_train_forward,
                                                                      killed):
    reference = train(tiny(tmp_path / "ref", epochs=1))
    flags = [*TINY, "--runs-dir", str(tmp_path / "runs")]
    if killed == "downloading data":  # a CIFAR download takes minutes (digits has nothing to fetch)
        def build_dataset(*args, **kwargs):
            raise Interrupt

        monkeypatch.setattr(attnlab.data, "build_dataset", build_dataset)
        flags.append("--download")
    else:
        on_train_forward(_once(3))
    with pytest.raises(Interrupt):
        main(["train", *flags])
    monkeypatch.undo()
    run = tmp_path / "runs" / reference["name"]
    assert not (run / "checkpoint.safetensors").exists()

    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert json.loads((run / "result.json").read_text())["top1"] == reference["top1"]
    assert _same_weights(tmp_path / "ref" / reference["name"], run)
