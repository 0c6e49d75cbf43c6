"""What an attention mechanism can do, declared once per class as data.

Every mechanism class (and every head transform) holds one frozen :class:`Capabilities` record as its class attribute
``capabilities``. The forward's refusals, ``convert`` on a causal model, ``attnlab variants --support``, the
instruments (entropy, maps, Jacobian, two-branch), QK-clip, the KV cache and the generated contract tests
(tests/attention/test_contract.py) read it; none of them probes a module for attributes. A mask part's field is None
when the mechanism honours it, else the one sentence (no final period) its refusal raises:

    capabilities = Capabilities(causal="nystrom cannot honour a causal mask: its landmarks are ...",
                                attn_mask="nystrom cannot honour this attention mask: ...", head_output=True)

docs/methods.md, "Adding a method", says what each field promises and how the contract tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError


@dataclass(frozen=True)
class Capabilities:
    """One mechanism's (or head transform's) capabilities.

    Args:
        causal: refusal of a causal mask (``is_causal``, an AttentionMask's causal order), or None: honoured.
        key_padding: refusal of key padding (an AttentionMask's ``key_padding``), or None.
        attn_mask: refusal of a caller's ``attn_mask`` (bool or additive, -inf or finfo.min), or None.
        window: refusal of Swin's window attention (relative-position bias and shifted-window mask), or None; asked
            when the module is built on a window geometry as well as when a window mask arrives.
        kv_cache: a new token's query against the cached keys and values is its causal output (generation may
            cache them). For a head transform: the transform keeps that true.
        plain_softmax: the weights are one row-stochastic softmax(q k^T / sqrt(D) + bias) per head, q and k the first
            two blocks of ``qkv`` (what entropy, the attention Jacobian and QK-clip need).
        explicit_maps: ``explicit_maps(x, mask) -> (output, {branch: Branch})`` recomputes the output on the explicit
            path with its weight maps (head redundancy, relevance).
        branches: the two-branch convention (``branch_outputs``, ``branch_values``, ``branch_coefficients``) of DnA
            and diff, which the two-branch instruments read.
        head_output: ``head_output(x, w_q, w_k, w_v, ...)``, one head's formula for the attention Jacobian (a
            mechanism that is not plain softmax).
        backends: the paths ``use_backend`` selects, each computing the same formula: ``sdpa`` (fused), ``explicit``
            (the readable definition, the contract tests' float64 reference), ``kernel`` (a fused CPU kernel),
            ``triton`` (CUDA).
    """

    causal: str | None = None
    key_padding: str | None = None
    attn_mask: str | None = None
    window: str | None = None
    kv_cache: bool = False
    plain_softmax: bool = False
    explicit_maps: bool = False
    branches: bool = False
    head_output: bool = False
    backends: tuple[str, ...] = ("explicit",)

    def refusal(self, mask) -> str | None:
        """The first sentence (causal, key padding, attn_mask, window) why ``mask`` (an AttentionMask, or None) cannot
        be honoured, or None."""
        if mask is None:
            return None
        for present, why in ((mask.is_causal, self.causal), (mask.key_padding is not None, self.key_padding),
                             (mask.attn_mask is not None, self.attn_mask), (mask.window is not None, self.window)):
            if present and why:
                return why
        return None


#: the record of a module that declares none (timm's own attention before conversion): it offers nothing
UNDECLARED = Capabilities(backends=())


class Declares:
    """Mixin of the module classes that declare a :class:`Capabilities` record (attention mechanisms, head
    transforms, DnA cross-attention)."""

    capabilities: ClassVar[Capabilities] = Capabilities()

    def use_backend(self, name: str) -> None:
        """Compute this module's forward on backend ``name``, one its record declares: ``explicit`` (the readable
        path) or the fused one (``sdpa``); mechanisms with more backends say how they pick them."""
        if name not in self.capabilities.backends:
            raise ConfigError(f"{type(self).__name__} has no {name!r} backend; it has: "
                              f"{', '.join(self.capabilities.backends) or 'none'}.")
        self.fused_attn = name != "explicit"


def capabilities_of(module) -> Capabilities:
    """``module``'s record, or :data:`UNDECLARED` for a module that declares none."""
    return module.capabilities if isinstance(module, Declares) else UNDECLARED


def global_only(term: str) -> str:
    """The window refusal of a global-attention approximation that takes no additive bias (nystrom, performer)."""
    return (f"{term} approximates global attention without an additive bias, and Swin's window attention adds a "
            "relative-position bias; use it on a ViT-family or sequence model")


__all__ = ["Capabilities", "Declares", "UNDECLARED", "capabilities_of", "global_only"]
