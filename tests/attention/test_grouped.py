"""Grouped-query attention (Ainslie et al., arXiv:2305.13245) and rotary positions (RoFormer, arXiv:2104.09864) in
the attention contract, for every registered kernel term.

A module with H query heads and H_kv grouped key/value heads is the same function as one with H heads whose key and
value rows repeat each group's for its H / H_kv query heads; rotary embeddings are checked against complex
multiplication (each feature pair (i, i + D/2) a complex number times exp(j position base^(-2i/D))); a KV cache of
grouped keys gives the full causal forward token by token.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.attention.base import LayerCache
from attnlab.attention.mask import AttentionMask
from attnlab.attention.standard import StandardAttention
from attnlab.errors import AttnlabError
from attnlab.ops.rotary import Rotary
from attnlab.variants import VARIANTS

DIM, H, H_KV, N = 32, 4, 2, 9
SPECS = {"standard": "standard", "dna": "dna(init=copy,neg_init=0.5)", "diff": "diff", "cog": "cog(all_layers=true)",
         "nystrom": "nystrom(landmarks=16)", "performer": "performer(features=32)"}


def test_every_kernel_term_is_covered():
    assert set(SPECS) == {n for n, v in VARIANTS.items() if v.kind == "kernel"}


def _pair(spec: str, rotary: bool):
    """(grouped, repeated): the term on a grouped module and on its H-head twin with repeated key/value rows."""
    torch.manual_seed(0)
    grouped = StandardAttention(DIM, H, num_kv_heads=H_KV, qkv_bias=True).double()
    D, A, Akv = grouped.head_dim, grouped.attn_dim, grouped.kv_dim
    twin = StandardAttention(DIM, H, qkv_bias=True).double()
    with torch.no_grad():
        w, b = grouped.qkv.weight, grouped.qkv.bias
        repeat = lambda t: t.view(H_KV, D, *t.shape[1:]).repeat_interleave(H // H_KV, dim=0).reshape(A, *t.shape[1:])  # noqa: E731
        for src, dst in ((w, twin.qkv.weight), (b, twin.qkv.bias)):
            dst.copy_(torch.cat([src[:A], repeat(src[A:A + Akv]), repeat(src[A + Akv:])]))
        twin.proj.load_state_dict(grouped.proj.state_dict())
    if rotary:
        grouped.rotary, twin.rotary = Rotary(D, theta=500.0), Rotary(D, theta=500.0)
    term = attnlab.parse_spec(spec).kernel
    cls, options = term.variant.load(), term.resolved()
    out = [cls.from_module(m, layer_index=1, num_layers=3, **options).double().eval() for m in (grouped, twin)]
    with torch.no_grad():  # what a conversion draws (diff's lambdas) the same in both
        for name, p in out[0].named_parameters():
            if not name.startswith("qkv"):
                out[1].get_parameter(name).copy_(p)
    return out


def _mask(kind: str):
    """The call's mask arguments for ``kind``: causal order, key padding (with causality), an additive finfo.min mask."""
    real = torch.ones(2, N, dtype=torch.bool)
    real[0, 6:] = False
    real[1, 2] = False
    return {"bidirectional": {}, "causal": {"is_causal": True},
            "key padding": {"attn_mask": AttentionMask(is_causal=True, key_padding=real)},
            "additive finfo.min": {"attn_mask": torch.zeros(2, 1, 1, N, dtype=torch.float64).masked_fill(
                ~real[:, None, None, :], torch.finfo(torch.float64).min)}}[kind]


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("mask", ["bidirectional", "causal", "key padding", "additive finfo.min"])
@pytest.mark.parametrize("term", SPECS)
def test_grouped_keys_are_repeated_keys(term, mask, rotary):
    grouped, twin = _pair(SPECS[term], rotary)
    assert grouped.qkv.out_features < twin.qkv.out_features
    x = torch.randn(2, N, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    try:
        want = twin(x, **_mask(mask))
    except AttnlabError as err:  # a term that cannot honour the mask refuses both, in the same words
        with pytest.raises(AttnlabError) as again:
            grouped(x, **_mask(mask))
        assert str(again.value) == str(err)
        return
    torch.testing.assert_close(grouped(x, **_mask(mask)), want, rtol=1e-10, atol=1e-10)


def _rotate_by_hand(t: torch.Tensor, theta: float) -> torch.Tensor:
    """(..., N, D) with each pair (i, i + D/2) of token n read as the complex number x_i + j x_(i+D/2) and multiplied
    by exp(j n theta^(-2i/D)): RoFormer's rotation as complex multiplication, in complex128."""
    D = t.shape[-1]
    z = torch.complex(t[..., : D // 2], t[..., D // 2:])
    n = torch.arange(t.shape[-2], dtype=torch.float64)[:, None]
    angle = n * theta ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)
    turned = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([turned.real, turned.imag], dim=-1)


def test_rotary_standard_with_grouped_keys_against_a_float64_loop():
    torch.manual_seed(3)
    m = StandardAttention(DIM, H, num_kv_heads=H_KV, qkv_bias=False, proj_bias=False, qk_norm=True,
                          norm_layer=torch.nn.RMSNorm).double().eval()
    with torch.no_grad():
        m.q_norm.weight.uniform_(0.5, 1.5)
        m.k_norm.weight.uniform_(0.5, 1.5)
    m.rotary = Rotary(m.head_dim, theta=1000.0)
    x = torch.randn(1, N, DIM, dtype=torch.float64)
    D = m.head_dim
    y = (x @ m.qkv.weight.T.detach())[0]
    q, k, v = y[:, :H * D].view(N, H, D), y[:, H * D:(H + H_KV) * D].view(N, H_KV, D), y[:, (H + H_KV) * D:].view(N, H_KV, D)
    rms = lambda t, w: t / torch.sqrt(t.square().mean(-1, keepdim=True) + torch.finfo(t.dtype).eps) * w.detach()  # noqa: E731
    q, k = rms(q, m.q_norm.weight), rms(k, m.k_norm.weight)  # Qwen3's order: norm, then rotation
    q, k = _rotate_by_hand(q.transpose(0, 1), 1000.0), _rotate_by_hand(k.transpose(0, 1), 1000.0)
    heads = []
    for h in range(H):
        g = h // (H // H_KV)
        logits = q[h] @ k[g].T / math.sqrt(D)
        logits = logits.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(logits.softmax(-1) @ v[:, g])
    want = torch.cat(heads, dim=-1) @ m.proj.weight.T.detach()
    with torch.no_grad():
        # the angles are float32 (as Hugging Face's), so the loop's exact ones agree to float32's precision
        torch.testing.assert_close(m(x, is_causal=True)[0], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("term", ["standard", "dna", "diff", "cog"])
def test_a_kv_cache_of_grouped_keys_gives_the_causal_forward(term):
    grouped, _ = _pair(SPECS[term], rotary=True)
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    with torch.no_grad():
        full = grouped(x, is_causal=True)
        cache = LayerCache()
        steps = [grouped(x[:, :4], cache=cache)] + [grouped(x[:, n:n + 1], cache=cache) for n in range(4, N)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.k.shape[1] == H_KV  # the cache keeps the grouped keys


@pytest.mark.parametrize("term", ["standard", "dna", "diff", "cog"])
def test_a_kv_cache_with_key_padding_gives_the_padded_causal_forward(term):
    """Key padding over every key so far (the cached ones and the new): each step's padded query row is zero, as in
    the full forward, and no padded key reaches a real token."""
    grouped, _ = _pair(SPECS[term], rotary=True)
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    real = torch.ones(2, N, dtype=torch.bool)
    real[0, 1] = real[1, 6] = False
    with torch.no_grad():
        full = grouped(x, attn_mask=AttentionMask(is_causal=True, key_padding=real))
        cache = LayerCache()
        steps = [grouped(x[:, :4], attn_mask=AttentionMask(key_padding=real[:, :4]), cache=cache)]
        steps += [grouped(x[:, n:n + 1], attn_mask=AttentionMask(key_padding=real[:, :n + 1]), cache=cache)
                  for n in range(4, N)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
