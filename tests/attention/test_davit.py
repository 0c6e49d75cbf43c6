"""DaViT's dual attention: window attention as token softmax attention, channel attention against a float64
reference (tests/reference_xcit.py), and which terms each takes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from timm.models.davit import ChannelAttentionV2

import attnlab
from attnlab.analysis.jacobian import jacobian_conditioning
from attnlab.errors import SpecError
from attnlab.models import attention_modules
from attnlab.models.convert import term_support
from tests import reference_reparam as ref_reparam
from tests.reference_xcit import conditioned, davit_channel_head, davit_channel_reference, davit_channel_v2_reference
from tests.backends import set_fused

# 8x8 then 4x4 tokens, windows of 4x4: no padded windows (a zero token makes the Jacobian singular)
TINY = dict(depths=(1, 1), embed_dims=(16, 32), num_heads=(2, 4), window_size=4, num_classes=5)


def tiny(attn="standard", seed=0):
    torch.manual_seed(seed)
    return attnlab.build_model("davit_tiny", attn=attn, **TINY).eval()


@pytest.mark.parametrize("fused", [True, False])
def test_convert_standard_is_bit_identical(fused):
    model = tiny(attn=None)
    set_fused(model, fused)
    x = torch.randn(2, 3, 32, 32)
    before = model(x)
    converted = attnlab.convert(copy.deepcopy(model), "standard")
    kinds = [type(m).__name__ for _, m in attention_modules(converted)]
    assert kinds == ["StandardAttention", "DaViTChannelAttention"] * 2
    assert torch.equal(converted(x), before)
    assert converted.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("spec,lam", [("standard", 0.0), ("speccond(lam=1.5)", 1.5)])
def test_channel_attention_matches_float64_reference(spec, lam):
    model = tiny(spec).double()
    seen = []
    channel = [m for _, m in attention_modules(model) if type(m).__name__ == "DaViTChannelAttention"]
    for m in channel:
        m.register_forward_hook(lambda mod, a, out: seen.append((mod, a[0], out)))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    assert len(seen) == 2
    for mod, x, out in seen:
        w = mod.qkv.parametrizations.weight.original if lam else mod.qkv.weight
        b = None if mod.qkv.bias is None else mod.qkv.bias.detach().numpy()
        ref = davit_channel_reference(x.numpy(), w.detach().numpy(), b, mod.proj.weight.detach().numpy(),
                                      mod.proj.bias.detach().numpy(), mod.num_heads, lam=lam)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10, atol=1e-12)


def test_qknorm_normalises_the_two_factors_of_the_channel_map():
    """DaViT's map is softmax(k^T v / sqrt(D)): QK-norm acts on k and v per token; q, the mixed factor, stays."""
    model = tiny("qknorm").double()
    seen = []
    for _, m in attention_modules(model):
        m.q_norm.weight.data.uniform_(0.5, 2.0)
        m.k_norm.bias.data.normal_(0.0, 0.3)
        if type(m).__name__ == "DaViTChannelAttention":
            m.register_forward_hook(lambda mod, a, out: seen.append((mod, a[0], out)))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    assert len(seen) == 2
    for mod, x, out in seen:
        b = None if mod.qkv.bias is None else mod.qkv.bias.detach().numpy()
        norms = [(n.weight.detach().numpy(), n.bias.detach().numpy()) for n in (mod.q_norm, mod.k_norm)]
        ref = davit_channel_reference(x.numpy(), mod.qkv.weight.detach().numpy(), b, mod.proj.weight.detach().numpy(),
                                      mod.proj.bias.detach().numpy(), mod.num_heads, norms=norms)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(jacobian_conditioning(model.float(), torch.randn(1, 3, 32, 32), heads=[0]).kappa).all()


def test_channel_attention_v2_bit_identical_and_matches_reference():
    torch.manual_seed(0)
    model = nn.Sequential(ChannelAttentionV2(24, num_heads=3)).double().eval()
    x = torch.randn(2, 10, 24, dtype=torch.float64)
    before = model(x)
    converted = attnlab.convert(copy.deepcopy(model), "standard")
    assert type(converted[0]).__name__ == "DaViTChannelAttention" and converted[0].v2
    assert torch.equal(converted(x), before)
    m = converted[0]
    ref = davit_channel_v2_reference(x.numpy(), m.qkv.weight.detach().numpy(), m.qkv.bias.detach().numpy(),
                                     m.proj.weight.detach().numpy(), m.proj.bias.detach().numpy(), 3)
    np.testing.assert_allclose(converted(x).detach().numpy(), ref, rtol=1e-10, atol=1e-12)


def test_window_attention_takes_token_kernels_and_ns_acts_on_both():
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        base = tiny("standard")(x)
        assert not torch.allclose(tiny("ns")(x), base)
    kinds = [type(m).__name__ for _, m in attention_modules(tiny("ns+sigma"))]
    assert kinds == ["StandardAttention", "DaViTChannelAttention"] * 2


@pytest.mark.parametrize("term", ["dna", "diff", "cog", "qkclip"])
def test_token_terms_are_refused_on_channel_attention(term):
    with pytest.raises(SpecError, match=r"does not apply to DaViT's channel attention \(stages\.0\.blocks\.0\.1\.attn\)"):
        tiny(term)


def test_support_splits_window_and_channel_attention():
    window, channel = term_support(tiny(None))
    assert window["type"] == "WindowAttention" and window["refused"] == {}
    assert {"dna", "qknorm", "qkclip"} <= set(window["applies"])
    assert channel["type"] == "ChannelAttention" and "speccond" in channel["applies"]
    assert "dna" in channel["refused"] and "qknorm" in channel["applies"]


def test_jacobian_matches_finite_differences_on_both_attentions():
    """Head 0's kappa in a window block and a channel block against central differences of float64 numpy heads
    on W + lam I_k, SVD by numpy. Stage 2's channel block: stage 1's has a tall, rank-deficient Jacobian."""
    model = tiny("speccond(lam=1.5)").double()
    images = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    seen = {}
    found = attention_modules(model)
    handles = [m.register_forward_pre_hook(lambda mod, a, i=i: seen.setdefault(i, a[0].detach()))
               for i, (_, m) in enumerate(found)]
    with torch.no_grad():
        model(images)
    for h in handles:
        h.remove()
    result = jacobian_conditioning(model, images, blocks=[0, 3], heads=[0])
    assert len(result.blocks) == 2
    for i, b in enumerate((0, 3)):
        mod = found[b][1]
        A, D = mod.attn_dim, mod.head_dim
        w = mod.qkv.parametrizations.weight.original.detach().numpy()
        w = np.concatenate([conditioned(w[i * A:(i + 1) * A], 1.5) for i in range(3)])
        bias = mod.qkv.bias.detach().numpy()
        rows = [slice(p * A, p * A + D) for p in range(3)]  # head 0's rows of q, k and v
        x = seen[b][0].numpy()  # window 0 / image 0
        if b == 0:  # window attention: softmax(q k^T / sqrt(D)) v over the window's tokens
            def f(wq, wk, wv, x=x, bias=bias, rows=rows, D=D):
                return ref_reparam.head_attention(x, wq, wk, wv, *(bias[r] for r in rows), D ** -0.5)
        else:  # channel attention: q softmax(k^T v / sqrt(D))^T
            def f(wq, wk, wv, x=x, bias=bias, rows=rows):
                return davit_channel_head(x, wq, wk, wv, *(bias[r] for r in rows))
        j = ref_reparam.finite_difference_jacobian(f, [w[r] for r in rows])
        assert result.kappa[i, 0, 0].item() == pytest.approx(ref_reparam.kappa(j), rel=1e-5)
