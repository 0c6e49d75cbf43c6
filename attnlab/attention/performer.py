"""Performer attention, FAVOR+ (Choromanski et al., "Rethinking Attention with Performers", ICLR 2021,
arXiv:2009.14794), as a kernel term ``performer``.

Per head, with M positive orthogonal random features phi (Lemma 1, Sec. 2.4):

    o_h = phi(q) (phi(k)^T v) / (phi(q) (phi(k)^T 1)),   phi(x) = exp(W x - ||x||^2 / 2) / sqrt(M),  x = q / D^(1/4)

an unbiased estimate of softmax(q k^T / sqrt(D)) v's numerator and denominator, linear in N
(:func:`attnlab.ops.lowrank.performer_attention`). Masks: padded keys weigh 0 in both sums; a causal mask gives the
unidirectional FAVOR+ of Sec. 2.2 (prefix sums); a caller's ``attn_mask`` or Swin's windows are refused.

The projection W (M, D) is a buffer of each module, drawn from a seed (``seed``, the block's index, the draw
number), so a run's features are reproducible on any device; ``redraw=n`` draws new ones every n training forwards
(``redraw=1``: every call, as Google's FAVOR+; lucidrains/performer-pytorch: every 1000), ``redraw=0`` keeps the
first draw. The count is kept in Python (no device read per forward) and saved with the model (``forwards``), so a
resumed run continues the same schedule. Evaluation never redraws.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError
from ..ops import performer_cpu
from ..ops.lowrank import orthogonal_gaussian, performer_attention
from .base import AttnlabAttention, norm_in_dtype
from .capabilities import Capabilities, global_only
from .mask import AttentionMask


class PerformerAttention(AttnlabAttention):
    """FAVOR+ attention; arguments as :class:`AttnlabAttention` plus:

    Args:
        features: number of random features M (default 256).
        redraw: draw new features every this many training forwards (0: never; 1: every call).
        seed: seed of the draws (with the block's index and the draw number).
        impl: ``auto`` (the fused CPU kernel, :mod:`attnlab.ops.performer_cpu`, for float32 forward passes without
            gradient or causal mask outside ``torch.compile``; else torch ops), ``torch`` or ``kernel`` (an error where
            it cannot run).
    """

    #: backends: ``explicit`` the torch ops (``impl=torch``), ``kernel`` the fused CPU kernel (``impl=kernel``)
    capabilities = Capabilities(
        attn_mask="performer cannot honour this attention mask: FAVOR+ has no N x N map to add an attn_mask or Swin's "
                  "window bias to; pass key padding and causality as an AttentionMask instead",
        window=global_only("performer"), head_output=True, backends=("explicit", "kernel"))

    def __init__(self, dim: int, num_heads: int = 8, *, features: int = 256, redraw: int = 0, seed: int = 0,
                 impl: str = "auto", **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        if impl not in ("auto", "torch", "kernel"):
            raise ConfigError(f"performer impl must be auto, torch or kernel, got {impl!r}.")
        self.impl = impl
        self.features, self.redraw, self.seed = features, redraw, seed
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))
        self.register_buffer("projection", self.draw(0))
        self._count = 0  # ``forwards`` as a Python int: the schedule never reads the device
        self._register_load_state_dict_pre_hook(self._load_count)

    def _load_count(self, state_dict, prefix, *args) -> None:
        if prefix + "forwards" in state_dict:
            self._count = int(state_dict[prefix + "forwards"])

    def draw(self, number: int) -> torch.Tensor:
        """Draw ``number`` of this block's projection (M, D): a function of (seed, layer_index, number) alone."""
        key = np.random.SeedSequence([self.seed, self.layer_index, number]).generate_state(2, dtype=np.uint32)
        generator = torch.Generator().manual_seed(int(key[0]) << 32 | int(key[1]))
        return orthogonal_gaussian(self.features, self.head_dim, generator=generator)

    @torch.compiler.disable
    def _advance(self) -> None:
        """Count a training forward; every ``redraw`` of them, load the next draw (without waiting for the device:
        from pinned memory on CUDA)."""
        if self._count and self._count % self.redraw == 0:
            new = self.draw(self._count // self.redraw).to(self.projection.dtype)
            if self.projection.is_cuda:
                self._staged = new.pin_memory()  # kept alive until the asynchronous copy has run
                self.projection.copy_(self._staged, non_blocking=True)
            else:
                self.projection.copy_(new)
        self._count += 1
        self.forwards.fill_(self._count)

    def attend(self, q, k, v, mask: AttentionMask | None = None) -> torch.Tensor:
        key_padding, causal = None, False
        if mask is not None:  # the rest of a mask is refused by mask_of (the record)
            causal = mask.is_causal
            key_padding = None if mask.key_padding is None else mask.key_padding[:, None, :]
        if self.training and self.redraw:
            self._advance()
        projection = self.projection.to(q.dtype)
        if self.impl != "torch":
            why = ("the fused kernel computes bidirectional FAVOR+ without a mask" if mask is not None
                   else performer_cpu.kernel_error(q, k, v, projection))
            if why is None and (self.impl == "kernel" or not torch.compiler.is_compiling()):
                return performer_cpu.performer_kernel(q, k, v, projection)
            if self.impl == "kernel":
                raise ConfigError(f"performer(impl=kernel) cannot run here: {why}; use impl=auto.")
        return performer_attention(q, k, v, projection, key_padding=key_padding, causal=causal)

    def use_backend(self, name: str) -> None:
        """As :meth:`~attnlab.attention.capabilities.Declares.use_backend`: ``explicit`` is ``impl=torch``,
        ``kernel`` ``impl=kernel``."""
        super().use_backend(name)
        self.impl = "torch" if name == "explicit" else "kernel"

    def head_output(self, x, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None, *, head: int,
                    mask: AttentionMask | None = None) -> torch.Tensor:
        """One head's o (N, D) from x (N, C) and its weights (D, C), with the current features; ``mask``: this
        sequence's (a batch of one)."""
        q, k, v = (x @ w.T + (b if b is not None else 0) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))
        q, k = norm_in_dtype(self.q_norm, q), norm_in_dtype(self.k_norm, k)
        kp = None if mask is None or mask.key_padding is None else mask.key_padding[0]
        return performer_attention(q, k, v, self.projection.to(x.dtype), key_padding=kp,
                                   causal=mask is not None and mask.is_causal)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, features={self.features}, redraw={self.redraw}, seed={self.seed}, "
                f"impl={self.impl}")


__all__ = ["PerformerAttention"]
