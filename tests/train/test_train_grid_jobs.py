"""run_grid with jobs=N: spawned workers give the same runs as one after another, placed on devices as documented
in attnlab.train.launch (slot k of N trains on cuda:(k mod G) of G visible devices; cpu and cuda:K stay)."""

import json
import os
import time

import pytest
import torch
from train_helpers import tiny, weights

from attnlab.train import launch, run_grid


# the policy as docs/training.md states it: (device, slots, visible CUDA devices) -> device of each slot
@pytest.mark.parametrize("device, jobs, gpus, expected", [
    ("auto", 2, 2, ["cuda:0", "cuda:1"]),             # one run per GPU
    ("auto", 2, 4, ["cuda:0", "cuda:1"]),             # more GPUs than slots: the first N
    ("cuda", 3, 1, ["cuda:0", "cuda:0", "cuda:0"]),   # one GPU: N runs packed on it
    ("auto", 3, 2, ["cuda:0", "cuda:1", "cuda:0"]),   # spread evenly
    ("auto", 2, 0, ["auto", "auto"]),                 # no CUDA: auto resolves to cpu in the run
    ("cpu", 2, 2, ["cpu", "cpu"]),                    # asked for cpu: stays
    ("cuda:1", 2, 2, ["cuda:1", "cuda:1"]),           # asked for one device: every run there
])
def test_device_for_slots(device, jobs, gpus, expected):
    assert [launch.device_for(device, k, gpus) for k in range(jobs)] == expected


def record_then_train_on_cpu(cfg, probe=None):
    """Test stand-in for launch.train_placed in the workers: log the device the parent placed the run on, then train
    it on the CPU through the worker's own (unpatched) train_placed (this machine has no CUDA device)."""
    with open(os.environ["ATTNLAB_TEST_PLACEMENT_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "device": cfg.run.device, "start": time.time()}) + "\n")
    result = launch.train_placed(cfg.replace(device="cpu"), probe)
    with open(os.environ["ATTNLAB_TEST_PLACEMENT_LOG"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "end": time.time()}) + "\n")
    return result


def test_jobs_2_on_two_fake_gpus_one_run_per_gpu_and_the_runs_of_one_after_another(tmp_path, monkeypatch):
    grid = (["standard", "ns"], [0, 1], None, None)
    seq = run_grid(tiny(tmp_path / "seq", epochs=1), *grid, tmp_path / "seq", progress=False, jobs=1)
    # only the device count is faked (in the parent, which places the runs); workers train on CPU through the stand-in
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(launch, "train_placed", record_then_train_on_cpu)
    log = tmp_path / "placement.jsonl"
    monkeypatch.setenv("ATTNLAB_TEST_PLACEMENT_LOG", str(log))
    par = run_grid(tiny(tmp_path / "par", epochs=1), *grid, tmp_path / "par", progress=False, jobs=2)
    # the same runs as one after another, to the bit
    assert [r["name"] for r in seq] == [r["name"] for r in par] == [
        f"vit_digits-digits-{v}-s{s}" for s in (0, 1) for v in ("standard", "ns")]
    for a, b in zip(seq, par):
        assert a["top1"] == b["top1"]
        wa = weights(tmp_path / "seq" / a["name"] / "checkpoint.safetensors")
        wb = weights(tmp_path / "par" / b["name"] / "checkpoint.safetensors")
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [e for e in lines if "device" in e]
    assert len(starts) == 4
    by_pid = {}
    for e in starts:
        by_pid.setdefault(e["pid"], set()).add(e["device"])
    # two worker processes, each on its own GPU for the whole grid
    assert len(by_pid) == 2
    assert sorted(d for devices in by_pid.values() for d in devices) == ["cuda:0", "cuda:1"]
    # never two runs at once on one GPU: a slot starts its next run after its previous one ended
    events = sorted(lines, key=lambda e: e.get("start", e.get("end")))
    busy = set()
    for e in events:
        if "device" in e:
            assert e["pid"] not in busy
            busy.add(e["pid"])
        else:
            busy.discard(e["pid"])
