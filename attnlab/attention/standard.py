"""Standard multi-head softmax attention (Vaswani et al., 2017), as timm computes it.

    o_h = softmax(q_h k_h^T / sqrt(D) + bias) v_h

``bias`` is Swin's relative-position bias plus the shifted-window mask (0 / -100), or a ViT ``attn_mask``. The fused
path calls ``F.scaled_dot_product_attention`` through :func:`attnlab.ops.sdpa.sdpa` (explicit products for short
sequences in CPU training, where they measure faster); the explicit path is the readable definition and matches
timm's own explicit path operation for operation, so converting a timm model to ``standard`` changes no output bit.
"""

from __future__ import annotations

import torch

from ..ops.sdpa import sdpa
from .base import AttnlabAttention


class StandardAttention(AttnlabAttention):
    """Softmax attention; the reference every other mechanism is compared against. Arguments as AttnlabAttention."""

    plain_softmax = True
    map_kind = "softmax"
    kv_cache = True  # generation may cache keys/values: a new query against them is its causal output

    def attend(self, q, k, v, mask=None, attn_mask=None) -> torch.Tensor:
        if self.fused_attn:
            return sdpa(
                q, k, v,
                attn_mask=self.attn_bias(q.shape[0], q.shape[2], mask, attn_mask),
                dropout_p=self.attn_drop.p if self.training else 0.0,
            )
        logits = self.add_bias((q * self.scale) @ k.transpose(-2, -1), mask, attn_mask)
        return self.attn_drop(logits.softmax(dim=-1)) @ v
