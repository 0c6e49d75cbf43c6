"""The one attention contract every attnlab mechanism follows (docs/methods.md, "Adding a method"):

    forward(x, attn_mask, is_causal, mask, *, cache, position_bias)      (cross-attention: forward(x, context, ...))
      -> Mask.resolve(...)        every mask argument, Swin's and ViTDet's position bias, a KV cache's offset: one
                                  value; the record refuses, in one line, what the mechanism cannot honour
      -> choose(Call)             each declared backend's supports(call), in the record's order (``backend=`` forces)
      -> project(x, context)      q, k, v per head (B, H, N, D), QK-norm and rotary applied; a KV cache extends k, v
      -> kernel(q, k, v, mask, want, backend) -> (o, Intermediates)    the formula, once
      -> finish(o, mask, x)       padded queries' rows zeroed, head transform (``ns``), head merge, projection

:meth:`AttnlabAttention.run` returns the :class:`Intermediates` with the output; instruments, QK-clip and the KV cache
read them, directly or through :meth:`AttnlabAttention.observe`. A new method is one file: a subclass that writes
``kernel`` (and ``project`` for other projections: cross-attention overrides only that) and declares its
:class:`~attnlab.attention.capabilities.Capabilities`. The constructor keeps timm's parameter names, so a converted
model loads the original state dict.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from timm.models.swin_transformer import WindowAttention as TimmWindowAttention
from timm.models.swin_transformer import get_relative_position_index

from ..errors import ConfigError, UnsupportedModelError
from ..ops.logits import screened_max_logits
from .capabilities import Capabilities, Declares, capabilities_of
from .mask import AttentionMask, Mask


@dataclass
class Branch:
    """One branch's weight map W (B, H, N, M) and ``effective`` c_h W (the same tensor when c = 1), the map the
    module's output is linear in."""

    weights: torch.Tensor
    effective: torch.Tensor


class Want(NamedTuple):
    """What a forward computes besides its output, each only when asked: each branch's weight map (the explicit
    backend); each branch's output and values before its coefficient; float32 logits q k^T / sqrt(D) (plain
    softmax); per-head max logits over the allowed positions, exact for every head whose Cauchy-Schwarz bound
    exceeds ``max_logits`` and that bound for the others (QK-clip passes tau, ``-inf``: every head exact);
    ``heads``: the per-head outputs head merge receives (the head-output spectra, the attention Jacobian)."""

    weights: bool = False
    branches: bool = False
    logits: bool = False
    max_logits: float | None = None
    heads: bool = False

    def __or__(self, other: "Want") -> "Want":
        cap = [m for m in (self.max_logits, other.max_logits) if m is not None]
        return Want(self.weights or other.weights, self.branches or other.branches, self.logits or other.logits,
                    min(cap) if cap else None, self.heads or other.heads)


@dataclass
class Intermediates:
    """The resolved ``mask``, and what ``want`` asked for: ``weights`` {branch: :class:`Branch`}, ``branches``
    (o_pos, o_neg) and ``values`` (v_pos, v_neg) each (B, H, N, D), ``logits`` (B, H, N, M) and ``max_logits`` (H,)
    float32, ``heads`` (B, H, N, D) the per-head outputs after padded queries' zeroing and the head transform."""

    mask: Mask | None = None
    weights: dict[str, Branch] | None = None
    branches: tuple[torch.Tensor, torch.Tensor] | None = None
    values: tuple[torch.Tensor, torch.Tensor] | None = None
    logits: torch.Tensor | None = None
    max_logits: torch.Tensor | None = None
    heads: torch.Tensor | None = None


class Call(NamedTuple):
    """What a backend's ``supports`` decides on, known before the projection runs."""

    device: torch.device
    dtype: torch.dtype  # the compute dtype (autocast's, under autocast)
    needs_grad: bool
    training: bool
    dropout: bool
    masked: bool  # a mask or a position bias of any kind
    head_dim: int
    batch_heads: int
    queries: int
    keys: int
    row_stride: int  # the fused projection's width: the token stride of q, k, v
    want: Want
    compiling: bool


def block_rows(linear: nn.Linear, names: tuple[str, ...], widths) -> dict[str, tuple]:
    """Views (weight rows, bias entries) of each named block of a fused Linear (``widths``: one per block), a shared
    query or value block (``q``, ``v``) also under its positive branch's name (``q_pos``, ``v_pos``, as DnA's)."""
    ends = list(accumulate(widths))
    rows = {name: (linear.weight.data[end - w:end], None if linear.bias is None else linear.bias.data[end - w:end])
            for name, w, end in zip(names, widths, ends)}
    return {**rows, **{f"{name}_pos": rows[name] for name in ("q", "v") if name in rows}}


def copy_rows(dst: dict, src: dict) -> None:
    """Copy each (weight, bias) block of ``src`` into the block of ``dst`` (:func:`block_rows`) of the same name, if
    it has one; a bias without a source bias is zeroed."""
    for name, (weight, bias) in src.items():
        if name in dst:
            w, b = dst[name]
            w.copy_(weight)
            if b is not None:
                b.copy_(bias) if bias is not None else b.zero_()


class LayerCache:
    """One layer's keys and values of the tokens seen so far (as ``project`` returns them), for ``forward(x,
    cache=...)``."""

    def __init__(self) -> None:
        self.k = self.v = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values followed by ``k``, ``v`` (kept for the next call)."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
        self.k, self.v = k, v
        return k, v


class AttnlabAttention(Declares, nn.Module):
    """Multi-head self-attention for ViT global attention (``window_size=None``) and Swin window attention; the
    constructor mirrors timm's ``Attention`` and ``WindowAttention`` so one mechanism stands in for another.

    Args:
        dim: input (and output) token dimension.
        num_heads: number of heads H.
        qkv_bias: bias in the fused q, k, v projection.
        qk_norm: normalise q and k per head with ``norm_layer`` (timm's QK-norm).
        attn_drop: dropout on attention weights (training only).
        proj_drop: dropout after the output projection.
        norm_layer: normalisation for ``qk_norm`` / ``scale_norm`` (default ``nn.LayerNorm``).
        head_dim: features per head D (default ``dim // num_heads``).
        num_kv_heads: key and value heads (grouped-query attention, Ainslie et al., arXiv:2305.13245): each serves
            ``num_heads // num_kv_heads`` consecutive query heads (default ``num_heads``).
        window_size: Swin window ``(Wh, Ww)``; adds the learned relative-position bias table.
        scale_norm: normalise the merged heads before the projection (timm option).
        proj_bias: bias in the output projection.
        backend: ``auto`` (the dispatcher picks, :meth:`choose`) or one of the record's backends, forced.
        layer_index, num_layers: position of this block in the model (some mechanisms depend on depth).
    """

    adopts_wide_qkv = False  # True for mechanisms that read a wider fused projection (DnA)
    qkv_blocks: tuple[str, ...] = ("q", "k", "v")  # the fused projection's row blocks, in order (DnA: its variant's)
    takes_context = False  # True for cross-attention: keys and values from a second sequence (``context``)
    #: every mask part honoured, the explicit backend only; a subclass that writes its own ``kernel`` without
    #: declaring a record keeps only the mask and backend fields
    capabilities = Capabilities()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "kernel" in cls.__dict__ and "capabilities" not in cls.__dict__:
            cls.capabilities = replace(cls.capabilities, plain_softmax=False, intermediates=(), kv_cache=False)

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, norm_layer: type[nn.Module] | None = None,
                 head_dim: int | None = None, num_kv_heads: int | None = None,
                 window_size: tuple[int, int] | None = None, scale_norm: bool = False, proj_bias: bool = True,
                 backend: str = "auto", layer_index: int = 0, num_layers: int = 1) -> None:
        super().__init__()
        self.qk_norm_layer = norm_layer  # what QK-norm builds here (None: the qknorm term's LayerNorm)
        norm_layer = norm_layer or nn.LayerNorm
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim or dim // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={num_heads}: each key head "
                              f"serves a whole group of query heads.")
        self.attn_dim, self.kv_dim = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.use_backend(backend)
        self.layer_index, self.num_layers = layer_index, num_layers
        self._observers: OrderedDict[int, tuple[Want, Callable, bool]] = OrderedDict()

        self.qkv = nn.Linear(dim, self.attn_dim + 2 * self.kv_dim, bias=qkv_bias)
        self.rotary: nn.Module | None = None  # rotary embeddings of q and k after QK-norm (Qwen3's order)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.head_transform: nn.Module = nn.Identity()
        self.norm = norm_layer(self.attn_dim) if scale_norm else nn.Identity()
        self.gate: nn.Linear | None = None
        self.proj = nn.Linear(self.attn_dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

        self.window_size = tuple(window_size) if window_size is not None else None
        if self.window_size is not None:
            if self.capabilities.window:
                raise UnsupportedModelError(f"{self.capabilities.window}.")
            win_h, win_w = self.window_size
            self.window_area = win_h * win_w
            self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * win_h - 1) * (2 * win_w - 1), num_heads))
            nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
            self.register_buffer("relative_position_index", get_relative_position_index(win_h, win_w),
                                 persistent=False)

    # ---- construction from an existing module ------------------------------------------------------------------
    @staticmethod
    def geometry(module: nn.Module) -> dict:
        """Constructor arguments that rebuild ``module`` (timm Attention, WindowAttention, or an attnlab one)."""
        qkv, ours = module.qkv, isinstance(module, AttnlabAttention)
        num_heads = getattr(module, "num_heads", None) or module.groups  # DaViT's ChannelAttentionV2: groups
        geo = dict(dim=qkv.in_features, num_heads=num_heads, num_kv_heads=getattr(module, "num_kv_heads", num_heads),
                   # attnlab's fused projections may be wider than q, k, v (DnA); timm's hold exactly those
                   head_dim=module.head_dim if ours else qkv.out_features // 3 // num_heads,
                   qkv_bias=qkv.bias is not None, proj_bias=module.proj.bias is not None,
                   # DaViT's attentions have no dropout modules
                   attn_drop=module.attn_drop.p if hasattr(module, "attn_drop") else 0.0,
                   proj_drop=module.proj_drop.p if hasattr(module, "proj_drop") else 0.0,
                   # timm's explicit path (fused_attn off) stays explicit; an attnlab module's backend carries over
                   backend=module.backend if ours else "auto" if getattr(module, "fused_attn", True) else "explicit")
        if isinstance(module, TimmWindowAttention):
            geo["window_size"] = tuple(module.window_size)
        elif ours:
            geo.update(window_size=module.window_size, norm_layer=module.qk_norm_layer)
        return geo

    @classmethod
    def from_module(cls, module: nn.Module, layer_index: int = 0, num_layers: int = 1, **options) -> "AttnlabAttention":
        """Build this mechanism in place of ``module``, taking over its submodules (and so its weights)."""
        geo = cls.geometry(module)
        if geo.get("backend") not in ("auto", *cls.capabilities.backends):
            geo["backend"] = "auto"
        if options.get("backend") == "auto":  # the spec's default keeps the module's own path
            del options["backend"]
        # what the new module builds itself (DnA's fused projection, diff's lambdas) on the weights' device and dtype
        ref = next(module.qkv.parameters())  # a stored parameter: reading it runs no parametrisation
        new = cls(**{**geo, **options}, layer_index=layer_index, num_layers=num_layers).to(ref.device, ref.dtype)
        new.adopt(module)
        return new

    def adopt(self, module: nn.Module) -> None:
        """Take ``module``'s shared submodules: q, k, v and output projections, norms, Swin position bias."""
        width = module.qkv.out_features
        if width != self.attn_dim + 2 * self.kv_dim and not self.adopts_wide_qkv:
            raise UnsupportedModelError(
                f"cannot turn a {type(module).__name__} (a {width}-wide q/k/v projection) into {type(self).__name__}, "
                f"which needs {self.attn_dim + 2 * self.kv_dim}; build the model afresh with the new spec.")
        for name in ("qkv", "proj", "attn_drop", "proj_drop", "q_norm", "k_norm", "norm", "gate", "rotary"):
            if hasattr(module, name):
                setattr(self, name, getattr(module, name))
        if self.window_size is not None:
            self.relative_position_bias_table = module.relative_position_bias_table
            self.relative_position_index = module.relative_position_index
        self.train(module.training)

    # ---- the contract ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | AttentionMask | None = None, is_causal: bool = False,
                mask: torch.Tensor | None = None, *, cache: LayerCache | None = None,
                position_bias: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """x: (B, N, dim) -> (B, N, dim). ``attn_mask``: SDPA's (bool or additive) or an :class:`AttentionMask`;
        ``is_causal``: timm's flag; ``mask``: Swin's shifted-window mask (num_windows, N, N); ``cache``: a
        :class:`LayerCache` whose tokens these continue (causal); ``position_bias``: a function of the queries (B, H,
        N, D) giving a bias added to every logit (ViTDet's relative positions)."""
        return self.run(x, attn_mask, is_causal, mask, cache=cache, position_bias=position_bias)[0]

    def run(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False, window: torch.Tensor | None = None, *,
            want: Want = Want(), cache: LayerCache | None = None,
            position_bias: Callable[[torch.Tensor], torch.Tensor] | None = None,
            context: torch.Tensor | None = None) -> tuple[torch.Tensor, Intermediates]:
        """:meth:`forward`'s output and the :class:`Intermediates` that ``want`` (and every observer) asks for;
        ``context`` (B, M, .): the sequence a cross-attention module takes its keys and values from."""
        B, N, _ = x.shape
        offset = 0 if cache is None else cache.length
        M = (N if context is None else context.shape[1]) + offset
        mask = Mask.resolve(attn_mask, is_causal or cache is not None, window, B=B, N=N, M=M, device=x.device,
                            bias=self.rel_pos_bias() if self.window_size is not None else None, offset=offset,
                            cross=context is not None)
        if mask is not None or position_bias is not None:
            for record in (self.capabilities, *(capabilities_of(head) for head in self.heads())):
                why = record.refusal(None if mask is None else mask.parts, position_bias is not None)
                if why:
                    raise UnsupportedModelError(f"{why}.")
        observers = [o for o in self._observers.values() if self.training or not o[2]]
        for seen, _, _ in observers:
            want = want | seen
        device = x.device.type  # the call the dispatcher decides on: compute dtype (autocast's), gradient, shapes
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        backend = self.choose(Call(x.device, torch.get_autocast_dtype(device) if autocast else x.dtype, needs_grad,
                                   self.training, self.training and self.attn_drop.p > 0,
                                   mask is not None or position_bias is not None, self.head_dim, B * self.num_heads,
                                   N, M, self.row_stride(), want, torch.compiler.is_compiling()))
        q, k, v = self.project(x, context)
        if self.rotary is not None:
            q, k = self.rotary(q, k, offset=offset)
        if cache is not None:
            k, v = cache.extend(k, v)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1 and backend not in self.capabilities.grouped:  # each key/value head serves its query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if position_bias is not None:  # from the first H query heads (a second query branch's follow them)
            mask = (mask or Mask(AttentionMask(), B, N, M, x.device)).with_bias(position_bias(q[:, :self.num_heads]))
        o, found = self.kernel(q, k, v, mask, want, backend)
        found.mask = mask
        if want.logits or want.max_logits is not None:
            self.logit_intermediates(q, k, mask, want, found)
        out = self.finish(o, mask, x, found if want.heads else None)
        for _, fn, _ in observers:
            fn(self, found)
        return out, found

    def project(self, x: torch.Tensor, context: torch.Tensor | None = None) -> tuple:
        """q (B, H, N, D), k and v (B, num_kv_heads, N, D), normalised (:meth:`normed`); a mechanism with more
        query or value blocks stacks each block's heads after the first's (cross-attention: k, v from ``context``)."""
        return self.split_heads(self.qkv(x))

    def split_heads(self, y: torch.Tensor) -> tuple:
        """The fused projection's output (B, N, .) as :meth:`project` returns it: views of the query blocks' heads,
        the key heads and the value blocks' heads, normalised (:meth:`normed`)."""
        q_heads = self.num_heads * sum(name.startswith("q") for name in self.qkv_blocks)
        heads = y.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # split: one gradient (tensor_split: 3 slices')
        return self.normed(*heads.split([q_heads, self.num_kv_heads, heads.shape[1] - q_heads - self.num_kv_heads], 1))

    def row_stride(self) -> int:
        """The token stride of q, k and v as :meth:`project` returns them: the fused projection's width."""
        return self.qkv.out_features

    def qkv_widths(self) -> list[int]:
        """Rows per block of the fused projection (:attr:`qkv_blocks`): num_heads heads of a query block, num_kv_heads
        of a key or value block."""
        return [(self.num_heads if name.startswith("q") else self.num_kv_heads) * self.head_dim
                for name in self.qkv_blocks]

    def rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) views of every block of the projection by name (:func:`block_rows`)."""
        return block_rows(self.qkv, self.qkv_blocks, self.qkv_widths())

    def normed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """The per-head steps after the projection: QK-norm on q and k."""
        return self.q_norm(q), self.k_norm(k), v

    def kernel(self, q, k, v, mask: Mask | None, want: Want, backend: str
               ) -> tuple[torch.Tensor, Intermediates]:  # pragma: no cover - abstract
        """The mechanism's formula: per-head outputs (B, H, N, D) from q, k, v and the call's mask, on ``backend``,
        and the intermediates ``want`` asks for."""
        raise NotImplementedError

    def softmax(self, logits: torch.Tensor, mask: Mask | None) -> torch.Tensor:
        """softmax(logits + position bias + mask) over keys, in the order timm's explicit paths add them."""
        return (logits if mask is None else mask.add_to(logits)).softmax(dim=-1)

    def logit_intermediates(self, q, k, mask: Mask | None, want: Want, found: Intermediates) -> None:
        """Float32 logits q k^T / sqrt(D) and per-head max logits over the allowed positions (plain softmax only)."""
        if not self.capabilities.plain_softmax:
            raise UnsupportedModelError(f"{type(self).__name__} does not form one softmax(q k^T / sqrt(D)) per head, "
                                        f"so it has no logits to report.")
        if q.is_meta:  # a model of shapes only has no logits
            return
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            q, k = q.detach(), k.detach()
            if k.shape[1] != q.shape[1]:  # grouped keys the backend took as they are: one per query head here
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            if want.logits:
                found.logits = (q.float() @ k.float().transpose(-2, -1)) * self.scale
            if want.max_logits is not None:
                causal = mask is not None and mask.causal_only
                found.max_logits = screened_max_logits(
                    q, k, self.scale, want.max_logits, causal=causal, keep=None if mask is None or causal else
                    mask.keep(), query_padding=None if mask is None else mask.key_padding)

    def rel_pos_bias(self) -> torch.Tensor:
        """Swin's learned relative-position bias, (1, H, N, N)."""
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(self.window_area, self.window_area, -1).permute(2, 0, 1).contiguous().unsqueeze(0)

    def finish(self, o: torch.Tensor, mask: Mask | None, x: torch.Tensor, found: Intermediates | None = None
               ) -> torch.Tensor:
        """Padded queries' rows zeroed, the head transform (the result kept as ``found.heads``), head merge and
        projection: (B, H, N, D) -> (B, N, dim)."""
        o = self.head_transform(o if mask is None else mask.zero_padded_queries(o))
        if found is not None:
            found.heads = o
        B, _, N, _ = o.shape
        out = self.norm(o.transpose(1, 2).reshape(B, N, self.attn_dim))
        if self.gate is not None:
            out = out * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(out))

    def heads(self) -> tuple[nn.Module, ...]:
        """The head transforms applied before head merge, in order (none for ``nn.Identity``)."""
        head = self.head_transform
        return () if isinstance(head, nn.Identity) else tuple(head) if isinstance(head, nn.Sequential) else (head,)

    def training_refusal(self, device: torch.device, dtype: torch.dtype, masked: bool = False) -> str | None:
        """Why a forced backend (the module's, or a head transform's) cannot run a training step on ``device`` in
        ``dtype``, or None: each one's :meth:`choose` asked with a training step's :class:`Call` (what a run checks
        before it starts)."""
        call = Call(torch.device(device), dtype, True, True, self.attn_drop.p > 0, masked, self.head_dim,
                    self.num_heads, 1, 1, self.row_stride(), Want(), False)
        for module in (self, *self.heads()):
            try:
                module.choose(call)
            except ConfigError:  # a head transform's only such backend is a forward-only kernel
                why = f"cannot run a training step: {module.supports(module.backend, call)}" if module is self else \
                    "is forward-only; training needs a gradient"
                return f"{type(module).__name__}'s {module.backend} backend {why}"
        return None

    def observe(self, want: Want, fn: Callable[["AttnlabAttention", Intermediates], None],
                training_only: bool = False) -> RemovableHandle:
        """From now on every forward (every training forward, with ``training_only``) computes what ``want`` asks
        and calls ``fn(module, intermediates)``; the handle's ``remove()`` ends that. ``want.weights`` makes the
        output the explicit path's, so the maps are in its autograd graph."""
        handle = RemovableHandle(self._observers)
        self._observers[handle.id] = (want, fn, training_only)
        return handle

    def extra_repr(self) -> str:
        win = f", window_size={self.window_size}" if self.window_size is not None else ""
        return f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}{win}, backend={self.backend}"


__all__ = ["AttentionMask", "AttnlabAttention", "Branch", "Call", "Capabilities", "Intermediates", "LayerCache", "Mask",
           "Want", "block_rows", "copy_rows"]
