"""The visual probes' interaction modules, built from a spec term: cross-attention with queries from the probes and
keys / values from an encoder block's hidden states (VisCoP, Reilly et al., arXiv:2510.13808; DnA, Sec. 3.3).

    standard   P' = softmax(P W_Q (X W_K)^T / sqrt(d)) X W_V, then the output projection      (VisCoP)
    dna(...)   P' = softmax(P W_Q+ (X W_K)^T / sqrt(d)) X W_V+ + alpha softmin(P W_Q- (X W_K)^T / sqrt(d)) X W_V-
               (every variant and option of the ``dna`` term; :class:`attnlab.attention.DnACrossAttention`)

Every module has the constructor ``(dim, num_heads, kv_dim=None, *, head_dim=None, qkv_bias, proj_bias, ...)``,
Linears ``q``, ``kv``, ``proj``, ``copy_from(q, k, v, proj)`` (the warm start) and ``forward(x, context,
attn_mask)``. A term without a cross-attention form, or any other term beside the kernel, is refused in one line.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import attention
from ..attention.mask import AttentionMask
from ..errors import SpecError
from ..spec import Spec, Term, parse_spec

#: spec term -> the cross-attention class of :mod:`attnlab.attention` that computes it
CROSS = {"standard": "StandardCrossAttention", "dna": "DnACrossAttention"}


class _SoftmaxCrossAttention(nn.Module):
    """Softmax cross-attention with the cross-attention contract (module docstring), for ``standard`` until
    :mod:`attnlab.attention` has its own ``StandardCrossAttention``; ``backend`` is accepted and SDPA runs."""

    def __init__(self, dim: int, num_heads: int = 8, kv_dim: int | None = None, *, head_dim: int | None = None,
                 qkv_bias: bool = False, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 backend: str = "auto") -> None:
        super().__init__()
        self.dim, self.kv_dim, self.num_heads = dim, kv_dim or dim, num_heads
        self.head_dim = head_dim or dim // num_heads
        self.attn_dim, self.backend = num_heads * self.head_dim, backend
        self.q = nn.Linear(dim, self.attn_dim, bias=qkv_bias)
        self.kv = nn.Linear(self.kv_dim, 2 * self.attn_dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(self.attn_dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    @torch.no_grad()
    def copy_from(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, proj: nn.Linear | None = None):
        """Take a softmax attention's q, k, v (and output) projections. Returns self."""
        self.q.load_state_dict(q.state_dict())
        self.kv.weight.copy_(torch.cat([k.weight, v.weight]))
        if self.kv.bias is not None:
            self.kv.bias.copy_(torch.cat([t.bias if t.bias is not None else torch.zeros_like(t.weight[:, 0])
                                          for t in (k, v)]))
        if proj is not None:
            self.proj.load_state_dict(proj.state_dict())
        return self

    def forward(self, x: torch.Tensor, context: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """x (B, N, dim), context (B, M, kv_dim); ``attn_mask``: an AttentionMask with key padding (True = real), or
        a bool mask broadcastable to (B, H, N, M). A sample whose context is all padding outputs zeros."""
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(context).view(B, -1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        keep = attn_mask.key_padding if isinstance(attn_mask, AttentionMask) else attn_mask
        if keep is not None and keep.dim() == 2:
            keep = keep[:, None, None, :]
        any_key = None if keep is None else keep.any(dim=-1, keepdim=True)
        if keep is not None:  # an all-padding row attends everything internally (no 0/0), then outputs zeros
            keep = keep | ~any_key
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                           dropout_p=self.attn_drop.p if self.training else 0.0)
        if any_key is not None:
            o = o * any_key.to(o.dtype)
        return self.proj_drop(self.proj(o.transpose(1, 2).reshape(B, N, self.attn_dim)))


def interaction_term(spec: str | Spec | None) -> Term:
    """The one kernel term of ``spec`` that has a cross-attention form; SpecError (one line) for anything else."""
    parsed = parse_spec(spec)
    others = [t.name for t in parsed.terms if t.kind != "kernel"]
    if others:
        raise SpecError(f"the probes' interaction modules take one attention term (standard or dna(...)), not "
                        f"{'+'.join(others)}; e.g. 'dna(neg_init=1e-2)'.")
    term = parsed.kernel
    if term.name not in CROSS:
        raise SpecError(f"{term.name!r} has no cross-attention form for the probes' interaction modules; use one of: "
                        f"{', '.join(CROSS)}.")
    return term


def cross_attention_class(name: str) -> type[nn.Module]:
    """The class computing term ``name`` as cross-attention."""
    cls = getattr(attention, CROSS[name], None)
    return _SoftmaxCrossAttention if cls is None and name == "standard" else cls


def build_interaction(term: Term, dim: int, num_heads: int, kv_dim: int | None = None) -> nn.Module:
    """One interaction module for ``term`` (biases on every projection, as VisCoP's)."""
    return cross_attention_class(term.name)(dim, num_heads, kv_dim, qkv_bias=True, proj_bias=True, **term.resolved())


__all__ = ["CROSS", "build_interaction", "cross_attention_class", "interaction_term"]
