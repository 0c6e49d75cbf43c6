"""Standard multi-head softmax attention (Vaswani et al., 2017), as timm computes it.

    o_h = softmax(q_h k_h^T / sqrt(D) + bias) v_h

``bias`` is Swin's relative-position bias plus the call's mask (:class:`~attnlab.attention.mask.AttentionMask`:
the shifted-window mask 0 / -100, a ViT ``attn_mask``, causal order, key padding; excluded keys at -inf). The fused
path calls ``F.scaled_dot_product_attention`` through :func:`attnlab.ops.sdpa.sdpa` (explicit products for short
sequences in CPU training, where they measure faster), with SDPA's ``is_causal`` when causality is all the mask
asks; the explicit path is the readable definition and matches timm's own explicit path operation for operation, so
converting a timm model to ``standard`` changes no output bit.
"""

from __future__ import annotations

import torch

from ..ops.sdpa import sdpa
from .base import AttnlabAttention, Branch
from .capabilities import Capabilities
from .mask import AttentionMask


class StandardAttention(AttnlabAttention):
    """Softmax attention; the reference every other mechanism is compared against. Arguments as AttnlabAttention."""

    capabilities = Capabilities(kv_cache=True, plain_softmax=True, explicit_maps=True, backends=("sdpa", "explicit"))

    def attend(self, q, k, v, mask: AttentionMask | None = None) -> torch.Tensor:
        if self.fused_attn:
            causal = self.sdpa_causal(mask)
            return sdpa(q, k, v, attn_mask=None if causal else self.attn_bias(mask, q),
                        dropout_p=self.attn_drop.p if self.training else 0.0, is_causal=causal)
        return self.attn_drop(self.weights(q, k, mask)) @ v

    def weights(self, q, k, mask: AttentionMask | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(D) + bias), (B, H, N, M)."""
        return self.add_bias((q * self.scale) @ k.transpose(-2, -1), mask).softmax(dim=-1)

    def explicit_maps(self, x: torch.Tensor, mask: AttentionMask | None = None):
        """(output, {"attn": softmax map}) on the explicit path, for the map instruments."""
        q, k, v = self.project(x)
        w = self.weights(q, k, mask)
        return self.finish(w @ v, mask, x), {"attn": Branch(w, w)}
