"""ViTDet against detectron2's own ``ViT`` + ``SimpleFeaturePyramid`` (``facebookresearch/detectron2``,
``detectron2/modeling/backbone/vit.py`` and ``utils.py``, read through ``tests/public_code.py``; skipped without
it), and every spec term with the relative positions (runs everywhere).

Their backbone at a small shape (8x8 tokens from a 14x14 pretraining grid with a class token, windows of 4 in
blocks 0 and 2, block 1 global, ``use_rel_pos=True`` with random tables) gets random float64 weights, which are
mapped to attnlab's layout by name (``net.`` -> ``trunk.``, ``attn.rel_pos_h`` -> ``rel_pos_h``) and, for the
pyramid, by order within each stage; every pyramid level must be theirs. Stubs: ``detectron2.layers``' ``Conv2d``
(a ``Conv2d`` with a ``norm`` applied after it, as theirs) and the ``LN`` of ``get_norm`` (their channels-first
LayerNorm, eps 1e-6, written out here), ``ShapeSpec``, and the FPN helpers (the stride check, ``LastLevelMaxPool``:
a 1x1 max-pool of stride 2).
"""

from __future__ import annotations

import copy
from collections import namedtuple
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from attnlab.errors import AttnlabError
from attnlab.models import convert
from attnlab.models.vitdet import ViTDetBackbone, ViTDetTrunk
from tests.public_code import load_module, stub

REPO = "facebookresearch/detectron2"
D, HEADS, DEPTH, IMG, PRETRAIN, WINDOW, OUT = 48, 3, 3, 128, 224, 4, 32


class _Conv2d(nn.Conv2d):
    def __init__(self, *args, norm=None, activation=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm, self.activation = norm, activation

    def forward(self, x):
        x = super().forward(x)
        x = self.norm(x) if self.norm is not None else x
        return self.activation(x) if self.activation is not None else x


class _LayerNorm(nn.Module):  # detectron2.layers.LayerNorm: over channels of (B, C, H, W)
    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels)), eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        return self.weight[:, None, None] * ((x - u) / torch.sqrt(s + self.eps)) + self.bias[:, None, None]


class _Backbone(nn.Module):
    def output_shape(self):
        return {name: _ShapeSpec(channels=self._out_feature_channels[name], stride=self._out_feature_strides[name])
                for name in self._out_features}


class _LastLevelMaxPool(nn.Module):
    num_levels, in_feature = 1, "p5"

    def forward(self, x):
        return [F.max_pool2d(x, kernel_size=1, stride=2, padding=0)]


_ShapeSpec = namedtuple("ShapeSpec", "channels height width stride", defaults=(None,) * 4)


@pytest.fixture(scope="module")
def theirs():
    utils = load_module(REPO, "detectron2/modeling/backbone/utils.py", "detectron2.modeling.backbone.utils")
    layers = stub("detectron2.layers", CNNBlockBase=nn.Module, Conv2d=_Conv2d, ShapeSpec=_ShapeSpec,
                  get_norm=lambda norm, c: _LayerNorm(c) if norm == "LN" else None)
    return load_module(REPO, "detectron2/modeling/backbone/vit.py", "detectron2.modeling.backbone.vit", stubs={
        "fvcore.nn.weight_init": stub("fvcore.nn.weight_init"), "detectron2.layers": layers,
        "detectron2.modeling.backbone.fpn": stub("detectron2.modeling.backbone.fpn",
                                                 _assert_strides_are_log2_contiguous=lambda strides: None),
        "detectron2.modeling.backbone.backbone": stub("detectron2.modeling.backbone.backbone", Backbone=_Backbone),
        "detectron2.modeling.backbone.utils": utils})


def _their_model(vit, seed=0):
    net = vit.ViT(img_size=IMG, patch_size=16, embed_dim=D, depth=DEPTH, num_heads=HEADS, mlp_ratio=4.0,
                  qkv_bias=True, norm_layer=partial(nn.LayerNorm, eps=1e-6), use_rel_pos=True, window_size=WINDOW,
                  window_block_indexes=(0, 2), pretrain_img_size=PRETRAIN, pretrain_use_cls_token=True)
    model = vit.SimpleFeaturePyramid(net, "last_feat", OUT, (4.0, 2.0, 1.0, 0.5), top_block=_LastLevelMaxPool(),
                                     norm="LN").double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_weight = name.endswith("weight") and p.ndim == 1
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (0.1 if norm_weight else 0.3)
                    + (1.0 if norm_weight else 0.0))
    return model


def _ours(abs_pos="interpolate"):
    vit = VisionTransformer(img_size=PRETRAIN, patch_size=16, embed_dim=D, depth=DEPTH, num_heads=HEADS,
                            mlp_ratio=4.0, qkv_bias=True)
    trunk = ViTDetTrunk(vit, IMG, window_size=WINDOW, global_blocks=(1,), rel_pos=True, abs_pos=abs_pos)
    return ViTDetBackbone(trunk, OUT).double().eval()


def _mapped(model, ours) -> dict[str, torch.Tensor]:
    """Their state dict in attnlab's names: the trunk by name, each pyramid stage by order."""
    theirs = model.state_dict()
    out = {}
    for name, t in theirs.items():
        if name.startswith("net."):
            out["trunk." + name[4:].replace("attn.rel_pos_", "rel_pos_")] = t
    for i, stage in enumerate(("simfp_2", "simfp_3", "simfp_4", "simfp_5")):
        their_names = [n for n in theirs if n.startswith(stage + ".")]
        our_names = [n for n in ours.state_dict() if n.startswith(f"pyramid.stages.{i}.")]
        assert len(their_names) == len(our_names)
        out.update({o: theirs[t] for t, o in zip(their_names, our_names)})
    return out


def test_every_pyramid_level_is_detectron2s(theirs):
    model = _their_model(theirs)
    ours = _ours()
    ours.load_state_dict(_mapped(model, ours), strict=True)
    # 128 x 128 (8x8 tokens, two windows of 4 per side) and 96 x 160 (6x10: windows padded, positions
    # interpolated to another grid, the global block's relative positions resized)
    for size in ((128, 128), (96, 160)):
        x = torch.randn(2, 3, *size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want, got = model(x), ours(x)
        worst = max((got[o] - want[t]).abs().max().item() for t, o in zip(want, got))
        print(f"ViTDet vs detectron2 at {size}: worst |difference| over p2..p6 {worst:.1e}")
        assert list(want) == ["p2", "p3", "p4", "p5", "p6"] and list(got) == ["0", "1", "2", "3", "pool"]
        for t, o in zip(want, got):
            assert want[t].abs().max() > 0.1
            torch.testing.assert_close(got[o], want[t], rtol=1e-10, atol=1e-10)
    # without the relative positions the levels differ: the comparison can fail
    state = _mapped(model, ours)
    ours.load_state_dict({k: (torch.zeros_like(v) if "rel_pos" in k else v) for k, v in state.items()})
    with torch.no_grad():
        assert (ours(x)["0"] - model(x)["p2"]).abs().max() > 1e-3


def test_timm_resampling_differs_from_detectron2s_interpolation(theirs):
    """abs_pos="resample" (attnlab's default: once, antialiased bicubic) is not detectron2's plain bicubic."""
    model = _their_model(theirs)
    ours = _ours(abs_pos="resample")
    state = _mapped(model, ours)
    pos = state.pop("trunk.pos_embed")
    ours.load_state_dict({**state, "trunk.pos_embed": ours.trunk.pos_embed.detach()})
    ours.trunk.pos_embed.data.copy_(
        F.interpolate(pos[:, 1:].reshape(1, 14, 14, D).permute(0, 3, 1, 2), size=(8, 8), mode="bicubic",
                      antialias=True).permute(0, 2, 3, 1).reshape(1, 64, D))
    x = torch.randn(1, 3, IMG, IMG, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ours(x)["2"] - model(x)["p4"]).abs().max().item()
    print(f"ViTDet abs_pos=resample against detectron2: {diff:.1e}")
    assert diff > 1e-3


# ---- every term with the relative positions (no public code needed) -----------------------------------------------
TERMS = ["standard", "dna", "dna(variant=q)", "diff", "cog(all_layers=true)", "ns", "dna+ns", "qknorm", "qkclip",
         "sigma", "specnorm", "speccond"]


@pytest.mark.parametrize("term", TERMS + ["nystrom", "performer"])
def test_every_term_takes_the_relative_positions_or_refuses(term):
    """The bias reaches every kernel (the output moves with the tables) on its fused and explicit paths alike; the
    low-rank kernels, which take no additive bias, refuse in one sentence."""
    torch.manual_seed(0)
    backbone = _ours()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for block in backbone.trunk.blocks:
            for table in (block.rel_pos_h, block.rel_pos_w):
                table.copy_(torch.randn(table.shape, generator=g, dtype=table.dtype))
    convert(backbone.trunk, term)
    x = torch.randn(1, 3, 96, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if term in ("nystrom", "performer"):
        with pytest.raises(AttnlabError, match="rel_pos=False") as err:
            backbone(x)
        assert "\n" not in str(err.value)
        return
    with torch.no_grad():
        out = backbone(x)["2"]
        explicit = copy.deepcopy(backbone)
        for block in explicit.trunk.blocks:
            block.attn.use_backend("explicit")
        torch.testing.assert_close(explicit(x)["2"], out, rtol=1e-9, atol=1e-9)
        for block in backbone.trunk.blocks:
            block.rel_pos_h.mul_(0.5)
        assert torch.isfinite(out).all() and (backbone(x)["2"] - out).abs().max() > 1e-6
