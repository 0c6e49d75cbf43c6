"""`cog`: sign(s) * softmax(|s|) against a float64 loop (ViT and shifted-window Swin), masked keys at exactly zero
weight, first/last layers softmax unless all_layers, standard state dicts load strictly."""

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from timm.models.swin_transformer import SwinTransformerBlock

import attnlab
from attnlab.attention.base import Want
from attnlab.attention.mask import AttentionMask, Mask
from attnlab.attention.cog import CogAttention
from attnlab.attention.standard import StandardAttention
from attnlab.models import attention_modules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_baselines as ref  # noqa: E402

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)


def _weights(m):
    return (m.qkv.weight.detach(), m.qkv.bias.detach(), m.proj.weight.detach(), m.proj.bias.detach(), m.num_heads)


def _vit_middle(all_layers=False):
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="cog(all_layers=true)" if all_layers else "cog").double().eval()
    return model


def test_vit_matches_float64_loop_with_bool_mask():
    attn = _vit_middle().blocks[1].attn
    assert attn.signed
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    keep = torch.rand(17, 17, generator=torch.Generator().manual_seed(1)) > 0.3
    keep.fill_diagonal_(True)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), ref.cog_attention(x, *_weights(attn)), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(attn(x, attn_mask=keep), ref.cog_attention(x, *_weights(attn), keep=keep),
                                   rtol=1e-10, atol=1e-10)
        # a float mask with -inf where keep is False means the same thing
        float_mask = torch.zeros(17, 17, dtype=torch.float64).masked_fill(~keep, float("-inf"))
        torch.testing.assert_close(attn(x, attn_mask=float_mask), attn(x, attn_mask=keep), rtol=0, atol=0)


def _swin(all_layers=True, layer_index=1):
    torch.manual_seed(2)
    block = SwinTransformerBlock(48, (8, 8), num_heads=3, head_dim=16, window_size=4, shift_size=2).double().eval()
    with torch.no_grad():  # make the relative-position bias matter (init is trunc-normal 0.02)
        block.attn.relative_position_bias_table.normal_(0, 1.0)
    original = copy.deepcopy(block)
    block.attn = CogAttention.from_module(block.attn, layer_index=layer_index, num_layers=4, all_layers=all_layers)
    return original, block


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa-flag", "explicit"])
def test_swin_matches_float64_loop_with_shift_mask(fused):
    _, block = _swin()
    attn, mask = block.attn, block.attn_mask
    attn.use_backend("auto" if fused else "explicit")  # signed layers ignore the flag: same result either way
    assert mask is not None and (mask != 0).any()
    x = torch.randn(mask.shape[0] * 2, 16, 48, dtype=torch.float64)
    bias = ref.rel_pos_bias(attn.relative_position_bias_table.detach(), 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, mask=mask), ref.cog_attention(x, *_weights(attn), bias=bias, mask=mask),
                                   rtol=1e-10, atol=1e-10)
        assert torch.isfinite(block(torch.randn(2, 8, 8, 48, dtype=torch.float64))).all()


def test_masked_positions_get_exactly_zero_weight():
    _, block = _swin()
    attn, mask = block.attn, block.attn_mask
    x = torch.randn(mask.shape[0], 16, 48, dtype=torch.float64)
    with torch.no_grad():
        w = attn.run(x, window=mask, want=Want(weights=True))[1].weights["attn"].weights
    off = (mask != 0).unsqueeze(1).expand_as(w)
    assert off.any() and (w[off] == 0).all()
    # absolute weights over the unmasked keys sum to one, and some weights are negative
    torch.testing.assert_close(w.abs().sum(-1), torch.ones(w.shape[:-1], dtype=w.dtype), rtol=1e-12, atol=1e-12)
    assert (w < 0).any() and (w > 0).any()
    # worked by hand: s = (1, -2, 0.5) with the last key masked -> weights (e/(e+e^2), -e^2/(e+e^2), 0)
    one = CogAttention(2, 1, backend="explicit", layer_index=1, num_layers=3).double()
    one.scale = 1.0
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[1.0, 0.0], [-2.0, 0.0], [0.5, 0.0]]]], dtype=torch.float64)
    e1, e2 = math.exp(1.0), math.exp(2.0)
    want = torch.tensor([e1 / (e1 + e2), -e2 / (e1 + e2), 0.0], dtype=torch.float64)
    mask = Mask.resolve(torch.tensor([[True, True, False]]), B=1, N=1, M=3, device=q.device)
    got = one.kernel(q, k, torch.eye(3, dtype=torch.float64)[None, None], mask, Want(weights=True), "explicit")[1] \
        .weights["attn"].weights
    torch.testing.assert_close(got.flatten(), want, rtol=1e-14, atol=1e-14)


def test_first_and_last_layers_stay_softmax():
    torch.manual_seed(3)
    original = attnlab.build_model("vit_digits", **TINY_VIT, attn=None).double().eval()
    cog = attnlab.convert(copy.deepcopy(original), "cog").eval()
    everywhere = attnlab.convert(copy.deepcopy(original), "cog(all_layers=true)").eval()
    assert [b.attn.signed for b in cog.blocks] == [False, True, False]
    assert all(b.attn.signed for b in everywhere.blocks)
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    with torch.no_grad():
        for i, (o, c, e) in enumerate(zip(original.blocks, cog.blocks, everywhere.blocks)):
            same = torch.equal(o.attn(x), c.attn(x))
            assert same == (i in (0, 2)), i
            assert not torch.allclose(o.attn(x), e.attn(x))
    # Swin: layer indices run over all stages; a middle-stage index is signed, index 0 and the last are not
    swin = attnlab.build_model("swin_cifar", attn="cog", depths=(1, 2, 1))
    assert [m.signed for _, m in attention_modules(swin)] == [False, True, True, False]


def test_softmax_layers_equal_standard_for_swin_block():
    original, block = _swin(all_layers=False, layer_index=0)
    assert not block.attn.signed
    x = torch.randn(2, 8, 8, 48, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(block(x), original(x), rtol=1e-12, atol=1e-12)


def test_standard_state_dict_loads_strictly():
    torch.manual_seed(4)
    standard = attnlab.build_model("vit_digits", **TINY_VIT)
    cog = attnlab.build_model("vit_digits", **TINY_VIT, attn="cog")
    assert list(cog.state_dict()) == list(standard.state_dict())
    cog.load_state_dict(standard.state_dict(), strict=True)
    assert isinstance(cog.blocks[1].attn, StandardAttention) and isinstance(cog.blocks[1].attn, CogAttention)


def test_gradcheck_float64():
    torch.manual_seed(5)
    attn = CogAttention(8, 2, qkv_bias=True, window_size=(2, 2), layer_index=1, num_layers=3).double()
    mask = torch.tensor([[0.0, -100.0, 0.0, -100.0]] * 4, dtype=torch.float64).unsqueeze(0)
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: attn(x, mask=mask), (x,), fast_mode=True)


def test_spec_round_trip():
    assert str(attnlab.parse_spec("cog(all_layers=false)")) == "cog"
    assert str(attnlab.parse_spec("cog(all_layers=true)")) == "cog(all_layers=true)"
