"""Cross-attention: queries from one sequence x, keys and values from another, the context (Vaswani et al., 2017,
"Attention Is All You Need", arXiv:1706.03762, Sec. 3.2.3, encoder-decoder attention; the visual probes of DnA's
Sec. 3.3 and of video language models).

    o_h = softmax((x W_q,h) (c W_k,h)^T / sqrt(D) + mask) (c W_v,h),     out = [o_1 ... o_H] W_o

A cross-attention module is a mechanism's self-attention with its projection overridden (:class:`CrossAttention`):
``forward(x, context, attn_mask)`` is ``run(x, attn_mask, context=context)``, so masks, the backend dispatcher and
the intermediates are the self-attention contract's. ``q`` projects x to the mechanism's query blocks, ``kv`` the
context to its key and value blocks. ``attn_mask`` is over the context's M tokens (key padding as an
:class:`~attnlab.attention.mask.AttentionMask`: a sample whose context is all padding outputs zeros before the
output projection); no causal order relates two sequences, so a causal mask is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from .capabilities import Capabilities
from .standard import StandardAttention


def cross_causal(name: str) -> str:
    """The causal refusal of a cross-attention module."""
    return (f"{name} takes no causal mask: its queries and keys are different sequences, so no order relates "
            f"them")


class CrossAttention:
    """The projection of cross-attention, for a mechanism class (``class X(CrossAttention, Mechanism)``): ``q`` on
    x (the mechanism's query blocks), ``kv`` on the context (its key block, then its value blocks); the forward is
    the mechanism's."""

    takes_context = True

    def cross_projections(self, kv_dim: int | None, q_blocks: int, kv_blocks: int, bias: bool) -> None:
        """Replace the fused self-attention projection by ``q`` (dim -> q_blocks heads) and ``kv`` (kv_dim ->
        kv_blocks heads), ``kv_dim`` the context's width (default dim)."""
        del self.qkv  # the self-attention projection; x and the context have their own
        self.context_dim = kv_dim or self.dim
        self.q = nn.Linear(self.dim, q_blocks * self.attn_dim, bias=bias)
        self.kv = nn.Linear(self.context_dim, kv_blocks * self.attn_dim, bias=bias)

    def row_stride(self) -> int:
        return self.q.out_features

    def project(self, x: torch.Tensor, context: torch.Tensor) -> tuple:
        """Queries (B, H * q_blocks, N, D) from x; keys (B, H, M, D) and values (B, H * (kv_blocks - 1), M, D) from
        the context: each block's heads one after the other, views of the two projections."""
        q, kv = (linear(t).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for linear, t in ((self.q, x),
                                                                                              (self.kv, context)))
        return q, *kv.split([self.num_heads, kv.shape[1] - self.num_heads], dim=1)

    def forward(self, x: torch.Tensor, context: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """x: (B, N, dim) queries, context: (B, M, kv_dim); ``attn_mask`` broadcastable to (B, H, N, M), bool (True =
        attend) or additive, or an :class:`AttentionMask` (key padding over the context). Returns (B, N, dim)."""
        return self.run(x, attn_mask, context=context)[0]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kv_dim={self.context_dim}"


class StandardCrossAttention(CrossAttention, StandardAttention):
    """Softmax cross-attention (module docstring); the constructor mirrors :class:`DnACrossAttention
    <attnlab.attention.dna_cross.DnACrossAttention>`.

    Args:
        dim: query token width (and output width).
        num_heads: heads H.
        kv_dim: context token width (default ``dim``).
        head_dim: features per head D (default ``dim // num_heads``).
        qkv_bias: bias in ``q`` and ``kv``.
        proj_bias, attn_drop, proj_drop, backend: as :class:`~attnlab.attention.base.AttnlabAttention`.
    """

    capabilities = Capabilities(causal=cross_causal("StandardCrossAttention"), intermediates=("weights",),
                                backends=("sdpa", "explicit"))

    def __init__(self, dim: int, num_heads: int = 8, kv_dim: int | None = None, *, head_dim: int | None = None,
                 qkv_bias: bool = False, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 backend: str = "auto") -> None:
        super().__init__(dim, num_heads, head_dim=head_dim, proj_bias=proj_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, backend=backend)
        self.cross_projections(kv_dim, 1, 2, qkv_bias)

    @torch.no_grad()
    def copy_from(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, proj: nn.Linear | None = None
                  ) -> "StandardCrossAttention":
        """Warm start from a pretrained softmax cross-attention's separate q, k, v (and output) projections.
        Returns self."""
        self.q.weight.copy_(q.weight)
        self.kv.weight.copy_(torch.cat([k.weight, v.weight]))
        if self.q.bias is not None:
            for dst, srcs in ((self.q.bias, (q,)), (self.kv.bias, (k, v))):
                dst.copy_(torch.cat([s.bias if s.bias is not None else s.weight.new_zeros(len(s.weight))
                                     for s in srcs]))
        if proj is not None:
            self.proj.load_state_dict(proj.state_dict())
        return self


__all__ = ["CrossAttention", "StandardCrossAttention", "cross_causal"]
