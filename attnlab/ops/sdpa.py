"""``softmax(scale * q k^T + mask) v``: PyTorch's fused SDPA, or the explicit product where that measures faster.

PyTorch's CPU flash kernel streams over key blocks, which wins for long sequences, but its backward is slow for
the short ones vision models use (65 tokens in ``vit_cifar``, 16 or 49 per Swin window), and very slow in bf16
(explicit / fused fwd+bwd time 0.72 at N = 65 in fp32, 0.17 in bf16; docs/perf.md, "End-to-end training", has the
crossover table). So inside :func:`short_sequence_products` (the trainer's and the throughput benchmark's
steps), CPU passes that need a gradient take the explicit product up to :data:`EXPLICIT_MAX_KEYS` keys; everything
else (inference, GPUs, long sequences, and any forward outside a training step, so that ``convert(model,
"standard")`` stays bit-identical to timm) calls SDPA.

The training-step hint is a flag that only :func:`short_sequence_products` sets and only :func:`explicit_is_faster`
reads: a module global, because ``torch.compile`` guards on a global's value and recompiles when it changes, while a
``ContextVar`` or a ``threading.local`` read inside a compiled forward is baked into the graph and goes stale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["EXPLICIT_MAX_KEYS", "causal_keep", "explicit_is_faster", "sdpa", "short_sequence_products"]

# largest key count at which the explicit product is faster for a CPU training step, per compute dtype
EXPLICIT_MAX_KEYS = {torch.float32: 96, torch.bfloat16: 224, torch.float16: 224}


_enabled = False


def causal_keep(N: int, M: int, device=None, offset: int = 0) -> torch.Tensor:
    """The causal order as a keep map (N, M), True where query i may attend key j: j <= i + ``offset`` (SDPA's
    top-left convention at ``offset=0``; a tile whose first query is r0 and first key c0 takes ``offset=r0 - c0``).
    The one place attnlab builds the causal triangle."""
    return torch.ones(N, M, dtype=torch.bool, device=device).tril(offset)


@contextlib.contextmanager
def short_sequence_products(enabled: bool = True) -> Iterator[None]:
    """Within: :func:`sdpa` may take the explicit product (a training step's forward)."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def explicit_is_faster(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``softmax(q k^T) v`` should run as explicit products here: inside :func:`short_sequence_products`,
    on the CPU, a gradient needed, few keys."""
    if not (_enabled and q.device.type == "cpu" and torch.is_grad_enabled()):
        return False
    if not (q.requires_grad or k.requires_grad):
        return False
    return k.shape[-2] <= EXPLICIT_MAX_KEYS.get(q.dtype, 0)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, scale: float | None = None, is_causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s result (same arguments), by whichever path :func:`explicit_is_faster`
    picks. ``attn_mask``: additive (float) or keep-mask (bool), broadcastable; ``is_causal``: query i attends keys
    j <= i (not together with ``attn_mask``)."""
    if not explicit_is_faster(q, k):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                              is_causal=is_causal)
    logits = (q * (q.shape[-1] ** -0.5 if scale is None else scale)) @ k.transpose(-2, -1)
    if is_causal:
        attn_mask = causal_keep(q.shape[-2], k.shape[-2], q.device)
    if attn_mask is not None:
        logits = logits.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else logits + attn_mask
    weights = logits.softmax(dim=-1, dtype=torch.float32).to(v.dtype)  # bf16 logits, float32 normalisation
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return weights @ v
