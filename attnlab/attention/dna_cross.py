"""DnA cross-attention ("DnA: Denoising Attention for Visual Tasks", Sec. 3.3): the visual-probe adapter, queries
from one sequence and keys / values from another (the formula: :class:`DnACrossAttention`). It is
:class:`~attnlab.attention.dna.DnAAttention` with the cross-attention projection
(:class:`~attnlab.attention.cross.CrossAttention`): variants, options, masks, backends and the forward are DnA's.
"""

from __future__ import annotations

import torch
from torch import nn

from .capabilities import Capabilities
from .cross import CrossAttention, cross_causal
from .dna import DnAAttention


class DnACrossAttention(CrossAttention, DnAAttention):
    """DnA cross-attention (Sec. 3.3, the visual-probe adapter): queries from ``x``, keys and values from ``context``,

        P' = softmax(P W_{Q+} (X W_K)^T / sqrt(d)) X W_{V+} + alpha * softmin(P W_{Q-} (X W_K)^T / sqrt(d)) X W_{V-}

    then the output projection; ``q`` (rows Q+, Q- or Q) projects ``x``, ``kv`` (rows K, V+, V- or K, V) ``context``.

    Args:
        dim: query token width (and output width).
        num_heads: heads H.
        kv_dim: context token width (default ``dim``).
        head_dim: features per head D (default ``dim // num_heads``).
        qkv_bias, proj_bias, attn_drop, proj_drop, backend: as :class:`AttnlabAttention`.
        variant, alpha_init, scale, init, neg_init: as :class:`DnAAttention`.
    """

    capabilities = Capabilities(causal=cross_causal("DnA cross-attention"), intermediates=("weights", "branches"),
                                backends=("kernel", "triton", "sdpa", "explicit"))

    def __init__(self, dim: int, num_heads: int = 8, kv_dim: int | None = None, *, head_dim: int | None = None,
                 qkv_bias: bool = False, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 backend: str = "auto", variant: str = "qv", alpha_init: float = 0.5, scale: str = "both",
                 init: str = "random", neg_init: float = 1e-4) -> None:
        super().__init__(dim, num_heads, head_dim=head_dim, proj_bias=proj_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, backend=backend, variant=variant, alpha_init=alpha_init, scale=scale,
                         init=init, neg_init=neg_init)
        self.cross_projections(kv_dim, qkv_bias)
        if init == "copy":
            with torch.no_grad():
                self._init_negative(self.rows())

    @torch.no_grad()
    def copy_from(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, proj: nn.Linear | None = None) -> "DnACrossAttention":
        """:meth:`CrossAttention.copy_from <attnlab.attention.cross.CrossAttention.copy_from>` (Q+, K, V+ and the
        output projection), the negative branch filled according to ``init`` (``copy``: the paper's scaled-down
        copies). Returns self."""
        super().copy_from(q, k, v, proj)
        self._init_negative(self.rows())
        return self


__all__ = ["DnACrossAttention"]
