"""`StandardCrossAttention`: softmax cross-attention against a float64 loop (tests/reference.py), against PyTorch's
own ``nn.MultiheadAttention`` after ``copy_from``, its masks over the context, its refusals and its weight maps."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from attnlab.attention import StandardCrossAttention
from attnlab.attention.base import Want
from attnlab.attention.mask import AttentionMask
from attnlab.errors import UnsupportedModelError
from attnlab.models import attention_modules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference as ref  # noqa: E402

DIM, HEADS, CTX = 24, 3, 10


def _module(backend: str, bias: bool = True) -> StandardCrossAttention:
    torch.manual_seed(3)
    m = StandardCrossAttention(DIM, HEADS, kv_dim=CTX, qkv_bias=bias, backend=backend).double().eval()
    with torch.no_grad():  # O(1) logits: the default init makes every map nearly uniform
        for p in m.parameters():
            p.normal_(0, 0.4)
    return m


def _expected(m, x, ctx, allowed=None):
    A = m.attn_dim
    (wq, bq), (wkv, bkv) = ((lin.weight.detach().numpy(), lin.bias.detach().numpy()) for lin in (m.q, m.kv))
    return np.stack([ref.cross_attention(x[b].numpy(), ctx[b].numpy(), wq, bq, wkv[:A], bkv[:A], wkv[A:], bkv[A:],
                                         m.proj.weight.detach().numpy(), m.proj.bias.detach().numpy(), HEADS,
                                         None if allowed is None else allowed[b]) for b in range(len(x))])


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
def test_matches_float64_loop_with_and_without_a_mask(backend):
    m = _module(backend)
    g = torch.Generator().manual_seed(5)
    x, ctx = torch.randn(2, 5, DIM, dtype=torch.float64, generator=g), torch.randn(2, 7, CTX, dtype=torch.float64,
                                                                                   generator=g)
    allowed = torch.rand(2, 1, 5, 7, generator=g) < 0.6
    allowed[..., 0] = True
    with torch.no_grad():
        np.testing.assert_allclose(m(x, ctx).numpy(), _expected(m, x, ctx), rtol=1e-10, atol=1e-10)
        got = m(x, ctx, attn_mask=allowed).numpy()
    np.testing.assert_allclose(got, _expected(m, x, ctx, allowed[:, 0].numpy()), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
def test_context_padding_and_a_context_of_padding_only(backend):
    m = _module(backend)
    g = torch.Generator().manual_seed(6)
    x, ctx = torch.randn(2, 4, DIM, dtype=torch.float64, generator=g), torch.randn(2, 6, CTX, dtype=torch.float64,
                                                                                   generator=g)
    real = torch.ones(2, 6, dtype=torch.bool)
    real[0, 4:] = False
    real[1] = False
    other = torch.where(real[..., None], ctx, 5 * torch.randn_like(ctx))  # padded tokens must not matter
    with torch.no_grad():
        a = m(x, ctx, attn_mask=AttentionMask(key_padding=real))
        b = m(x, other, attn_mask=AttentionMask(key_padding=real))
    assert torch.equal(a, b)
    allowed = real[:, None, :].expand(2, 4, 6).numpy()
    np.testing.assert_allclose(a.numpy(), _expected(m, x, ctx, allowed), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(a[1], m.proj.bias.detach().expand(4, -1), rtol=0, atol=0)


def test_copy_from_equals_pytorch_multihead_attention():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(DIM, HEADS, kdim=CTX, vdim=CTX, batch_first=True).double().eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    A = DIM
    q, k, v = (nn.Linear(i, A).double() for i in (DIM, CTX, CTX))
    with torch.no_grad():
        for lin, w, b in ((q, mha.q_proj_weight, mha.in_proj_bias[:A]),
                          (k, mha.k_proj_weight, mha.in_proj_bias[A:2 * A]),
                          (v, mha.v_proj_weight, mha.in_proj_bias[2 * A:])):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    m = StandardCrossAttention(DIM, HEADS, kv_dim=CTX, qkv_bias=True).double().eval().copy_from(
        q, k, v, mha.out_proj)
    x, ctx = torch.randn(3, 5, DIM, dtype=torch.float64), torch.randn(3, 8, CTX, dtype=torch.float64)
    pad = torch.zeros(3, 8, dtype=torch.bool)
    pad[0, 5:] = True
    with torch.no_grad():
        expected = mha(x, ctx, ctx, key_padding_mask=pad, need_weights=False)[0]  # True = padding, PyTorch's sense
        for backend in ("sdpa", "explicit"):
            m.use_backend(backend)
            torch.testing.assert_close(m(x, ctx, attn_mask=AttentionMask(key_padding=~pad)), expected,
                                       rtol=1e-12, atol=1e-12)


def test_refuses_a_causal_mask_and_stays_out_of_self_attention_surgery():
    m = _module("auto")
    with pytest.raises(UnsupportedModelError, match="no causal mask"):
        m(torch.randn(1, 3, DIM, dtype=torch.float64), torch.randn(1, 4, CTX, dtype=torch.float64),
          attn_mask=AttentionMask(is_causal=True))
    assert attention_modules(nn.Sequential(m)) == []  # convert and the instruments take self-attention only


def test_weight_maps_are_row_stochastic_and_zero_at_padded_keys():
    m = _module("auto")
    x, ctx = torch.randn(2, 3, DIM, dtype=torch.float64), torch.randn(2, 5, CTX, dtype=torch.float64)
    real = torch.tensor([[True] * 3 + [False] * 2, [True] * 5])
    with torch.no_grad():
        out, found = m.run(x, AttentionMask(key_padding=real), want=Want(weights=True), context=ctx)
    w = found.weights["attn"].weights
    assert w.shape == (2, HEADS, 3, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, HEADS, 3, dtype=torch.float64))
    assert torch.all(w[0, ..., 3:] == 0)
    torch.testing.assert_close(out, m(x, ctx, attn_mask=AttentionMask(key_padding=real)), rtol=1e-12, atol=1e-12)
