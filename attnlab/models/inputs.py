"""An input of the form a model takes (zeros), for operation counts and shape checks: images (B, C, H, W) for timm
models, token ids (B, N) for the sequence and language models, clips (B, C, T, H, W) for TimeSformer."""

from __future__ import annotations

import torch
from torch import nn


def image_size(model: nn.Module, img_size: int | tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(channels, height, width) of an image model's input: its patch embedding's, or ``img_size``."""
    embed = getattr(model, "patch_embed", None)
    chans = embed.proj.in_channels if embed is not None and hasattr(embed, "proj") else 3
    if img_size is None:
        cfg = getattr(model, "pretrained_cfg", None) or {}
        size = getattr(embed, "img_size", None) or cfg.get("input_size", (3, 224, 224))[1:]
    else:
        size = img_size
    h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    return chans, int(h), int(w)


def example_input(model: nn.Module, batch: int = 1, device: torch.device | str | None = None,
                  img_size: int | tuple[int, int] | None = None) -> torch.Tensor:
    """Zeros of the form ``model`` takes: its own ``example_input(batch, device)`` where it defines one (attnlab's
    sequence, language and video models), else an image batch at its input size."""
    device = device if device is not None else next(model.parameters()).device
    own = getattr(model, "example_input", None)
    if callable(own):
        return own(batch, device)
    return torch.zeros(batch, *image_size(model, img_size), device=device)


__all__ = ["example_input", "image_size"]
