"""The visual probes' interaction modules, built from a spec term: cross-attention with queries from the probes and
keys / values from an encoder block's hidden states (VisCoP, Reilly et al., arXiv:2510.13808; DnA, Sec. 3.3).

    standard   P' = softmax(P W_Q (X W_K)^T / sqrt(d)) X W_V, then the output projection      (VisCoP)
               (:class:`attnlab.attention.StandardCrossAttention`)
    dna(...)   P' = softmax(P W_Q+ (X W_K)^T / sqrt(d)) X W_V+ + alpha softmin(P W_Q- (X W_K)^T / sqrt(d)) X W_V-
               (every variant and option of the ``dna`` term; :class:`attnlab.attention.DnACrossAttention`)

Every module has the constructor ``(dim, num_heads, kv_dim=None, *, head_dim=None, qkv_bias, proj_bias, ...)``,
Linears ``q``, ``kv``, ``proj``, ``copy_from(q, k, v, proj)`` (the warm start) and ``forward(x, context,
attn_mask)``. A term without a cross-attention form, or any other term beside the kernel, is refused in one line.
"""

from __future__ import annotations

from torch import nn

from .. import attention
from ..errors import SpecError
from ..spec import Spec, Term, parse_spec

#: spec term -> the cross-attention class of :mod:`attnlab.attention` that computes it
CROSS = {"standard": "StandardCrossAttention", "dna": "DnACrossAttention"}


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
    return getattr(attention, CROSS[name])


def build_interaction(term: Term, dim: int, num_heads: int, kv_dim: int | None = None) -> nn.Module:
    """One interaction module for ``term`` (biases on every projection, as VisCoP's)."""
    return cross_attention_class(term.name)(dim, num_heads, kv_dim, qkv_bias=True, proj_bias=True, **term.resolved())


__all__ = ["CROSS", "build_interaction", "cross_attention_class", "interaction_term"]
