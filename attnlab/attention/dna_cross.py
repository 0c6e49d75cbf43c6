"""DnA cross-attention ("DnA: Denoising Attention for Visual Tasks", Sec. 3.3): the visual-probe adapter, queries
from one sequence and keys / values from another (the formula: :class:`DnACrossAttention`). The variants, options,
masks and backends are those of :mod:`attnlab.attention.dna`, whose :func:`~attnlab.attention.dna.dna_attention`
computes the formula for both modules.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .capabilities import Capabilities, Declares
from .dna import _canonical, _DnAParams, _rows, _slots, combine, dna_attention, dna_branches, negative_bias
from .mask import AttentionMask


class DnACrossAttention(_DnAParams, Declares, nn.Module):
    """DnA cross-attention (Sec. 3.3, the visual-probe adapter): queries from ``x``, keys and values from ``context``.

        P' = softmax(P W_{Q+} (X W_K)^T / sqrt(d)) X W_{V+} + alpha * softmin(P W_{Q-} (X W_K)^T / sqrt(d)) X W_{V-}

    followed by the output projection. Projections: ``q`` (rows Q+, Q- or Q) on ``x``, ``kv`` (rows K, V+, V- or K,
    V) on ``context``; options as :class:`DnAAttention` (``init=copy`` derives Q-, V- from Q+, V+ at construction and
    in :meth:`copy_from`).

    Args:
        dim: query token width (and output width).
        num_heads: heads H.
        kv_dim: context token width (default ``dim``).
        head_dim: features per head D (default ``dim // num_heads``).
        qkv_bias, proj_bias, attn_drop, proj_drop, fused_attn: as :class:`AttnlabAttention`.
        variant, alpha_init, scale, init, neg_init: as :class:`DnAAttention`.
    """

    capabilities = Capabilities(
        causal="DnA cross-attention takes no causal mask: its queries and keys are different sequences, so no order "
               "relates them", backends=("sdpa", "explicit", "kernel", "triton"))

    def __init__(self, dim: int, num_heads: int = 8, kv_dim: int | None = None, *, head_dim: int | None = None,
                 qkv_bias: bool = False, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 fused_attn: bool = True, variant: str = "qv", alpha_init: float = 0.5, scale: str = "both",
                 init: str = "random", neg_init: float = 1e-4) -> None:
        super().__init__()
        self.dim = dim
        self.kv_dim = kv_dim or dim
        self.num_heads = num_heads
        self.head_dim = head_dim or dim // num_heads
        self.attn_dim = num_heads * self.head_dim
        self.fused_attn = fused_attn
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
        rows = {**_rows(self.q, self.q_blocks, self.attn_dim), **_rows(self.kv, self.kv_blocks, self.attn_dim)}
        return _canonical(rows)

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

    def _heads(self, linear: nn.Linear, x: torch.Tensor, blocks: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        """One (B, H, N, D) tensor per block of ``linear``'s output on x (B, N, .)."""
        B, N, _ = x.shape
        return linear(x).view(B, N, len(blocks), self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def project(self, x: torch.Tensor, context: torch.Tensor):
        """((q_pos, q_neg), k, (v_pos, v_neg)): queries (B, H, N, D) from x, keys / values (B, H, M, D) from context."""
        heads = self._heads(self.q, x, self.q_blocks) + self._heads(self.kv, context, self.kv_blocks)
        q_pos, q_neg, k, v_pos, v_neg = _slots(self.q_blocks + self.kv_blocks, heads)
        return (q_pos, q_neg), k, (v_pos, v_neg)

    def _biases(self, mask: AttentionMask | None, like: torch.Tensor, M: int):
        """(bias_pos, bias_neg) for queries ``like`` (B, H, N, D) and M keys (see :class:`DnAAttention`)."""
        if mask is None:
            return None, None
        B, _, N, _ = like.shape
        keep = mask.keep(B, N, M, like.device)
        return (mask.additive(B, N, M, like.dtype, like.device),
                negative_bias(mask.logit_bias(like.dtype), keep, like))

    def branches(self, q, k, v, mask: AttentionMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        (q_pos, q_neg), (v_pos, v_neg) = q, v
        bias_pos, bias_neg = self._biases(mask, q_pos, k.shape[-2])
        if self.fused_attn:
            return dna_branches(q_pos, q_neg, k, v_pos, v_neg, scale_pos=self.scale_pos, scale_neg=self.scale_neg,
                                bias_pos=bias_pos, bias_neg=bias_neg,
                                dropout_p=self.attn_drop.p if self.training else 0.0)
        kt = k.transpose(-2, -1)
        pos_logits = (q_pos * self.scale_pos) @ kt
        if bias_pos is not None:
            pos_logits = pos_logits + bias_pos
        neg_logits = -((q_neg * self.scale_neg) @ kt)
        if bias_neg is not None:
            neg_logits = neg_logits + bias_neg
        return (self.attn_drop(pos_logits.softmax(-1)) @ v_pos, self.attn_drop(neg_logits.softmax(-1)) @ v_neg)

    def _mask(self, attn_mask, x, context) -> AttentionMask | None:
        mask = AttentionMask.of(attn_mask)
        if mask is not None:
            mask.check(x.shape[0], context.shape[1])
            why = self.capabilities.refusal(mask)
            if why:
                raise UnsupportedModelError(f"{why}.")
        return mask

    def branch_outputs(self, x: torch.Tensor, context: torch.Tensor, attn_mask=None):
        """(o_pos, o_neg), each (B, H, N, D), before alpha."""
        return self.branches(*self.project(x, context), mask=self._mask(attn_mask, x, context))

    def branch_values(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(V^+_h, V^-_h) of ``context`` (B, M, kv_dim), each (B, H, M, D)."""
        *_, v_pos, v_neg = _slots(self.kv_blocks, self._heads(self.kv, context, self.kv_blocks))
        return v_pos, v_neg

    def attend(self, q, k, v, mask: AttentionMask | None = None) -> torch.Tensor:
        """alpha-combined output of both branches, (B, H, N, D), from :meth:`project`'s queries, keys and values: the
        explicit path when ``fused_attn`` is off, else :func:`~attnlab.attention.dna.dna_attention` (which picks
        kernel, Triton or SDPA) with ``self.backend``."""
        if not self.fused_attn:
            return combine(*self.branches(q, k, v, mask), self.alpha)
        (q_pos, q_neg), (v_pos, v_neg) = q, v
        bias_pos, bias_neg = self._biases(mask, q_pos, k.shape[-2])
        return dna_attention(q_pos, q_neg, k, v_pos, v_neg, self.alpha, scale_pos=self.scale_pos,
                             scale_neg=self.scale_neg, bias_pos=bias_pos, bias_neg=bias_neg,
                             dropout_p=self.attn_drop.p if self.training else 0.0, backend=self.backend)

    def forward(self, x: torch.Tensor, context: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """x: (B, N, dim) queries, context: (B, M, kv_dim); ``attn_mask``: broadcastable to (B, H, N, M), bool
        (True = attend) or additive, or an :class:`AttentionMask` (key padding over the context's M tokens: a
        sample whose context is all padding outputs zeros). Returns (B, N, dim)."""
        mask = self._mask(attn_mask, x, context)
        o = self.attend(*self.project(x, context), mask=mask)
        if mask is not None:
            o = mask.zero_empty_rows(o)
        B, _, N, _ = o.shape
        return self.proj_drop(self.proj(o.transpose(1, 2).reshape(B, N, self.attn_dim)))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, kv_dim={self.kv_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"variant={self.variant}, scale={self.scale_mode}")


__all__ = ["DnACrossAttention"]
