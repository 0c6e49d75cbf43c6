"""`qknorm`: equal to timm's Attention(qk_norm=True) on the same weights, its state dict, the norm itself."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from timm.layers import Attention as TimmAttention

import attnlab
from attnlab.models import attention_modules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_qk as ref  # noqa: E402
from tests.backends import set_fused

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)


def _randomise_norms(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("weight") else 0.0))


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
def test_vit_matches_timm_qk_norm(fused):
    """A timm ViT built with qk_norm=True and attnlab's `qknorm` ViT compute the same function on one state dict."""
    torch.manual_seed(0)
    timm_model = attnlab.build_model("vit_digits", **TINY_VIT, attn=None, qk_norm=True).eval()
    assert isinstance(timm_model.blocks[0].attn, TimmAttention)
    _randomise_norms(timm_model)
    ours = attnlab.build_model("vit_digits", **TINY_VIT, attn="qknorm").eval()
    assert list(ours.state_dict()) == list(timm_model.state_dict())
    ours.load_state_dict(timm_model.state_dict(), strict=True)
    for model in (timm_model, ours):
        set_fused(model, fused)
    x = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), timm_model(x), rtol=1e-6, atol=1e-6)
    # and back: the attnlab state dict loads into timm's model
    timm_model.load_state_dict(ours.state_dict(), strict=True)


def test_norms_are_timm_layernorm_on_head_dim():
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="qknorm")
    for _, m in attention_modules(model):
        for norm in (m.q_norm, m.k_norm):
            assert isinstance(norm, torch.nn.LayerNorm)
            assert norm.normalized_shape == (m.head_dim,) and norm.eps == 1e-6
            assert torch.equal(norm.weight, torch.ones(m.head_dim)) and torch.equal(norm.bias, torch.zeros(m.head_dim))


def test_swin_project_normalises_each_head():
    """Swin gets the same norm: `project` returns LayerNorm(x W_q,h^T + b_q,h) per head (float64 reference)."""
    torch.manual_seed(0)
    model = attnlab.build_model("swin_cifar", attn="qknorm")
    attn = model.layers[1].blocks[0].attn
    _randomise_norms(attn, seed=3)
    x = torch.randn(2, 16, attn.dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        q, k, _ = attn.project(x)
    q_ref, k_ref = ref.head_qk(attn.qkv.weight, attn.qkv.bias, x, attn.num_heads)
    np.testing.assert_allclose(q.double().numpy(), ref.layer_norm(q_ref, attn.q_norm.weight, attn.q_norm.bias, 1e-6),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(k.double().numpy(), ref.layer_norm(k_ref, attn.k_norm.weight, attn.k_norm.bias, 1e-6),
                               rtol=1e-4, atol=1e-5)


def test_existing_norms_are_kept():
    """A timm model trained with qk_norm keeps its norms (and their weights) when converted with `qknorm`."""
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn=None, qk_norm=True)
    _randomise_norms(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attnlab.convert(model, "qknorm")
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)


def test_diff_gets_half_head_norms():
    """With the diff kernel each half-head is normalised, as timm's DiffAttention builds its norms in a ViT."""
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="diff+qknorm")
    m = attention_modules(model)[0][1]
    assert m.q_norm.normalized_shape == (m.head_dim // 2,)
    model(torch.randn(2, 1, 8, 8))
