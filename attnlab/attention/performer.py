"""Performer attention, FAVOR+ (Choromanski et al., "Rethinking Attention with Performers", ICLR 2021,
arXiv:2009.14794), as a kernel term ``performer``.

Per head, with M positive orthogonal random features phi (Lemma 1, Sec. 2.4):

    o_h = phi(q) (phi(k)^T v) / (phi(q) (phi(k)^T 1)),   phi(x) = exp(W x - ||x||^2 / 2) / sqrt(M),  x = q / D^(1/4)

an unbiased estimate of softmax(q k^T / sqrt(D)) v's numerator and denominator, linear in N
(:func:`attnlab.ops.lowrank.performer_attention`). Padded keys weigh 0 in both sums; a causal mask gives the
unidirectional FAVOR+ of Sec. 2.2 (prefix sums). W (M, D) is a buffer drawn from (``seed``, block index, draw
number); ``redraw=n`` draws anew every n training forwards, counted in Python and saved (``forwards``) so a resumed
run keeps the schedule; docs/methods.md, "Low-rank kernels".
"""

from __future__ import annotations

import numpy as np
import torch

from ..ops import performer_cpu
from ..ops.lowrank import orthogonal_gaussian, performer_attention
from .base import AttnlabAttention, Intermediates
from .capabilities import Capabilities, global_only


class PerformerAttention(AttnlabAttention):
    """FAVOR+ attention; arguments as :class:`AttnlabAttention` plus:

    Args:
        features: number of random features M (default 256).
        redraw: draw new features every this many training forwards (0: never; 1: every call).
        seed: seed of the draws (with the block's index and the draw number).
    """

    capabilities = Capabilities(
        attn_mask="performer cannot honour this attention mask: FAVOR+ has no N x N map to add an attn_mask or Swin's "
                  "window bias to; pass key padding and causality as an AttentionMask instead",
        window=global_only("performer"), bias=global_only("performer"), intermediates=("head",),
        backends=("kernel", "explicit"))

    def __init__(self, dim: int, num_heads: int = 8, *, features: int = 256, redraw: int = 0, seed: int = 0,
                 **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
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
                new = self._staged = new.pin_memory()  # kept alive until the asynchronous copy has run
            self.projection.copy_(new, non_blocking=self.projection.is_cuda)
        self._count += 1
        self.forwards.fill_(self._count)

    def supports(self, backend, call):
        """The fused CPU kernel: bidirectional FAVOR+ without a mask, float32 forward passes on the CPU (head dim and
        feature count as :func:`attnlab.ops.performer_cpu.supports`), outside ``torch.compile`` unless forced."""
        if backend != "kernel":
            return super().supports(backend, call)
        for failed, why in ((call.masked, "the fused kernel computes bidirectional FAVOR+ without a mask"),
                            (call.device.type != "cpu", f"the fused kernel runs on the CPU, not {call.device.type}"),
                            (call.dtype != torch.float32, f"the fused kernel takes float32, not {call.dtype}"),
                            (call.needs_grad, "the fused kernel is forward-only; this call needs a gradient"),
                            (not performer_cpu.supports(call.head_dim, self.features),
                             f"the fused kernel takes head dim 16, 32, 48 or 64 and a multiple of 16 features up to "
                             f"1024, got head dim {call.head_dim} and {self.features} features"),
                            (call.compiling and self.backend == "auto", "torch.compile traces the torch ops")):
            if failed:
                return why
        return performer_cpu.unavailable()

    def kernel(self, q, k, v, mask, want, backend):
        if self.training and self.redraw:
            self._advance()
        projection = self.projection.to(q.dtype)
        if backend == "kernel":
            return performer_cpu.performer_kernel(q, k, v, projection), Intermediates()
        kp = None if mask is None or mask.key_padding is None else mask.key_padding[:, None, :]
        causal = mask is not None and mask.is_causal
        return performer_attention(q, k, v, projection, key_padding=kp, causal=causal), Intermediates()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, features={self.features}, redraw={self.redraw}, seed={self.seed}"


__all__ = ["PerformerAttention"]
