"""The benchmark scripts the GPU suite runs: a failing variant or row is recorded and the next one runs, each
variant is timed against the first in alternating rounds, DnA's rows carry their difference instead of an assert,
and the packing barrier gives up after its timeout."""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from torch import nn

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


load("common")  # what the scripts import as `from common import ...` (benchmarks/ is their sys.path[0])
tt, dna, pack, suite = (load(n) for n in ("train_throughput", "dna_overhead", "pack", "gpu_suite"))


class FakeRun:
    """Stands in for train_throughput.EndToEnd: fixed rates, a failure on cue, the order of the timed epochs."""

    calls: list[str] = []
    rates = {"standard": 100.0, "ns": 98.0, "sigma": 50.0}

    def __init__(self, name, spec, compiled, args, device, amp):
        if spec in ("dna", "broken"):
            raise RuntimeError("inductor found no lowering for aten.foo\nwith more detail")
        self.spec = spec

    def epoch(self, e, steps):
        if e > 0:
            FakeRun.calls.append(self.spec)
        return self.rates[self.spec]


def e2e(monkeypatch, capsys, specs):
    monkeypatch.setattr(tt, "EndToEnd", FakeRun)
    FakeRun.calls = []
    args = Namespace(modes=["compiled"], warmup=1, rounds=3, steps=2, precompile=False)
    failed = tt.end_to_end("vit_cifar", specs, args, torch.device("cpu"), None)
    out = capsys.readouterr().out
    rows = suite.tables(tt.E2E_HEADER.format(base=specs[0]) + "\n" + out)[0]
    return failed, {r["variant"]: r for r in rows}


def test_each_variant_is_timed_against_the_first_and_a_failure_is_a_row(monkeypatch, capsys):
    failed, rows = e2e(monkeypatch, capsys, ["standard", "ns", "dna", "sigma"])
    assert failed == 1
    assert rows["standard"]["ratio to standard"] == 1.0 and rows["standard"]["status"] == "ok"
    assert rows["ns"]["img/s (median of rounds)"] == 98.0 and rows["ns"]["ratio to standard"] == 0.98
    assert rows["dna"]["status"] == "failed: RuntimeError: inductor found no lowering for aten.foo"
    assert rows["dna"]["img/s (median of rounds)"] == "-"
    assert rows["sigma"]["ratio to standard"] == 0.5  # the variant after the failure still ran
    # standard's own 3 rounds, then each variant's rounds alternating with standard's: v s, s v, v s
    assert FakeRun.calls == ["standard"] * 3 + ["ns", "standard", "standard", "ns", "ns", "standard",
                                                "sigma", "standard", "standard", "sigma", "sigma", "standard"]


def test_a_failed_first_variant_leaves_the_others_measured_alone(monkeypatch, capsys):
    failed, rows = e2e(monkeypatch, capsys, ["broken", "ns"])
    assert failed == 1 and rows["broken"]["status"].startswith("failed: RuntimeError")
    assert rows["ns"]["img/s (median of rounds)"] == 98.0 and rows["ns"]["ratio to broken"] == "-"


class Times(nn.Module):
    def __init__(self, k: float, fail: bool = False):
        super().__init__()
        self.k, self.fail = k, fail

    def forward(self, x):
        if self.fail:
            raise RuntimeError("no kernel image is available")
        return x * self.k


def test_dna_rows_record_their_difference_and_a_wrong_one_is_flagged_not_raised():
    models = {"standard": Times(3.0), "dna": Times(1.0), "dna[sdpa]": Times(1.0 + 2 ** -17), "dna[triton]": Times(1.5),
              "dna[straightforward]": Times(1.0, fail=True)}
    got = dna.differences(models, torch.ones(2, 4), tol=1e-4)
    assert got["standard"] == "- | -" and got["dna"] == "0 | reference"
    assert got["dna[sdpa]"] == f"{2 ** -17:.2e} | ok"  # 1 + 2^-17 is exact in float32
    assert got["dna[triton]"] == "5.00e-01 | WRONG"
    assert got["dna[straightforward]"] == "- | failed: RuntimeError"
    # TF32 on CUDA (cuDNN's convolution, Triton's tl.dot) and bf16 get looser bounds than CPU fp32
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert dna.tolerance("fp32", cpu) == 1e-4 and dna.tolerance("fp32", cuda) == 1e-2
    assert dna.tolerance("bf16", cuda) == 0.1


def test_the_other_dna_implementations_compute_dna():
    """Each alternative Q±V± of the benchmark (separate Linears, one SDPA over 2H heads, two SDPA calls) gives the
    registered dna's output on shared weights (the first two once called a merge method attnlab no longer has)."""
    models = dna.build("vit_digits", ["dna", "dna[straightforward]", "dna[one-sdpa]", "dna[sdpa]"])
    got = dna.differences({k: m.eval() for k, m in models.items()}, torch.randn(2, 1, 8, 8), tol=1e-4)
    assert all(got[k].endswith("| ok") for k in ("dna[straightforward]", "dna[one-sdpa]", "dna[sdpa]")), got


def test_the_packing_barrier_gives_up_after_its_timeout(tmp_path, monkeypatch, capsys):
    assert pack.barrier(tmp_path, 0, 2, timeout=0.2) == 1  # the other process never came
    assert pack.barrier(tmp_path, 1, 2, timeout=0.2) == 2
    monkeypatch.setattr(sys, "argv", ["pack.py", "0", "3", "--work", str(tmp_path), "--model", "vit_digits",
                                      "--steps", "1", "--batch-size", "2", "--device", "cpu", "--amp", "none",
                                      "--barrier-timeout", "0.2"])
    with pytest.raises(SystemExit) as stop:
        pack.main()
    assert stop.value.code == 3
    assert capsys.readouterr().err == "pack.py 0/3: only 1 of 3 processes were ready after 0.2 s; not timing\n"
