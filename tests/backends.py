"""Switching a model between its fused and its explicit attention paths, for tests that compare them."""

from __future__ import annotations

from torch import nn

from attnlab.attention.base import AttnlabAttention
from attnlab.attention.dna_cross import DnACrossAttention


def set_fused(model: nn.Module, fused: bool) -> None:
    """timm's ``fused_attn`` flag on timm's attention modules; attnlab's on the dispatcher's choice (``auto``) or the
    explicit backend."""
    for m in model.modules():
        if isinstance(m, (AttnlabAttention, DnACrossAttention)):
            m.use_backend("auto" if fused else "explicit")
        elif hasattr(m, "fused_attn"):
            m.fused_attn = fused
