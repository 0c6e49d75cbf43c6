"""The dispatcher's SDPA-or-explicit rule for softmax (a CPU training step with few keys takes the explicit product,
everything else SDPA, a forced backend as forced), and the explicit backend's value and gradient against a float64
per-head loop and SDPA's; the one causal builder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.attention.base import Call, Want
from attnlab.attention.standard import StandardAttention
from attnlab.ops.sdpa import EXPLICIT_MAX_KEYS, causal_keep


def _call(keys, grad=True, training=True, dtype=torch.float32):
    return Call(torch.device("cpu"), dtype, grad, training, False, False, 8, 2, 4, keys, 48, Want(), False)


def test_the_rule():
    m = StandardAttention(16, 2)
    short = EXPLICIT_MAX_KEYS[torch.float32]
    assert m.choose(_call(short)) == "explicit"
    assert m.choose(_call(short + 1)) == "sdpa"
    assert m.choose(_call(short, grad=False)) == "sdpa"  # inference
    assert m.choose(_call(short, training=False)) == "sdpa"  # eval mode: convert stays bit-identical to timm
    assert m.choose(_call(EXPLICIT_MAX_KEYS[torch.bfloat16], dtype=torch.bfloat16)) == "explicit"
    assert m.choose(_call(EXPLICIT_MAX_KEYS[torch.bfloat16] + 1, dtype=torch.bfloat16)) == "sdpa"
    m.use_backend("sdpa")
    assert m.choose(_call(short)) == "sdpa"  # forced
    with pytest.raises(Exception, match="has no 'flash' backend"):
        m.use_backend("flash")


def _reference(x, m, keep):
    """The module's output in float64, one (sample, head) at a time: softmax(q k^T / sqrt(D) over kept keys) v."""
    w, b = m.qkv.weight.detach().double(), m.qkv.bias.detach().double()
    qkv = (x.detach().double() @ w.T + b).reshape(*x.shape[:2], 3, m.num_heads, m.head_dim).numpy()
    out = np.zeros((x.shape[0], x.shape[1], m.num_heads, m.head_dim))
    for s, h in np.ndindex(x.shape[0], m.num_heads):
        q, k, v = qkv[s, :, 0, h], qkv[s, :, 1, h], qkv[s, :, 2, h]
        logits = np.where(keep, q @ k.T / np.sqrt(m.head_dim), -np.inf)
        e = np.exp(logits - logits.max(1, keepdims=True))
        out[s, :, h] = (e / e.sum(1, keepdims=True)) @ v
    out = out.reshape(x.shape[0], x.shape[1], -1) @ m.proj.weight.detach().double().numpy().T
    return out + m.proj.bias.detach().double().numpy()


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_and_sdpa_backends_value_and_gradient(causal):
    torch.manual_seed(0)
    m = StandardAttention(32, 2, qkv_bias=True).train()  # a training step: auto takes the explicit product
    x = torch.randn(2, 17, 32, requires_grad=True)
    keep = np.tril(np.ones((17, 17), dtype=bool)) if causal else np.ones((17, 17), dtype=bool)
    results = []
    for backend in ("auto", "sdpa"):
        m.use_backend(backend)
        y = m(x, is_causal=causal)
        np.testing.assert_allclose(y.detach().double().numpy(), _reference(x, m, keep), rtol=1e-5, atol=1e-6)
        results.append((y, *torch.autograd.grad(y.square().sum(), (x, m.qkv.weight))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_causal_keep_offsets():
    assert torch.equal(causal_keep(3, 3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    # two new queries after a KV cache of three keys: each sees the cache and itself
    assert torch.equal(causal_keep(2, 5, offset=3), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
