"""One writer per run directory (issue 27 items 2 and 5): an exclusive OS lock taken before anything is written,
held for the whole run, released by the kernel however the process ends; a second writer gets one line naming the
holder; the next holder removes the temporary files of killed writers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import forked
import pytest
import yaml
from process_helpers import attnlab, one_line, start_paused, wait_for

from attnlab.errors import ConfigError
from attnlab.train import checkpoint as ckpt
from attnlab.train.lock import LOCK, RunLock, RunLockedError, check_unlocked


def _dead_pid() -> int:
    """A pid no process has now."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run) as lock:
        assert lock.held and (run / LOCK).read_text().split()[0] == str(os.getpid())
        with pytest.raises(RunLockedError, match=f"being written by process {os.getpid()}") as err:
            RunLock(run).__enter__()
        assert len(str(err.value).splitlines()) == 1 and "--name" in str(err.value)
        with pytest.raises(RunLockedError):
            check_unlocked(run)  # a planner's probe sees it too
    assert not (run / LOCK).exists()  # released: the file goes with the lock
    check_unlocked(run)
    with RunLock(run):
        pass


def test_a_missing_run_directory_is_locked_when_it_is_made(tmp_path):
    run = tmp_path / "runs" / "run"
    with RunLock(run) as lock:
        assert not lock.held and not run.exists()  # nothing written before the run decides to make it
        ckpt.create_dir_with(run, {"config.yaml": b"a: 1\n"}, lock)
        assert lock.held and (run / "config.yaml").read_text() == "a: 1\n"
        with pytest.raises(RunLockedError):
            check_unlocked(run)
        ckpt.create_dir_with(run, {"config.yaml": b"a: 2\n"}, lock)  # its own directory: rewritten
        assert (run / "config.yaml").read_text() == "a: 2\n"
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]  # no temporary directory left
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_create_dir_with_never_rewrites_a_held_directory(tmp_path):
    run = tmp_path / "run"
    ckpt.create_dir_with(run, {"config.yaml": b"mine\n"})
    with RunLock(run):
        for lock in (None, RunLock(run)):  # a lock-less call, and another run's own lock
            with pytest.raises(RunLockedError):
                ckpt.create_dir_with(run, {"config.yaml": b"theirs\n"}, lock)
    assert (run / "config.yaml").read_text() == "mine\n"


def test_a_directory_made_by_another_process_meanwhile_is_not_taken_over(tmp_path):
    run = tmp_path / "run"
    with RunLock(run) as lock:  # this run saw no directory and decided to train afresh
        ckpt.create_dir_with(run, {"config.yaml": b"theirs\n"})  # another process made it, and ended
        with pytest.raises(ConfigError, match="made by another process while this run set up"):
            ckpt.create_dir_with(run, {"config.yaml": b"mine\n"}, lock)
    assert (run / "config.yaml").read_text() == "theirs\n"


def test_the_next_holder_removes_what_killed_writers_left(tmp_path):
    runs, dead, me = tmp_path / "runs", _dead_pid(), os.getpid()
    run = runs / "run"
    run.mkdir(parents=True)
    stale = [run / f".trainer_state.pt.{dead}.0123456789ab.tmp",  # a kill inside an atomic write
             run / ".checkpoint.safetensors.0123456789ab.tmp"]     # older versions named no pid
    kept = [run / f".metrics.jsonl.{me}.0123456789ab.tmp",         # a live process's
            run / "notes.tmp", run / "checkpoint.safetensors"]
    for path in stale + kept:
        path.write_bytes(b"x")
    stale_dir, live_dir, other_run = (runs / f".run.{dead}.0123456789ab.tmp", runs / f".run.{me}.0123456789ac.tmp",
                                      runs / f".run2.{dead}.0123456789ab.tmp")
    for d in (stale_dir, live_dir, other_run):  # create_dir_with's temporary directories beside the run
        d.mkdir()
        (d / "config.yaml").write_bytes(b"a: 1\n")
    with RunLock(run):
        assert not any(p.exists() for p in (*stale, stale_dir))
        assert all(p.exists() for p in (*kept, live_dir, other_run))


def test_a_file_system_that_cannot_lock_writes_unlocked(tmp_path, monkeypatch):
    import errno

    import attnlab.train.lock as lock_module

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_locks)
    run = tmp_path / "run"
    with RunLock(run) as lock:
        ckpt.create_dir_with(run, {"config.yaml": b"a: 1\n"}, lock)
        assert lock.held and not (run / LOCK).exists()
    check_unlocked(run)


FORKED = textwrap.dedent("""
    import os, sys, time
    from attnlab.train.lock import RunLock

    lock = RunLock(sys.argv[1]).__enter__()
    child = os.fork()
    if child == 0:  # a DataLoader worker, say: outlives its parent for a while
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1), os.dup2(null, 2)  # off the test's pipes, so that its read ends with the parent
        time.sleep(60)
        os._exit(0)
    print("held", child, flush=True)
    os._exit(0)  # dies holding the lock, without releasing it
""")


@pytest.mark.slow
def test_the_lock_ends_with_the_process_not_with_its_forked_children(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc = forked.run([sys.executable, "-c", FORKED, str(run)], capture_output=True, text=True, timeout=300)
    word, child = proc.stdout.split()
    assert word == "held", proc.stderr
    try:
        os.kill(int(child), 0)  # the child still runs, but its copy of the descriptor was closed at the fork
        check_unlocked(run)
        with RunLock(run):
            pass
    finally:
        os.kill(int(child), signal.SIGKILL)


TRAIN = ["--recipe", "demo", "--epochs", "2", "--batch-size", "64", "--no-progress"]


@pytest.mark.slow
def test_a_second_writer_gets_one_line_naming_the_first(tmp_path):
    """`train` into a held run, `train --resume` of it and a `compare` whose grid holds it: each refused with the
    holder's pid, config.yaml untouched; SIGKILL of the holder (with a DataLoader worker alive) leaves no stale
    lock: `train --resume` continues the run at once."""
    runs, ready = tmp_path / "runs", tmp_path / "ready"
    name = "vit_digits-digits-standard-s0"
    holder = start_paused(ready, "train", *TRAIN, "--num-workers", "1", "--runs-dir", runs)
    pid = int(wait_for(lambda: ready.exists() and ready.read_text(), "the first writer to train", holder))
    run = runs / name
    config = (run / "config.yaml").read_bytes()
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"variants": ["standard", "ns"], "seeds": [0], "runs_dir": str(runs),
                                    "base": {"recipe": "demo", "epochs": 2, "batch_size": 64}}))
    for argv in (["train", *TRAIN, "--attn", "ns", "--name", name, "--runs-dir", runs],  # another config
                 ["train", "--resume", run],
                 ["compare", "--config", grid]):
        proc = attnlab(*argv)
        assert proc.returncode == 2, proc.stderr
        line = one_line(proc.stderr)
        assert f"is being written by process {pid}" in line and str(run) in line, line
    assert (run / "config.yaml").read_bytes() == config
    assert not (runs / "vit_digits-digits-ns-s0").exists()  # the grid trained nothing

    os.kill(pid, signal.SIGKILL)
    holder.communicate(timeout=60)
    proc = attnlab("train", "--resume", run)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((run / "result.json").read_text())
    assert result["attn"] == "standard" and result["epochs"] == 2
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # no lock, no temporary left
