"""The DnA authors' state dicts load by meaning ("DnA: Denoising Attention for Visual Tasks").

The authors' attention is written here from their documented layout (a fused ``qqkvv`` Linear split in their
forward's order Q+, Q-, K, V+, V-; per-head ``neg_scalers``; softmax branch plus (or minus) alpha times the softmin
branch, both scaled by head_dim^-0.5) inside timm's ViT, in float64, importing nothing from attnlab. Its state dict,
and the same weights in their legacy converter's row order (Q+, K, V+, Q-, V-) and in their video transformer's
separate ``qkv`` + ``q_neg`` + ``v_neg`` Linears, must give attnlab's ``dna`` model the same outputs.
"""

from __future__ import annotations

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import attnlab
from attnlab.errors import ConfigError
from attnlab.models.pretrained import dna_authors_state_dict, load_dna_authors

KW = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=48, depth=2, num_heads=3, mlp_ratio=2.0, qkv_bias=True,
          class_token=False, global_pool="avg", drop_path_rate=0.0, num_classes=10)  # the vit_digits preset


class AuthorsAttention(nn.Module):
    """The authors' ViT attention as documented: qqkvv (5*dim) read as Q+, Q-, K, V+, V-; neg_scalers (1, H, 1, 1)."""

    def __init__(self, dim: int, num_heads: int, sign: float = 1.0):
        super().__init__()
        self.h, self.d, self.sign = num_heads, dim // num_heads, sign
        self.qqkvv = nn.Linear(dim, 5 * dim)
        self.neg_scalers = nn.Parameter(torch.rand(1, num_heads, 1, 1) + 0.2)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None, is_causal=False):
        B, N, C = x.shape
        q_pos, q_neg, k, v_pos, v_neg = self.qqkvv(x).reshape(B, N, 5, self.h, self.d).permute(2, 0, 3, 1, 4)
        scale = self.d ** -0.5
        a_pos = (q_pos @ k.transpose(-2, -1) * scale).softmax(-1)
        a_neg = (-(q_neg @ k.transpose(-2, -1) * scale)).softmax(-1)  # softmin
        out = a_pos @ v_pos + self.sign * self.neg_scalers * (a_neg @ v_neg)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


def authors_model(sign: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    model = VisionTransformer(**KW)
    for block in model.blocks:
        block.attn = AuthorsAttention(KW["embed_dim"], KW["num_heads"], sign)
        nn.init.normal_(block.attn.qqkvv.weight, std=0.2)  # logits large enough that a scrambled order shows
    return model.double().eval()


def legacy(state: dict) -> dict:
    """Their legacy converter's file: the same rows concatenated as Q+, K, V+, Q-, V-."""
    out = dict(state)
    for key in [k for k in state if "qqkvv" in k]:
        qp, qn, k, vp, vn = state[key].chunk(5)
        out[key] = torch.cat([qp, k, vp, qn, vn])
    return out


def separate(state: dict) -> dict:
    """Their video transformer's layout: qkv (Q+, K, V+) plus q_neg and v_neg Linears."""
    out = {}
    for key, t in state.items():
        if "qqkvv" in key:
            qp, qn, k, vp, vn = t.chunk(5)
            out[key.replace("qqkvv", "qkv")] = torch.cat([qp, k, vp])
            out[key.replace("qqkvv", "q_neg")] = qn
            out[key.replace("qqkvv", "v_neg")] = vn
        else:
            out[key] = t
    return out


def attnlab_model(attn: str = "dna") -> nn.Module:
    return attnlab.build_model("vit_digits", num_classes=10, attn=attn).double().eval()


@pytest.fixture(scope="module")
def x():
    return torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("layout, make", [("forward", lambda s: s), ("auto", lambda s: s), ("legacy", legacy),
                                          ("separate", separate), ("auto", separate)])
def test_authors_state_dict_gives_the_authors_outputs(x, layout, make):
    ref = authors_model()
    model = load_dna_authors(attnlab_model(), make(ref.state_dict()), layout=layout)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-10, atol=1e-10)


def test_legacy_file_read_by_position_is_scrambled(x):
    """What their own forward does with a legacy file; attnlab reads it as such only when told the wrong layout."""
    ref = authors_model()
    wrong = load_dna_authors(attnlab_model(), legacy(ref.state_dict()), layout="forward")
    with torch.no_grad():
        assert (wrong(x) - ref(x)).abs().max() > 1e-3


@pytest.mark.parametrize("make", [lambda s: s, separate])
def test_subtracting_files_load_with_sign_minus(x, make):
    ref = authors_model(sign=-1.0)
    model = load_dna_authors(attnlab_model(), make(ref.state_dict()), sign="-")
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-10, atol=1e-10)
        plus = load_dna_authors(attnlab_model(), make(ref.state_dict()), sign="+")
        assert (plus(x) - ref(x)).abs().max() > 1e-3


def test_alpha_and_rows_land_by_name():
    ref = authors_model()
    state = dna_authors_state_dict(attnlab_model(), ref.state_dict())
    assert "blocks.0.attn.neg_scalers" not in state and "blocks.0.attn.qqkvv.weight" not in state
    torch.testing.assert_close(state["blocks.1.attn.alpha"], ref.blocks[1].attn.neg_scalers.detach().reshape(3))
    torch.testing.assert_close(state["blocks.1.attn.qkv.weight"], ref.blocks[1].attn.qqkvv.weight.detach())


def test_wrong_model_or_layout_is_one_sentence(tmp_path):
    ref = authors_model()
    with pytest.raises(ConfigError, match="no DnA attention module"):
        load_dna_authors(attnlab_model("standard"), ref.state_dict())
    with pytest.raises(ConfigError, match="layout 'fused' is not valid"):
        load_dna_authors(attnlab_model(), ref.state_dict(), layout="fused")
    state = ref.state_dict()
    state["blocks.0.attn.neg_scalers"] = torch.ones(4, dtype=torch.float64)
    with pytest.raises(ConfigError, match="4 values for 3 heads"):
        load_dna_authors(attnlab_model(), state)
    with pytest.raises(ConfigError, match="holds v_neg rows .* no place for"):
        load_dna_authors(attnlab.build_model("vit_digits", num_classes=10, attn="dna(variant=q)").double(),
                         ref.state_dict())
