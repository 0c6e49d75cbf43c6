"""`diff`: timm's DiffAttention mathematics, its state dict, the Swin form against a float64 loop, branch outputs."""

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from timm.layers import DiffAttention as TimmDiffAttention
from timm.models.swin_transformer import SwinTransformerBlock
from timm.models.vision_transformer import VisionTransformer

import attnlab
from attnlab.attention.base import Want
from attnlab.attention.mask import AttentionMask
from attnlab.attention.diff import DiffAttention
from attnlab.errors import UnsupportedModelError
from attnlab.models.backbones import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_baselines as ref  # noqa: E402
from tests.backends import set_fused

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)


def _set_fused(model, fused):
    set_fused(model, fused)


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
def test_vit_matches_timm_diff_model(fused):
    """A timm ViT built with attn_layer='diff' and attnlab's vit_digits converted to `diff` are the same function
    once the timm state dict is loaded (strictly: names and shapes all map)."""
    torch.manual_seed(0)
    kwargs = dict(PRESETS["vit_digits"].kwargs, num_classes=10, **TINY_VIT)
    theirs = VisionTransformer(**kwargs, attn_layer="diff").double().eval()
    for m in theirs.modules():  # the paper's init is small; make lambda and the sub-norm matter
        if isinstance(m, TimmDiffAttention):
            for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2):
                p.data.normal_(0, 0.5)
            m.sub_norm.weight.data.uniform_(0.5, 1.5)
    ours = attnlab.build_model("vit_digits", **TINY_VIT, num_classes=10, attn="diff").double().eval()
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    _set_fused(theirs, fused)
    _set_fused(ours, fused)
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        # timm rounds lambda to fp32 (``.float()``) even in a float64 model; attnlab keeps float64, hence 1e-6
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_lambda_init_follows_depth():
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="diff")
    got = [b.attn.lambda_init for b in model.blocks]
    assert got == pytest.approx([0.2, 0.8 - 0.6 * 0.7408182206817179, 0.8 - 0.6 * 0.5488116360940264])


@pytest.mark.parametrize("dual_lambda", [False, True])
def test_module_from_timm_diff_with_qk_norm(dual_lambda):
    """from_module takes over a timm DiffAttention whole (lambdas, sub-norm, half-width q/k norms), fp32 tight."""
    torch.manual_seed(1)
    theirs = TimmDiffAttention(64, num_heads=4, qkv_bias=True, qk_norm=True, depth=2, dual_lambda=dual_lambda).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name or "lambda" in name:
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.5)
    ours = DiffAttention.from_module(copy.deepcopy(theirs), layer_index=2, dual_lambda=dual_lambda).eval()
    fresh = DiffAttention(64, 4, qkv_bias=True, qk_norm=True, layer_index=2, dual_lambda=dual_lambda).eval()
    fresh.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        want = theirs(x)
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fresh(x), want, rtol=1e-5, atol=1e-5)


def _swin_block(fused):
    """A timm shifted-window Swin block (8x8 tokens, window 4, shift 2: 4 windows with -100 entries), its attention
    replaced by `diff` as convert does it."""
    torch.manual_seed(2)
    block = SwinTransformerBlock(48, (8, 8), num_heads=3, head_dim=16, window_size=4, shift_size=2).double().eval()
    attn = block.attn = DiffAttention.from_module(block.attn, layer_index=1, num_layers=4)
    with torch.no_grad():  # trunc-normal(0.02) init barely moves the logits; make the bias and lambda matter
        attn.relative_position_bias_table.normal_(0, 1.0)
        for p in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2):
            p.normal_(0, 0.5)
        attn.sub_norm.weight.uniform_(0.5, 1.5)
    attn.use_backend("auto" if fused else "explicit")
    return block, attn


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
def test_swin_matches_float64_loop(fused):
    block, attn = _swin_block(fused)
    assert block.attn_mask is not None and attn.layer_index == 1
    mask = block.attn_mask
    x = torch.randn(mask.shape[0], attn.window_area, attn.dim, dtype=torch.float64)  # one image's windows
    bias = ref.rel_pos_bias(attn.relative_position_bias_table.detach(), *attn.window_size)
    want, branches = ref.diff_attention(
        x, attn.qkv.weight.detach(), attn.qkv.bias.detach(), attn.proj.weight.detach(), attn.proj.bias.detach(),
        attn.num_heads, attn.lambda_q1.detach(), attn.lambda_k1.detach(), attn.lambda_q2.detach(),
        attn.lambda_k2.detach(), attn.sub_norm.weight.detach(), depth=1, bias=bias, mask=mask)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, mask=mask), want, rtol=1e-10, atol=1e-10)
        o_pos, o_neg = attn.run(x, window=mask, want=Want(branches=True))[1].branches
    assert o_pos.shape == o_neg.shape == (x.shape[0], attn.num_heads, attn.window_area, attn.head_dim)
    for b in range(x.shape[0]):
        for h in range(attn.num_heads):
            torch.testing.assert_close(o_pos[b, h], branches[b][h][0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(o_neg[b, h], branches[b][h][1], rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        assert not torch.allclose(attn(x, mask=mask), attn(x))  # the mask matters
        assert torch.isfinite(block(torch.randn(2, 8, 8, 48, dtype=torch.float64))).all()  # timm's block runs it


def test_branch_outputs_recompose_forward():
    """o_pos - lambda * o_neg, sub-normed, scaled and merged is the module's output (ViT, eval)."""
    torch.manual_seed(3)
    attn = attnlab.build_model("vit_digits", **TINY_VIT, attn="diff").blocks[2].attn.double().eval()
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    with torch.no_grad():
        o_pos, o_neg = attn.run(x, want=Want(branches=True))[1].branches
        lam = attn.lambda_full()
        o = attn.sub_norm(o_pos - lam * o_neg) * (1 - attn.lambda_init)
        torch.testing.assert_close(attn.finish(o, None, x), attn(x), rtol=1e-12, atol=1e-12)
        # branches are convex combinations of v rows: softmax weights, not the lambda-weighted difference
        q, k, v = attn.project(x)
        d = attn.head_dim // 2
        a1 = torch.softmax(q[..., :d] @ k[..., :d].transpose(-1, -2) / math.sqrt(d), -1)
        torch.testing.assert_close(o_pos, a1 @ v, rtol=1e-12, atol=1e-12)


def test_gradcheck_float64():
    torch.manual_seed(4)
    attn = DiffAttention(8, 2, qkv_bias=True, window_size=(2, 2), backend="explicit", layer_index=3).double()
    mask = torch.tensor([[0.0, -100.0, 0.0, -100.0]] * 4, dtype=torch.float64).unsqueeze(0)
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    lq1 = attn.lambda_q1.detach().clone().requires_grad_(True)

    def f(x, lq1):
        params = dict(attn.named_parameters(), lambda_q1=lq1)
        return torch.func.functional_call(attn, params, (x,), {"mask": mask})

    assert torch.autograd.gradcheck(f, (x, lq1), fast_mode=True)


def test_new_parameters_follow_model_dtype():
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn=None).double()
    attnlab.convert(model, "diff")
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def test_odd_head_dim_is_refused():
    model = VisionTransformer(img_size=8, patch_size=4, in_chans=1, embed_dim=12, depth=1, num_heads=4)
    with pytest.raises(UnsupportedModelError, match="even head dimension"):
        attnlab.convert(model, "diff")


def test_spec_round_trip():
    assert str(attnlab.parse_spec("diff(dual_lambda=true)")) == "diff(dual_lambda=true)"
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="diff(dual_lambda=true)")
    assert model.blocks[0].attn.lambda_a is not None and model.blocks[0].attn.lambda_q1 is None
