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

Masks. Swin's shifted-window mask (0 / -100) and a ViT ``attn_mask`` enter the softmax branch's logits exactly as
in standard attention. In the softmin branch a masked position is *excluded* (weight exactly 0): adding -100 to a
logit and then negating it would make softmin pick precisely the masked positions. The relative-position bias B is
part of each branch's logit, so the softmin branch is softmax(-(s^- + B)) over the allowed positions. A float
``attn_mask`` counts as a mask in the softmin branch: its negative entries exclude a position.

Layout. All projections of a block are ONE ``nn.Linear`` named ``qkv`` (kept name, new width), its rows in the
authors' order Q+, Q-, K, V+, V- (width 5*dim for ``qv``; Q+, Q-, K, V for ``q``; Q, K, V+, V- for ``v``; Q, K, V
for ``shared`` / ``sum``). State dicts that keep Q- and V- as separate ``q_neg`` / ``v_neg`` Linears next to a
3*dim ``qkv`` are fused on load.

Backends. :func:`dna_attention` is the one place a backend is picked, for the self- and the cross-attention
module alike (their ``attend``; ``fused_attn=False`` runs the explicit path instead, the readable definition):
``kernel``, the fused CPU kernel (:mod:`attnlab.ops.dna_cpu`, the custom op ``attnlab::dna_fused``) for float32
forwards without gradient or dropout; ``triton``, the opt-in CUDA kernel (:mod:`attnlab.ops.dna_triton`,
``ATTNLAB_DNA_TRITON=1``); else ``sdpa``, two SDPA calls and :func:`combine`. All compute the formula above. On the
CPU the projection is one bias-free GEMM whose bias the kernel adds as it copies each head (the other backends add
it first). The softmin branch is SDPA with a negated scale on CPU (free), or with -Q- elsewhere (CUDA flash kernels
take the row maximum before scaling, so a negative scale is not safe there). Measurements: docs/perf.md.

Two-branch convention (shared with ``diff``, used by :mod:`attnlab.analysis.dna`): ``branch_outputs(x, mask=None,
attn_mask=None) -> (o_pos, o_neg)``, each (B, H, N, D), the two branches before alpha; ``branch_values(x) ->
(v_pos, v_neg)``, each (B, H, N, D); ``alpha_values() -> (H,)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import trunc_normal_

from ..errors import ConfigError, SpecError
from ..ops import dna_cpu
from ..ops.dna_triton import dna_attention_triton, triton_error
from ..ops.sdpa import sdpa
from .base import AttnlabAttention

VARIANTS = ("qv", "q", "v", "shared", "sum")
SCALES = ("both", "neg_only")
INITS = ("random", "copy")
BACKENDS = ("auto", "kernel", "triton", "sdpa")


def block_names(variant: str) -> tuple[str, ...]:
    """Row blocks of the fused projection, in order: e.g. ``("q_pos", "q_neg", "k", "v_pos", "v_neg")`` for qv.

    A shared query is named ``"q"`` and a shared value ``"v"``.
    """
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


def negative_bias(rel_pos: torch.Tensor | None, mask: torch.Tensor | None, like: torch.Tensor
                  ) -> torch.Tensor | None:
    """Additive bias for the softmin branch in "negated logits" form: softmin weights = softmax(-s^- + bias).

    ``rel_pos``: the relative-position bias B (broadcastable to (B, H, N, M)) or None; it is part of the logit, so it
    enters negated. ``mask``: a bool mask (True = attend) or an additive float mask; masked positions (False, or a
    negative float entry) get -inf, i.e. weight exactly 0. Returns None when there is neither.
    """
    bias = None if rel_pos is None else -rel_pos
    if mask is not None:
        blocked = ~mask if mask.dtype == torch.bool else mask < 0
        excl = torch.zeros(blocked.shape, dtype=like.dtype, device=like.device).masked_fill_(blocked, float("-inf"))
        bias = excl if bias is None else bias + excl
    return bias


def dna_branches(q_pos: torch.Tensor, q_neg: torch.Tensor, k: torch.Tensor, v_pos: torch.Tensor, v_neg: torch.Tensor,
                 *, scale_pos: float, scale_neg: float, bias_pos: torch.Tensor | None = None,
                 bias_neg: torch.Tensor | None = None, dropout_p: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two branches of DnA with fused SDPA, each (B, H, N, D):

        o_pos = softmax(scale_pos * q_pos k^T + bias_pos) v_pos
        o_neg = softmax(-scale_neg * q_neg k^T + bias_neg) v_neg  = softmin(scale_neg * q_neg k^T - bias_neg) v_neg

    q_*: (B, H, N, D), k and v_*: (B, H, M, D). ``bias_neg`` is in negated-logit form (see :func:`negative_bias`).
    """
    o_pos = sdpa(q_pos, k, v_pos, attn_mask=bias_pos, dropout_p=dropout_p, scale=scale_pos)
    if q_neg.device.type == "cpu":  # the CPU kernels scale before the row maximum: a negative scale costs nothing
        o_neg = sdpa(q_neg, k, v_neg, attn_mask=bias_neg, dropout_p=dropout_p, scale=-scale_neg)
    else:
        o_neg = sdpa(-q_neg, k, v_neg, attn_mask=bias_neg, dropout_p=dropout_p, scale=scale_neg)
    return o_pos, o_neg


def combine(o_pos: torch.Tensor, o_neg: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    """o_pos + alpha_h * o_neg for (B, H, N, D) branches; ``alpha`` (H,), or None for alpha fixed at 1."""
    if alpha is None:
        return o_pos + o_neg
    return torch.addcmul(o_pos, alpha.to(o_pos.dtype).view(-1, 1, 1), o_neg)


def backend_error(backend: str, q_pos, q_neg, k, v_pos, v_neg, alpha, *, bias_pos=None, bias_neg=None,
                  input_bias=None, dropout_p: float = 0.0) -> str | None:
    """Why ``backend`` (``kernel``, ``triton`` or ``sdpa``) cannot compute this call, or None when it can."""
    if backend == "sdpa":
        return None
    if dropout_p:
        return f"the {backend} backend has no attention dropout"
    if backend == "kernel":
        return dna_cpu.kernel_error(q_pos, k, q_neg, v_pos, v_neg, alpha, bias_pos, bias_neg, *(input_bias or ()))
    if backend == "triton":
        return triton_error(q_pos, k, q_neg, v_pos, v_neg, alpha, bias=bias_pos is not None or bias_neg is not None)
    raise ConfigError(f"the DnA backend {backend!r} does not exist; use one of: {', '.join(BACKENDS)}.")


def dna_attention(q_pos: torch.Tensor, q_neg: torch.Tensor, k: torch.Tensor, v_pos: torch.Tensor,
                  v_neg: torch.Tensor, alpha: torch.Tensor | None, *, scale_pos: float, scale_neg: float,
                  bias_pos: torch.Tensor | None = None, bias_neg: torch.Tensor | None = None,
                  input_bias: tuple[torch.Tensor | None, ...] | None = None, dropout_p: float = 0.0,
                  backend: str = "auto") -> torch.Tensor:
    """A_h = softmax(scale_pos q+ k^T + bias_pos) v+ + alpha_h softmin(scale_neg q- k^T - bias_neg) v-, (B, H, N, D).

    q_*: (B, H, N, D), k and v_*: (B, H, M, D); alpha (H,) or None (= 1); ``bias_neg`` in negated-logit form
    (:func:`negative_bias`); ``input_bias``: None or five (H, D) tensors (or None) added to q+, q-, k, v+, v- first
    (a projection's bias). ``backend="auto"`` takes the first of ``kernel``, ``triton``, ``sdpa`` that can run
    the call; a named backend that cannot raises ConfigError with the reason.
    """
    args = (q_pos, q_neg, k, v_pos, v_neg, alpha)
    if backend == "auto":
        backend = next(b for b in ("kernel", "triton", "sdpa") if backend_error(
            b, *args, bias_pos=bias_pos, bias_neg=bias_neg, input_bias=input_bias, dropout_p=dropout_p) is None)
    else:
        why = backend_error(backend, *args, bias_pos=bias_pos, bias_neg=bias_neg, input_bias=input_bias,
                            dropout_p=dropout_p)
        if why:
            raise ConfigError(f"DnA's {backend} backend cannot run this call: {why}; use backend='auto'.")
    if backend == "kernel":
        return dna_cpu.dna_attention(*args, scale_pos=scale_pos, scale_neg=scale_neg, bias_pos=bias_pos,
                                     bias_neg=bias_neg, input_bias=input_bias)
    q_pos, q_neg, k, v_pos, v_neg = add_input_bias((q_pos, q_neg, k, v_pos, v_neg), input_bias)
    if backend == "triton":
        return dna_attention_triton(q_pos, q_neg, k, v_pos, v_neg, alpha, scale_pos=scale_pos, scale_neg=scale_neg)
    return combine(*dna_branches(q_pos, q_neg, k, v_pos, v_neg, scale_pos=scale_pos, scale_neg=scale_neg,
                                 bias_pos=bias_pos, bias_neg=bias_neg, dropout_p=dropout_p), alpha)


def add_input_bias(heads: tuple[torch.Tensor, ...], input_bias) -> tuple[torch.Tensor, ...]:
    """Each (B, H, ., D) tensor of ``heads`` plus its (H, D) bias (None: unchanged); a tensor passed twice (a
    shared query or value) with the same bias stays one tensor."""
    if input_bias is None:
        return tuple(heads)
    out: list[torch.Tensor] = []
    for i, (t, b) in enumerate(zip(heads, input_bias)):
        prev = next((out[j] for j in range(i) if heads[j] is t and input_bias[j] is b), None)
        if prev is not None:
            out.append(prev)
        else:
            out.append(t if b is None else t + b.to(t.dtype).reshape(1, t.shape[1], 1, t.shape[-1]))
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
        if self.alpha is None:
            return torch.ones(self.num_heads)
        return self.alpha.detach()

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
    out = {}
    for i, name in enumerate(names):
        sl = slice(i * width, (i + 1) * width)
        out[name] = (linear.weight.data[sl], None if linear.bias is None else linear.bias.data[sl])
    return out


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

    map_kind = "dna"
    kv_cache = True  # generation may cache keys/values: a new query against them is its causal output

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
    @staticmethod
    def geometry(module: nn.Module) -> dict:
        geo = AttnlabAttention.geometry(module)
        if isinstance(module, DnAAttention):  # its qkv is wider than 3 * H * D
            geo["head_dim"] = module.head_dim
        return geo

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
        A = self.attn_dim
        parts = {"weight": {}, "bias": {}}
        for kind in ("weight", "bias"):
            qkv = state_dict.get(prefix + f"qkv.{kind}")
            if qkv is None:
                continue
            for i, name in enumerate(("q_pos", "k", "v_pos")):
                parts[kind][name] = qkv[i * A:(i + 1) * A]
            for name in sep:
                t = state_dict.pop(prefix + f"{name}.{kind}", None)
                if t is not None:
                    parts[kind][name] = t
            aliases = {"q": "q_pos", "v": "v_pos"}
            try:
                fused = [parts[kind][aliases.get(n, n)] for n in self.qkv_blocks]
                state_dict[prefix + f"qkv.{kind}"] = torch.cat(fused)
            except KeyError as err:
                raise SpecError(f"checkpoint at {prefix!r} lacks {err.args[0]}.{kind} that dna(variant="
                                f"{self.variant}) needs.") from None

    # ---- the mechanism ---------------------------------------------------------------------------------------------
    def project(self, x: torch.Tensor):
        """``((q_pos, q_neg), k, (v_pos, v_neg))``, each (B, H, N, D); a shared query or value fills both slots.

        Q and K are normalised per head when qk_norm is on (each query branch by the same ``q_norm``).
        """
        q, k, v, input_bias = self._project(x)
        q_pos, q_neg, k, v_pos, v_neg = add_input_bias((*q, k, *v), input_bias)
        return (q_pos, q_neg), k, (v_pos, v_neg)

    def _project(self, x: torch.Tensor):
        """:meth:`project`'s result and the projection bias still to be added (five (H, D) tensors or None, see
        :func:`dna_attention`). On the CPU without QK-norm the projection is one bias-free GEMM and the bias is
        left to the backend: the kernel adds it as it copies each head, which spares a pass over the (B, N, 5*dim)
        output (docs/perf.md); forward hooks on ``qkv`` do not see this GEMM. ``qkv.weight`` is read once (a
        parametrisation such as sigma's power iteration runs on each read)."""
        B, N, _ = x.shape
        H, D, nb = self.num_heads, self.head_dim, len(self.qkv_blocks)
        defer = x.device.type == "cpu" and isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm,
                                                                                              nn.Identity)
        if defer:
            w, b = self.qkv.weight, self.qkv.bias
            y = F.linear(x, w)
        else:
            y, b = self.qkv(x), None
        blocks = y.view(B, N, nb, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        q_pos, q_neg, k, v_pos, v_neg = self._slots(blocks)
        input_bias = None if b is None else self._slots(b.view(nb, H, D).unbind(0))
        if not defer:
            shared_q = q_neg is q_pos
            q_pos, k = self.q_norm(q_pos), self.k_norm(k)
            q_neg = q_pos if shared_q else self.q_norm(q_neg)
        return (q_pos, q_neg), k, (v_pos, v_neg), input_bias

    def _slots(self, blocks):
        """(q_pos, q_neg, k, v_pos, v_neg) from one item per block of ``qkv_blocks``; a shared query or value (the
        same object) fills both of its slots."""
        named = dict(zip(self.qkv_blocks, blocks))
        q_pos, v_pos = named.get("q_pos", named.get("q")), named.get("v_pos", named.get("v"))
        return q_pos, named.get("q_neg", q_pos), named["k"], v_pos, named.get("v_neg", v_pos)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`AttnlabAttention.forward`; the projection bias goes to :meth:`attend` unapplied where
        :meth:`_project` leaves it."""
        attn_mask = self.causal_mask(x, attn_mask, is_causal)
        q, k, v, input_bias = self._project(x)
        o = self.attend(q, k, v, mask=mask, attn_mask=attn_mask, input_bias=input_bias)
        return self.merge(self.head_transform(o), x)

    def _biases(self, B: int, N: int, mask, attn_mask, like: torch.Tensor):
        """(bias_pos, bias_neg): the standard fused bias, and the softmin branch's in negated-logit form (its masks
        in ``like``'s dtype and device)."""
        bias_pos = self.attn_bias(B, N, mask, attn_mask)
        if self.window_size is None and attn_mask is None:
            return bias_pos, None
        bias_neg = negative_bias(self.rel_pos_bias() if self.window_size is not None else None, None, like)
        if mask is not None:  # (num_windows, N, N) 0 / -100, windows fastest-varying in B (as AttnlabAttention)
            num_win = mask.shape[0]
            excl = negative_bias(None, mask, like)
            excl = excl.view(1, num_win, 1, N, N).expand(B // num_win, -1, self.num_heads, -1, -1)
            excl = excl.reshape(-1, self.num_heads, N, N)
            bias_neg = excl if bias_neg is None else bias_neg + excl
        if attn_mask is not None:
            excl = negative_bias(None, attn_mask, like)
            bias_neg = excl if bias_neg is None else bias_neg + excl
        return bias_pos, bias_neg

    def weights(self, q, k, mask=None, attn_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Explicit attention weights (softmax(s^+), softmin(s^-)), each (B, H, N, N); q = (q_pos, q_neg).

        A shared query's q k^T is computed once (variants v, shared, sum), as in the paper's operation count.
        """
        (q_pos, q_neg) = q
        B, N = q_pos.shape[0], q_pos.shape[2]
        _, bias_neg = self._biases(B, N, mask, attn_mask, like=q_pos)
        kt = k.transpose(-2, -1)
        qk_pos = q_pos @ kt
        qk_neg = qk_pos if q_neg is q_pos else q_neg @ kt
        w_pos = self.add_bias(qk_pos * self.scale_pos, mask, attn_mask).softmax(dim=-1)
        neg_logits = qk_neg * -self.scale_neg  # softmin(s) = softmax(-s)
        if bias_neg is not None:
            neg_logits = neg_logits + bias_neg
        return w_pos, neg_logits.softmax(dim=-1)

    def branches(self, q, k, v, mask=None, attn_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(o_pos, o_neg), each (B, H, N, D), before alpha: softmax(s^+) V^+ and softmin(s^-) V^-."""
        (q_pos, q_neg), (v_pos, v_neg) = q, v
        if self.fused_attn:
            bias_pos, bias_neg = self._biases(q_pos.shape[0], q_pos.shape[2], mask, attn_mask, like=q_pos)
            return dna_branches(q_pos, q_neg, k, v_pos, v_neg, scale_pos=self.scale_pos, scale_neg=self.scale_neg,
                                bias_pos=bias_pos, bias_neg=bias_neg,
                                dropout_p=self.attn_drop.p if self.training else 0.0)
        w_pos, w_neg = self.weights(q, k, mask, attn_mask)
        return self.attn_drop(w_pos) @ v_pos, self.attn_drop(w_neg) @ v_neg

    def attend(self, q, k, v, mask=None, attn_mask=None, input_bias=None) -> torch.Tensor:
        """A_h = softmax(s^+) V^+ + alpha_h softmin(s^-) V^-, (B, H, N, D); q = (q_pos, q_neg), v = (v_pos, v_neg),
        ``input_bias`` as :func:`dna_attention`. The one place this module's backend is chosen: the explicit path
        when ``fused_attn`` is off, else :func:`dna_attention` with ``self.backend``.

        The explicit path with a shared V (variants q, shared, sum) forms [softmax(s^+) + alpha softmin(s^-)] V,
        one product with V, as Table 12 writes it.
        """
        (q_pos, q_neg), (v_pos, v_neg) = q, v
        dropout_p = self.attn_drop.p if self.training else 0.0
        if self.fused_attn:
            bias_pos, bias_neg = self._biases(q_pos.shape[0], q_pos.shape[2], mask, attn_mask, like=q_pos)
            return dna_attention(q_pos, q_neg, k, v_pos, v_neg, self.alpha, scale_pos=self.scale_pos,
                                 scale_neg=self.scale_neg, bias_pos=bias_pos, bias_neg=bias_neg,
                                 input_bias=input_bias, dropout_p=dropout_p, backend=self.backend)
        q_pos, q_neg, k, v_pos, v_neg = add_input_bias((q_pos, q_neg, k, v_pos, v_neg), input_bias)
        q, v = (q_pos, q_neg), (v_pos, v_neg)
        if v_pos is not v_neg:
            return combine(*self.branches(q, k, v, mask, attn_mask), self.alpha)
        w_pos, w_neg = self.weights(q, k, mask, attn_mask)
        if self.alpha is None:
            w = w_pos + w_neg
        else:
            w = torch.addcmul(w_pos, self.alpha.to(w_pos.dtype).view(-1, 1, 1), w_neg)
        return self.attn_drop(w) @ v_pos

    # ---- the two-branch convention (analysis) --------------------------------------------------------------------
    def branch_outputs(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A^{Q+V+}_h, A^{Q-V-}_h) for x: (B, N, dim), each (B, H, N, D), before alpha and head merge."""
        q, k, v = self.project(x)
        return self.branches(q, k, v, mask, attn_mask)

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


__all__ = ["BACKENDS", "DnAAttention", "add_input_bias", "backend_error", "block_names", "combine", "dna_attention",
           "dna_branches", "negative_bias", "VARIANTS"]
