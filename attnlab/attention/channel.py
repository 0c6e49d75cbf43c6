"""Channel attention: a D x D softmax map over each head's features, built from sums over tokens.

DaViT's channel attention (Ding et al., "DaViT: Dual Attention Vision Transformers", arXiv:2204.03645, Sec. 3.2),
as timm computes it (timm and the authors' code name the projections so that k and v form the map and q is mixed):

    A_h = softmax(s * k_h^T v_h)     (D x D, softmax over the last index),   o_h = q_h A_h^T     (N x D)

with s = 1/sqrt(D) (``ChannelAttention``), or s = 1/sqrt(N) on q and the map softmax(s q^T k) mixing v
(``ChannelAttentionV2``, the Florence-2 models). XCiT's cross-covariance attention (:mod:`attnlab.attention.xca`) is
of the same family. Which terms act on a channel map, and why: docs/methods.md, "XCiT and DaViT".
"""

from __future__ import annotations

from typing import ClassVar

from timm.models.davit import ChannelAttentionV2 as TimmChannelAttentionV2

from .base import AttnlabAttention, Intermediates
from .capabilities import Capabilities


#: why a term does not apply to a channel map, by term; a kernel term missing here gets the generic sentence
CHANNEL_REFUSALS: dict[str, str] = {
    "dna": "DnA's softmin branch is defined on the token-by-token map (it down-weights tokens, Sec. 3.2 of the DnA "
           "paper), and the paper gives no meaning for it on a feature-by-feature map",
    "diff": "Differential attention subtracts two token-by-token maps, and its paper gives no form for a "
            "feature-by-feature map",
    "cog": "Cog attention signs the weights of a token-by-token map, and its paper gives no form for a "
           "feature-by-feature map",
    "qkclip": "QK-clip caps the token logits q k^T / sqrt(D) by rescaling W_q and W_k, which a channel map's "
              "logits are not",
}


def channel_capabilities(family: str, backends: tuple[str, ...] = ("explicit",)) -> Capabilities:
    """The record of a channel map: every mask refused (a D x D map summed over every token has no token-by-token
    mask), its own head formula for the Jacobian."""
    why = (f"{family} takes no attention mask: its map is D x D over features, summed over every token, so no "
           f"token-by-token mask applies to it")
    return Capabilities(causal=why, key_padding=why, attn_mask=why, window=why, bias=why, intermediates=("head",),
                        backends=backends)


class ChannelMapAttention(AttnlabAttention):
    """Base of the mechanisms whose map is D x D over features; ``family`` names the module kind in messages."""

    family: ClassVar[str] = "channel attention"
    capabilities = channel_capabilities(family)

    @classmethod
    def refusal(cls, term: str, kind: str) -> str | None:
        """Why ``term`` (of ``kind``) cannot act on this module, or None when it can."""
        if kind == "kernel" and term != "standard":
            return CHANNEL_REFUSALS.get(term, f"{term} is a token-attention kernel, and {cls.family}'s map is "
                                              f"D x D over features, for which it has no form")
        return CHANNEL_REFUSALS.get(term)


class DaViTChannelAttention(ChannelMapAttention):
    """DaViT's channel attention (timm ``ChannelAttention``), or with ``v2`` timm's ``ChannelAttentionV2``, whose
    ``dynamic_scale`` takes s = 1/sqrt(N). Arguments as :class:`AttnlabAttention` plus those two."""

    family = "DaViT's channel attention"
    capabilities = channel_capabilities(family)

    def __init__(self, *args, v2: bool = False, dynamic_scale: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.v2, self.dynamic_scale = v2, dynamic_scale

    @staticmethod
    def geometry(module) -> dict:
        geo = AttnlabAttention.geometry(module)
        if isinstance(module, DaViTChannelAttention):
            geo.update(v2=module.v2, dynamic_scale=module.dynamic_scale)
        elif isinstance(module, TimmChannelAttentionV2):
            geo.update(v2=True, dynamic_scale=module.dynamic_scale)
        return geo

    def normed(self, q, k, v):
        """With qknorm the map's factors are normalised (v2: q, k; v1: k by q_norm, v by k_norm)."""
        return super().normed(q, k, v) if self.v2 else (q, self.q_norm(k), self.k_norm(v))

    def kernel(self, q, k, v, mask, want, backend):
        if self.v2:  # timm's ChannelAttentionV2, operation for operation
            q = q * (q.shape[-2] ** -0.5 if self.dynamic_scale else self.scale)
            attn = (q.transpose(-1, -2) @ k).softmax(dim=-1)
            return (attn @ v.transpose(-1, -2)).transpose(-1, -2), Intermediates()
        k = k * self.scale  # timm's ChannelAttention: k and v form the map, q is mixed
        attn = (k.transpose(-1, -2) @ v).softmax(dim=-1)
        return (attn @ q.transpose(-1, -2)).transpose(-1, -2), Intermediates()

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", v2=True, dynamic_scale={self.dynamic_scale}" if self.v2 else "")


__all__ = ["CHANNEL_REFUSALS", "ChannelMapAttention", "DaViTChannelAttention", "channel_capabilities"]
