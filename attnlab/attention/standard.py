"""Standard multi-head softmax attention (Vaswani et al., 2017, "Attention Is All You Need", arXiv:1706.03762), as
timm computes it.

    o_h = softmax(q_h k_h^T / sqrt(D) + bias) v_h

``bias`` is the call's position bias (Swin's table, ViTDet's relative positions) plus its mask (the shifted-window
mask 0 / -100, a ViT ``attn_mask``, causal order, key padding; excluded keys at -inf). The ``sdpa`` backend calls
``F.scaled_dot_product_attention`` (its ``is_causal`` when causality is all the mask asks); ``explicit`` is the
readable definition and matches timm's own explicit path operation for operation, so converting a timm model to
``standard`` changes no output bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttnlabAttention, Branch, Intermediates
from .capabilities import Capabilities


class StandardAttention(AttnlabAttention):
    """Softmax attention; the reference every other mechanism is compared against. Arguments as AttnlabAttention."""

    capabilities = Capabilities(kv_cache=True, plain_softmax=True, intermediates=("weights", "head"),
                                grouped=("sdpa",), backends=("sdpa", "explicit"))

    def kernel(self, q, k, v, mask, want, backend):
        if backend == "sdpa":
            attn_mask, causal = (None, False) if mask is None else mask.sdpa(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, dropout_p=(
                self.attn_drop.p if self.training else 0.0), enable_gqa=k.shape[1] != q.shape[1]), Intermediates()
        w = self.softmax((q * self.scale) @ k.transpose(-2, -1), mask)
        return self.attn_drop(w) @ v, Intermediates(weights={"attn": Branch(w, w)} if want.weights else None)
