"""The shared frame of every attnlab attention module: projections, ViT/Swin biases, head transform, head merge.

A mechanism (standard, dna, diff, cog) subclasses :class:`AttnlabAttention` and overrides :meth:`attend`, which maps
per-head queries, keys and values to per-head outputs. Everything around it is shared and keeps timm's parameter
names, so a converted model loads the original state dict:

    x --qkv--> q, k, v (B, H, N, D) --q_norm/k_norm--> attend(q, k, v, mask) --head_transform--> merge --proj--> y

``mask`` is the one :class:`~attnlab.attention.mask.AttentionMask` of the call (causal order, key padding, a ViT
``attn_mask``, Swin's shifted-window mask), or None; Swin's relative-position bias is the module's own and enters
each branch's logits with it (:meth:`attn_bias`, :meth:`add_bias`). ``head_transform`` is ``nn.Identity`` unless a
head term (``ns``) is set; a forward hook on it sees exactly the tensor right before head merge, which is what the
analyses read. With key padding, the rows of padded queries are zero before the head transform.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

import torch
from torch import nn

from timm.layers import Attention as TimmAttention
from timm.models.davit import ChannelAttention as DaViTChannelAttention
from timm.models.davit import ChannelAttentionV2 as DaViTChannelAttentionV2
from timm.models.davit import WindowAttention as DaViTWindowAttention
from timm.models.swin_transformer import WindowAttention as TimmWindowAttention
from timm.models.swin_transformer import get_relative_position_index
from timm.models.xcit import XCA

from ..errors import UnsupportedModelError
from .capabilities import Capabilities, Declares, capabilities_of
from .mask import AttentionMask


@dataclass
class Branch:
    """One branch of a module's explicit path (:meth:`AttnlabAttention.explicit_maps`): ``weights`` W (B, H, N, M)
    and ``effective`` c_h W (the same tensor when c = 1), the map the module's output is linear in."""

    weights: torch.Tensor
    effective: torch.Tensor


#: :meth:`AttnlabAttention.forward`'s arguments in order; every attention module's forward takes exactly these
FORWARD_ARGUMENTS = ("x", "attn_mask", "is_causal", "mask")


class AttnlabAttention(Declares, nn.Module):
    """Multi-head self-attention for ViT global attention (``window_size=None``) and Swin window attention.

    The constructor mirrors timm's ``Attention`` and ``WindowAttention`` so one mechanism stands in for another.

    Args:
        dim: input (and output) token dimension.
        num_heads: number of heads H.
        qkv_bias: bias in the fused q, k, v projection.
        qk_norm: normalise q and k per head with ``norm_layer`` (timm's QK-norm).
        attn_drop: dropout on attention weights (training only).
        proj_drop: dropout after the output projection.
        norm_layer: normalisation for ``qk_norm`` / ``scale_norm`` (default ``nn.LayerNorm``).
        head_dim: features per head D (default ``dim // num_heads``).
        window_size: Swin window ``(Wh, Ww)``; adds the learned relative-position bias table.
        scale_norm: normalise the merged heads before the projection (timm option).
        proj_bias: bias in the output projection.
        fused_attn: use ``F.scaled_dot_product_attention`` (True) or the explicit, readable path (False).
        layer_index, num_layers: position of this block in the model (some mechanisms depend on depth).
    """

    fused_attn: Final[bool]
    adopts_wide_qkv = False  # True for mechanisms that know how to read a wider fused projection (DnA)
    #: what this mechanism can do (:class:`~attnlab.attention.capabilities.Capabilities`): every mask part honoured,
    #: no KV cache, plain softmax, maps, branches or head formula, the explicit path only. A subclass that overrides
    #: ``attend`` without declaring its own record loses ``plain_softmax``; one that overrides ``attend`` or
    #: ``weights`` loses ``explicit_maps`` as well.
    capabilities = Capabilities()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "capabilities" not in cls.__dict__ and ("attend" in cls.__dict__ or "weights" in cls.__dict__):
            cls.capabilities = replace(cls.capabilities, explicit_maps=False,
                                       plain_softmax=cls.capabilities.plain_softmax and "attend" not in cls.__dict__)

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
        head_dim: int | None = None,
        window_size: tuple[int, int] | None = None,
        scale_norm: bool = False,
        proj_bias: bool = True,
        fused_attn: bool = True,
        layer_index: int = 0,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        norm_layer = norm_layer or nn.LayerNorm
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim or dim // num_heads
        self.attn_dim = self.num_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.fused_attn = fused_attn
        self.layer_index = layer_index
        self.num_layers = num_layers

        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.head_transform: nn.Module = nn.Identity()
        self.norm = norm_layer(self.attn_dim) if scale_norm else nn.Identity()
        self.gate: nn.Linear | None = None
        self.proj = nn.Linear(self.attn_dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

        self.window_size = tuple(window_size) if window_size is not None else None
        why = self.geometry_refusal({"window_size": self.window_size})
        if why:
            raise UnsupportedModelError(f"{why}.")
        if self.window_size is not None:
            win_h, win_w = self.window_size
            self.window_area = win_h * win_w
            self.relative_position_bias_table = nn.Parameter(
                torch.zeros((2 * win_h - 1) * (2 * win_w - 1), num_heads))
            nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
            self.register_buffer("relative_position_index", get_relative_position_index(win_h, win_w),
                                 persistent=False)

    # ---- construction from an existing module ------------------------------------------------------------------
    @classmethod
    def geometry_refusal(cls, geometry: dict) -> str | None:
        """Why this mechanism cannot replace an attention of ``geometry`` (:meth:`geometry`), or None: the record's
        window refusal on a Swin window geometry. Asked by the constructor and by ``variants --support``."""
        return cls.capabilities.window if geometry.get("window_size") is not None else None

    @staticmethod
    def geometry(module: nn.Module) -> dict:
        """Constructor arguments that rebuild ``module`` (timm Attention, WindowAttention, or an attnlab one)."""
        qkv = module.qkv
        num_heads = getattr(module, "num_heads", None) or module.groups  # DaViT's ChannelAttentionV2: groups
        # attnlab's fused projections may be wider than 3 blocks (DnA); timm's modules hold exactly q, k, v
        head_dim = module.head_dim if isinstance(module, AttnlabAttention) else qkv.out_features // 3 // num_heads
        geo = dict(
            dim=qkv.in_features,
            num_heads=num_heads,
            head_dim=head_dim,
            qkv_bias=qkv.bias is not None,
            proj_bias=module.proj.bias is not None,
            # DaViT's attentions have no dropout modules
            attn_drop=module.attn_drop.p if hasattr(module, "attn_drop") else 0.0,
            proj_drop=module.proj_drop.p if hasattr(module, "proj_drop") else 0.0,
            fused_attn=bool(getattr(module, "fused_attn", True)),
        )
        if isinstance(module, TimmWindowAttention):
            geo["window_size"] = tuple(module.window_size)
        elif isinstance(module, AttnlabAttention):
            geo["window_size"] = module.window_size
        return geo

    @classmethod
    def from_module(cls, module: nn.Module, layer_index: int = 0, num_layers: int = 1, **options) -> "AttnlabAttention":
        """Build this mechanism in place of ``module``, taking over its submodules (and so its weights)."""
        new = cls(**cls.geometry(module), layer_index=layer_index, num_layers=num_layers, **options)
        new.adopt(module)
        return new

    def adopt(self, module: nn.Module) -> None:
        """Take ``module``'s shared submodules: q, k, v and output projections, norms, Swin position bias."""
        width = module.qkv.out_features
        if width != 3 * self.attn_dim and not self.adopts_wide_qkv:
            raise UnsupportedModelError(
                f"cannot turn a {type(module).__name__} (a {width}-wide q/k/v projection) into {type(self).__name__}, "
                f"which needs {3 * self.attn_dim}; build the model afresh with the new spec.")
        self.qkv = module.qkv
        self.proj = module.proj
        for name in ("attn_drop", "proj_drop", "q_norm", "k_norm", "norm", "gate"):
            if hasattr(module, name):
                setattr(self, name, getattr(module, name))
        if self.window_size is not None:
            self.relative_position_bias_table = module.relative_position_bias_table
            self.relative_position_index = module.relative_position_index
        self.train(module.training)

    # ---- shared pieces ------------------------------------------------------------------------------------------
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of shape (B, H, N, D), q and k normalised when qk_norm is on."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return self.q_norm(q), self.k_norm(k), v

    def rel_pos_bias(self) -> torch.Tensor:
        """Swin's learned relative-position bias, (1, H, N, N)."""
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(self.window_area, self.window_area, -1).permute(2, 0, 1).contiguous().unsqueeze(0)

    def attn_bias(self, mask: AttentionMask | None, like: torch.Tensor) -> torch.Tensor | None:
        """The additive bias a fused softmax takes for queries ``like`` (B, H, N, D): Swin's position bias plus
        ``mask`` as :meth:`AttentionMask.additive` forms it, broadcastable to (B, H, N, N); None when there is none."""
        B, _, N, _ = like.shape
        return self._with_position_bias(None if mask is None else mask.additive(B, N, N, like.dtype, like.device))

    def _with_position_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Swin's position bias plus ``bias`` (either may be absent)."""
        if self.window_size is None:
            return bias
        return self.rel_pos_bias() if bias is None else self.rel_pos_bias() + bias

    def sdpa_causal(self, mask: AttentionMask | None) -> bool:
        """Whether causality is all this call asks and no position bias is added: SDPA's ``is_causal`` path, no mask
        in memory."""
        return mask is not None and mask.causal_only and self.window_size is None

    def add_bias(self, logits: torch.Tensor, mask: AttentionMask | None) -> torch.Tensor:
        """``logits + bias`` in the order timm's explicit paths add it (position bias, then window mask)."""
        B, _, N, M = logits.shape
        if self.window_size is not None:
            logits = logits + self.rel_pos_bias()
        if mask is not None:
            bias = mask.additive(B, N, M, logits.dtype, logits.device)
            if bias is not None:
                logits = logits + bias
        return logits

    def logit_bias(self, mask: AttentionMask | None, dtype) -> torch.Tensor | None:
        """What is part of every branch's logit besides q k^T: Swin's position bias and a float ``attn_mask``'s
        finite entries (branches that exclude masked positions rather than add -inf: DnA's softmin, Cog)."""
        return self._with_position_bias(None if mask is None else mask.logit_bias(dtype))

    def attend(self, q, k, v, mask: AttentionMask | None = None) -> torch.Tensor:  # pragma: no cover - abstract
        """Per-head outputs (B, H, N, D) from q, k, v (B, H, N, D) and the call's mask; the mechanism's formula."""
        raise NotImplementedError

    def merge(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Head merge and output projection: (B, H, N, D) -> (B, N, dim)."""
        B, _, N, _ = o.shape
        out = self.norm(o.transpose(1, 2).reshape(B, N, self.attn_dim))
        if self.gate is not None:
            out = out * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(out))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | AttentionMask | None = None, is_causal: bool = False,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, N, dim). ``attn_mask``: a ViT mask (SDPA's) or an :class:`AttentionMask`; ``is_causal``: timm's
        flag; ``mask``: Swin's shifted-window mask (num_windows, N, N)."""
        mask = self.mask_of(x, attn_mask, is_causal, mask)
        q, k, v = self.project(x)
        return self.finish(self.attend(q, k, v, mask), mask, x)

    def mask_of(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False, window=None) -> AttentionMask | None:
        """The call's :class:`AttentionMask` (None when nothing is masked), checked against x; UnsupportedModelError
        with the sentence of the mechanism's record, or of a head transform's, that refuses a part of it."""
        mask = AttentionMask.of(attn_mask, is_causal, window)
        if mask is not None:
            mask.check(x.shape[0], x.shape[1])
            for record in (self.capabilities, *(capabilities_of(head) for head in self.heads())):
                why = record.refusal(mask)
                if why:
                    raise UnsupportedModelError(f"{why}.")
        return mask

    def heads(self) -> tuple[nn.Module, ...]:
        """The head transforms applied before head merge, in order (none for ``nn.Identity``)."""
        head = self.head_transform
        if isinstance(head, nn.Identity):
            return ()
        return tuple(head) if isinstance(head, nn.Sequential) else (head,)

    def finish(self, o: torch.Tensor, mask: AttentionMask | None, x: torch.Tensor) -> torch.Tensor:
        """Padded queries' rows zeroed, the head transform, head merge and projection: (B, H, N, D) -> (B, N, dim)."""
        if mask is not None:
            o = mask.zero_padded_queries(o)
        return self.merge(self.head_transform(o), x)

    def forward_mask(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, AttentionMask | None]:
        """(x, the call's mask) from the arguments of a forward call (what a forward hook sees), positional or named
        as :meth:`forward` takes them (every subclass keeps that signature)."""
        bound = {**dict(zip(FORWARD_ARGUMENTS, args)), **kwargs}
        x = bound["x"]
        return x, self.mask_of(x, bound.get("attn_mask"), bound.get("is_causal", False), bound.get("mask"))

    def extra_repr(self) -> str:
        win = f", window_size={self.window_size}" if self.window_size is not None else ""
        return f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}{win}, fused_attn={self.fused_attn}"


#: module types that :func:`attnlab.convert` replaces (exact types: subclasses may change the forward); DaViT's window
#: attention is token softmax attention without a bias; XCA and the channel attentions go to ``attention.channel``
SUPPORTED_TYPES: tuple[type, ...] = (TimmAttention, TimmWindowAttention, DaViTWindowAttention, XCA,
                                     DaViTChannelAttention, DaViTChannelAttentionV2)


def norm_in_dtype(norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """``norm(t)`` with a LayerNorm's parameters detached and cast to ``t``'s dtype: the QK-norm inside a
    ``head_output``, which the Jacobian instrument differentiates in float64 with respect to its input alone."""
    if isinstance(norm, nn.Identity):
        return t
    weight, bias = (p.detach().to(t.dtype) if p is not None else None for p in (norm.weight, norm.bias))
    return nn.functional.layer_norm(t, norm.normalized_shape, weight, bias, norm.eps)


def is_supported(module: nn.Module) -> bool:
    return type(module) in SUPPORTED_TYPES or isinstance(module, AttnlabAttention)


__all__ = ["AttentionMask", "AttnlabAttention", "Branch", "Capabilities", "FORWARD_ARGUMENTS", "SUPPORTED_TYPES",
           "is_supported", "norm_in_dtype"]
