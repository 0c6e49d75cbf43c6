"""Performer attention, FAVOR+ (Choromanski et al., "Rethinking Attention with Performers", ICLR 2021,
arXiv:2009.14794), as a kernel term ``performer``.

Per head, with M positive orthogonal random features phi (Lemma 1, Sec. 2.4):

    o_h = phi(q) (phi(k)^T v) / (phi(q) (phi(k)^T 1)),   phi(x) = exp(W x - ||x||^2 / 2) / sqrt(M),  x = q / D^(1/4)

an unbiased estimate of softmax(q k^T / sqrt(D)) v's numerator and denominator, linear in N
(:func:`attnlab.ops.lowrank.performer_attention`). The projection W (M, D) is a buffer of each module, drawn from
a seed (``seed``, the block's index, the draw number), so a run's features are reproducible; ``redraw=n`` draws new
ones every n training forwards (the authors redraw periodically), ``redraw=0`` keeps the first draw. Both the
projection and the forward count are saved with the model, so a resumed run continues the same schedule.
No additive bias: Swin's windows and attention masks are refused.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError, UnsupportedModelError
from ..ops import performer_cpu
from ..ops.lowrank import orthogonal_gaussian, performer_attention
from .base import AttnlabAttention, norm_in_dtype


class PerformerAttention(AttnlabAttention):
    """FAVOR+ attention; arguments as :class:`AttnlabAttention` plus:

    Args:
        features: number of random features M (default 256).
        redraw: draw new features every this many training forwards (0: never).
        seed: seed of the draws (with the block's index and the draw number).
        impl: ``auto`` (the fused CPU kernel, :mod:`attnlab.ops.performer_cpu`, for float32 forward passes without
            gradient outside ``torch.compile``; else torch ops), ``torch`` or ``kernel`` (an error where it cannot run).
    """

    global_only = "performer"

    def __init__(self, dim: int, num_heads: int = 8, *, features: int = 256, redraw: int = 0, seed: int = 0,
                 impl: str = "auto", **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        if impl not in ("auto", "torch", "kernel"):
            raise ConfigError(f"performer impl must be auto, torch or kernel, got {impl!r}.")
        self.impl = impl
        self.features, self.redraw, self.seed = features, redraw, seed
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))
        self.register_buffer("projection", self.draw(0))

    def draw(self, number: int) -> torch.Tensor:
        """Draw ``number`` of this block's projection (M, D): a function of (seed, layer_index, number) alone."""
        key = np.random.SeedSequence([self.seed, self.layer_index, number]).generate_state(2, dtype=np.uint32)
        generator = torch.Generator().manual_seed(int(key[0]) << 32 | int(key[1]))
        return orthogonal_gaussian(self.features, self.head_dim, generator=generator)

    def attend(self, q, k, v, mask=None, attn_mask=None) -> torch.Tensor:
        if attn_mask is not None or mask is not None:
            raise UnsupportedModelError("performer takes no attention mask; run it on unmasked (global) attention.")
        if self.training and self.redraw:
            count = int(self.forwards)
            if count and count % self.redraw == 0:
                self.projection.copy_(self.draw(count // self.redraw))
            self.forwards += 1
        projection = self.projection.to(q.dtype)
        if self.impl != "torch":
            why = performer_cpu.kernel_error(q, k, v, projection)
            if why is None and (self.impl == "kernel" or not torch.compiler.is_compiling()):
                return performer_cpu.performer_kernel(q, k, v, projection)
            if self.impl == "kernel":
                raise ConfigError(f"performer(impl=kernel) cannot run here: {why}; use impl=auto.")
        return performer_attention(q, k, v, projection)

    def head_output(self, x, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None, *, head: int) -> torch.Tensor:
        """One head's o (N, D) from x (N, C) and its weights (D, C), with the current features."""
        q, k, v = (x @ w.T + (b if b is not None else 0) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))
        q, k = norm_in_dtype(self.q_norm, q), norm_in_dtype(self.k_norm, k)
        return performer_attention(q, k, v, self.projection.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, features={self.features}, redraw={self.redraw}, seed={self.seed}, "
                f"impl={self.impl}")


__all__ = ["PerformerAttention"]
