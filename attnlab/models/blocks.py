"""Post-LN ViT block: the original Transformer's order, a recipe knob sigma-Reparam is claimed to make trainable.

    pre-LN (timm's Block):  x = x + attn(LN1(x));   x = x + mlp(LN2(x))
    post-LN (this block):   x = LN1(x + attn(x));   x = LN2(x + mlp(x))

Built on timm's Block, with the same submodules and parameter names, so every attention variant converts it and a
pre-LN checkpoint loads into it (the function differs, the names do not).
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import Block


class PostNormBlock(Block):
    """timm's ViT Block with the normalisation after each residual addition (post-LN)."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        x = self.norm1(x + self.drop_path1(self.ls1(self.attn(x, attn_mask=attn_mask, is_causal=is_causal))))
        return self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))
