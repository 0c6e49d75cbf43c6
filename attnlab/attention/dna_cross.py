"""DnA cross-attention ("DnA: Denoising Attention for Visual Tasks", Sec. 3.3): the visual-probe adapter, queries
from one sequence and keys / values from another (the formula: :class:`DnACrossAttention`). The variants, options,
masks and backends are those of :mod:`attnlab.attention.dna`, whose kernel computes the formula for both modules.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .base import Intermediates, Want, make_call
from .capabilities import Capabilities, Declares
from .dna import Pair, Queries, _DnAParams, _rows, _slots
from .mask import Mask


class DnACrossAttention(_DnAParams, Declares, nn.Module):
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

    capabilities = Capabilities(
        causal="DnA cross-attention takes no causal mask: its queries and keys are different sequences, so no order "
               "relates them", intermediates=("weights", "branches"), backends=("kernel", "triton", "sdpa", "explicit"))

    def __init__(self, dim: int, num_heads: int = 8, kv_dim: int | None = None, *, head_dim: int | None = None,
                 qkv_bias: bool = False, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 backend: str = "auto", variant: str = "qv", alpha_init: float = 0.5, scale: str = "both",
                 init: str = "random", neg_init: float = 1e-4) -> None:
        super().__init__()
        self.dim, self.kv_dim, self.num_heads = dim, kv_dim or dim, num_heads
        self.head_dim = head_dim or dim // num_heads
        self.attn_dim = num_heads * self.head_dim
        self.use_backend(backend)
        self._setup_dna(variant, alpha_init, scale, init, neg_init)
        self.q_blocks = tuple(b for b in self.qkv_blocks if b.startswith("q"))
        self.kv_blocks = tuple(b for b in self.qkv_blocks if not b.startswith("q"))
        self.q = nn.Linear(dim, len(self.q_blocks) * self.attn_dim, bias=qkv_bias)
        self.kv = nn.Linear(self.kv_dim, len(self.kv_blocks) * self.attn_dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(self.attn_dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        if init == "copy":
            with torch.no_grad():
                self._init_negative(self._all_rows())

    def _all_rows(self) -> dict:
        return {**_rows(self.q, self.q_blocks, [self.attn_dim] * len(self.q_blocks)),
                **_rows(self.kv, self.kv_blocks, [self.attn_dim] * len(self.kv_blocks))}

    @torch.no_grad()
    def copy_from(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, proj: nn.Linear | None = None) -> "DnACrossAttention":
        """Warm start from a pretrained softmax cross-attention: Q+, K, V+ (and the output projection) copied, the
        negative branch filled according to ``init`` (``copy``: the paper's scaled-down copies). Returns self."""
        rows = self._all_rows()
        for name, src in (("q_pos", q), ("k", k), ("v_pos", v)):
            w, b = rows[name]
            w.copy_(src.weight)
            if b is not None:
                b.copy_(src.bias) if src.bias is not None else b.zero_()
        self._init_negative(rows)
        if proj is not None:
            self.proj.load_state_dict(proj.state_dict())
        return self

    def row_stride(self) -> int:
        return self.q.out_features

    def project(self, x: torch.Tensor, context: torch.Tensor) -> tuple[Queries, torch.Tensor, Pair]:
        """Queries (B, H, N, D) from x, keys and values (B, H, M, D) from context."""
        heads = [t for linear, y in ((self.q, x), (self.kv, context)) for t in
                 linear(y).unflatten(-1, (-1, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4).unbind(0)]
        q_pos, q_neg, k, v_pos, v_neg = _slots(self.q_blocks + self.kv_blocks, heads)
        return Queries(q_pos, q_neg), k, Pair(v_pos, v_neg)

    def run(self, x: torch.Tensor, context: torch.Tensor, attn_mask=None, *, want: Want = Want()
            ) -> tuple[torch.Tensor, Intermediates]:
        """:meth:`forward`'s output and the intermediates ``want`` asks for (DnA's kernel's: branches, maps)."""
        mask = Mask.resolve(attn_mask, B=x.shape[0], N=x.shape[1], M=context.shape[1], device=x.device)
        why = self.capabilities.refusal(None if mask is None else mask.parts)
        if why:
            raise UnsupportedModelError(f"{why}.")
        backend = self.choose(make_call(self, x, context.shape[1], mask, want))
        q, k, v = self.project(x, context)
        o, found = self.kernel(q, k, v, mask, want, backend)
        if mask is not None and mask.key_padding is not None:  # a sample whose context is all padding: zeros
            o = torch.where(mask.key_padding.any(dim=-1)[:, None, None, None], o, torch.zeros((), dtype=o.dtype))
        found.mask = mask
        B, _, N, _ = o.shape
        return self.proj_drop(self.proj(o.transpose(1, 2).reshape(B, N, self.attn_dim))), found

    def forward(self, x: torch.Tensor, context: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """x: (B, N, dim) queries, context: (B, M, kv_dim); ``attn_mask``: broadcastable to (B, H, N, M), bool
        (True = attend) or additive, or an :class:`AttentionMask` (key padding over the context's M tokens: a
        sample whose context is all padding outputs zeros). Returns (B, N, dim)."""
        return self.run(x, context, attn_mask)[0]

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, kv_dim={self.kv_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"variant={self.variant}, scale={self.scale_mode}")


__all__ = ["DnACrossAttention"]
