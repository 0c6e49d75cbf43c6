"""Rotary position embeddings (Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding",
arXiv:2104.09864), in the rotate-half layout of Llama and Qwen: feature i is paired with feature i + D/2.

    q_m = q * cos(m theta_i) + rotate_half(q) * sin(m theta_i),   theta_i = base^(-2i / D),  rotate_half(x) = [-x2, x1]

for the token at position m; q k^T then depends on positions only through their difference.

The base must be a finite number above 1 that float32 holds (``THETA_MIN < base <= THETA_MAX``): then the D/2
frequencies fall geometrically from 1 to about 1/base, each pair turning at its own rate. At 1 every pair turns at
the same rate, below 1 the pairs turn faster than one radian per token (aliased), 0 and negative bases give infinite
or NaN angles, and a base float32 rounds to infinity (the angles are computed in float32) leaves one pair turning.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from torch import nn

from ..errors import ConfigError

#: the open lower and the closed upper bound of the base (float32's largest finite number: the angles are float32)
THETA_MIN, THETA_MAX = 1.0, float(torch.finfo(torch.float32).max)


def theta_ok(theta: object) -> bool:
    """Whether ``theta`` is a real number (not a boolean) with THETA_MIN < theta <= THETA_MAX (module docstring)."""
    return (isinstance(theta, (int, float)) and not isinstance(theta, bool) and math.isfinite(theta)
            and THETA_MIN < theta <= THETA_MAX)


class Rotary(nn.Module):
    """Rotates queries and keys (..., N, D) by their positions ``offset``, ``offset + 1``, ...; ``theta``: the base
    (Llama 2: 10,000; Llama 3: 500,000; Qwen: 1,000,000). No parameters, so state dicts do not change."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ConfigError(f"rotary embeddings pair features, so the head dimension must be even, not {head_dim}.")
        if not theta_ok(theta):
            raise ConfigError(f"the rotary base theta is {theta!r}, not a finite number above {THETA_MIN:g} and at "
                              f"most {THETA_MAX:.4g}; give one such as 10000.0.")
        self.head_dim, self.theta = head_dim, float(theta)
        # in float32 arithmetic, as Hugging Face's Llama and Qwen compute it
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, *ts: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, ...]:
        """Each of ``ts`` (..., N, D) with token n rotated by angle (offset + n) theta_i (the angles computed once
        for all). The angles, their cosines and sines are computed in float32 whatever the dtype, as Hugging Face's
        Llama and Qwen do, so a float64 model gives their logits; the rotation itself runs in each tensor's dtype."""
        t = ts[0]
        device = t.device.type
        with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext():
            positions = torch.arange(offset, offset + t.shape[-2], device=t.device, dtype=torch.float32)
            angles = positions[:, None] * self.inv_freq.to(device=t.device, dtype=torch.float32)[None, :]
            cos, sin = (torch.cat([f, f], dim=-1) for f in (angles.cos(), angles.sin()))
        return tuple(_turn(x, cos.to(x.dtype), sin.to(x.dtype)) for x in ts)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta:g}"


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


__all__ = ["THETA_MAX", "THETA_MIN", "Rotary", "theta_ok"]
