"""Cog attention (Lv et al., 2024, "More Expressive Attention with Negative Weights"): signed attention weights.

    s = q_h k_h^T / sqrt(D) + b                 (b: Swin relative-position bias, or a finite ViT float mask)
    w = sign(s) * softmax(|s| over unmasked keys),   w = 0 exactly at masked keys
    o_h = w v_h

Masked keys (those the call's :class:`~attnlab.attention.mask.AttentionMask` excludes) are removed from the softmax
(its input set to -inf) rather than added to s: adding -100 to s would make |s| large and give the masked key the
largest weight, with a negative sign. No parameters beyond the standard module's, so a standard state dict loads
strictly. As in the authors' models, the first and last attention layers (by ``layer_index`` / ``num_layers``) stay
plain softmax unless ``all_layers=True``; those layers run the standard (fused or explicit) path. Cog layers always
run the explicit path (no fused kernel computes signed weights). Details: docs/methods.md, "cog".
"""

from __future__ import annotations

import torch

from .capabilities import Capabilities
from .mask import AttentionMask
from .standard import StandardAttention


class CogAttention(StandardAttention):
    """Cog attention; arguments as :class:`AttnlabAttention` plus:

    Args:
        all_layers: use signed weights in every layer, including the first and last (default: those stay softmax).
    """

    #: signed layers compute the explicit path on either backend; the first and last run the standard one
    capabilities = Capabilities(kv_cache=True, explicit_maps=True, backends=("sdpa", "explicit"))

    def __init__(self, dim: int, num_heads: int = 8, *, all_layers: bool = False, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        self.all_layers = all_layers
        self.signed = all_layers or 0 < self.layer_index < self.num_layers - 1

    def weights(self, q, k, mask: AttentionMask | None = None) -> torch.Tensor:
        """Attention weights (B, H, N, N): sign(s) * softmax(|s|) with masked keys at exactly zero."""
        if not self.signed:
            return super().weights(q, k, mask)
        s = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.logit_bias(mask, s.dtype)
        if bias is not None:
            s = s + bias
        magnitude = s.abs()
        if mask is not None:
            B, _, N, M = s.shape
            keep = mask.keep(B, N, M, s.device)
            if keep is not None:
                magnitude = magnitude.masked_fill(~keep, float("-inf"))
        return torch.sign(s) * magnitude.softmax(dim=-1)

    def attend(self, q, k, v, mask: AttentionMask | None = None) -> torch.Tensor:
        if not self.signed:
            return super().attend(q, k, v, mask)
        return self.attn_drop(self.weights(q, k, mask)) @ v

    def explicit_maps(self, x: torch.Tensor, mask: AttentionMask | None = None):
        """(output, {"attn": sign(s) softmax(|s|)}) on the explicit path."""
        return super().explicit_maps(x, mask)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, signed={self.signed}"


__all__ = ["CogAttention"]
