"""Atomic checkpoint writes and RNG state that survives torch.load(weights_only=True)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from attnlab.train import checkpoint as ckpt


def _model(value: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _state(epoch: int) -> dict:
    return {"epoch": epoch, "num_updates": 10 * epoch, "history": [{"epoch": epoch, "top1": 50.0}],
            "rng": ckpt.get_rng_state()}


def _assert_holds(run_dir, value: float, epoch: int):
    weights, state = ckpt.load_checkpoint(run_dir)
    assert set(weights) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    for t in weights.values():
        assert torch.equal(t, torch.full_like(t, value))
    assert state["epoch"] == epoch
    assert [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("fail_at", ["rename", "serialise", "mid_write"])
def test_failed_write_leaves_previous_checkpoint_valid(tmp_path, monkeypatch, fail_at):
    ckpt.save_checkpoint(tmp_path, _model(1.0), _state(1))
    _assert_holds(tmp_path, 1.0, 1)

    class Boom(Exception):
        pass

    def boom(*args, **kwargs):
        raise Boom

    if fail_at == "rename":
        monkeypatch.setattr(ckpt.os, "replace", boom)
    elif fail_at == "serialise":
        monkeypatch.setattr(ckpt, "safetensors_bytes", boom)
    else:  # half the bytes reach the temporary file, then the process "dies"
        def half(path, data):
            def write(f):
                f.write(data[: len(data) // 2])
                raise Boom
            ckpt.atomic_write(path, write)

        monkeypatch.setattr(ckpt, "atomic_write_bytes", half)
    with pytest.raises(Boom):
        ckpt.save_checkpoint(tmp_path, _model(2.0), _state(2))
    monkeypatch.undo()
    _assert_holds(tmp_path, 1.0, 1)
    ckpt.save_checkpoint(tmp_path, _model(3.0), _state(3))
    _assert_holds(tmp_path, 3.0, 3)


def test_weights_and_state_of_different_epochs_are_refused(tmp_path):
    ckpt.save_checkpoint(tmp_path, _model(1.0), _state(1))
    state_bytes = (tmp_path / ckpt.STATE).read_bytes()
    ckpt.save_checkpoint(tmp_path, _model(2.0), _state(2))
    (tmp_path / ckpt.STATE).write_bytes(state_bytes)  # as if killed between the two renames
    from attnlab.errors import AttnlabError

    with pytest.raises(AttnlabError, match="epoch 2 .* epoch 1"):
        ckpt.load_checkpoint(tmp_path)


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    ckpt.seed_everything(123)
    random.random(), np.random.rand(), torch.rand(1)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's legacy state
    saved = ckpt.get_rng_state()
    torch.save({"rng": saved}, tmp_path / "s.pt")
    first = (random.random(), np.random.standard_normal(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    ckpt.seed_everything(999)
    ckpt.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["rng"])
    second = (random.random(), np.random.standard_normal(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    assert first == second


def test_atomic_write_text_replaces_content(tmp_path):
    path = tmp_path / "f.txt"
    ckpt.atomic_write_text(path, "one")
    ckpt.atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert os.listdir(tmp_path) == ["f.txt"]
