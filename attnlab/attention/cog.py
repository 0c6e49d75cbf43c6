"""Cog attention (Lv et al., 2024, "More Expressive Attention with Negative Weights", arXiv:2411.07176): signed
attention weights.

    s = q_h k_h^T / sqrt(D) + b                 (b: the position bias, or a finite ViT float mask)
    w = sign(s) * softmax(|s| over unmasked keys),   w = 0 exactly at masked keys
    o_h = w v_h

A masked key is removed from the softmax, not added to s (adding -100 would give it the largest |s|). As in the
authors' models the first and last attention layers stay plain softmax unless ``all_layers=True``; docs/methods.md,
"cog".
"""

from __future__ import annotations

import torch

from .base import Branch, Intermediates
from .capabilities import Capabilities
from .standard import StandardAttention


class CogAttention(StandardAttention):
    """Cog attention; arguments as :class:`AttnlabAttention` plus:

    Args:
        all_layers: use signed weights in every layer, including the first and last (default: those stay softmax).
    """

    capabilities = Capabilities(kv_cache=True, intermediates=("weights",), backends=("sdpa", "explicit"))

    def __init__(self, dim: int, num_heads: int = 8, *, all_layers: bool = False, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        self.all_layers = all_layers
        self.signed = all_layers or 0 < self.layer_index < self.num_layers - 1

    def kernel(self, q, k, v, mask, want, backend):
        if not self.signed:
            return super().kernel(q, k, v, mask, want, backend)
        s = (q * self.scale) @ k.transpose(-2, -1)
        bias, keep = (None, None) if mask is None else (mask.logit_bias(s.dtype), mask.keep())
        s = s if bias is None else s + bias
        magnitude = s.abs() if keep is None else s.abs().masked_fill(~keep, float("-inf"))
        w = torch.sign(s) * magnitude.softmax(dim=-1)
        return self.attn_drop(w) @ v, Intermediates(weights={"attn": Branch(w, w)} if want.weights else None)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, signed={self.signed}"


__all__ = ["CogAttention"]
