"""One mask for every attention term: causal order, key padding, a caller's ``attn_mask`` and Swin's window mask.

    AttentionMask(is_causal=True)                          query i sees keys j <= i (SDPA's top-left convention)
    AttentionMask(key_padding=tokens != pad_id)            (B, M) bool, True at real tokens: padded keys unseen
    AttentionMask(attn_mask=m)                             SDPA's attn_mask: bool (True = attend) or additive float
                                                           (an entry <= EXCLUDED, -inf or finfo.min: key excluded)
    AttentionMask(window=swin_mask)                        Swin's shifted-window mask (num_windows, N, N), 0 / -100

They combine (a causal model with padded batches passes both). Every attnlab attention module folds its forward's
arguments (``attn_mask``, ``is_causal``, Swin's ``mask``) into one (:meth:`AttentionMask.of`); a mechanism asks
:meth:`keep` (branches that exclude positions: DnA's softmin, Cog's |s|) or :meth:`additive` (softmax branches),
neither formed when causality is all that is asked (:attr:`causal_only`: SDPA's ``is_causal``). A padded query
without any allowed key attends every key internally (no 0/0), and :meth:`zero_padded_queries` zeroes its output
(a row that a caller's own ``attn_mask`` empties follows the backend's convention, SDPA's: zeros on the CPU).
The conventions and what each term supports: docs/methods.md, "Masks".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import ConfigError
from ..ops.sdpa import causal_keep

#: an additive float mask's entries at or below this exclude their key from every branch (weight exactly 0): -inf,
#: any dtype's ``finfo.min`` (Hugging Face's padding), the -1e9 / -1e4 of older code. A softmax gives such a key
#: weight exp(-1e4) = 0 in every float dtype anyway; a branch that negates the logit (DnA's softmin) or takes its
#: magnitude (Cog) would otherwise make it the most attended key. Entries above it are part of the logit.
EXCLUDED = -1e4


def _resolved(attn_mask):
    """A float ``attn_mask`` with every excluded entry (:data:`EXCLUDED`) as -inf, so that every later reader needs
    only one test (``isneginf``); a bool mask or None as given."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return attn_mask
    return attn_mask.masked_fill(attn_mask <= EXCLUDED, float("-inf"))


class AttentionMask(NamedTuple):
    """Which keys each query may attend (see the module docstring). A NamedTuple, so ``torch.compile`` traces it."""

    is_causal: bool = False
    key_padding: torch.Tensor | None = None  # (B, M) bool, True at real tokens
    attn_mask: torch.Tensor | None = None  # bool (True = attend) or additive float, broadcastable to (B, H, N, M)
    window: torch.Tensor | None = None  # Swin: (num_windows, N, N), 0 attend / nonzero masked, windows fastest in B

    # ---- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def of(cls, attn_mask=None, is_causal: bool = False, window: torch.Tensor | None = None) -> "AttentionMask | None":
        """One mask from an attention forward's arguments (timm's ``attn_mask`` / ``is_causal`` / Swin's ``mask``);
        ``attn_mask`` may itself be an AttentionMask. None when nothing is masked. The one place a float mask's
        excluded entries (:data:`EXCLUDED`) become -inf."""
        if isinstance(attn_mask, AttentionMask):
            mask = attn_mask._replace(is_causal=attn_mask.is_causal or bool(is_causal),
                                      attn_mask=_resolved(attn_mask.attn_mask))
            return mask._replace(window=window) if window is not None else mask
        if attn_mask is None and not is_causal and window is None:
            return None
        return cls(is_causal=bool(is_causal), attn_mask=_resolved(attn_mask), window=window)

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, pad_id: int, *, is_causal: bool = False) -> "AttentionMask":
        """Key padding from token ids (B, N): every position holding ``pad_id`` is padding."""
        return cls(is_causal=is_causal, key_padding=tokens != pad_id)

    def check(self, B: int, M: int) -> None:
        """ConfigError unless ``key_padding`` is a bool (B, M) tensor for this call's batch and keys."""
        kp = self.key_padding
        if kp is not None and (kp.dtype != torch.bool or tuple(kp.shape) != (B, M)):
            raise ConfigError(f"key_padding must be a bool tensor of shape (batch, keys) = ({B}, {M}), True at real "
                              f"tokens; got {kp.dtype} {tuple(kp.shape)}.")

    # ---- what a backend asks --------------------------------------------------------------------------------------
    @property
    def causal_only(self) -> bool:
        """Only causality is asked: SDPA's ``is_causal`` path, no mask in memory."""
        return self.is_causal and self.key_padding is None and self.attn_mask is None and self.window is None

    # ---- the mask as tensors --------------------------------------------------------------------------------------
    def _windows(self, B: int, t: torch.Tensor) -> torch.Tensor:
        """A (num_windows, N, M) tensor as (B, 1, N, M): windows are the fastest-varying part of Swin's batch."""
        num_win, N, M = t.shape
        return t.view(1, num_win, 1, N, M).expand(B // num_win, -1, -1, -1, -1).reshape(B, 1, N, M)

    def _ours(self, N: int, M: int, device, padding: bool = True) -> torch.Tensor | None:
        """Causality and key padding as a keep map (1|B, 1, N|1, M), rows without any key opened (module
        docstring), or None."""
        keep = None
        if self.is_causal:
            keep = causal_keep(N, M, device)
        if padding and self.key_padding is not None:
            kp = self.key_padding[:, None, None, :]
            keep = kp if keep is None else keep & kp
            keep = keep | ~keep.any(dim=-1, keepdim=True)  # a padded query without keys: open, zeroed later
        return keep

    def keep(self, B: int, N: int, M: int, device, *, window: bool = True, padding: bool = True
             ) -> torch.Tensor | None:
        """True where a query may attend, broadcastable to (B, H, N, M); ``window=False`` leaves Swin's window mask
        out (a softmax branch adds it as a bias instead), ``padding=False`` the key padding (a caller that applies
        it per token). None when every position is allowed."""
        keep = self._ours(N, M, device, padding)
        user = self.attn_mask
        if user is not None:
            allowed = user if user.dtype == torch.bool else ~torch.isneginf(user)
            keep = allowed if keep is None else keep & allowed
        if window and self.window is not None:
            allowed = self._windows(B, self.window == 0)
            keep = allowed if keep is None else keep & allowed
        return keep

    def logit_bias(self, dtype) -> torch.Tensor | None:
        """The finite part of a float ``attn_mask`` (its -inf entries as 0): a bias that is part of each logit."""
        user = self.attn_mask
        if user is None or user.dtype == torch.bool:
            return None
        return user.masked_fill(torch.isneginf(user), 0.0).to(dtype)

    def additive(self, B: int, N: int, M: int, dtype, device) -> torch.Tensor | None:
        """The mask as one additive float bias for a softmax, broadcastable to (B, H, N, M): Swin's window mask as
        given (timm's -100), a float ``attn_mask`` as given, excluded positions -inf. None when nothing is masked."""
        bias = None if self.window is None else self._windows(B, self.window.to(dtype))
        user = self.attn_mask
        if user is not None and user.dtype != torch.bool:
            bias = user.to(dtype) if bias is None else bias + user
        keep = self._ours(N, M, device)
        if user is not None and user.dtype == torch.bool:
            keep = user if keep is None else keep & user
        if keep is None:
            return bias
        if bias is None:
            return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
        return bias.masked_fill(~keep, float("-inf"))

    def zero_padded_queries(self, o: torch.Tensor) -> torch.Tensor:
        """Self-attention output (B, H, N, D) with every padded query's row exactly zero (module docstring)."""
        if self.key_padding is None:
            return o
        return torch.where(self.key_padding[:, None, :, None], o, torch.zeros((), dtype=o.dtype, device=o.device))

    def zero_empty_rows(self, o: torch.Tensor) -> torch.Tensor:
        """Cross-attention output (B, H, N, D) with every row of a sample whose keys are all padding at zero."""
        if self.key_padding is None:
            return o
        alive = self.key_padding.any(dim=-1)[:, None, None, None]
        return torch.where(alive, o, torch.zeros((), dtype=o.dtype, device=o.device))

    def for_sample(self, index: int) -> "AttentionMask":
        """The mask of one sample (or Swin window) of the batch, as a batch of one (the Jacobian instrument)."""
        user = self.attn_mask
        if user is not None and user.ndim == 4 and user.shape[0] > 1:
            user = user[index:index + 1]
        return self._replace(
            key_padding=None if self.key_padding is None else self.key_padding[index:index + 1], attn_mask=user,
            window=None if self.window is None else self.window[index % self.window.shape[0]][None])


__all__ = ["AttentionMask", "EXCLUDED"]
