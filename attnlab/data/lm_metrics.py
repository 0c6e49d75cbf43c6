"""Language-model loss and metrics, as functions of next-token logits (B, N, V) and targets (B, N).

    loss         mean cross-entropy in nats over the counted positions (targets != -100; MQAR counts its queries)
    perplexity   exp(loss)
    bits/byte    loss * tokens / (bytes * ln 2) = loss / (bytes_per_token * ln 2)   (1 byte per token: loss / ln 2)
    accuracy     share of counted positions whose most likely token is the target (MQAR's metric)
    z-loss       z * mean over counted positions of (log sum_v exp logit_v)^2   (PaLM; Wortsman et al. 2023 use 1e-4)

An evaluation sums losses and counts over every position before dividing, so batches of unequal counts weigh by
their tokens.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy (float32) over positions whose target is not -100, plus the optional z-loss."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    y = targets.reshape(-1)
    loss = F.cross_entropy(flat, y, ignore_index=IGNORE)
    if z_loss:
        keep = y != IGNORE
        loss = loss + z_loss * torch.logsumexp(flat[keep], dim=-1).square().mean()
    return loss


def perplexity(loss: float) -> float:
    """exp(loss) of a mean loss in nats per token (inf where it overflows)."""
    return math.exp(loss) if loss < 700 else math.inf


def bits_per_byte(loss: float, bytes_per_token: float) -> float:
    """Nats per token -> bits per byte of the text those tokens encode."""
    return loss / (bytes_per_token * math.log(2))


def batch_sums(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int, int]:
    """(summed cross-entropy in nats, counted positions, correct argmax predictions) of one batch."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    y = targets.reshape(-1)
    keep = y != IGNORE
    total = F.cross_entropy(flat, y, ignore_index=IGNORE, reduction="sum")
    correct = (flat[keep].argmax(dim=-1) == y[keep]).sum()
    return float(total), int(keep.sum()), int(correct)


def summarize(total: float, count: int, correct: int, bytes_per_token: float | None = None) -> dict[str, float]:
    """``loss``, ``perplexity``, ``accuracy`` and (when the bytes per token are known) ``bits_per_byte``."""
    loss = total / max(count, 1)
    out = {"loss": loss, "perplexity": perplexity(loss), "accuracy": correct / max(count, 1)}
    if bytes_per_token:
        out["bits_per_byte"] = bits_per_byte(loss, bytes_per_token)
    return out


@torch.no_grad()
def evaluate_lm(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                bytes_per_token: float | None = None, device: torch.device | str | None = None,
                amp_dtype: torch.dtype | None = None) -> dict[str, float]:
    """:func:`summarize` over every (x, y) of ``batches`` (``model(x)`` the logits), in eval mode (restored after)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    total, count, correct = 0.0, 0, 0
    was_training = model.training
    model.eval()
    autocast = (torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext())
    try:
        for x, y in batches:
            with autocast:
                logits = model(x.to(device))
            t, c, k = batch_sums(logits, y.to(device))
            total, count, correct = total + t, count + c, correct + k
    finally:
        model.train(was_training)
    return summarize(total, count, correct, bytes_per_token)


__all__ = ["IGNORE", "batch_sums", "bits_per_byte", "evaluate_lm", "lm_loss", "perplexity", "summarize"]
