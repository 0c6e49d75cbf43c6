"""What an attention mechanism can do, declared once per class as data.

Every mechanism class (and head transform) holds one frozen :class:`Capabilities` record, ``capabilities``. The
forward's refusals, the backend dispatcher, ``convert``, ``attnlab variants --support``, the instruments, QK-clip,
the KV cache and the generated contract tests read it; none probes a module for attributes. A mask part's field is
None when the mechanism honours it, else the one sentence (no final period) its refusal raises. docs/methods.md,
"Adding a method", says what each field promises and how the contract tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from ..ops.sdpa import explicit_is_faster

#: what a kernel can return besides its output (:class:`~attnlab.attention.base.Want`): each branch's weight map,
#: each branch's output and values before its coefficient (DnA, diff); ``head``: each head's output is a function of
#: that head's rows of ``qkv`` alone, its per-head output (``Want.heads``) what the attention Jacobian differentiates
INTERMEDIATES = ("weights", "branches", "head")


@dataclass(frozen=True)
class Capabilities:
    """One mechanism's (or head transform's) capabilities: the refusal sentence of each mask part it cannot honour
    (None: honoured; ``window`` is also asked when a module is built on a Swin window geometry), and what it offers."""

    causal: str | None = None  # a causal mask (``is_causal``, an AttentionMask's causal order)
    key_padding: str | None = None  # an AttentionMask's ``key_padding``
    attn_mask: str | None = None  # a caller's ``attn_mask`` (bool or additive, -inf or finfo.min)
    window: str | None = None  # Swin's window attention (relative-position bias and shifted-window mask)
    bias: str | None = None  # a position bias added to every logit (ViTDet's decomposed relative positions)
    #: a new token's query against cached keys and values is its causal output (a head transform keeps that true)
    kv_cache: bool = False
    #: one row-stochastic softmax(q k^T / sqrt(D) + bias) per head, q and k the first two blocks of ``qkv``: the
    #: forward can return its logits and per-head max logits (entropy, QK-clip, the attention Jacobian)
    plain_softmax: bool = False
    intermediates: tuple[str, ...] = ()  # what the kernel returns when asked (:data:`INTERMEDIATES`)
    #: a head's logits come from this many equal parts of its q and k, each of width head_dim / qk_split (diff: two
    #: halves): QK-norm normalises each part; the per-head spectral norm of W_q W_k^T needs one
    qk_split: int = 1
    #: the backends that take grouped keys and values (fewer heads than the queries) as they are; for the others
    #: the forward repeats each key/value head for its group of query heads
    grouped: tuple[str, ...] = ()
    #: the backends the dispatcher may pick, in order of preference, each computing the same formula: ``kernel`` (a
    #: fused CPU kernel), ``triton`` (CUDA), ``sdpa`` (PyTorch's), ``explicit`` (the readable definition, the
    #: contract tests' float64 reference)
    backends: tuple[str, ...] = ("explicit",)

    def __post_init__(self) -> None:
        unknown = set(self.intermediates) - set(INTERMEDIATES)
        if unknown:
            raise ValueError(f"unknown intermediates {sorted(unknown)}; they are: {', '.join(INTERMEDIATES)}")

    def refusal(self, mask, bias: bool = False) -> str | None:
        """The first sentence (causal, key padding, attn_mask, window, bias) why ``mask`` (an AttentionMask, or
        None) and, with ``bias``, a position bias cannot be honoured, or None."""
        parts = () if mask is None else (
            (mask.is_causal, self.causal), (mask.key_padding is not None, self.key_padding),
            (mask.attn_mask is not None, self.attn_mask), (mask.window is not None, self.window))
        return next((why for present, why in (*parts, (bias, self.bias)) if present and why), None)


#: the record of a module that declares none (timm's own attention before conversion): it offers nothing
UNDECLARED = Capabilities(backends=())


class Declares:
    """Mixin of the module classes that declare a :class:`Capabilities` record (attention mechanisms, head
    transforms, DnA cross-attention). ``backend``: ``auto`` (the dispatcher's choice) or one of the record's
    backends, forced."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    backend: str = "auto"

    def use_backend(self, name: str) -> None:
        """Force backend ``name`` (one the record declares), or ``auto``; ConfigError naming the declared ones."""
        if name != "auto" and name not in self.capabilities.backends:
            raise ConfigError(f"{type(self).__name__} has no {name!r} backend; it has: "
                              f"{', '.join(('auto', *self.capabilities.backends))}.")
        self.backend = name

    def choose(self, call) -> str:
        """The one backend dispatcher, asked once per forward with its :class:`~attnlab.attention.base.Call`: the
        forced backend (ConfigError with the reason when it cannot run the call), else the first of the record's
        backends whose :meth:`supports` accepts the call (SDPA passed over where the explicit product measures faster,
        :func:`~attnlab.ops.sdpa.explicit_is_faster`)."""
        if self.backend != "auto":
            why = self.supports(self.backend, call)
            if why:
                raise ConfigError(f"{type(self).__name__}'s {self.backend} backend cannot run this call: {why}; "
                                  f"use backend=auto.")
            return self.backend
        backends = self.capabilities.backends
        for name in backends:
            if self.supports(name, call) is None and not (
                    name == "sdpa" and "explicit" in backends and explicit_is_faster(call)):
                return name
        return "explicit"

    def supports(self, backend: str, call) -> str | None:
        """Why ``backend`` cannot compute ``call``, or None when it can: ``explicit`` computes everything; the others
        return no weight maps. A mechanism with a kernel of its own extends this."""
        return "it returns no attention weights" if backend != "explicit" and call.want.weights else None


def capabilities_of(module) -> Capabilities:
    """``module``'s record, or :data:`UNDECLARED` for a module that declares none."""
    return module.capabilities if isinstance(module, Declares) else UNDECLARED


def global_only(term: str) -> str:
    """The window and position-bias refusal of a global-attention approximation that takes no additive bias
    (nystrom, performer)."""
    return (f"{term} approximates global attention without an additive bias, and Swin's window attention and "
            "ViTDet's relative positions add one; use it on a ViT-family or sequence model without them")


__all__ = ["Capabilities", "Declares", "INTERMEDIATES", "UNDECLARED", "capabilities_of", "global_only"]
