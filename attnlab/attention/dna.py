"""Denoising attention, DnA ("DnA: Denoising Attention for Visual Tasks", Sec. 3.2, Algorithm 1, Appendix C.5).

Per head h, with s^± = Q^± K^T / sqrt(d) (+ the Swin relative-position bias B):

    A_h = softmax(s^+_h) V^+_h + alpha_h * softmin(s^-_h) V^-_h,     softmin(z) = softmax(-z)     (Sec. 3.2)

The variants of Table 12 (``variant=``):

    qv      Q±V±   separate queries and values (the paper's DnA, default)
    q       Q±V    separate queries, one shared V:   [softmax(s^+) + alpha softmin(s^-)] V
    v       QV±    one query, separate values:        softmax(s) V^+ + alpha softmin(s) V^-
    shared  Â±     one Q and one V, learnable alpha:  [softmax(s) + alpha softmin(s)] V
    sum     A±     one Q and one V, alpha fixed at 1: [softmax(s) + softmin(s)] V

``alpha`` is one learnable scalar per head (``alpha_init=0.5``). ``scale=both`` scales both branches by
1/sqrt(d) (the main text and all of the authors' code); ``scale=neg_only`` scales only the negative branch, as
Algorithm 1 is written.

Masks enter the softmax branch's logits as in standard attention; in the softmin branch a masked position is
*excluded* (weight exactly 0: adding -100 and then negating would make softmin pick it), while B and a float
``attn_mask``'s finite entries stay part of its logit, softmax(-(s^- + B)) over the allowed positions. All
projections of a block are ONE ``nn.Linear`` named ``qkv``, its rows in the authors' order Q+, Q-, K, V+, V- (or
the variant's subset, :func:`block_names`); separate ``q_neg`` / ``v_neg`` Linears in a state dict are fused on
load. :func:`choose_backend` is the one place a backend is picked (``explicit``, the fused CPU ``kernel``, the
opt-in CUDA ``triton``, ``sdpa``), for the self- and the cross-attention module alike; docs/methods.md, "DnA", has
the masks, the layout and the backends in full.

Two-branch convention (shared with ``diff``, declared by ``Capabilities.branches``, read by
:mod:`attnlab.analysis.dna`): ``branch_outputs(x, mask=None) -> (o_pos, o_neg)``, each (B, H, N, D), the two branches
before alpha; ``branch_values(x) -> (v_pos, v_neg)``, each (B, H, N, D); ``branch_coefficients() -> ("alpha", (H,))``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import trunc_normal_

from ..errors import ConfigError, SpecError
from ..ops import dna_cpu
from ..ops.dna_triton import call_error as triton_call_error
from ..ops.dna_triton import dna_attention_triton
from ..ops.sdpa import causal_keep, sdpa
from .base import AttnlabAttention, Branch
from .capabilities import Capabilities
from .mask import AttentionMask

VARIANTS = ("qv", "q", "v", "shared", "sum")
SCALES = ("both", "neg_only")
INITS = ("random", "copy")
BACKENDS = ("auto", "kernel", "triton", "sdpa")


def block_names(variant: str) -> tuple[str, ...]:
    """Row blocks of the fused projection, in order: e.g. ``("q_pos", "q_neg", "k", "v_pos", "v_neg")`` for qv; a
    shared query is named ``"q"`` and a shared value ``"v"``."""
    sep_q, sep_v = variant in ("qv", "q"), variant in ("qv", "v")
    return (("q_pos", "q_neg") if sep_q else ("q",)) + ("k",) + (("v_pos", "v_neg") if sep_v else ("v",))


def _check_options(variant: str, alpha_init: float, scale: str, init: str, neg_init: float) -> None:
    for key, value, allowed in (("variant", variant, VARIANTS), ("scale", scale, SCALES), ("init", init, INITS)):
        if value not in allowed:
            raise SpecError(f"dna({key}={value}) is not valid; {key} is one of: {', '.join(allowed)}.")
    if variant == "sum" and alpha_init != 0.5:
        raise SpecError("dna(variant=sum) fixes alpha at 1; drop alpha_init, or use variant=shared for a "
                        "learnable alpha.")
    if not math.isfinite(alpha_init) or not math.isfinite(neg_init):
        raise SpecError("dna's alpha_init and neg_init must be finite numbers.")


def negative_bias(logit_bias: torch.Tensor | None, keep: torch.Tensor | None, like: torch.Tensor
                  ) -> torch.Tensor | None:
    """Additive bias for the softmin branch in "negated logits" form: softmin weights = softmax(-s^- + bias).

    ``logit_bias``: what is part of the logit besides q k^T (the relative-position bias B, a float mask's finite
    entries; broadcastable to (B, H, N, M)) or None; it enters negated. ``keep``: a bool map (True = attend) or None;
    excluded positions get -inf, i.e. weight exactly 0. Returns None when there is neither.
    """
    bias = None if logit_bias is None else -logit_bias
    if keep is not None:
        excl = torch.zeros(keep.shape, dtype=like.dtype, device=like.device).masked_fill_(~keep, float("-inf"))
        bias = excl if bias is None else bias + excl
    return bias


def negates_query(device: torch.device, is_causal: bool = False) -> bool:
    """How SDPA computes the softmin branch: with -Q- (True) or a negated scale (False: free, on the CPU without
    ``is_causal``, whose kernels scale before taking the row maximum; CUDA's flash kernels take it before scaling,
    and the CPU's causal path returns NaN for a negative scale)."""
    return device.type != "cpu" or is_causal


def dna_branches(q_pos: torch.Tensor, q_neg: torch.Tensor, k: torch.Tensor, v_pos: torch.Tensor, v_neg: torch.Tensor,
                 *, scale_pos: float, scale_neg: float, bias_pos: torch.Tensor | None = None,
                 bias_neg: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two branches of DnA with fused SDPA, each (B, H, N, D):

        o_pos = softmax(scale_pos * q_pos k^T + bias_pos) v_pos
        o_neg = softmax(-scale_neg * q_neg k^T + bias_neg) v_neg  = softmin(scale_neg * q_neg k^T - bias_neg) v_neg

    q_*: (B, H, N, D), k and v_*: (B, H, M, D). ``bias_neg`` is in negated-logit form (see :func:`negative_bias`);
    ``is_causal`` (without biases): query i sees keys j <= i in both branches.
    """
    o_pos = sdpa(q_pos, k, v_pos, attn_mask=bias_pos, dropout_p=dropout_p, scale=scale_pos, is_causal=is_causal)
    negate = negates_query(q_neg.device, is_causal)
    o_neg = sdpa(-q_neg if negate else q_neg, k, v_neg, attn_mask=bias_neg, dropout_p=dropout_p,
                 scale=scale_neg if negate else -scale_neg, is_causal=is_causal)
    return o_pos, o_neg


def combine(o_pos: torch.Tensor, o_neg: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    """o_pos + alpha_h * o_neg for (B, H, N, D) branches; ``alpha`` (H,), or None for alpha fixed at 1."""
    if alpha is None:
        return o_pos + o_neg
    return torch.addcmul(o_pos, alpha.to(o_pos.dtype).view(-1, 1, 1), o_neg)


class Call(NamedTuple):
    """What a DnA backend choice depends on, known before the projection runs (:func:`choose_backend`)."""

    device: torch.device
    dtype: torch.dtype | None  # None: tensors of several dtypes
    needs_grad: bool
    dropout: bool
    masked: bool  # an attention bias or mask of any kind (Swin's position bias included)
    head_dim: int
    batch_heads: int
    queries: int
    keys: int
    row_stride: int  # the largest token stride of q, k, v

    @classmethod
    def of(cls, q_pos, q_neg, k, v_pos, v_neg, alpha=None, *extra, masked: bool, dropout_p: float) -> "Call":
        """The call of these tensors (``extra``: the biases and projection bias, which must match dtype and grad)."""
        tensors = [t for t in (q_pos, q_neg, k, v_pos, v_neg, alpha, *extra) if t is not None]
        same = all(t.dtype in (q_pos.dtype, torch.bool) for t in tensors)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        return cls(q_pos.device, q_pos.dtype if same else None, needs_grad, bool(dropout_p), masked, q_pos.shape[-1],
                   q_pos.shape[0] * q_pos.shape[1], q_pos.shape[-2], k.shape[-2],
                   max(t.stride(-2) for t in (q_pos, q_neg, k, v_pos, v_neg)))


def call_error(backend: str, call: Call) -> str | None:
    """Why ``backend`` (``kernel``, ``triton`` or ``sdpa``) cannot compute ``call``, or None when it can."""
    if backend == "sdpa":
        return None
    if call.dropout:
        return f"the {backend} backend has no attention dropout"
    if backend == "kernel":
        return dna_cpu.call_error(cpu=call.device.type == "cpu", float32=call.dtype == torch.float32,
                                  needs_grad=call.needs_grad, head_dim=call.head_dim, keys=call.keys)
    if backend == "triton":
        return triton_call_error(cuda=call.device.type == "cuda", dtype_ok=call.dtype in (
            torch.float16, torch.bfloat16, torch.float32), bias=call.masked, needs_grad=call.needs_grad,
            head_dim=call.head_dim, batch_heads=call.batch_heads, queries=call.queries, row_stride=call.row_stride)
    raise ConfigError(f"the DnA backend {backend!r} does not exist; use one of: {', '.join(BACKENDS)}.")


class Choice(NamedTuple):
    """:func:`choose_backend`'s answer: the backend and, for each one passed over, why."""

    backend: str
    refused: tuple[tuple[str, str], ...] = ()


def choose_backend(call: Call, requested: str = "auto", fused_attn: bool = True) -> Choice:
    """The one place DnA's backend is picked: ``explicit`` when ``fused_attn`` is off; a ``requested`` backend
    (``kernel``, ``triton``, ``sdpa``) as pinned, ConfigError with the reason when it cannot run ``call``; for
    ``auto`` the first of kernel, triton, sdpa that can."""
    if not fused_attn:
        return Choice("explicit")
    if requested != "auto":
        why = call_error(requested, call)
        if why:
            raise ConfigError(f"DnA's {requested} backend cannot run this call: {why}; use backend='auto'.")
        return Choice(requested)
    refused = []
    for backend in ("kernel", "triton"):
        why = call_error(backend, call)
        if why is None:
            return Choice(backend, tuple(refused))
        refused.append((backend, why))
    return Choice("sdpa", tuple(refused))


def dna_attention(q_pos: torch.Tensor, q_neg: torch.Tensor, k: torch.Tensor, v_pos: torch.Tensor,
                  v_neg: torch.Tensor, alpha: torch.Tensor | None, *, scale_pos: float, scale_neg: float,
                  bias_pos: torch.Tensor | None = None, bias_neg: torch.Tensor | None = None,
                  input_bias: tuple[torch.Tensor | None, ...] | None = None, dropout_p: float = 0.0,
                  is_causal: bool = False, backend: str = "auto") -> torch.Tensor:
    """A_h = softmax(scale_pos q+ k^T + bias_pos) v+ + alpha_h softmin(scale_neg q- k^T - bias_neg) v-, (B, H, N, D).

    q_*: (B, H, N, D), k and v_*: (B, H, M, D); alpha (H,) or None (= 1); ``bias_neg`` in negated-logit form
    (:func:`negative_bias`); ``is_causal`` (without biases): query i sees keys j <= i in both branches;
    ``input_bias``: None or five (H, D) tensors (or None) added to q+, q-, k, v+, v- first (a projection's bias).
    ``backend``: ``auto`` (:func:`choose_backend` picks), or ``kernel`` / ``triton`` / ``sdpa`` pinned.
    """
    args = (q_pos, q_neg, k, v_pos, v_neg, alpha)
    call = Call.of(*args, bias_pos, bias_neg, *(input_bias or ()), dropout_p=dropout_p,
                   masked=bias_pos is not None or bias_neg is not None or is_causal)
    backend = choose_backend(call, backend).backend
    if backend == "kernel":
        if is_causal:
            N, M = q_pos.shape[-2], k.shape[-2]
            causal = causal_keep(N, M, k.device)
            bias_pos = bias_neg = torch.zeros(N, M, device=k.device).masked_fill_(~causal, float("-inf"))
        return dna_cpu.dna_attention(*args, scale_pos=scale_pos, scale_neg=scale_neg, bias_pos=bias_pos,
                                     bias_neg=bias_neg, input_bias=input_bias)
    q_pos, q_neg, k, v_pos, v_neg = add_input_bias((q_pos, q_neg, k, v_pos, v_neg), input_bias)
    if backend == "triton":
        return dna_attention_triton(q_pos, q_neg, k, v_pos, v_neg, alpha, scale_pos=scale_pos, scale_neg=scale_neg)
    return combine(*dna_branches(q_pos, q_neg, k, v_pos, v_neg, scale_pos=scale_pos, scale_neg=scale_neg,
                                 bias_pos=bias_pos, bias_neg=bias_neg, dropout_p=dropout_p, is_causal=is_causal),
                   alpha)


def add_input_bias(heads: tuple[torch.Tensor, ...], input_bias) -> tuple[torch.Tensor, ...]:
    """Each (B, H, ., D) tensor of ``heads`` plus its (H, D) bias (None: unchanged); a tensor passed twice (a
    shared query or value) with the same bias stays one tensor."""
    if input_bias is None:
        return tuple(heads)
    out: list[torch.Tensor] = []
    for i, (t, b) in enumerate(zip(heads, input_bias)):
        prev = next((out[j] for j in range(i) if heads[j] is t and input_bias[j] is b), None)
        if prev is None:
            prev = t if b is None else t + b.to(t.dtype).reshape(1, t.shape[1], 1, t.shape[-1])
        out.append(prev)
    return tuple(out)


# ---- parameters shared by the self- and cross-attention modules --------------------------------------------------
class _DnAParams:
    """Options, alpha and the fused-projection bookkeeping common to :class:`DnAAttention` and
    :class:`attnlab.attention.dna_cross.DnACrossAttention`.

    ``backend`` (attribute, default ``auto``): what :func:`dna_attention` runs when ``fused_attn`` is on; ``kernel``,
    ``triton`` or ``sdpa`` pin one (a benchmark's row, a test)."""

    backend: str = "auto"

    def _setup_dna(self, variant: str, alpha_init: float, scale: str, init: str, neg_init: float) -> None:
        _check_options(variant, alpha_init, scale, init, neg_init)
        self.variant = variant
        self.alpha_init = alpha_init
        self.scale_mode = scale
        self.init = init
        self.neg_init = neg_init
        self.qkv_blocks = block_names(variant)
        # Sec. 3.2: alpha_h, one learnable scalar per head; variant=sum fixes it at 1 (no parameter)
        self.alpha = None if variant == "sum" else nn.Parameter(torch.full((self.num_heads,), float(alpha_init)))
        self.scale_neg = self.head_dim ** -0.5
        self.scale_pos = self.scale_neg if scale == "both" else 1.0

    def alpha_values(self) -> torch.Tensor:
        """alpha_h per head, (H,): the learned values, or ones for ``variant=sum``."""
        return torch.ones(self.num_heads) if self.alpha is None else self.alpha.detach()

    def branch_coefficients(self) -> tuple[str, torch.Tensor]:
        """("alpha", alpha_h per head (H,)): the negative branch's coefficient."""
        return "alpha", self.alpha_values()

    def use_backend(self, name: str) -> None:
        """As :meth:`~attnlab.attention.capabilities.Declares.use_backend`, ``sdpa``, ``kernel`` and ``triton``
        pinned (``backend``)."""
        super().use_backend(name)
        self.backend = "auto" if name == "explicit" else name

    def _init_negative(self, rows: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                       only: tuple[str, ...] = ("q_neg", "v_neg")) -> None:
        """Fill the q_neg / v_neg rows (those in ``only``) in place: ``init=copy`` gives Q- = |neg_init| * Q+ and
        V- = neg_init * V+ (a negative neg_init flips only V-, as the authors' video code does); ``init=random``
        draws timm's init (trunc normal, std 0.02, zero bias)."""
        for neg, pos, factor in (("q_neg", "q_pos", abs(self.neg_init)), ("v_neg", "v_pos", self.neg_init)):
            if neg not in rows or neg not in only:
                continue
            w, b = rows[neg]
            if self.init == "copy":
                pw, pb = rows[pos]
                w.copy_(pw * factor)
                if b is not None:
                    b.copy_(pb * factor)
            else:
                trunc_normal_(w, std=0.02)
                if b is not None:
                    b.zero_()


def _rows(linear: nn.Linear, names: tuple[str, ...], width: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Views (weight rows, bias entries) of each named block of a fused Linear."""
    blocks = {name: slice(i * width, (i + 1) * width) for i, name in enumerate(names)}
    return {name: (linear.weight.data[sl], None if linear.bias is None else linear.bias.data[sl])
            for name, sl in blocks.items()}


def _slots(names: tuple[str, ...], items) -> tuple:
    """(q_pos, q_neg, k, v_pos, v_neg) from one item per named block; a shared query or value (the same object) fills
    both of its slots."""
    named = dict(zip(names, items))
    q_pos, v_pos = named.get("q_pos", named.get("q")), named.get("v_pos", named.get("v"))
    return q_pos, named.get("q_neg", q_pos), named["k"], v_pos, named.get("v_neg", v_pos)


def _canonical(rows: dict) -> dict:
    """Name every block by its branch: a shared "q" serves as q_pos (and q_neg), a shared "v" as v_pos (and v_neg)."""
    out = dict(rows)
    for shared in ("q", "v"):
        if shared in out:
            out.setdefault(f"{shared}_pos", out[shared])
    return out


class DnAAttention(_DnAParams, AttnlabAttention):
    """DnA self-attention for ViT global attention and Swin window attention (Sec. 3.2, Table 12).

    Arguments as :class:`AttnlabAttention` plus:

    Args:
        variant: ``qv`` (Q±V±, default), ``q`` (Q±V), ``v`` (QV±), ``shared`` (Â±) or ``sum`` (A±, alpha = 1).
        alpha_init: initial alpha_h of every head (0.5, as the authors).
        scale: ``both`` (1/sqrt(d) on both branches, main text) or ``neg_only`` (Algorithm 1 as written).
        init: how :meth:`from_module` fills Q- and V-: ``random`` (timm's init) or ``copy`` (warm start:
            Q- = |neg_init| Q, V- = neg_init V, so a converted pretrained model starts next to the original).
        neg_init: the warm-start factor (1e-4, paper Sec. 4.2 and Table 13).
    """

    capabilities = Capabilities(kv_cache=True, explicit_maps=True, branches=True,
                                backends=("sdpa", "explicit", "kernel", "triton"))
    adopts_wide_qkv = True  # reads Q+, K, V+ (and Q-, V-) out of another DnA module's fused projection

    def __init__(self, dim: int, num_heads: int = 8, *, variant: str = "qv", alpha_init: float = 0.5,
                 scale: str = "both", init: str = "random", neg_init: float = 1e-4, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        self._setup_dna(variant, alpha_init, scale, init, neg_init)
        bias = self.qkv.bias is not None
        self.qkv = nn.Linear(dim, len(self.qkv_blocks) * self.attn_dim, bias=bias)
        if init == "copy":
            with torch.no_grad():
                self._init_negative(_canonical(_rows(self.qkv, self.qkv_blocks, self.attn_dim)))
        self._register_load_state_dict_pre_hook(self._fuse_separate_projections)

    # ---- construction from an existing module ------------------------------------------------------------------
    def adopt(self, module: nn.Module) -> None:
        """Take over ``module``'s projections as Q+, K, V+ (and, from a DnA module, its own Q-, V- and alpha);
        fill what is new according to ``init``."""
        fused = self.qkv
        super().adopt(module)  # takes module.qkv (and proj, norms, position bias) as the base class does
        src = module.qkv
        fused = fused.to(device=src.weight.device, dtype=src.weight.dtype)
        src_blocks = module.qkv_blocks if isinstance(module, DnAAttention) else ("q", "k", "v")
        src_rows = _canonical(_rows(src, src_blocks, self.attn_dim))
        dst_rows = _rows(fused, self.qkv_blocks, self.attn_dim)
        with torch.no_grad():
            for name, (w, b) in dst_rows.items():
                key = {"q": "q_pos", "v": "v_pos"}.get(name, name)
                if key not in src_rows:  # a negative branch the source does not have
                    continue
                w.copy_(src_rows[key][0])
                if b is not None:
                    sb = src_rows[key][1]
                    b.copy_(sb) if sb is not None else b.zero_()
            new = tuple(n for n in ("q_neg", "v_neg") if n in dst_rows and n not in src_rows)
            self._init_negative(_canonical(dst_rows), only=new)
        self.qkv = fused
        if self.alpha is not None:
            alpha = getattr(module, "alpha", None)
            if isinstance(alpha, nn.Parameter) and alpha.shape == self.alpha.shape:
                self.alpha = alpha
            else:
                self.alpha = nn.Parameter(self.alpha.detach().to(device=src.weight.device, dtype=src.weight.dtype))

    def _fuse_separate_projections(self, state_dict, prefix, *args) -> None:
        """Load-time hook: a checkpoint with a 3*dim ``qkv`` (Q+, K, V+) and separate ``q_neg`` / ``v_neg``
        Linears becomes this module's fused ``qkv``."""
        sep = [n for n in ("q_neg", "v_neg") if prefix + f"{n}.weight" in state_dict]
        if not sep or prefix + "qkv.weight" not in state_dict:
            return
        for kind in ("weight", "bias"):
            qkv = state_dict.get(prefix + f"qkv.{kind}")
            if qkv is None:
                continue
            parts = dict(zip(("q_pos", "k", "v_pos"), qkv.split(self.attn_dim)))
            for name in sep:
                t = state_dict.pop(prefix + f"{name}.{kind}", None)
                if t is not None:
                    parts[name] = t
            try:
                fused = [parts[{"q": "q_pos", "v": "v_pos"}.get(n, n)] for n in self.qkv_blocks]
                state_dict[prefix + f"qkv.{kind}"] = torch.cat(fused)
            except KeyError as err:
                raise SpecError(f"checkpoint at {prefix!r} lacks {err.args[0]}.{kind} that dna(variant="
                                f"{self.variant}) needs.") from None

    # ---- the mechanism ---------------------------------------------------------------------------------------------
    def project(self, x: torch.Tensor):
        """``((q_pos, q_neg), k, (v_pos, v_neg))``, each (B, H, N, D); a shared query or value fills both slots.

        Q and K are normalised per head when qk_norm is on (each query branch by the same ``q_norm``).
        """
        q, k, v, _ = self._project(x, defer_bias=False)
        return q, k, v

    def _project(self, x: torch.Tensor, defer_bias: bool):
        """:meth:`project`'s result and the projection bias still to be added (five (H, D) tensors, or None; see
        :func:`dna_attention`). ``defer_bias`` (the kernel will run, and no QK-norm acts on the biased projection):
        the projection is one bias-free GEMM and the kernel adds the bias as it copies each head, which spares a
        pass over the (B, N, 5*dim) output (docs/perf.md); forward hooks on ``qkv`` do not see that GEMM.
        ``qkv.weight`` is read once (a parametrisation such as sigma's power iteration runs on each read)."""
        B, N, _ = x.shape
        H, D, nb = self.num_heads, self.head_dim, len(self.qkv_blocks)
        defer = defer_bias and isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)
        if defer:
            w, b = self.qkv.weight, self.qkv.bias
            y = F.linear(x, w)
        else:
            y, b = self.qkv(x), None
        blocks = y.view(B, N, nb, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        q_pos, q_neg, k, v_pos, v_neg = _slots(self.qkv_blocks, blocks)
        input_bias = None if b is None else _slots(self.qkv_blocks, b.view(nb, H, D).unbind(0))
        if not defer:
            shared_q = q_neg is q_pos
            q_pos, k = self.q_norm(q_pos), self.k_norm(k)
            q_neg = q_pos if shared_q else self.q_norm(q_neg)
        return (q_pos, q_neg), k, (v_pos, v_neg), input_bias

    def choose(self, x: torch.Tensor, mask: AttentionMask | None) -> Choice:
        """This forward's backend (:func:`choose_backend`), from x (B, N, dim) before the projection runs: its device,
        its dtype (autocast's, under autocast), whether a gradient will be needed (x's or any parameter's), dropout,
        the mask, and the fused projection's layout."""
        device = x.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        call = Call(x.device, dtype, needs_grad, self.training and self.attn_drop.p > 0,
                    mask is not None or self.window_size is not None, self.head_dim, x.shape[0] * self.num_heads,
                    x.shape[1], x.shape[1], len(self.qkv_blocks) * self.attn_dim)
        return choose_backend(call, self.backend, self.fused_attn)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | AttentionMask | None = None, is_causal: bool = False,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`AttnlabAttention.forward`: the backend is chosen first (:meth:`choose`), so the projection can
        leave its bias to the kernel."""
        mask = self.mask_of(x, attn_mask, is_causal, mask)
        backend = self.choose(x, mask).backend
        q, k, v, input_bias = self._project(x, defer_bias=backend == "kernel")
        return self.finish(self.attend(q, k, v, mask, input_bias=input_bias, backend=backend), mask, x)

    def _biases(self, mask: AttentionMask | None, like: torch.Tensor):
        """(bias_pos, bias_neg, is_causal) for the fused backends: the standard fused bias, the softmin branch's in
        negated-logit form (both None and ``is_causal`` True when causality is all the mask asks)."""
        if self.sdpa_causal(mask):
            return None, None, True
        return self.attn_bias(mask, like), self._softmin_bias(mask, like, like.shape[-2]), False

    def _softmin_bias(self, mask: AttentionMask | None, like: torch.Tensor, M: int) -> torch.Tensor | None:
        """The softmin branch's bias in negated-logit form (:func:`negative_bias`) for ``like`` (B, H, N, .)."""
        keep = None if mask is None else mask.keep(like.shape[0], like.shape[-2], M, like.device)
        return negative_bias(self.logit_bias(mask, like.dtype), keep, like)

    def weights(self, q, k, mask: AttentionMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Explicit attention weights (softmax(s^+), softmin(s^-)), each (B, H, N, N); q = (q_pos, q_neg).

        A shared query's q k^T is computed once (variants v, shared, sum), as in the paper's operation count.
        """
        (q_pos, q_neg) = q
        kt = k.transpose(-2, -1)
        qk_pos = q_pos @ kt
        qk_neg = qk_pos if q_neg is q_pos else q_neg @ kt
        w_pos = self.add_bias(qk_pos * self.scale_pos, mask).softmax(dim=-1)
        neg_logits = qk_neg * -self.scale_neg  # softmin(s) = softmax(-s)
        bias_neg = self._softmin_bias(mask, qk_neg, qk_neg.shape[-1])
        if bias_neg is not None:
            neg_logits = neg_logits + bias_neg
        return w_pos, neg_logits.softmax(dim=-1)

    def branches(self, q, k, v, mask: AttentionMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_pos, o_neg), each (B, H, N, D), before alpha: softmax(s^+) V^+ and softmin(s^-) V^-."""
        (q_pos, q_neg), (v_pos, v_neg) = q, v
        if self.fused_attn:
            bias_pos, bias_neg, is_causal = self._biases(mask, q_pos)
            return dna_branches(q_pos, q_neg, k, v_pos, v_neg, scale_pos=self.scale_pos, scale_neg=self.scale_neg,
                                bias_pos=bias_pos, bias_neg=bias_neg, is_causal=is_causal,
                                dropout_p=self.attn_drop.p if self.training else 0.0)
        w_pos, w_neg = self.weights(q, k, mask)
        return self.attn_drop(w_pos) @ v_pos, self.attn_drop(w_neg) @ v_neg

    def attend(self, q, k, v, mask: AttentionMask | None = None, input_bias=None, backend: str | None = None
               ) -> torch.Tensor:
        """A_h = softmax(s^+) V^+ + alpha_h softmin(s^-) V^-, (B, H, N, D); q = (q_pos, q_neg), v = (v_pos, v_neg),
        ``input_bias`` as :func:`dna_attention`; ``backend`` as :meth:`choose` returned it (default: ``explicit``
        when ``fused_attn`` is off, else :func:`choose_backend` on these tensors with ``self.backend``).

        The explicit path with a shared V (variants q, shared, sum) forms [softmax(s^+) + alpha softmin(s^-)] V,
        one product with V, as Table 12 writes it.
        """
        (q_pos, q_neg), (v_pos, v_neg) = q, v
        backend = backend or ("explicit" if not self.fused_attn else self.backend)
        if backend != "explicit":
            bias_pos, bias_neg, is_causal = self._biases(mask, q_pos)
            return dna_attention(q_pos, q_neg, k, v_pos, v_neg, self.alpha, scale_pos=self.scale_pos,
                                 scale_neg=self.scale_neg, bias_pos=bias_pos, bias_neg=bias_neg, is_causal=is_causal,
                                 input_bias=input_bias, dropout_p=self.attn_drop.p if self.training else 0.0,
                                 backend=backend)
        q_pos, q_neg, k, v_pos, v_neg = add_input_bias((q_pos, q_neg, k, v_pos, v_neg), input_bias)
        w_pos, w_neg = self.weights((q_pos, q_neg), k, mask)
        if v_pos is not v_neg:
            return combine(self.attn_drop(w_pos) @ v_pos, self.attn_drop(w_neg) @ v_neg, self.alpha)
        return self.attn_drop(combine(w_pos, w_neg, self.alpha)) @ v_pos

    # ---- the two-branch convention and the weight maps (analysis) ------------------------------------------------
    def branch_outputs(self, x: torch.Tensor, mask: AttentionMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A^{Q+V+}_h, A^{Q-V-}_h) for x: (B, N, dim), each (B, H, N, D), before alpha and head merge."""
        q, k, v = self.project(x)
        return self.branches(q, k, v, mask)

    def explicit_maps(self, x: torch.Tensor, mask: AttentionMask | None = None):
        """(output, {"pos": softmax(s^+), "neg": softmin(s^-) with coefficient alpha_h}) on the explicit path."""
        q, k, (v_pos, v_neg) = self.project(x)
        w_pos, w_neg = self.weights(q, k, mask)
        e_neg = w_neg if self.alpha is None else self.alpha.to(w_neg.dtype).view(-1, 1, 1) * w_neg
        o = w_pos @ v_pos + e_neg @ v_neg
        return self.finish(o, mask, x), {"pos": Branch(w_pos, w_pos), "neg": Branch(w_neg, e_neg)}

    def branch_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(V^+_h, V^-_h) for x: (B, N, dim), each (B, H, N, D); the same tensor twice when V is shared."""
        _, _, (v_pos, v_neg) = self.project(x)
        return v_pos, v_neg

    def projection(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) views of one block of the fused ``qkv``: ``q_pos``, ``q_neg``, ``k``, ``v_pos``,
        ``v_neg`` (or ``q`` / ``v`` when shared)."""
        rows = _canonical(_rows(self.qkv, self.qkv_blocks, self.attn_dim))
        if name not in rows:
            raise KeyError(f"dna(variant={self.variant}) has no {name!r} projection; it has "
                           f"{', '.join(self.qkv_blocks)}.")
        return rows[name]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, variant={self.variant}, scale={self.scale_mode}"


__all__ = ["BACKENDS", "Call", "Choice", "DnAAttention", "add_input_bias", "block_names",
           "call_error", "choose_backend", "combine", "dna_attention", "dna_branches", "negates_query",
           "negative_bias", "VARIANTS"]
