"""Differential attention (Ye et al., 2024, "Differential Transformer", arXiv:2410.05258), as timm's
``DiffAttention`` computes it.

Each head h (value width D) splits its query and key into two halves of width d = D / 2 (timm's split) and shares
one value v_h of width D:

    A1 = softmax(q1 k1^T / sqrt(d) + bias),   A2 = softmax(q2 k2^T / sqrt(d) + bias)
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init
    lambda_init = 0.8 - 0.6 * exp(-0.3 * depth)          (depth: 0-based index of the attention layer)
    o_h = (1 - lambda_init) * RMSNorm_D((A1 - lambda * A2) v_h)

``bias``: the call's position bias plus its mask, in both branches (timm's is ViT-only; the Swin form is attnlab's).
Parameters keep timm's names, so a timm ``DiffAttention`` state dict loads; docs/methods.md, "diff".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from timm.layers import RmsNorm

from ..errors import UnsupportedModelError
from .base import AttnlabAttention, Branch, Intermediates
from .capabilities import Capabilities


class DiffAttention(AttnlabAttention):
    """Differential attention; arguments as :class:`AttnlabAttention` plus:

    Args:
        dual_lambda: timm's simplified lambda, ``exp(lambda_a) - exp(lambda_b) + lambda_init`` (2 scalars, zero
            init), instead of the paper's four vectors of width d (normal init, std 0.1).

    ``head_dim`` is the value width D per head; queries and keys use d = D / 2 (``qk_head_dim``), and the logit scale
    is ``d ** -0.5`` as in timm. ``layer_index`` is timm's ``depth``.
    """

    capabilities = Capabilities(kv_cache=True, intermediates=("weights", "branches"), qk_split=2,
                                backends=("sdpa", "explicit"))
    _OWN = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "lambda_a", "lambda_b")

    def __init__(self, dim: int, num_heads: int = 8, *, dual_lambda: bool = False, qk_norm: bool = False,
                 norm_layer: type[nn.Module] | None = None, **kwargs) -> None:
        super().__init__(dim, num_heads, qk_norm=qk_norm, norm_layer=norm_layer, **kwargs)
        if self.head_dim % 2:
            raise UnsupportedModelError(
                f"diff splits each head's query and key in two halves, so it needs an even head dimension; this "
                f"module has head_dim={self.head_dim}.")
        self.qk_head_dim = self.head_dim // self.capabilities.qk_split
        self.scale = self.qk_head_dim ** -0.5
        if qk_norm:  # timm's DiffAttention normalises each half (default RmsNorm)
            norm_layer = norm_layer or RmsNorm
            self.q_norm = norm_layer(self.qk_head_dim)
            self.k_norm = norm_layer(self.qk_head_dim)

        self.dual_lambda = dual_lambda
        for name in self._OWN:  # timm's order: q1, k1, q2, k2 drawn normal(0, 0.1); or a, b at zero
            dual = name in ("lambda_a", "lambda_b")
            shape = () if dual else (self.qk_head_dim,)
            setattr(self, name, None if dual != dual_lambda else
                    nn.Parameter(torch.zeros(shape) if dual else torch.empty(shape).normal_(0, 0.1)))
        self.sub_norm = RmsNorm(self.head_dim, eps=1e-5)
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * self.layer_index)

    def adopt(self, module: nn.Module) -> None:
        """Take the shared submodules; from a timm or attnlab ``DiffAttention`` also its lambdas and sub-norm."""
        super().adopt(module)
        is_diff = all(hasattr(module, n) for n in self._OWN) and hasattr(module, "sub_norm")
        if is_diff and (getattr(module, "lambda_a", None) is not None) == self.dual_lambda:
            for name in self._OWN:
                setattr(self, name, getattr(module, name))
            self.sub_norm = module.sub_norm

    # ---- the mechanism ---------------------------------------------------------------------------------------------
    def normed(self, q, k, v):
        """q and k normalised per half (width d) when qk_norm is on; a norm sized to the full head width D (e.g.
        adopted from a standard module with qk_norm) normalises the whole head before the split."""
        return self._norm_halves(self.q_norm, q), self._norm_halves(self.k_norm, k), v

    def _norm_halves(self, norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
        if isinstance(norm, nn.Identity):
            return t
        if tuple(getattr(norm, "normalized_shape", (self.qk_head_dim,)))[-1] == self.head_dim:
            return norm(t)
        return norm(t.unflatten(-1, (2, self.qk_head_dim))).flatten(-2)

    def lambda_full(self) -> torch.Tensor:
        """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init (a 0-d tensor)."""
        if self.dual_lambda:
            a, b = self.lambda_a, self.lambda_b
        else:
            a, b = (self.lambda_q1 * self.lambda_k1).sum(-1), (self.lambda_q2 * self.lambda_k2).sum(-1)
        dtype = torch.promote_types(a.dtype, torch.float32)  # timm computes lambda in (at least) fp32
        return torch.exp(a.to(dtype)) - torch.exp(b.to(dtype)) + self.lambda_init

    def kernel(self, q, k, v, mask, want, backend):
        """(1 - lambda_init) RMSNorm(A1 v - lambda A2 v); the branches are A1 v and A2 v (before lambda)."""
        d, found = self.qk_head_dim, Intermediates()
        halves = ((q[..., :d], k[..., :d]), (q[..., d:], k[..., d:]))
        if backend == "sdpa":
            p = self.attn_drop.p if self.training else 0.0
            attn_mask, causal = (None, False) if mask is None else mask.sdpa(q.dtype)
            o1, o2 = (F.scaled_dot_product_attention(qh, kh, v, attn_mask=attn_mask, dropout_p=p, is_causal=causal)
                      for qh, kh in halves)
        else:
            w1, w2 = (self.softmax((qh * self.scale) @ kh.transpose(-2, -1), mask) for qh, kh in halves)
            o1 = self.attn_drop(w1) @ v
            o2 = self.attn_drop(w2) @ v if want.branches or not want.weights else None
            if want.weights:  # the output from the very maps reported, so gradients reach them (relevance)
                e2 = -self.lambda_full().to(w2.dtype) * w2
                found.weights = {"pos": Branch(w1, w1), "neg": Branch(w2, e2)}
        if want.branches:
            found.branches, found.values = (o1, o2), (v, v)
        o = o1 + self.attn_drop(e2) @ v if found.weights else o1 - self.lambda_full().to(o1.dtype) * o2
        return self.sub_norm(o) * (1 - self.lambda_init), found

    def branch_coefficients(self) -> tuple[str, torch.Tensor]:
        """("lambda", lambda): the negative branch's coefficient (one for every head)."""
        return "lambda", self.lambda_full()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lambda_init={self.lambda_init:.4f}, dual_lambda={self.dual_lambda}"


__all__ = ["DiffAttention"]
