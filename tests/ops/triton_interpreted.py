"""Checks of the Triton DnA kernel that need Triton's CPU interpreter from the start of the process: run by
tests/ops/test_dna_triton.py in a subprocess with TRITON_INTERPRET=1 and ATTNLAB_DNA_TRITON=1 (not collected on its
own: the file name does not start with test_)."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from triton.runtime import interpreter

from attnlab.attention import DnAAttention
from attnlab.attention import dna as dna_module
from attnlab.ops.dna_triton import TILES, dna_attention_triton, triton_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_dna as ref  # noqa: E402

assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("ATTNLAB_DNA_TRITON") == "1", \
    "run through tests/ops/test_dna_triton.py"


def _inputs(B, H, N, M, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, 2, H, D, generator=g).permute(2, 0, 3, 1, 4)
    kv = torch.randn(B, M, 3, H, D, generator=g).permute(2, 0, 3, 1, 4)
    return q[0], q[1], kv[0], kv[1], kv[2]


def _reference(qp, qn, k, vp, vn, alpha, s_pos, s_neg):
    return torch.from_numpy(np.stack([
        ref.dna_heads(*(t[b].double().numpy() for t in (qp, qn, k, vp, vn)),
                      None if alpha is None else alpha.double().numpy(), s_pos, s_neg)[0]
        for b in range(qp.shape[0])]))


@pytest.mark.parametrize("shared", [False, True], ids=["qv", "shared-q-and-v"])
@pytest.mark.parametrize("N,M,D", [(37, 37, 16), (9, 70, 32), (20, 5, 16)])  # several key tiles; M < one tile
def test_matches_float64_loop_across_key_tiles(shared, N, M, D):
    qp, qn, k, vp, vn = _inputs(2, 3, N, M, D, seed=N + M)
    if shared:
        qn, vn = qp, vp
    alpha = None if shared else torch.tensor([0.5, -0.3, 1.2])
    # tiles of 16 queries and 16 keys: the online softmax rescales across tiles, the last tiles are partial
    got = dna_attention_triton(qp, qn, k, vp, vn, alpha, scale_pos=0.3, scale_neg=0.2, block_m=16, block_n=16)
    assert got.shape == (2, 3, N, D) and got.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(got.double(), _reference(qp, qn, k, vp, vn, alpha, 0.3, 0.2), rtol=1e-4, atol=1e-5)


def test_module_uses_it_without_bias_and_matches_sdpa(monkeypatch):
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")  # the CPU kernel would take this CPU call first
    m = DnAAttention(32, 2, qkv_bias=True).eval()
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(3))
    calls = []
    real = dna_module.dna_attention_triton
    monkeypatch.setattr(dna_module, "dna_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        got = m(x)
        assert calls == [1]
        monkeypatch.setenv("ATTNLAB_DNA_TRITON", "0")
        want = m(x)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_half_precision_inputs_accumulate_in_float32():
    # fp16 q, k, v (what autocast hands over on CUDA); the output comes back in fp16, within fp16 rounding
    qp, qn, k, vp, vn = _inputs(1, 2, 40, 40, 16, seed=5)
    alpha = torch.tensor([0.7, -0.2])
    half = [t.half() for t in (qp, qn, k, vp, vn)]
    got = dna_attention_triton(*half, alpha, scale_pos=0.25, scale_neg=0.25, block_m=16, block_n=16)
    assert got.dtype == torch.float16
    want = _reference(*(t.float() for t in half), alpha, 0.25, 0.25)
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("block_m,block_n", TILES)
def test_every_tile_the_autotuner_may_pick(block_m, block_n):
    qp, qn, k, vp, vn = _inputs(1, 2, 65, 65, 16, seed=block_m + block_n)  # vit_cifar's 65 tokens
    alpha = torch.tensor([0.5, -0.3])
    got = dna_attention_triton(qp, qn, k, vp, vn, alpha, scale_pos=0.25, scale_neg=0.25, block_m=block_m,
                               block_n=block_n)
    torch.testing.assert_close(got.double(), _reference(qp, qn, k, vp, vn, alpha, 0.25, 0.25), rtol=1e-4, atol=1e-5)


def test_offsets_past_2_to_the_31_elements():
    # A (B, N, 5, H, D) projection whose batch stride is 2^30 + 64 elements: batch 2 starts past 2^31, where
    # 32-bit offsets wrap. The 4 GiB buffer is virtual memory: only the three batches' rows are ever touched.
    B, H, N, D = 3, 2, 20, 16
    s_b = 2**30 + 64
    big = torch.empty(2 * s_b + N * 5 * H * D, dtype=torch.float16)
    proj = big.as_strided((B, N, 5, H, D), (s_b, 5 * H * D, H * D, D, 1))
    proj.copy_(torch.randn(B, N, 5, H, D, generator=torch.Generator().manual_seed(7)).half())
    qp, qn, k, vp, vn = proj.permute(2, 0, 3, 1, 4)
    alpha = torch.tensor([0.5, 1.5])
    got = dna_attention_triton(qp, qn, k, vp, vn, alpha, scale_pos=0.25, scale_neg=0.25, block_m=16, block_n=16)
    want = _reference(*(t.float() for t in (qp, qn, k, vp, vn)), alpha, 0.25, 0.25)
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3)


@pytest.fixture
def bf16_dot(monkeypatch):
    """The interpreter stores bf16 as raw uint16 and multiplies those bits in tl.dot; convert each bf16 operand to
    the float32 it stands for first (exact: what the GPU's bf16 MMA reads, accumulating in float32)."""
    real = interpreter.InterpreterBuilder.create_dot

    def as_f32(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle(
            interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, *rest: real(self, as_f32(a), as_f32(b), *rest))


@pytest.mark.parametrize("D,block_m,block_n", [(16, 16, 32), (64, 64, 32)])
def test_bf16_within_twice_the_error_of_two_bf16_sdpa_calls(bf16_dot, D, block_m, block_n):
    # bf16 q, k, v and a float32 alpha (what CUDA autocast hands over); the float64 loop on the same bf16 values
    # is the truth. The kernel rounds the weights to bf16 for the tensor-core product with V, as flash kernels do.
    ts = [t.bfloat16() for t in _inputs(2, 3, 65, 65, D, seed=D)]
    alpha = torch.tensor([0.5, -0.3, 1.2])
    s = D ** -0.5
    want = _reference(*ts, alpha, s, s)
    got = dna_attention_triton(*ts, alpha, scale_pos=s, scale_neg=s, block_m=block_m, block_n=block_n)
    assert got.dtype == torch.bfloat16
    qp, qn, k, vp, vn = ts
    sdpa = torch.addcmul(F.scaled_dot_product_attention(qp, k, vp, scale=s), alpha.bfloat16().view(-1, 1, 1),
                         F.scaled_dot_product_attention(-qn, k, vn, scale=s))
    rms = lambda x: (x.double() - want).pow(2).mean().sqrt().item()  # noqa: E731
    assert rms(got) <= 2 * rms(sdpa), (rms(got), rms(sdpa))


def test_torch_compile_traces_it_without_a_graph_break():
    def f(qp, qn, k, vp, vn, alpha):
        if triton_error(qp, k, qn, vp, vn, alpha) is not None:
            return None
        return dna_attention_triton(qp, qn, k, vp, vn, alpha, scale_pos=0.3, scale_neg=0.2) * 2

    qp, qn, k, vp, vn = _inputs(2, 3, 20, 20, 16, seed=11)
    alpha = torch.tensor([0.5, -0.3, 1.2])
    with torch.no_grad():
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(qp, qn, k, vp, vn, alpha)
    assert got is not None, "triton_error refused the call while compiling"
    torch.testing.assert_close(got.double(), 2 * _reference(qp, qn, k, vp, vn, alpha, 0.3, 0.2), rtol=1e-4,
                               atol=1e-5)


def test_module_flops_equal_the_two_sdpa_calls(monkeypatch):
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    m = DnAAttention(32, 2).eval()
    x = torch.randn(2, 21, 32)
    calls = []
    real = dna_module.dna_attention_triton
    monkeypatch.setattr(dna_module, "dna_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def flops():
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            m(x)
        return counter.get_total_flops()

    with_kernel = flops()
    monkeypatch.setenv("ATTNLAB_DNA_TRITON", "0")
    assert with_kernel == flops() > 0 and calls == [1]
