"""One mask for every attention term: the caller's :class:`AttentionMask`, and the :class:`Mask` a forward resolves.

    AttentionMask(is_causal=True)                  query i sees keys j <= i (SDPA's top-left convention)
    AttentionMask(key_padding=tokens != pad_id)    (B, M) bool, True at real tokens: padded keys unseen
    AttentionMask(attn_mask=m)                     SDPA's attn_mask: bool (True = attend) or additive float (an entry
                                                   <= EXCLUDED, -inf or finfo.min: key excluded)
    AttentionMask(window=swin_mask)                Swin's shifted-window mask (num_windows, N, N), 0 / -100

They combine (a causal model with padded batches passes both). A kernel asks the call's :class:`Mask` for the form
it takes, each built at most once per call. A padded query without any allowed key attends every key internally
(no 0/0) and its output row is zeroed; a row that a caller's own ``attn_mask`` empties follows the backend's
convention (SDPA's: zeros on the CPU). Conventions and what each term supports: docs/methods.md, "Masks".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..errors import ConfigError
from ..ops.sdpa import causal_keep

#: an additive float mask's entries at or below this exclude their key from every branch (weight exactly 0): -inf,
#: any dtype's ``finfo.min`` (Hugging Face's padding), the -1e9 / -1e4 of older code. A softmax gives such a key
#: weight exp(-1e4) = 0 in every float dtype anyway; a branch that negates the logit (DnA's softmin) or takes its
#: magnitude (Cog) would otherwise make it the most attended key. Entries above it are part of the logit.
EXCLUDED = -1e4


class AttentionMask(NamedTuple):
    """Which keys each query may attend, as a caller passes it (module docstring); a NamedTuple, so
    ``torch.compile`` traces it."""

    is_causal: bool = False
    key_padding: torch.Tensor | None = None  # (B, M) bool, True at real tokens
    attn_mask: torch.Tensor | None = None  # bool (True = attend) or additive float, broadcastable to (B, H, N, M)
    window: torch.Tensor | None = None  # Swin: (num_windows, N, N), 0 attend / nonzero masked, windows fastest in B

    @classmethod
    def of(cls, attn_mask=None, is_causal: bool = False, window: torch.Tensor | None = None) -> "AttentionMask | None":
        """One mask from a forward's ``attn_mask`` (itself possibly an AttentionMask), ``is_causal`` and Swin's
        ``mask``, or None when nothing is masked; the one place a float mask's excluded entries become -inf."""
        if not isinstance(attn_mask, AttentionMask):
            if attn_mask is None and not is_causal and window is None:
                return None
            attn_mask = cls(attn_mask=attn_mask)
        user = attn_mask.attn_mask
        if user is not None and user.dtype != torch.bool:  # later readers need one test: isneginf
            user = user.masked_fill(user <= EXCLUDED, float("-inf"))
        return attn_mask._replace(is_causal=attn_mask.is_causal or bool(is_causal), attn_mask=user,
                                  window=attn_mask.window if window is None else window)

    @property
    def causal_only(self) -> bool:
        """Only causality is asked: SDPA's ``is_causal`` path, no mask in memory."""
        return self.is_causal and self.key_padding is None and self.attn_mask is None and self.window is None


def _windows(B: int, t: torch.Tensor) -> torch.Tensor:
    """A (num_windows, N, M) tensor as (B, 1, N, M): windows are the fastest-varying part of Swin's batch."""
    num_win, N, M = t.shape
    return t.view(1, num_win, 1, N, M).expand(B // num_win, -1, -1, -1, -1).reshape(B, 1, N, M)


def _once(build):
    """A form of the call's mask, built at most once per call and arguments."""
    @functools.wraps(build)
    def form(self, *args):
        key = (build.__name__, *args)
        if key not in self._forms:
            self._forms[key] = build(self, *args)
        return self._forms[key]
    return form


def _excluded(keep: torch.Tensor, dtype) -> torch.Tensor:
    """0 where ``keep``, -inf elsewhere."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


class Mask:
    """One call's mask and position bias, resolved once: what :meth:`AttnlabAttention.forward
    <attnlab.attention.base.AttnlabAttention.forward>` hands a kernel.

    ``parts``: the caller's :class:`AttentionMask` (an empty one when nothing is masked); ``B, N, M``: the call's
    batch, queries and keys; ``bias``: a position bias in every branch's logit (Swin's table, ViTDet's relative
    positions), broadcastable to (B, H, N, M), or None; ``offset``: keys before the first query (a KV cache's), so
    causal order is j <= i + offset; ``from_queries``: part of the bias is a function of the queries (ViTDet's);
    ``cross``: the keys are another sequence's (cross-attention), so key padding pads no query.
    """

    def __init__(self, parts: AttentionMask, B: int, N: int, M: int, device, bias: torch.Tensor | None = None,
                 offset: int = 0, from_queries: bool = False, cross: bool = False) -> None:
        self.parts, self.B, self.N, self.M, self.device, self.bias, self.offset = parts, B, N, M, device, bias, offset
        self.from_queries, self.cross = from_queries, cross
        self._forms: dict = {}

    @classmethod
    def resolve(cls, attn_mask=None, is_causal: bool = False, window=None, *, B: int, N: int, M: int, device,
                bias: torch.Tensor | None = None, offset: int = 0, cross: bool = False) -> "Mask | None":
        """The call's Mask from a forward's arguments (None when nothing is masked and no bias is added; a Mask
        passed as ``attn_mask`` is taken as resolved); ConfigError when key padding does not fit the call."""
        if isinstance(attn_mask, Mask):
            return attn_mask
        parts = AttentionMask.of(attn_mask, is_causal, window)
        kp = None if parts is None else parts.key_padding
        if kp is not None and (kp.dtype != torch.bool or tuple(kp.shape) != (B, M)):
            raise ConfigError(f"key_padding must be a bool tensor of shape (batch, keys) = ({B}, {M}), True at real "
                              f"tokens; got {kp.dtype} {tuple(kp.shape)}.")
        if parts is not None and parts.causal_only and offset >= M - 1:
            parts = None  # one new token after a KV cache's keys sees every key
        if parts is None and bias is None:
            return None
        return cls(parts or AttentionMask(), B, N, M, device, bias, offset, cross=cross)

    def with_bias(self, bias: torch.Tensor) -> "Mask":
        """This mask with ``bias``, computed from the queries (ViTDet's), added to its position bias."""
        return Mask(self.parts, self.B, self.N, self.M, self.device, bias if self.bias is None else self.bias + bias,
                    self.offset, from_queries=True, cross=self.cross)

    @property
    def is_causal(self) -> bool:
        return self.parts.is_causal

    @property
    def key_padding(self) -> torch.Tensor | None:
        return self.parts.key_padding

    @property
    def causal_only(self) -> bool:
        """Causality from the first key is all this call asks, and no bias is added: SDPA's ``is_causal``."""
        return self.parts.causal_only and self.bias is None and self.offset == 0

    # ---- the forms a kernel takes ----------------------------------------------------------------------------------
    @_once
    def keep(self, window: bool = True) -> torch.Tensor | None:
        """True where a query may attend, broadcastable to (B, H, N, M), or None when every position is allowed;
        ``window=False`` leaves Swin's window mask out (a softmax branch adds it as a bias instead). Rows that key
        padding empties are opened (module docstring)."""
        p, allowed = self.parts, []
        if p.is_causal:
            allowed.append(causal_keep(self.N, self.M, self.device, self.offset))
        if p.key_padding is not None:
            kp = p.key_padding[:, None, None, :]
            keep = kp if not allowed else allowed.pop() & kp
            allowed.append(keep | ~keep.any(dim=-1, keepdim=True))  # a padded query without keys: open, zeroed later
        if p.attn_mask is not None:
            allowed.append(p.attn_mask if p.attn_mask.dtype == torch.bool else ~torch.isneginf(p.attn_mask))
        if window and p.window is not None:
            allowed.append(_windows(self.B, p.window == 0))
        return functools.reduce(torch.logical_and, allowed) if allowed else None

    @_once
    def additive(self, dtype) -> torch.Tensor | None:
        """The mask (not the position bias) as one additive bias for a softmax: Swin's window mask as given (timm's
        -100), a float ``attn_mask`` as given, excluded positions -inf; None when nothing is masked."""
        p, user = self.parts, self.parts.attn_mask
        bias = None if p.window is None else _windows(self.B, p.window.to(dtype))
        if user is not None and user.dtype != torch.bool:
            bias = user.to(dtype) if bias is None else bias + user
        if user is not None and user.dtype != torch.bool and not p.is_causal and p.key_padding is None:
            return bias  # the float mask's excluded entries are -inf in it already
        keep = self.keep(False)
        if keep is None:
            return bias
        return _excluded(keep, dtype) if bias is None else bias.masked_fill(~keep, float("-inf"))

    def sdpa(self, dtype) -> tuple[torch.Tensor | None, bool]:
        """(attn_mask, is_causal) for ``F.scaled_dot_product_attention``: :meth:`softmax_bias`, or no tensor and
        ``is_causal`` when causality is all that is asked."""
        return (None, True) if self.causal_only else (self.softmax_bias(dtype), False)

    def _plus_bias(self, t: torch.Tensor | None, dtype) -> torch.Tensor | None:
        return t if self.bias is None else self.bias.to(dtype) if t is None else self.bias.to(dtype) + t

    @_once
    def softmax_bias(self, dtype) -> torch.Tensor | None:
        """A softmax branch's whole bias as one tensor, the position bias plus :meth:`additive` (a kernel without an
        ``is_causal`` path takes causal order this way)."""
        return self._plus_bias(self.additive(dtype), dtype)

    def add_to(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (B, H, N, M) plus the position bias, then the mask, in the order timm's explicit paths add them
        (a converted timm model's explicit output is bit-identical)."""
        if self.bias is not None:
            logits = logits + self.bias.to(logits.dtype)
        additive = self.additive(logits.dtype)
        return logits if additive is None else logits + additive

    @_once
    def logit_bias(self, dtype) -> torch.Tensor | None:
        """What is part of every branch's logit besides q k^T: the position bias plus a float ``attn_mask``'s finite
        entries (for branches that exclude masked positions rather than add -inf: DnA's softmin, Cog)."""
        user = self.parts.attn_mask
        finite = None if user is None or user.dtype == torch.bool else \
            user.masked_fill(torch.isneginf(user), 0.0).to(dtype)
        return self._plus_bias(finite, dtype)

    @_once
    def negated(self, dtype) -> torch.Tensor | None:
        """The softmin branch's bias in negated-logit form, softmin weights = softmax(-s + this): minus
        :meth:`logit_bias`, -inf at every excluded position (weight exactly 0); None when there is neither."""
        logit, keep = self.logit_bias(dtype), self.keep()
        excl = None if keep is None else _excluded(keep, dtype)
        return excl if logit is None else -logit if excl is None else excl - logit

    def zero_padded_queries(self, o: torch.Tensor) -> torch.Tensor:
        """Output (B, H, N, D) with every padded query's row exactly zero (the queries are the last N of the M keys;
        after a KV cache's, the new tokens); cross-attention: every row of a sample whose keys are all padding."""
        kp = self.parts.key_padding
        if kp is None:
            return o
        real = kp.any(dim=-1)[:, None, None, None] if self.cross else kp[:, None, -o.shape[-2]:, None]
        return torch.where(real, o, torch.zeros((), dtype=o.dtype, device=o.device))


__all__ = ["AttentionMask", "EXCLUDED", "Mask"]
