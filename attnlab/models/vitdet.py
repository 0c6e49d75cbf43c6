"""ViTDet: a plain ViT as a detection backbone (Li, Mao, Girshick, He, "Exploring Plain Vision Transformer Backbones
for Object Detection", arXiv 2203.16527).

    image --patch_embed--> (B, H/p, W/p, C) + pos --blocks (windowed or global)--> stride-p map
          --SimpleFeaturePyramid--> {'0': 1/4, '1': 1/8, '2': 1/16, '3': 1/32, 'pool': 1/64}  (for p = 16)

The trunk keeps the timm ViT's submodules and state-dict names, each block's attention (timm's, or whatever
``attnlab.convert`` put there) called on windows of the token grid or on the whole grid, so every kernel term
converts it; the class token goes and the position embedding is resampled to the grid (once, timm's way) or
interpolated on every forward (detectron2's). With ``rel_pos`` each block adds ViTDet's decomposed relative
positions (``rel_pos_h``, ``rel_pos_w``, :func:`attnlab.ops.relpos.decomposed_rel_pos`) to its attention logits.
The pyramid is the paper's
(Section 3, Figure 2), its output names torchvision's FPN's; docs/methods.md (Detection backbones) describes both
and where they differ from the authors' detectron2 code.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.layers import LayerNorm2d, resample_abs_pos_embed
from timm.models.swin_transformer import window_partition, window_reverse
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn
from torchvision.ops import Conv2dNormActivation
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from ..attention.base import AttnlabAttention
from ..attention.standard import StandardAttention
from ..errors import ConfigError, UnsupportedModelError
from ..ops.relpos import decomposed_rel_pos, interpolate_abs_pos
from .blocks import PostNormBlock

_DECONVOLUTIONS = {4.0: 2, 2.0: 1, 1.0: 0, 0.5: 0}  # per pyramid scale factor (0.5: a max-pool instead)
_BLOCK_PARTS = ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")
ABS_POS = ("resample", "interpolate")


def rel_pos_attention(attn: nn.Module, x: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor,
                      hw: tuple[int, int]) -> torch.Tensor:
    """``attn`` on tokens x (B, h*w, C) of an (h, w) grid with ViTDet's relative positions in every logit: the bias
    q . R_h + q . R_w of the module's queries (DnA: the softmax branch's Q+, whose bias the softmin branch also takes,
    as it takes Swin's) is the forward's position bias (docs/methods.md, Detection backbones), so instruments and
    hooks see the call as every other."""
    why = attn.capabilities.bias
    if why:
        raise UnsupportedModelError(f"{why}; build the detector with rel_pos=False (--model-options "
                                    f"'{{rel_pos: false}}') to use it.")
    return attn(x, position_bias=lambda q: decomposed_rel_pos(q, rel_pos_h, rel_pos_w, hw, hw))


class WindowBlock(nn.Module):
    """A timm ViT ``Block`` (pre-LN) or attnlab ``PostNormBlock`` on a (B, H, W, C) token grid: attention within
    non-overlapping ``window_size`` x ``window_size`` windows (the grid zero-padded to a multiple after the norm, as
    ViTDet pads), or over the whole grid when ``window_size`` is 0. Takes over the block's submodules, so the
    parameter names stay timm's. ``rel_pos_size`` (the window, or the grid of a global block) adds ViTDet's
    relative positions ``rel_pos_h``, ``rel_pos_w`` of shape (2 size - 1, head_dim), zero at the start as
    detectron2's (so a pretrained ViT starts unchanged); timm's attention becomes attnlab's ``standard`` (the same
    outputs), whose queries the bias is formed from."""

    def __init__(self, block: nn.Module, window_size: int = 0, rel_pos_size: int | None = None) -> None:
        super().__init__()
        if type(block) not in (Block, PostNormBlock):
            raise UnsupportedModelError(
                f"ViTDet takes ViT blocks of timm's Block (pre-LN) or attnlab's PostNormBlock, not "
                f"{type(block).__name__}; build the backbone from a plain timm ViT/DeiT.")
        for name in _BLOCK_PARTS:
            setattr(self, name, getattr(block, name))
        self.post_norm = type(block) is PostNormBlock
        self.window_size = int(window_size)
        self.rel_pos_h = self.rel_pos_w = None
        if rel_pos_size:
            if not isinstance(self.attn, AttnlabAttention):
                self.attn = StandardAttention.from_module(self.attn)
            ref = self.attn.qkv.weight
            shape = (2 * int(rel_pos_size) - 1, self.attn.head_dim)
            self.rel_pos_h = nn.Parameter(torch.zeros(shape, device=ref.device, dtype=ref.dtype))
            self.rel_pos_w = nn.Parameter(torch.zeros(shape, device=ref.device, dtype=ref.dtype))

    def _attend(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        if self.rel_pos_h is None:
            return self.attn(x)
        return rel_pos_attention(self.attn, x, self.rel_pos_h, self.rel_pos_w, hw)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """The block's attention on (B, H, W, C): per window, or global."""
        B, H, W, C = x.shape
        w = self.window_size
        if not w:
            return self._attend(x.reshape(B, H * W, C), (H, W)).view(B, H, W, C)
        pad_h, pad_w = (w - H % w) % w, (w - W % w) % w
        if pad_h or pad_w:
            x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
        Hp, Wp = H + pad_h, W + pad_w
        windows = window_partition(x, (w, w)).view(-1, w * w, C)
        x = window_reverse(self._attend(windows, (w, w)).view(-1, w, w, C), (w, w), Hp, Wp)
        return x[:, :H, :W].contiguous() if pad_h or pad_w else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_norm:
            x = self.norm1(x + self.drop_path1(self.ls1(self.attention(x))))
            return self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))
        x = x + self.drop_path1(self.ls1(self.attention(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def extra_repr(self) -> str:
        return (f"window_size={self.window_size}" + (", post_norm=True" if self.post_norm else "")
                + (", rel_pos=True" if self.rel_pos_h is not None else ""))


class ViTDetTrunk(nn.Module):
    """A timm ``VisionTransformer``'s patch embedding, position embedding and blocks as a stride-p feature map.

    Args:
        vit: the timm ViT/DeiT (pretrained or converted or not); its blocks are taken over, its class token, final
            norm and head are dropped.
        img_size: the detection input (square side) the position embedding is resampled to once.
        window_size: window side in tokens for the window blocks; 0 makes every block global.
        global_blocks: indices of the blocks that stay global when ``window_size`` > 0 (ViTDet-B: 2, 5, 8, 11).
        rel_pos: ViTDet's decomposed relative positions in every block (:class:`WindowBlock`).
        abs_pos: ``resample`` (the position embedding resampled to the detection grid once, by timm's antialiased
            bicubic ``resample_abs_pos_embed``; stored at that grid) or ``interpolate`` (detectron2's ``get_abs_pos``:
            stored as pretrained, class token's entry included, and resized by plain bicubic interpolation on every
            forward to the input's grid).
    """

    def __init__(self, vit: nn.Module, img_size: int, window_size: int = 0,
                 global_blocks: Sequence[int] = (), rel_pos: bool = False, abs_pos: str = "resample") -> None:
        super().__init__()
        if not isinstance(vit, VisionTransformer):
            raise UnsupportedModelError(f"ViTDet takes a timm VisionTransformer (ViT, DeiT), not "
                                        f"{type(vit).__name__}.")
        depth = len(vit.blocks)
        bad = [i for i in global_blocks if not 0 <= int(i) < depth]
        if bad:
            raise UnsupportedModelError(f"global block {bad[0]} is outside the backbone's {depth} blocks; give "
                                        f"indices 0 to {depth - 1}.")
        self.patch_embed = vit.patch_embed
        self.patch_size = int(vit.patch_embed.patch_size[0])
        if img_size % self.patch_size:
            raise UnsupportedModelError(f"img_size {img_size} is not a multiple of the patch size "
                                        f"{self.patch_size}; give a multiple.")
        self.grid = (img_size // self.patch_size,) * 2
        self.embed_dim = vit.embed_dim
        if abs_pos not in ABS_POS:
            raise ConfigError(f"abs_pos={abs_pos!r} is not valid; use one of: {', '.join(ABS_POS)}.")
        self.abs_pos_mode = abs_pos
        self.pos_prefix = 0 if getattr(vit, "no_embed_class", False) else vit.num_prefix_tokens
        if vit.pos_embed is None:
            self.pos_embed = None
        elif abs_pos == "interpolate":
            self.pos_embed = nn.Parameter(vit.pos_embed.detach().clone())
        else:
            prefix = 0 if getattr(vit, "no_embed_class", False) else vit.num_prefix_tokens
            old = tuple(vit.patch_embed.grid_size)
            grid = resample_abs_pos_embed(vit.pos_embed.detach(), list(self.grid), list(old), num_prefix_tokens=prefix)
            self.pos_embed = nn.Parameter(grid[:, prefix:].clone())
        self.patch_drop = vit.patch_drop
        self.norm_pre = vit.norm_pre
        global_blocks = {int(i) for i in global_blocks}
        sizes = [self.grid[0] if i in global_blocks or not window_size else window_size for i in range(depth)]
        self.blocks = nn.Sequential(*(WindowBlock(b, 0 if i in global_blocks else window_size,
                                                  sizes[i] if rel_pos else None)
                                      for i, b in enumerate(vit.blocks)))

    def abs_pos(self, h: int, w: int) -> torch.Tensor:
        """The position embedding on an (h, w) grid, (1, h, w, C); resampled when the grid is not the stored one."""
        pos = self.pos_embed
        if self.abs_pos_mode == "interpolate":
            return interpolate_abs_pos(pos, self.pos_prefix, (h, w))
        if (h, w) != self.grid:
            pos = resample_abs_pos_embed(pos, [h, w], list(self.grid), num_prefix_tokens=0)
        return pos.view(1, h, w, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) images, H and W multiples of the patch size -> (B, C, H/p, W/p)."""
        x = self.patch_embed.proj(x).permute(0, 2, 3, 1)  # timm's PatchEmbed, kept as a grid
        x = self.patch_embed.norm(x)
        if self.pos_embed is not None:
            x = x + self.abs_pos(x.shape[1], x.shape[2])
        x = self.norm_pre(self.patch_drop(x))
        return self.blocks(x).permute(0, 3, 1, 2)


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's simple feature pyramid: one map of ``in_channels`` (the ViT width) at stride s -> maps of
    ``out_channels`` (the paper: 256) at s/f for each scale factor f (the paper: 4, 2, 1, 0.5), then p6;
    ``norm_layer`` is the paper's "LN" over channels."""

    def __init__(self, in_channels: int, out_channels: int = 256,
                 scale_factors: Sequence[float] = (4.0, 2.0, 1.0, 0.5), norm_layer=LayerNorm2d) -> None:
        super().__init__()
        self.scale_factors = tuple(float(f) for f in scale_factors)
        self.out_channels = out_channels
        stages = []
        for scale in self.scale_factors:
            if scale not in _DECONVOLUTIONS:
                raise UnsupportedModelError(f"scale factor {scale} is not one of ViTDet's 4, 2, 1, 0.5.")
            dim, layers = in_channels, [nn.MaxPool2d(2, stride=2)] if scale == 0.5 else []
            for _ in range(_DECONVOLUTIONS[scale]):  # stride-2 deconvolutions, a LayerNorm and GELU between two
                if layers:
                    layers += [norm_layer(dim), nn.GELU()]
                layers.append(nn.ConvTranspose2d(dim, dim // 2, 2, stride=2))
                dim //= 2
            layers += [Conv2dNormActivation(dim, out_channels, 1, norm_layer=norm_layer, activation_layer=None,
                                            bias=False),
                       Conv2dNormActivation(out_channels, out_channels, 3, norm_layer=norm_layer,
                                            activation_layer=None, bias=False)]
            stages.append(nn.Sequential(*layers))
        self.stages = nn.ModuleList(stages)
        self.top_block = LastLevelMaxPool()

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        names = [str(i) for i in range(len(self.stages))]
        feats = [stage(x) for stage in self.stages]
        feats, names = self.top_block(feats, feats, names)
        return OrderedDict(zip(names, feats))


class ViTDetBackbone(nn.Module):
    """``trunk`` (:class:`ViTDetTrunk`) then ``pyramid`` (:class:`SimpleFeaturePyramid`): the ``backbone`` of a
    torchvision ``MaskRCNN`` / ``FasterRCNN`` (it has ``out_channels`` and returns an ordered dict of maps)."""

    def __init__(self, trunk: ViTDetTrunk, out_channels: int = 256,
                 scale_factors: Sequence[float] = (4.0, 2.0, 1.0, 0.5)) -> None:
        super().__init__()
        self.trunk = trunk
        self.pyramid = SimpleFeaturePyramid(trunk.embed_dim, out_channels, scale_factors)
        self.out_channels = out_channels
        self.strides = tuple(trunk.patch_size / f for f in self.pyramid.scale_factors)

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        return self.pyramid(self.trunk(x))


__all__ = ["SimpleFeaturePyramid", "ViTDetBackbone", "ViTDetTrunk", "WindowBlock"]
