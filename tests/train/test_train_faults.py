"""Faults as real processes (issue 27 items 4, 5, 6, 8): damage that still parses is noticed and the run falls back
to the previous epoch; a kill inside the first save restarts the run; SIGTERM stops at once with one line; a full
disk is one line; a checkpoint that lacks a key falls back like a damaged one."""

from __future__ import annotations

import io
import json
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import zipfile

import forked
import pytest
import torch
from process_helpers import alive, attnlab, children, one_line, start_paused, wait_for
from safetensors.torch import load_file, save_file
from train_helpers import STEPS_PER_EPOCH_64, tiny, weights

from attnlab.train import train
from attnlab.train import checkpoint as ckpt
from attnlab.train.loop import check_run

NAME = "vit_digits-digits-standard-s0"


class Interrupt(Exception):
    pass


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished 3-epoch run ("full") and the same run stopped in epoch 3 ("cut": checkpoints of epochs 1, 2)."""
    import attnlab.models as models

    root = tmp_path_factory.mktemp("faults")
    train(tiny(root / "full", epochs=3))
    build, count = models.build_model, [0]

    def build_and_stop(*args, **kwargs):
        model = build(*args, **kwargs)

        def hook(module, inputs, output):
            if module.training:
                count[0] += 1
                if count[0] == 2 * STEPS_PER_EPOCH_64 + 1:
                    raise Interrupt

        model.register_forward_hook(hook)
        return model

    models.build_model = build_and_stop
    try:
        with pytest.raises(Interrupt):
            train(tiny(root / "cut", epochs=3))
    finally:
        models.build_model = build
    return root


def _copy_cut(runs, tmp_path):
    run = tmp_path / "runs" / NAME
    shutil.copytree(runs / "cut" / NAME, run)
    return run


def _same_weights(a, b) -> bool:
    wa, wb = weights(a / ckpt.WEIGHTS), weights(b / ckpt.WEIGHTS)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _flip(path, offset: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + n] = bytes(b ^ 0xFF for b in data[offset:offset + n])
    path.write_bytes(bytes(data))


def _tensor_bytes(path) -> int:
    """An offset in the middle of the tensor data: of a safetensors file, or of the largest record of a torch file."""
    if path.suffix == ".safetensors":
        header = struct.unpack("<Q", path.read_bytes()[:8])[0]
        return 8 + header + (path.stat().st_size - 8 - header) // 2
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    local = path.read_bytes()[info.header_offset:info.header_offset + 30]
    start = info.header_offset + 30 + struct.unpack("<H", local[26:28])[0] + struct.unpack("<H", local[28:30])[0]
    return start + info.file_size // 2


def _resume(run, runs):
    """`attnlab train --resume RUN`: its one stderr line; the run must end as the uninterrupted one did."""
    proc = attnlab("train", "--resume", run)
    assert proc.returncode == 0, proc.stderr
    assert _same_weights(runs / "full" / NAME, run)
    assert json.loads((run / "result.json").read_text())["top1"] == \
        json.loads((runs / "full" / NAME / "result.json").read_text())["top1"]
    return one_line(proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [ckpt.WEIGHTS, ckpt.STATE])
def test_flipped_bytes_fall_back_to_the_previous_epoch(runs, tmp_path, victim):
    run = _copy_cut(runs, tmp_path)
    _flip(run / victim, _tensor_bytes(run / victim))  # still parses: only the checksum can tell
    if victim == ckpt.WEIGHTS:  # readers fall back too, and say so
        proc = attnlab("export", run, "--out", tmp_path / "w.safetensors")
        assert proc.returncode == 0, proc.stderr
        line = one_line(proc.stderr)
        assert "using epoch 1" in line and victim in line and "sha256" in line, line
    line = _resume(run, runs)
    assert "continuing from epoch 1" in line and victim in line and "sha256" in line, line


def _drop(run, victim: str, key: str | None = None) -> None:
    """Rewrite ``victim`` as an older attnlab wrote it (no checksum), and without ``key``."""
    path = run / victim
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = {k: v for k, v in f.metadata().items() if k != "sha256"}
        tensors = load_file(path)
        tensors.pop(key, None)
        save_file(tensors, path, metadata=meta)
    else:
        state = torch.load(path, weights_only=True)
        state.pop(key, None)
        del state["sha256"]
        buf = io.BytesIO()
        torch.save(state, buf)
        path.write_bytes(buf.getvalue())


@pytest.mark.slow
def test_a_checkpoint_that_parses_but_lacks_a_key_falls_back(runs, tmp_path):
    run = _copy_cut(runs, tmp_path)
    _drop(run, ckpt.STATE, "optimizer")
    line = _resume(run, runs)
    assert "continuing from epoch 1" in line and "trainer_state.pt: parses but lacks 'optimizer'" in line, line

    run = _copy_cut(runs, tmp_path / "b")
    key = next(iter(weights(run / ckpt.WEIGHTS)))
    _drop(run, ckpt.WEIGHTS, key)
    proc = attnlab("export", run, "--out", tmp_path / "w.safetensors")
    assert proc.returncode == 0, proc.stderr
    line = one_line(proc.stderr)
    assert "using epoch 1" in line and f"parses but lacks {key!r}" in line, line
    found, note = ckpt.resume_point(run, _model_of(run), ckpt.RESUME_KEYS)  # training falls back the same way
    assert found.epoch == 1 and f"lacks {key!r}" in note


def _model_of(run):
    from attnlab.train import load_run

    return load_run(run)[0]


def test_old_checkpoints_without_checksums_still_load(runs, tmp_path):
    run = _copy_cut(runs, tmp_path)
    for victim in (ckpt.WEIGHTS, ckpt.STATE, ckpt.PREV_WEIGHTS, ckpt.PREV_STATE):
        _drop(run, victim)
    found = ckpt.find_checkpoint(run, model=_model_of(run), state_keys=ckpt.RESUME_KEYS)
    assert found.epoch == 2 and found.note is None
    assert ckpt.find_weights(run).epoch == 2


# Runs `attnlab train ARGV...` in a fresh process whose fsync of the trainer state's temporary file does $FAULT:
# "kill" (SIGKILL, as a kill inside the first save) or "full" (ENOSPC, as a full disk).
FAULTY_FSYNC = textwrap.dedent("""
    import errno, os, signal, sys
    fault, fsync = os.environ["FAULT"], os.fsync

    def faulty_fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".trainer_state.pt."):
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as the kernel reports it: no file name
        fsync(fd)

    os.fsync = faulty_fsync
    from attnlab.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _faulty(fault: str, *argv) -> subprocess.CompletedProcess:
    import os

    return forked.run([sys.executable, "-c", FAULTY_FSYNC, *map(str, argv)], capture_output=True, text=True,
                      timeout=600, env=dict(os.environ, FAULT=fault))


TRAIN = ["train", "--recipe", "demo", "--epochs", "2", "--batch-size", "64", "--no-progress"]


@pytest.mark.slow
def test_a_kill_inside_the_first_state_write_restarts_the_run(tmp_path):
    killed = _faulty("kill", *TRAIN, "--runs-dir", tmp_path / "runs")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = tmp_path / "runs" / NAME
    assert (run / ckpt.WEIGHTS).exists() and not (run / ckpt.STATE).exists()
    assert list(run.glob(".trainer_state.pt.*.tmp"))  # what the kill left
    # a grid with this run is not refused: it plans to train it afresh
    plan = check_run(tiny(tmp_path / "runs", epochs=2, resume=True))
    assert plan["action"] == "train" and "starting the run afresh" in plan["note"]

    proc = attnlab("train", "--resume", run)
    assert proc.returncode == 0, proc.stderr
    line = one_line(proc.stderr)
    assert "no intact checkpoint" in line and "starting the run afresh" in line and ckpt.WEIGHTS in line, line
    reference = train(tiny(tmp_path / "ref", epochs=2))
    assert _same_weights(tmp_path / "ref" / NAME, run)
    assert json.loads((run / "result.json").read_text())["top1"] == reference["top1"]
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == []  # the temporary file was removed


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_the_file(tmp_path):
    proc = _faulty("full", *TRAIN, "--runs-dir", tmp_path / "runs")
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith("attnlab train: error: cannot use ") and "no space left on the device" in line, line
    assert str(tmp_path / "runs" / NAME / ckpt.STATE) in line, line
    assert not list((tmp_path / "runs" / NAME).glob(".*.tmp"))


@pytest.mark.slow
def test_sigterm_stops_training_at_once_with_one_line(tmp_path):
    ready = tmp_path / "ready"
    proc = start_paused(ready, *TRAIN, "--num-workers", "2", "--runs-dir", tmp_path / "runs", pause_at=3)
    pid = int(wait_for(lambda: ready.exists() and ready.read_text(), "training to start", proc))
    workers = children(pid)
    assert len(workers) >= 2, workers  # the DataLoader's worker processes
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert one_line(err) == "attnlab train: terminated (SIGTERM)"
    assert not any(alive(w) for w in workers), [w for w in workers if alive(w)]  # ended with it, not orphaned
    # nothing half-written: the run continues from where it stood
    assert (tmp_path / "runs" / NAME / "config.yaml").exists()
