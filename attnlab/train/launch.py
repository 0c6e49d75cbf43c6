"""Where a grid's runs train: worker processes on this machine placed on its devices, or one cluster job per run
(docs/training.md, "Grids").

``local`` (``attnlab compare --jobs N``): N slots, each one spawned worker process training one run at a time,
placed by :func:`device_for`; workers never outlive the parent (:func:`run_local`, :func:`_worker_init`).

``submitit`` / ``submitit-local``: one job per run through submitit, on SLURM or as local processes (the tests').
Jobs train with ``resume``, so a preempted or timed-out job is requeued and continues from its last epoch;
submitit's files go to ``<runs_dir>/.submitit/``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from attnlab.errors import AttnlabError, ConfigError

from .config import TrainConfig
from .loop import train
from .files import result_line
from .run import run_dir_of

LAUNCHERS = ("local", "submitit", "submitit-local")
# launcher options (YAML ``launcher:`` keys, ``--slurm-*`` flags) and the submitit parameter each one sets
SLURM_OPTIONS = {"partition": "slurm_partition", "account": "slurm_account", "time": "timeout_min",
                 "gpus_per_node": "gpus_per_node", "cpus_per_task": "cpus_per_task"}
SUBMITIT_FOLDER = ".submitit"


def device_for(device: str, slot: int, cuda_count: int) -> str:
    """The device a run configured with ``device`` trains on in worker slot ``slot`` (0-based) when this machine
    has ``cuda_count`` visible CUDA devices: ``cuda:(slot mod cuda_count)`` for ``auto`` and ``cuda``, else
    ``device`` unchanged (cpu, a numbered device, or auto on a machine without CUDA)."""
    if device in ("auto", "cuda") and cuda_count > 0:
        return f"cuda:{slot % cuda_count}"
    return device


def train_placed(cfg: TrainConfig, probe=None) -> dict[str, Any]:
    """A worker slot's entry: train ``cfg`` with its device as the process's current CUDA device, so that CUDA
    graphs, compiled kernels and caching allocators of this process live on it."""
    dev = cfg.run.device
    if dev.startswith("cuda:") and torch.cuda.is_available() and int(dev[5:]) < torch.cuda.device_count():
        torch.cuda.set_device(int(dev[5:]))
    return train(cfg, probe)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_group(*_) -> None:
    """End this worker and its DataLoader workers (its process group) at once."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    _end_group()


def _worker_init(parent: int) -> None:
    """A grid worker's set-up: a process group of its own, ended when the parent dies (PR_SET_PDEATHSIG where
    Linux has it, a thread watching the parent's pid elsewhere too) or when the worker gets SIGTERM. POSIX only
    (Windows has no process groups to kill)."""
    import multiprocessing

    # DataLoader workers start as under `attnlab train` (the platform's default, fork on Linux), not by the spawn
    # this process inherited: spawned ones register semaphores that a killed worker would leave to be reported
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    if not hasattr(os, "killpg"):
        return
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, _end_group)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which ends the workers
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above
        _end_group()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="attnlab-parent-watch").start()


def _end_workers(slots) -> None:
    """Kill every worker's process group (the worker and its DataLoader workers)."""
    if not hasattr(os, "killpg"):
        return
    for pool in slots:
        for pid in list(getattr(pool, "_processes", None) or {}):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def run_local(todo: Sequence[TrainConfig], jobs: int, probe=None, progress: bool = True) -> None:
    """Train ``todo`` ``jobs`` at a time, each slot a spawned worker process placed by :func:`device_for`; the
    next run goes to the first slot that frees. The first run that fails raises its error once the others
    running then have finished; runs not started are not started. Anything else that stops the parent (Ctrl-C,
    SIGTERM) ends the workers at once; so does the parent's death (:func:`_worker_init`)."""
    import multiprocessing
    from collections import deque
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0  # those of CUDA_VISIBLE_DEVICES
    pending = deque(todo)
    # spawn, not fork: a forked child of a process that already ran torch's thread pools can deadlock
    spawn = multiprocessing.get_context("spawn")
    slots = [ProcessPoolExecutor(1, mp_context=spawn, initializer=_worker_init, initargs=(os.getpid(),))
             for _ in range(min(jobs, len(todo)))]
    running: dict[Any, tuple[int, TrainConfig]] = {}

    def start(slot: int) -> None:
        cfg = pending.popleft()
        cfg = cfg.replace(device=device_for(cfg.run.device, slot, count))
        running[slots[slot].submit(train_placed, cfg, probe)] = (slot, cfg)

    done_count = 0
    try:
        for slot in range(len(slots)):
            start(slot)
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                slot, cfg = running.pop(future)
                result = future.result()
                done_count += 1
                if progress:
                    print(f"[{done_count}/{len(todo)}] {result_line(result)} on {cfg.run.device} "
                          f"({result['seconds']:.1f} s)", flush=True)
                if pending:
                    start(slot)
    except BaseException as err:
        if not isinstance(err, Exception):  # Ctrl-C, SIGTERM, exit: stop now, not after the runs in progress
            _end_workers(slots)
        raise
    finally:
        for pool in slots:
            pool.shutdown(wait=True, cancel_futures=True)


def check_launcher(launcher: str, options: dict[str, Any] | None) -> None:
    """ConfigError unless ``launcher`` is known, its options are ``SLURM_OPTIONS`` keys of the right types and, for
    the submitit launchers, submitit is installed (and ``sbatch`` is on PATH for SLURM). Nothing is submitted."""
    if launcher not in LAUNCHERS:
        raise ConfigError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}.")
    for key, value in (options or {}).items():
        if key not in SLURM_OPTIONS:
            raise ConfigError(f"unknown launcher option {key!r}; valid options are {', '.join(SLURM_OPTIONS)}.")
        wanted = str if key in ("partition", "account") else int
        if value is not None and (isinstance(value, bool) or not isinstance(value, wanted)
                                  or (wanted is int and value < (0 if key == "gpus_per_node" else 1))):
            words = "a name" if wanted is str else "a positive integer" + (" (minutes)" if key == "time" else "")
            raise ConfigError(f"launcher option {key} is {value!r}, but it must be {words}.")
    if launcher == "local":
        if any(v is not None for v in (options or {}).values()):
            raise ConfigError("launcher options (partition, time, ...) apply to --launcher submitit; drop them or "
                              "add --launcher submitit.")
        return
    if importlib.util.find_spec("submitit") is None:
        raise ConfigError(f"--launcher {launcher} needs the submitit package, which is not installed; run "
                          "`pip install attnlab[cluster]` or use --jobs N on this machine.")
    if launcher == "submitit" and shutil.which("sbatch") is None:
        raise ConfigError("--launcher submitit submits SLURM jobs, but sbatch is not on PATH; run compare on the "
                          "cluster's login node, or use --launcher submitit-local to run the jobs on this machine.")


class GridJob:
    """One run as a submitit job: ``train(cfg)``; on preemption or timeout submitit calls :meth:`checkpoint` and
    requeues the same run, which resumes from its run directory. An AttnlabError comes back as the job's result,
    so the parent raises it as the one-line error it is."""

    def __call__(self, cfg: TrainConfig, probe=None) -> dict[str, Any]:
        try:
            return train_placed(cfg, probe)
        except AttnlabError as e:
            return {"error": e}

    def checkpoint(self, cfg: TrainConfig, probe=None):
        import submitit

        return submitit.helpers.DelayedSubmission(GridJob(), cfg, probe)


def run_submitit(todo: Sequence[TrainConfig], runs_dir: str | Path, launcher: str = "submitit",
                 options: dict[str, Any] | None = None, jobs: int | None = None, probe=None,
                 progress: bool = True, poll_s: float = 2.0) -> None:
    """Submit one job per run of ``todo`` (a SLURM array for ``submitit``, with at most ``jobs`` running at once;
    local processes for ``submitit-local``) and wait for all of them. ``options``: ``SLURM_OPTIONS`` keys
    (``time`` in minutes). Raises the first failed run's AttnlabError, or a RuntimeError naming the job's log."""
    import submitit

    check_launcher(launcher, options)
    folder = Path(runs_dir) / SUBMITIT_FOLDER
    params = {SLURM_OPTIONS[k]: v for k, v in (options or {}).items() if v is not None}
    if launcher == "submitit-local":
        executor = submitit.LocalExecutor(folder=folder)
        params = {k: v for k, v in params.items() if k in ("timeout_min", "gpus_per_node")}
    else:
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        params.setdefault("gpus_per_node", 1)
        if jobs is not None:
            params["slurm_array_parallelism"] = jobs
    executor.update_parameters(**params)
    submitted = executor.map_array(GridJob(), list(todo), [probe] * len(todo))
    if progress:
        print(f"submitted {len(submitted)} jobs ({launcher}); logs in {folder}", flush=True)
    waiting = dict(zip(submitted, todo))
    finished = 0
    while waiting:
        for job in [j for j in waiting if j.done()]:
            cfg = waiting.pop(job)
            try:
                result = job.result()
            except submitit.core.utils.UncompletedJobError as e:
                raise RuntimeError(f"run {run_dir_of(cfg).name} failed in job {job.job_id}: "
                                   f"{str(e).strip().splitlines()[-1]} (log: {job.paths.stderr})") from None
            if "error" in result:
                raise result["error"]
            finished += 1
            if progress:
                print(f"[{finished}/{len(todo)}] {result_line(result)} (job {job.job_id}) "
                      f"({result['seconds']:.1f} s)", flush=True)
        if waiting:
            time.sleep(poll_s)
