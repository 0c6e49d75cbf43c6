"""XCiT's cross-covariance attention (attnlab.attention.xca) against timm and an independent float64 reference."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import attnlab
from attnlab.analysis.jacobian import jacobian_conditioning
from attnlab.errors import SpecError
from attnlab.models import attention_modules
from attnlab.models.convert import term_support
from tests.reference_xcit import conditioned, xca_head_output, xca_reference

TINY = dict(img_size=32, depth=2, cls_attn_layers=1, num_classes=5)  # 4 tokens, 4 heads of D = 32


def tiny(attn="standard", seed=0):
    torch.manual_seed(seed)
    return attnlab.build_model("xcit_nano_12_p16_224", attn=attn, **TINY).eval()


@pytest.mark.parametrize("fused", [True, False])
def test_convert_standard_is_bit_identical(fused):
    model = tiny(attn=None)
    for m in model.modules():
        if type(m).__name__ == "XCA":
            m.fused_attn = fused
            m.temperature.data.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 32, 32)
    before = model(x)
    converted = attnlab.convert(copy.deepcopy(model), "standard")
    assert {type(m).__name__ for _, m in attention_modules(converted)} == {"XCAttention"}
    assert torch.equal(converted(x), before)
    assert converted.state_dict().keys() == model.state_dict().keys()


def _captured(model, x):
    seen = []
    handles = [m.register_forward_hook(lambda mod, a, out: seen.append((mod, a[0], out)))
               for _, m in attention_modules(model)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("spec,lam", [("standard", 0.0), ("speccond(lam=2)", 2.0)])
def test_xca_matches_float64_reference(spec, lam):
    model = tiny(spec).double()
    for _, m in attention_modules(model):
        m.temperature.data.uniform_(0.3, 3.0)  # a learned temperature per head, not timm's init of 1
    seen = _captured(model, torch.randn(2, 3, 32, 32, dtype=torch.float64))
    assert len(seen) == 2
    for mod, x, out in seen:
        w = mod.qkv.parametrizations.weight.original if lam else mod.qkv.weight
        ref = xca_reference(x.numpy(), w.detach().numpy(), mod.qkv.bias.detach().numpy(),
                            mod.proj.weight.detach().numpy(), mod.proj.bias.detach().numpy(),
                            mod.temperature.detach().flatten().numpy(), mod.num_heads, lam=lam)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10, atol=1e-12)


def _ln_params(norm):
    return norm.weight.detach().numpy(), norm.bias.detach().numpy()


def test_qknorm_normalises_each_token_before_the_cross_covariance():
    model = tiny("qknorm+speccond(lam=0.5)").double()
    for _, m in attention_modules(model):
        m.temperature.data.uniform_(0.3, 3.0)
        for norm in (m.q_norm, m.k_norm):  # trained-looking norms, not the identity-like init
            norm.weight.data.uniform_(0.5, 2.0)
            norm.bias.data.normal_(0.0, 0.3)
    seen = _captured(model, torch.randn(2, 3, 32, 32, dtype=torch.float64))
    for mod, x, out in seen:
        w = mod.qkv.parametrizations.weight.original
        ref = xca_reference(x.numpy(), w.detach().numpy(), mod.qkv.bias.detach().numpy(),
                            mod.proj.weight.detach().numpy(), mod.proj.bias.detach().numpy(),
                            mod.temperature.detach().flatten().numpy(), mod.num_heads, lam=0.5,
                            norms=(_ln_params(mod.q_norm), _ln_params(mod.k_norm)))
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10, atol=1e-12)
    result = jacobian_conditioning(model.float(), torch.randn(1, 3, 32, 32), blocks=[0], heads=[0])
    assert torch.isfinite(result.kappa).all()


def test_ns_acts_on_each_heads_token_by_feature_output():
    plain, ns = tiny("standard"), tiny("ns")
    seen = []
    ns.blocks[0].attn.head_transform.register_forward_hook(lambda m, a, out: seen.append(a[0]))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(plain(x), ns(x))
    assert seen[0].shape == (1, 4, 4, 32)  # (B, H, N, D)


@pytest.mark.parametrize("term", ["dna", "diff", "cog", "qkclip", "dna+speccond"])
def test_token_attention_terms_are_refused_with_a_reason(term):
    with pytest.raises(SpecError, match=r"does not apply to XCiT's cross-covariance attention \(blocks\.0\.attn\)"):
        tiny(term)


def test_support_lists_xca_terms_and_leaves_class_attention():
    groups = term_support(tiny(None))
    xca = groups[0]
    assert xca["type"] == "XCA" and xca["modules"] == ["blocks.0.attn", "blocks.1.attn"]
    assert set(xca["applies"]) >= {"standard", "ns", "sigma", "specnorm", "speccond", "qknorm"}
    assert set(xca["refused"]) >= {"dna", "diff", "cog", "qkclip"}
    assert groups[-1]["type"] == "ClassAttn" and groups[-1]["applies"] == []


def test_jacobian_condition_matches_reference():
    model = tiny("speccond(lam=2)")
    for _, m in attention_modules(model):
        m.temperature.data.fill_(1.7)
    images = torch.randn(1, 3, 32, 32)
    got = jacobian_conditioning(model, images, blocks=[1], heads=[1])
    mod, x, _ = _captured(model, images)[1]  # the block's input as the instrument sees it, then float64
    x = x.double()
    A, D, h = mod.attn_dim, mod.head_dim, 1
    w = mod.qkv.parametrizations.weight.original.detach().double().numpy()
    w = torch.cat([torch.from_numpy(conditioned(w[i * A:(i + 1) * A], 2.0)) for i in range(3)])
    rows = [slice(p * A + h * D, p * A + (h + 1) * D) for p in range(3)]
    b = mod.qkv.bias.detach().double()
    parts = torch.autograd.functional.jacobian(
        lambda wq, wk, wv: xca_head_output(x[0], wq, wk, wv, b[rows[0]], b[rows[1]], b[rows[2]], 1.7),
        tuple(w[r] for r in rows))
    j = torch.cat([p.reshape(x.shape[1] * D, -1) for p in parts], dim=1).numpy()
    s = np.linalg.svd(j, compute_uv=False)
    assert float(got.kappa[0, 0, 0]) == pytest.approx(s[0] / s[-1], rel=1e-6)
