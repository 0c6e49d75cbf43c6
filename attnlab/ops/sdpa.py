"""The causal order as a keep map, and when the explicit product beats PyTorch's fused SDPA.

PyTorch's CPU flash kernel wins for long sequences, but its backward is slow for the short ones vision models use
(65 tokens in ``vit_cifar``, 16 or 49 per Swin window), and very slow in bf16 (docs/perf.md, "End-to-end training",
has the crossover table). So the attention dispatcher passes SDPA over for a CPU training forward that needs a
gradient and has at most :data:`EXPLICIT_MAX_KEYS` keys; everything else calls SDPA.
"""

from __future__ import annotations

import torch

__all__ = ["EXPLICIT_MAX_KEYS", "causal_keep", "explicit_is_faster"]

# largest key count at which the explicit product is faster for a CPU training step, per compute dtype
EXPLICIT_MAX_KEYS = {torch.float32: 96, torch.bfloat16: 224, torch.float16: 224}


def causal_keep(N: int, M: int, device=None, offset: int = 0) -> torch.Tensor:
    """The causal order as a keep map (N, M), True where query i may attend key j: j <= i + ``offset`` (SDPA's
    top-left convention at 0; a tile at query r0 and key c0 takes r0 - c0, queries after a KV cache's L keys L). The
    one place attnlab builds the causal triangle."""
    return torch.ones(N, M, dtype=torch.bool, device=device).tril(offset)


def explicit_is_faster(call) -> bool:
    """Whether a softmax over ``call``'s keys (an attention :class:`~attnlab.attention.base.Call`) runs faster as
    explicit products: a CPU training forward that needs a gradient, few keys."""
    return (call.device.type == "cpu" and call.training and call.needs_grad
            and call.keys <= EXPLICIT_MAX_KEYS.get(call.dtype, 0))
