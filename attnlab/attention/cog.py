"""Cog attention (Lv et al., 2024, "More Expressive Attention with Negative Weights"): signed attention weights.

    s = q_h k_h^T / sqrt(D) + b                 (b: Swin relative-position bias, or a finite ViT float mask)
    w = sign(s) * softmax(|s| over unmasked keys),   w = 0 exactly at masked keys
    o_h = w v_h

Masked keys are Swin's shifted-window mask (any nonzero entry, timm uses -100), ``False`` in a boolean ViT
``attn_mask``, or ``-inf`` in a float one. They are removed from the softmax (its input set to -inf) rather than
added to s: adding -100 to s would make |s| large and give the masked key the largest weight, with a negative sign.
The weights sum to 1 in absolute value over the unmasked keys. No parameters beyond the standard module's, so a
standard state dict loads strictly. As in the authors' models, the first and last attention layers (by
``layer_index`` / ``num_layers``) stay plain softmax unless ``all_layers=True``; those layers run the standard
(fused or explicit) path. Cog layers always run the explicit path (no fused kernel computes signed weights).
"""

from __future__ import annotations

import torch

from .standard import StandardAttention


class CogAttention(StandardAttention):
    """Cog attention; arguments as :class:`AttnlabAttention` plus:

    Args:
        all_layers: use signed weights in every layer, including the first and last (default: those stay softmax).
    """

    map_kind = "cog"
    kv_cache = True  # generation may cache keys/values: a new query against them is its causal output

    def __init__(self, dim: int, num_heads: int = 8, *, all_layers: bool = False, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        self.all_layers = all_layers
        self.signed = all_layers or 0 < self.layer_index < self.num_layers - 1

    def weights(self, q, k, mask=None, attn_mask=None) -> torch.Tensor:
        """Attention weights (B, H, N, N): sign(s) * softmax(|s|) with masked keys at exactly zero."""
        s = (q * self.scale) @ k.transpose(-2, -1)
        B, H, N, M = s.shape
        masked = None
        if self.window_size is not None:
            s = s + self.rel_pos_bias()
            if mask is not None:  # (num_windows, N, N); windows are the fastest-varying part of B
                num_win = mask.shape[0]
                win = (mask != 0).view(1, num_win, 1, N, M)
                masked = win.expand(B // num_win, -1, H, -1, -1).reshape(B, H, N, M)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                extra = ~attn_mask
            else:
                extra = torch.isneginf(attn_mask)
                s = s + attn_mask.masked_fill(extra, 0.0)
            extra = extra.expand(B, H, N, M)
            masked = extra if masked is None else masked | extra
        magnitude = s.abs()
        if masked is not None:
            magnitude = magnitude.masked_fill(masked, float("-inf"))
        return torch.sign(s) * magnitude.softmax(dim=-1)

    def attend(self, q, k, v, mask=None, attn_mask=None) -> torch.Tensor:
        if not self.signed:
            return super().attend(q, k, v, mask=mask, attn_mask=attn_mask)
        return self.attn_drop(self.weights(q, k, mask, attn_mask)) @ v

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, signed={self.signed}"


__all__ = ["CogAttention"]
