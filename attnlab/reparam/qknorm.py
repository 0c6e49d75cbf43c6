"""QK-norm: LayerNorm over each head's query and key vectors, before the 1/sqrt(D) scale (timm's ``qk_norm=True``).

    q_h = LN_q(x W_q,h^T + b_q,h),   k_h = LN_k(x W_k,h^T + b_k,h),   logits_h = q_h k_h^T / sqrt(D)

One ``LN_q`` and one ``LN_k`` per attention module, over the head dimension D and shared by its heads, as timm's
``Attention(qk_norm=True)`` builds them (``timm.layers.LayerNorm``, eps 1e-6), stored as ``q_norm`` / ``k_norm`` so
that a timm checkpoint trained with ``qk_norm=True`` loads strictly into ``build_model(..., attn="qknorm")``. The
norm bounds every logit by the norms' own parameters, |logit| <= (sqrt(D) max|g_q| + ||b_q||)(sqrt(D) max|g_k| +
||b_k||) / sqrt(D), whatever W_q and W_k are, and divides out any rescaling of them (why ``qkclip+qknorm`` is
refused). Swin and ``diff`` (LayerNorm of D / 2 per half-head): docs/methods.md, "qknorm".
"""

from __future__ import annotations

from functools import partial

from torch import nn
from timm.layers import LayerNorm

from ..attention.capabilities import capabilities_of

#: LayerNorm epsilon of timm's ViT norm layer (``timm.layers.LayerNorm``), which its ``qk_norm`` norms use
EPS = 1e-6


def apply(model: nn.Module, modules: list[nn.Module]) -> None:
    """Give every attention module in ``modules`` ``q_norm`` and ``k_norm`` = LayerNorm(head_dim, eps=1e-6), or the
    module's own ``qk_norm_layer`` where its model names one (the Llama and Qwen presets: RMSNorm, as Qwen3).

    A module that already normalises q and k (a timm model built with ``qk_norm=True``) keeps its norms and their
    trained weights. The norms are created on the device and in the dtype of the module's ``qkv`` weight.
    """
    for module in modules:
        weight = module.qkv.weight
        # each part of a head's logits (its record's qk_split: diff's halves), as timm's DiffAttention in a ViT does
        width = module.head_dim // capabilities_of(module).qk_split
        # a model's own QK-norm layer where it names one (Llama/Qwen presets: RMSNorm over head_dim, as Qwen3)
        norm = getattr(module, "qk_norm_layer", None) or partial(LayerNorm, eps=EPS)
        for name in ("q_norm", "k_norm"):
            if isinstance(getattr(module, name, nn.Identity()), nn.Identity):
                setattr(module, name, norm(width).to(device=weight.device, dtype=weight.dtype))


def has_qk_norm(module: nn.Module) -> bool:
    """Whether ``module`` normalises its queries or keys after the projection (any non-identity q_norm / k_norm)."""
    return any(not isinstance(getattr(module, name, nn.Identity()), nn.Identity) for name in ("q_norm", "k_norm"))


__all__ = ["EPS", "apply", "has_qk_norm"]
