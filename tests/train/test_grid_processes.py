"""A grid whose runs train with several processes each (launcher option nproc_per_run, `compare --nproc-per-run`):
on this machine each run under torchrun, one at a time; on SLURM, N tasks per job joined into one process group."""

from __future__ import annotations

import json
import sys
import types

import pytest
from cli_runner import in_process

from attnlab.errors import ConfigError
from attnlab.train import launch
from attnlab.train.config import make_config
from attnlab.train.grid import run_grid


def test_runs_of_several_processes_on_this_machine_are_one_at_a_time(tmp_path):
    with pytest.raises(ConfigError, match="one at a time on this machine .* asks for 2 at a time; give --jobs 1"):
        run_grid(make_config("demo"), ["standard"], [0, 1], None, None, tmp_path, jobs=2,
                 launcher_options={"nproc_per_run": 2})
    assert list(tmp_path.iterdir()) == []


def test_slurm_jobs_get_a_task_and_a_gpu_per_process(tmp_path, monkeypatch):
    seen = {}

    class Executor:
        def __init__(self, folder, cluster):
            pass

        def update_parameters(self, **params):
            seen.update(params)

        def map_array(self, fn, cfgs, probes):
            return []

    monkeypatch.setitem(sys.modules, "submitit", types.SimpleNamespace(AutoExecutor=Executor))
    monkeypatch.setattr(launch, "check_launcher", lambda *a: None)
    launch.run_submitit([make_config("demo")], tmp_path, "submitit", {"nproc_per_run": 4, "time": 60},
                        progress=False)
    assert seen["tasks_per_node"] == 4 and seen["gpus_per_node"] == 4 and seen["timeout_min"] == 60
    launch.run_submitit([make_config("demo")], tmp_path, "submitit", {"nproc_per_run": 4, "gpus_per_node": 8},
                        progress=False)
    assert seen["gpus_per_node"] == 8


def test_a_job_of_several_tasks_exports_torchs_process_group_environment(monkeypatch):
    exported = []

    class Env:
        def export(self, set_cuda_visible_devices=True):
            exported.append(set_cuda_visible_devices)

    fake = types.SimpleNamespace(JobEnvironment=lambda: types.SimpleNamespace(num_tasks=2),
                                 helpers=types.SimpleNamespace(TorchDistributedEnvironment=Env))
    monkeypatch.setitem(sys.modules, "submitit", fake)
    monkeypatch.setattr(launch, "train_placed", lambda cfg, probe=None: {"ok": cfg})
    assert launch.GridJob()("cfg") == {"ok": "cfg"} and exported == [False]
    fake.JobEnvironment = lambda: types.SimpleNamespace(num_tasks=1)
    launch.GridJob()("cfg")
    assert exported == [False]  # one task: no process group


@pytest.mark.slow
def test_compare_trains_each_run_under_torchrun(tmp_path):
    proc = in_process(["compare", "--preset", "demo", "--attn", "standard", "--seeds", "0", "--epochs", "1",
                       "--nproc-per-run", "2", "--jobs", "1", "--analyze", "none", "--no-report",
                       "--runs-dir", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run] = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert json.loads((run / "result.json").read_text())["world_size"] == 2
