"""VisCoP's vision side (Reilly et al., arXiv:2510.13808): a vision encoder and its visual probes, clips in, the LLM's
visual tokens and probe tokens out.

    clips (B, T, C, H, W), num_frames (B,)  --the real frames, one sequence per frame-->  encoder blocks
        visual tokens: the encoder's output merged m x m per frame, frames in order     (B, T * n, dim)
        probes:        VisualProbes over each probe layer's hidden states of all frames  (B, P, dim)

The encoder is :class:`~attnlab.models.siglip_navit.SigLIPNaViT` (VideoLLaMA3's and VisCoP's) or any timm
``VisionTransformer`` (:class:`TimmFrames`: every block's output, prefix tokens included, is what the probes read;
the final norm's patch tokens, merged in raster order, are the visual tokens). Both give ``encode(frames,
merge_size) -> (hidden states per block, visual tokens)`` and their blocks' attentions, so a spec converts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..errors import ConfigError
from ..spec import Spec
from .probes import VisualProbes


class TimmFrames(nn.Module):
    """A timm ``VisionTransformer`` run on frames: ``encode`` returns each block's output (F, N, dim) and the final
    norm's patch tokens merged m x m (bilinear, raster order, as SigLIP-NaViT's merge)."""

    def __init__(self, vit: VisionTransformer) -> None:
        super().__init__()
        self.vit = vit
        self.embed_dim = vit.embed_dim

    @property
    def blocks(self) -> nn.ModuleList:
        return self.vit.blocks

    @property
    def patch_size(self) -> int:
        return self.vit.patch_embed.patch_size[0]

    def encode(self, frames: torch.Tensor, merge_size: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
        vit, (H, W) = self.vit, frames.shape[-2:]
        h, w = (s // p for s, p in zip((H, W), vit.patch_embed.patch_size))
        if h % merge_size or w % merge_size:
            raise ConfigError(f"a {h}x{w} patch grid does not split into {merge_size}x{merge_size} blocks; give frames "
                              f"whose patch grid is a multiple of the merge size.")
        x = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(frames))))
        hidden = []
        for block in vit.blocks:
            x = block(x)
            hidden.append(x)
        tokens = vit.norm(x)[:, vit.num_prefix_tokens:]
        if merge_size > 1:
            grid = tokens.transpose(1, 2).reshape(tokens.shape[0], -1, h, w)
            tokens = F.interpolate(grid, size=(h // merge_size, w // merge_size), mode="bilinear").flatten(2)
            tokens = tokens.transpose(1, 2)
        return hidden, tokens


class VisCoPEncoder(nn.Module):
    """A vision encoder with visual probes (module docstring).

    Args:
        encoder: a :class:`SigLIPNaViT`, or a timm ``VisionTransformer`` (wrapped in :class:`TimmFrames`).
        num_probes, layers, attn: as :class:`~attnlab.models.probes.VisualProbes` (heads: the encoder's).
        warm_start: ``block`` (default), ``position`` (the authors' rule) or ``none``
            (:meth:`VisualProbes.warm_start`).
        freeze_encoder: the encoder's weights take no gradient and it stays in eval mode (VisCoP trains the probes,
            the projectors and the LLM).
    """

    def __init__(self, encoder: nn.Module, num_probes: int = 16, layers: str | Sequence[int] = "all",
                 attn: str | Spec = "standard", warm_start: str = "block", freeze_encoder: bool = True) -> None:
        super().__init__()
        if isinstance(encoder, VisionTransformer):
            encoder = TimmFrames(encoder)
        if not hasattr(encoder, "encode"):
            raise ConfigError(f"VisCoP's encoder is SigLIP-NaViT or a timm VisionTransformer, not "
                              f"{type(encoder).__name__}.")
        self.encoder = encoder
        attns = [block.attn for block in encoder.blocks]
        weight = next(encoder.parameters())
        self.probes = VisualProbes(encoder.embed_dim, attns[0].num_heads, len(attns), num_probes, layers, attn).to(
            device=weight.device, dtype=weight.dtype)
        self.probes.warm_start(attns, warm_start)
        self.freeze_encoder = freeze_encoder
        if freeze_encoder:
            encoder.requires_grad_(False)
            encoder.eval()

    def train(self, mode: bool = True) -> "VisCoPEncoder":
        """A frozen encoder stays in eval mode (no dropout or drop-path: it computes the features it was trained
        to); the probes follow ``mode``."""
        super().train(mode)
        if self.freeze_encoder:
            self.encoder.eval()
        return self

    @property
    def embed_dim(self) -> int:
        return self.encoder.embed_dim

    def forward(self, clips: torch.Tensor, num_frames: torch.Tensor | None = None, merge_size: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """clips (B, T, C, H, W) (an image: T = 1), ``num_frames`` (B,) the real frames of each clip (default all;
        the rest is padding). Returns (visual tokens (B, T * n, dim), their validity (B, T * n) bool, probes
        (B, P, dim))."""
        B, T = clips.shape[:2]
        if num_frames is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=clips.device)
        else:
            num_frames = torch.as_tensor(num_frames, device=clips.device)
            if num_frames.shape != (B,) or bool((num_frames < 1).any() | (num_frames > T).any()):
                raise ConfigError(f"num_frames must give each of the {B} clips between 1 and {T} frames; got "
                                  f"{num_frames.tolist()}.")
            valid = torch.arange(T, device=clips.device) < num_frames[:, None]
        hidden, tokens = self.encoder.encode(clips[valid], merge_size)

        def per_clip(x: torch.Tensor) -> torch.Tensor:  # (F, N, dim) of the real frames -> (B, T * N, dim)
            out = x.new_zeros(B, T, *x.shape[1:])
            out[valid] = x
            return out.flatten(1, 2)

        used = set(self.probes.layers)
        keys = [per_clip(h) if i in used else None for i, h in enumerate(hidden)]
        key_padding = valid.repeat_interleave(hidden[0].shape[1], dim=1)
        probes = self.probes(keys, key_padding)
        return per_clip(tokens), valid.repeat_interleave(tokens.shape[1], dim=1), probes


__all__ = ["TimmFrames", "VisCoPEncoder"]
