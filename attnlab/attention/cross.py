"""Cross-attention: queries from a sequence x, keys and values from another, the context (Vaswani et al., 2017,
"Attention Is All You Need", arXiv:1706.03762, Sec. 3.2.3; the visual probes of DnA's Sec. 3.3).

    o_h = softmax((x W_q,h) (c W_k,h)^T / sqrt(D) + mask) (c W_v,h),     out = [o_1 ... o_H] W_o

A mechanism's cross-attention is its self-attention with the projection overridden (:class:`CrossAttention`):
``forward(x, context, attn_mask)`` is ``run(x, attn_mask, context=context)``, masks, dispatcher and intermediates
as the contract's. ``attn_mask`` is over the context's M tokens; a sample whose context is all padding outputs zeros
before the output projection; no order relates two sequences, so a causal mask is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import block_rows, copy_rows
from .capabilities import Capabilities
from .standard import StandardAttention


def cross_causal(name: str) -> str:
    return f"{name} takes no causal mask: its queries and keys are different sequences, so no order relates them"


class CrossAttention:
    """The cross-attention projection of a mechanism (``class X(CrossAttention, Mechanism)``): ``q`` (dim -> the
    query blocks) on x, ``kv`` (kv_dim -> the key block, then the value blocks) on the context."""

    takes_context = True

    def cross_projections(self, kv_dim: int | None, bias: bool) -> None:
        del self.qkv  # the self-attention projection
        self.context_dim = kv_dim or self.dim
        self.query_blocks = sum(name.startswith("q") for name in self.qkv_blocks)
        self.q = nn.Linear(self.dim, self.query_blocks * self.attn_dim, bias=bias)
        self.kv = nn.Linear(self.context_dim, (len(self.qkv_blocks) - self.query_blocks) * self.attn_dim, bias=bias)

    def rows(self) -> dict:
        """(weight, bias) views of each named block (:func:`~attnlab.attention.base.block_rows`): the query blocks of
        ``q``, the key and value blocks of ``kv``."""
        n, widths = self.query_blocks, self.qkv_widths()
        return {**block_rows(self.q, self.qkv_blocks[:n], widths[:n]),
                **block_rows(self.kv, self.qkv_blocks[n:], widths[n:])}

    def row_stride(self) -> int:
        return self.q.out_features

    def project(self, x: torch.Tensor, context: torch.Tensor) -> tuple:
        """q (B, H * query blocks, N, D) from x; k (B, H, M, D) and v (B, H * value blocks, M, D) from context."""
        q, kv = (f(t).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for f, t in ((self.q, x), (self.kv, context)))
        return q, *kv.split([self.num_heads, kv.shape[1] - self.num_heads], dim=1)

    def forward(self, x: torch.Tensor, context: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """x: (B, N, dim), context: (B, M, kv_dim) -> (B, N, dim); ``attn_mask`` broadcastable to (B, H, N, M), bool
        (True = attend) or additive, or an :class:`AttentionMask` (key padding over the context)."""
        return self.run(x, attn_mask, context=context)[0]

    @torch.no_grad()
    def copy_from(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, proj: nn.Linear | None = None):
        """Warm start from a softmax cross-attention's q, k, v (and output) projections, copied into the query, key
        and value blocks (DnA: Q+, K, V+); returns self."""
        copy_rows(self.rows(), {"q_pos": (q.weight, q.bias), "k": (k.weight, k.bias), "v_pos": (v.weight, v.bias)})
        if proj is not None:
            self.proj.load_state_dict(proj.state_dict())
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kv_dim={self.context_dim}"


class StandardCrossAttention(CrossAttention, StandardAttention):
    """Softmax cross-attention (module docstring); arguments as :class:`DnACrossAttention
    <attnlab.attention.dna_cross.DnACrossAttention>`: ``dim`` (queries and output), ``num_heads``, ``kv_dim`` (the
    context's width, default dim), ``head_dim``, ``qkv_bias`` (in ``q`` and ``kv``), ``proj_bias``, ``attn_drop``,
    ``proj_drop``, ``backend``."""

    capabilities = Capabilities(causal=cross_causal("StandardCrossAttention"), intermediates=("weights",),
                                backends=("sdpa", "explicit"))

    def __init__(self, dim: int, num_heads: int = 8, kv_dim: int | None = None, *, head_dim: int | None = None,
                 qkv_bias: bool = False, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 backend: str = "auto") -> None:
        super().__init__(dim, num_heads, head_dim=head_dim, proj_bias=proj_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, backend=backend)
        self.cross_projections(kv_dim, qkv_bias)


__all__ = ["CrossAttention", "StandardCrossAttention", "cross_causal"]
