"""attnlab.ops.sdpa: the explicit product it takes for short sequences in CPU training gives softmax attention's
value and gradient (against a float64 per-head loop), and the choice follows the documented rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.ops import sdpa as sdpa_module
from attnlab.ops.sdpa import EXPLICIT_MAX_KEYS, explicit_is_faster, sdpa, short_sequence_products


def _reference(q, k, v, mask, scale):
    """softmax(scale q k^T + mask) v, one (sample, head) at a time in float64."""
    q, k, v = (t.detach().double().numpy() for t in (q, k, v))
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for b, h in np.ndindex(*q.shape[:2]):
        logits = scale * q[b, h] @ k[b, h].T
        if mask is not None:
            m = np.broadcast_to(mask.numpy(), q.shape[:2] + logits.shape)[b, h]
            logits = np.where(m, logits, -np.inf) if m.dtype == bool else logits + m
        w = np.exp(logits - logits.max(1, keepdims=True))
        out[b, h] = (w / w.sum(1, keepdims=True)) @ v[b, h]
    return out


@pytest.fixture(autouse=True)
def training_step():
    with short_sequence_products():
        yield


@pytest.mark.parametrize("mask_kind", [None, "float", "bool"])
@pytest.mark.parametrize("scale", [None, -0.3])  # DnA's softmin branch passes a negative scale
def test_explicit_path_value_and_gradient(mask_kind, scale):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 16, generator=g, requires_grad=True) for _ in range(3))
    mask = {None: None, "float": torch.randn(1, 3, 17, 17, generator=g),
            "bool": torch.rand(17, 17, generator=g) > 0.3}[mask_kind]
    if mask is not None and mask.dtype == torch.bool:
        mask[:, 0] = True  # no fully masked row
    assert explicit_is_faster(q, k)
    out = sdpa(q, k, v, attn_mask=mask, scale=scale)
    np.testing.assert_allclose(out.detach().numpy(), _reference(q, k, v, mask, 16 ** -0.5 if scale is None else scale),
                               rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).square().sum(),
                               (q, k, v))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_rule(monkeypatch):
    calls = []
    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or a[0])
    short, long_ = EXPLICIT_MAX_KEYS[torch.float32], EXPLICIT_MAX_KEYS[torch.float32] + 1
    for keys, grad, fused in ((short, True, False), (long_, True, True), (short, False, True)):
        q = torch.randn(1, 1, 4, 8, requires_grad=grad)
        k = torch.randn(1, 1, keys, 8)
        calls.clear()
        sdpa(q, k, torch.randn(1, 1, keys, 8))
        assert bool(calls) == fused, (keys, grad)
    q, k = torch.randn(1, 1, 4, 8, requires_grad=True), torch.randn(1, 1, 4, 8)
    with torch.no_grad():  # inference never takes the explicit path
        assert not explicit_is_faster(q, k)
    with short_sequence_products(False):  # nor a forward outside a training step (convert stays bit-identical)
        assert not explicit_is_faster(q, k)
    assert explicit_is_faster(q, k)
    bf16 = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert explicit_is_faster(bf16, torch.randn(1, 1, EXPLICIT_MAX_KEYS[torch.bfloat16], 8, dtype=torch.bfloat16))


def test_bf16_normalises_in_float32():
    # logits in bf16, the softmax in float32: the rows of weights still sum to one to float32 precision
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, 40, 16, generator=g).bfloat16().requires_grad_() for _ in range(2))
    v = torch.ones(1, 2, 40, 16, dtype=torch.bfloat16)
    out = sdpa(q, k, v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.ones(1, 2, 40, 16), rtol=0, atol=4e-3)
