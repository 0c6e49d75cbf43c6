"""The opt-in Triton kernel of DnA's two branches (attnlab/ops/dna_triton.py). No GPU here: the kernel runs under
Triton's CPU interpreter, which must be on before Triton is first imported, so those checks
(tests/ops/triton_interpreted.py: against the float64 per-head loop, and inside DnAAttention) run in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.ops.dna_triton import triton_error


def test_kernel_under_the_interpreter():
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1", ATTNLAB_DNA_TRITON="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(here / "triton_interpreted.py")], env=env, capture_output=True, text=True,
                          cwd=here.parents[1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout


@pytest.mark.parametrize(
    "env,kwargs,needle",
    [
        ("0", {}, "opt-in"),
        ("1", dict(bias=True), "no attention bias"),
        ("1", dict(D=24), "power-of-two head dim"),
        ("1", dict(grad=True), "needs a gradient"),
        ("1", dict(dtype=torch.float64), "fp16, bf16 or fp32"),
    ],
)
def test_triton_error_says_why(monkeypatch, env, kwargs, needle):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read per call: stands in for a CUDA device here
    monkeypatch.setenv("ATTNLAB_DNA_TRITON", env)
    D = kwargs.get("D", 16)
    q = torch.randn(1, 2, 8, D, dtype=kwargs.get("dtype", torch.float32), requires_grad=kwargs.get("grad", False))
    assert needle in triton_error(q, q.detach(), bias=kwargs.get("bias", False))


def test_without_the_interpreter_it_wants_cuda(monkeypatch):
    monkeypatch.setenv("ATTNLAB_DNA_TRITON", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 8, 16)
    assert "runs on CUDA" in triton_error(q, q)
