"""Atomic checkpoint writes, the two-epoch checkpoint rotation, umask-respecting files, and RNG state that survives
torch.load(weights_only=True)."""

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


def _files(run_dir) -> set[str]:
    return {p.name for p in run_dir.iterdir()}


def test_the_last_two_epochs_are_kept(tmp_path):
    for epoch in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, _model(float(epoch)), _state(epoch))
    assert _files(tmp_path) == {ckpt.WEIGHTS, ckpt.STATE, ckpt.PREV_WEIGHTS, ckpt.PREV_STATE}
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / ckpt.PREV_WEIGHTS)["0.bias"], torch.full((4,), 2.0))
    assert torch.load(tmp_path / ckpt.PREV_STATE, weights_only=True)["epoch"] == 2
    _assert_holds(tmp_path, 3.0, 3)


GARBAGE = {"random": lambda data: os.urandom(len(data)), "truncated": lambda data: data[: len(data) // 2],
           "empty": lambda data: b""}


@pytest.mark.parametrize("damage", sorted(GARBAGE))
@pytest.mark.parametrize("victim", [ckpt.WEIGHTS, ckpt.STATE])
def test_unreadable_latest_falls_back_to_the_previous_epoch(tmp_path, victim, damage):
    for epoch in (1, 2):
        ckpt.save_checkpoint(tmp_path, _model(float(epoch)), _state(epoch))
    path = tmp_path / victim
    path.write_bytes(GARBAGE[damage](path.read_bytes()))
    found = ckpt.find_checkpoint(tmp_path)
    assert found.epoch == 1 and found.files == (ckpt.PREV_WEIGHTS, ckpt.PREV_STATE)
    assert len(found.note.splitlines()) == 1 and victim in found.note and "epoch 1" in found.note
    _assert_holds(tmp_path, 1.0, 1)
    # training on from there keeps epoch 1 as the previous checkpoint, not the damaged file
    ckpt.save_checkpoint(tmp_path, _model(5.0), _state(2), previous=found.files)
    _assert_holds(tmp_path, 5.0, 2)
    assert ckpt.find_checkpoint(tmp_path).note is None
    (tmp_path / ckpt.WEIGHTS).unlink()
    _assert_holds(tmp_path, 1.0, 1)


def test_weights_and_state_of_different_saves_are_never_paired(tmp_path):
    # two runs' epoch-2 checkpoints: same epoch, other weights; run a gets run b's trainer state
    a, b = tmp_path / "a", tmp_path / "b"
    for run_dir, value in ((a, 2.0), (b, 7.0)):
        run_dir.mkdir()
        ckpt.save_checkpoint(run_dir, _model(1.0), _state(1))
        ckpt.save_checkpoint(run_dir, _model(value), _state(2))
    (a / ckpt.STATE).write_bytes((b / ckpt.STATE).read_bytes())
    found = ckpt.find_checkpoint(a)
    assert found.epoch == 1 and ckpt.WEIGHTS in found.note
    _assert_holds(a, 1.0, 1)


class Kill(Exception):
    pass


@pytest.mark.parametrize("kill_before", range(5))
def test_a_kill_anywhere_in_a_save_leaves_an_intact_checkpoint(tmp_path, monkeypatch, kill_before):
    # a save is four renames (latest -> previous twice, then two atomic writes); die before the n-th one
    for epoch in (1, 2):
        ckpt.save_checkpoint(tmp_path, _model(float(epoch)), _state(epoch))
    renames = [0]
    replace = os.replace

    def dying_replace(src, dst):
        if renames[0] == kill_before:
            raise Kill
        renames[0] += 1
        replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", dying_replace)
    if kill_before < 4:
        with pytest.raises(Kill):
            ckpt.save_checkpoint(tmp_path, _model(3.0), _state(3))
    else:
        ckpt.save_checkpoint(tmp_path, _model(3.0), _state(3))
    monkeypatch.undo()
    found = ckpt.find_checkpoint(tmp_path)
    expected = 3 if kill_before == 4 else 2
    assert found.epoch == expected
    _assert_holds(tmp_path, float(expected), expected)
    # the run goes on: the checkpoint it continued from becomes the previous one
    ckpt.save_checkpoint(tmp_path, _model(9.0), _state(expected + 1), previous=found.files)
    _assert_holds(tmp_path, 9.0, expected + 1)
    for name in (ckpt.WEIGHTS, ckpt.STATE):
        (tmp_path / name).unlink()
    _assert_holds(tmp_path, float(expected), expected)


def test_no_intact_checkpoint_is_one_clear_error(tmp_path):
    assert ckpt.find_checkpoint(tmp_path) is None
    ckpt.save_checkpoint(tmp_path, _model(1.0), _state(1))
    (tmp_path / ckpt.WEIGHTS).write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint") as info:
        ckpt.load_checkpoint(tmp_path)
    assert ckpt.WEIGHTS in str(info.value) and len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002], ids=lambda m: f"umask{m:03o}")
def test_files_and_directories_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        ckpt.atomic_write_text(tmp_path / "f.txt", "x")
        ckpt.create_dir_with(tmp_path / "run", {"config.yaml": b"a: 1\n"})
        ckpt.save_checkpoint(tmp_path / "run", _model(1.0), _state(1))
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777
    assert mode(tmp_path / "f.txt") == 0o666 & ~umask
    assert mode(tmp_path / "run") == 0o777 & ~umask
    for p in (tmp_path / "run").iterdir():
        assert mode(p) == 0o666 & ~umask, p.name


def test_create_dir_with_never_shows_the_directory_without_its_files(tmp_path, monkeypatch):
    def dying_rename(src, dst):
        raise Kill

    monkeypatch.setattr(ckpt.os, "rename", dying_rename)
    with pytest.raises(Kill):
        ckpt.create_dir_with(tmp_path / "run", {"config.yaml": b"a: 1\n"})
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    ckpt.create_dir_with(tmp_path / "run", {"config.yaml": b"a: 1\n"})
    ckpt.create_dir_with(tmp_path / "run", {"config.yaml": b"a: 2\n"})  # an existing directory: rewritten in place
    assert (tmp_path / "run" / "config.yaml").read_text() == "a: 2\n"
    assert _files(tmp_path / "run") == {"config.yaml"}


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


def test_load_run_says_when_it_reads_the_previous_checkpoint(tmp_path, capsys):
    # analysis and eval read runs through load_run: a damaged latest checkpoint is named, not silently skipped
    from safetensors.torch import load_file

    from attnlab.train import RECIPES, load_run, train

    result = train(RECIPES["demo"].replace(epochs=2, runs_dir=str(tmp_path), progress=False))
    run = tmp_path / result["name"]
    capsys.readouterr()
    model, _ = load_run(run)
    assert capsys.readouterr().err == ""
    previous = load_file(run / ckpt.PREV_WEIGHTS)
    (run / ckpt.WEIGHTS).write_bytes(b"")
    model, _ = load_run(run)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unusable" in err[0] and "using epoch 1" in err[0] and ckpt.WEIGHTS in err[0], err
    assert all(torch.equal(model.state_dict()[k], v) for k, v in previous.items())
