"""Checks of the Triton DnA kernel that need Triton's CPU interpreter from the start of the process: run by
tests/ops/test_dna_triton.py in a subprocess with TRITON_INTERPRET=1 and ATTNLAB_DNA_TRITON=1 (not collected on its
own: the file name does not start with test_)."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.attention import DnAAttention
from attnlab.attention import dna as dna_module
from attnlab.ops.dna_triton import dna_attention_triton

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
