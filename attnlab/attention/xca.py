"""XCiT's cross-covariance attention (XCA; El-Nouby et al., "XCiT: Cross-Covariance Image Transformers",
arXiv:2106.09681, Sec. 3.2, eq. 2), as timm's ``timm.models.xcit.XCA`` computes it.

For head h with q_h, k_h, v_h (N x D), each feature column of q and k is L2-normalised along the tokens:

    q^_h = q_h / ||q_h||_col,   k^_h = k_h / ||k_h||_col,   A_h = softmax(tau_h q^_h^T k^_h)   (D x D)
    o_h = v_h A_h^T   (N x D; timm: A_h v_h^T in the transposed layout)

tau_h is a learned temperature per head (``temperature``, (H, 1, 1), no weight decay in timm). The map is over
features, so its cost is linear in N and its logits are bounded by |tau_h|; docs/methods.md, "XCiT and DaViT".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Intermediates
from .channel import ChannelMapAttention, channel_capabilities


class XCAttention(ChannelMapAttention):
    """Cross-covariance attention; the fused path (SDPA with scale 1) and the explicit one match timm's bit for bit.

    Args: as :class:`AttnlabAttention`; ``temperature`` starts at 1 per head (timm's init) and is taken over on
    conversion.
    """

    family = "XCiT's cross-covariance attention"
    capabilities = channel_capabilities(family, ("sdpa", "explicit"))

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.temperature = nn.Parameter(torch.ones(self.num_heads, 1, 1))

    def no_weight_decay(self) -> set[str]:
        return {"temperature"}  # as timm's XCA: decaying a per-head temperature would flatten every map

    def adopt(self, module: nn.Module) -> None:
        super().adopt(module)
        self.temperature = module.temperature

    def kernel(self, q, k, v, mask, want, backend):
        # timm works on (B, H, D, N); the transposes are views, so the ops below are timm's own
        q, k, v = q.transpose(-2, -1), k.transpose(-2, -1), v.transpose(-2, -1)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        if backend == "sdpa":
            return F.scaled_dot_product_attention(q * self.temperature, k, v, scale=1.0).transpose(-2, -1), \
                Intermediates()
        attn = ((q @ k.transpose(-2, -1)) * self.temperature).softmax(dim=-1)
        return (self.attn_drop(attn) @ v).transpose(-2, -1), Intermediates()


__all__ = ["XCAttention"]
