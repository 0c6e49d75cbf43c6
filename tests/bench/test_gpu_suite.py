"""benchmarks/gpu_suite.sh: the dry run (every step tiny on the CPU) runs every step and writes the one JSON file;
a spent budget skips steps instead of overrunning."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_suite.sh"
STEPS = ["env", "data", "e2e_vit_cifar", "e2e_swin_cifar", "ns_eager", "dna_vit_b", "packed_swin", "variants",
         "ns_compiled"]
MEASURED = STEPS[2:]  # steps whose output is a table of numbers
TARGETS = {"vit_cifar end-to-end img/s", "swin_cifar end-to-end img/s", "every variant / standard, training",
           "3 packed swin_cifar / one", "NS-Attn time / standard, worst row",
           "dna bf16 ViT-B/16 throughput / standard", "dna[triton] bf16 ViT-B/16 throughput / standard"}


def run_suite(tmp_path, budget=None):
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env.pop("OUT", None)
    if budget is not None:
        env["GPU_SUITE_BUDGET"] = str(budget)
    out = tmp_path / "out" / "gpu_suite.json"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_dry_run_runs_every_step(tmp_path):
    proc, result = run_suite(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["dry_run"] is True
    assert list(result["steps"]) == STEPS
    for name, step in result["steps"].items():
        assert step["rc"] == 0 and not step["skipped"], (name, step["tail"])
    for name in MEASURED:
        rows = [r for t in result["steps"][name]["tables"] for r in t]
        assert rows and all(len(r) >= 3 for r in rows), (name, result["steps"][name]["tail"])
    assert set(result["targets"]) == TARGETS
    for name in TARGETS - {"dna[triton] bf16 ViT-B/16 throughput / standard"}:  # triton: CUDA only
        assert isinstance(result["targets"][name]["value"], float), name
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # its scratch folder removed


def test_spent_budget_skips_steps_and_still_writes_json(tmp_path):
    proc, result = run_suite(tmp_path, budget=0)
    assert proc.returncode == 1  # not everything was measured
    assert list(result["steps"]) == STEPS
    assert all(s["skipped"] and s["rc"] is None for s in result["steps"].values())
    assert all(t["value"] is None and t["met"] is None for t in result["targets"].values())
