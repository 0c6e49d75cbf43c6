"""Denoising attention, DnA ("DnA: Denoising Attention for Visual Tasks", Sec. 3.2, Algorithm 1, Appendix C.5).

Per head h, with s^± = Q^± K^T / sqrt(d) (+ the position bias B):

    A_h = softmax(s^+_h) V^+_h + alpha_h * softmin(s^-_h) V^-_h,     softmin(z) = softmax(-z)     (Sec. 3.2)

The variants of Table 12 (``variant=``):

    qv      Q±V±   separate queries and values (the paper's DnA, default)
    q       Q±V    separate queries, one shared V:   [softmax(s^+) + alpha softmin(s^-)] V
    v       QV±    one query, separate values:        softmax(s) V^+ + alpha softmin(s) V^-
    shared  Â±     one Q and one V, learnable alpha:  [softmax(s) + alpha softmin(s)] V
    sum     A±     one Q and one V, alpha fixed at 1: [softmax(s) + softmin(s)] V

``alpha``: one learnable scalar per head. ``scale=both`` scales both branches by 1/sqrt(d) (the main text and the
authors' code), ``neg_only`` only the negative one (Algorithm 1 as written). A masked position is excluded from the
softmin branch (weight exactly 0), while B and a float ``attn_mask``'s finite entries stay in its logit
(:meth:`~attnlab.attention.mask.Mask.negated`). All projections of a block are ONE ``nn.Linear`` ``qkv``, its rows
in the authors' order Q+, Q-, K, V+, V- (the variant's subset, :func:`block_names`). One kernel computes the formula
for the self- and the cross-attention module on four backends. docs/methods.md, "DnA": masks, layout, backends.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import trunc_normal_

from ..errors import SpecError
from ..ops import dna_cpu
from ..ops.dna_triton import call_error as triton_call_error
from ..ops.dna_triton import dna_attention_triton
from .base import AttnlabAttention, Branch, Intermediates, Want, block_rows, copy_rows
from .capabilities import Capabilities
from .mask import Mask

VARIANTS = ("qv", "q", "v", "shared", "sum")
SCALES = ("both", "neg_only")
INITS = ("random", "copy")


def block_names(variant: str) -> tuple[str, ...]:
    """Row blocks of the fused projection, in order: e.g. ``("q_pos", "q_neg", "k", "v_pos", "v_neg")`` for qv; a
    shared query is named ``"q"`` and a shared value ``"v"``."""
    sep_q, sep_v = variant in ("qv", "q"), variant in ("qv", "v")
    return (("q_pos", "q_neg") if sep_q else ("q",)) + ("k",) + (("v_pos", "v_neg") if sep_v else ("v",))


def combine(o_pos: torch.Tensor, o_neg: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    """o_pos + alpha_h * o_neg for (B, H, N, D) branches; ``alpha`` (H,), or None for alpha fixed at 1."""
    if alpha is None:
        return o_pos + o_neg
    return torch.addcmul(o_pos, alpha.to(o_pos.dtype).view(-1, 1, 1), o_neg)


class DnAAttention(AttnlabAttention):
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

    capabilities = Capabilities(kv_cache=True, intermediates=("weights", "branches"),
                                backends=("kernel", "triton", "sdpa", "explicit"))
    adopts_wide_qkv = True  # reads Q+, K, V+ (and Q-, V-) out of another DnA module's fused projection

    def __init__(self, dim: int, num_heads: int = 8, *, variant: str = "qv", alpha_init: float = 0.5,
                 scale: str = "both", init: str = "random", neg_init: float = 1e-4, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        for key, value, allowed in (("variant", variant, VARIANTS), ("scale", scale, SCALES), ("init", init, INITS)):
            if value not in allowed:
                raise SpecError(f"dna({key}={value}) is not valid; {key} is one of: {', '.join(allowed)}.")
        if variant == "sum" and alpha_init != 0.5:
            raise SpecError("dna(variant=sum) fixes alpha at 1; drop alpha_init, or use variant=shared for a "
                            "learnable alpha.")
        if not math.isfinite(alpha_init) or not math.isfinite(neg_init):
            raise SpecError("dna's alpha_init and neg_init must be finite numbers.")
        self.variant, self.alpha_init, self.scale_mode = variant, alpha_init, scale
        self.init, self.neg_init = init, neg_init
        self.qkv_blocks = block_names(variant)
        # Sec. 3.2: alpha_h, one learnable scalar per head; variant=sum fixes it at 1 (no parameter)
        self.alpha = None if variant == "sum" else nn.Parameter(torch.full((self.num_heads,), float(alpha_init)))
        self.scale_neg = self.head_dim ** -0.5
        self.scale_pos = self.scale_neg if scale == "both" else 1.0
        self.qkv = nn.Linear(dim, sum(self.qkv_widths()), bias=self.qkv.bias is not None)
        if init == "copy" and not self.takes_context:  # cross-attention copies once its projections exist
            with torch.no_grad():
                self._init_negative(self.rows())

    def branch_coefficients(self) -> tuple[str, torch.Tensor]:
        """("alpha", alpha_h per head (H,)): the negative branch's coefficient, ones for ``variant=sum``."""
        return "alpha", torch.ones(self.num_heads) if self.alpha is None else self.alpha.detach()

    # ---- the projection ----------------------------------------------------------------------------------------
    def adopt(self, module: nn.Module) -> None:
        """Take over ``module``'s projections as Q+, K, V+ (and, from a DnA module, its own Q-, V- and alpha);
        fill what is new according to ``init``."""
        fused = self.qkv
        super().adopt(module)  # takes module.qkv (and proj, norms, position bias) as the base class does
        src_rows = module.rows() if isinstance(module, AttnlabAttention) else \
            block_rows(module.qkv, ("q", "k", "v"), [self.attn_dim] * 3)  # timm's: no grouped keys
        self.qkv = fused  # this module's own (wider) projection, filled from the source's rows
        dst_rows = self.rows()
        with torch.no_grad():
            copy_rows(dst_rows, src_rows)  # the blocks both have: not a negative branch the source lacks
            self._init_negative(dst_rows, only=tuple(n for n in ("q_neg", "v_neg") if n not in src_rows))
        alpha = getattr(module, "alpha", None)
        if self.alpha is not None and isinstance(alpha, nn.Parameter) and alpha.shape == self.alpha.shape:
            self.alpha = alpha

    def _init_negative(self, rows: dict, only: tuple[str, ...] = ("q_neg", "v_neg")) -> None:
        """Fill the q_neg / v_neg rows (those in ``only``) in place: ``init=copy`` gives Q- = |neg_init| * Q+ and
        V- = neg_init * V+ (a negative neg_init flips only V-, as the authors' video code does); ``init=random``
        draws timm's init (trunc normal, std 0.02, zero bias)."""
        for neg, pos, factor in (("q_neg", "q_pos", abs(self.neg_init)), ("v_neg", "v_pos", self.neg_init)):
            if neg in rows and neg in only:
                (w, b), (pw, pb) = rows[neg], rows[pos]
                if self.init == "copy":
                    w.copy_(pw * factor)
                else:
                    trunc_normal_(w, std=0.02)
                if b is not None:
                    b.copy_(pb * factor) if self.init == "copy" else b.zero_()

    def projection(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) views of one block of the projection: ``q_pos``, ``q_neg``, ``k``, ``v_pos``, ``v_neg``
        (or ``q`` / ``v`` when shared)."""
        rows = self.rows()
        if name not in rows:
            raise KeyError(f"dna(variant={self.variant}) has no {name!r} projection; it has "
                           f"{', '.join(self.qkv_blocks)}.")
        return rows[name]

    def deferred_bias(self) -> torch.Tensor | None:
        """The fused projection's bias where :meth:`project` leaves it to the kernel, else None: a float32 CPU
        forward without gradient or autocast, the C kernel allowed (``auto`` or ``kernel``), and nothing between the
        projection and the kernel that needs it biased (QK-norm, rotary, grouped keys). Device and dtype are the
        bias's: reading a parametrised weight (sigma, speccond) computes it."""
        bias = None if self.takes_context else self.qkv.bias
        if bias is None or self.backend not in ("auto", "kernel") or torch.is_grad_enabled():
            return None
        if bias.device.type != "cpu" or bias.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            return None
        plain = isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)
        return bias if plain and self.rotary is None and self.num_kv_heads == self.num_heads else None

    def project(self, x: torch.Tensor, context: torch.Tensor | None = None) -> tuple:
        """The heads of :meth:`split_heads`: the Q+ then the Q- heads, the K heads, the V+ then the V- heads (a shared
        query or value once). Where :meth:`deferred_bias` holds (the C kernel's forwards) the projection is one
        bias-free GEMM and the bias is left to the kernel (one pass fewer over the (B, N, 5 dim) output; forward hooks
        on ``qkv`` do not see that GEMM). ``qkv.weight`` is read once (a parametrisation runs on each read)."""
        return self.split_heads(self.qkv(x) if self.deferred_bias() is None else F.linear(x, self.qkv.weight))

    # ---- the mechanism -----------------------------------------------------------------------------------------
    def supports(self, backend: str, call) -> str | None:
        """The fused backends return the combined output only and take no attention dropout; the C kernel runs
        float32 forward passes on the CPU (:func:`attnlab.ops.dna_cpu.call_error`), Triton CUDA calls without a mask
        (:func:`attnlab.ops.dna_triton.call_error`)."""
        if backend not in ("kernel", "triton"):
            return super().supports(backend, call)
        if call.dropout:
            return f"the {backend} backend has no attention dropout"
        if call.want.branches or call.want.weights:
            return f"the {backend} backend returns the combined output only"
        if backend == "kernel":
            return dna_cpu.call_error(cpu=call.device.type == "cpu", float32=call.dtype == torch.float32,
                                      needs_grad=call.needs_grad, head_dim=call.head_dim, keys=call.keys)
        return triton_call_error(cuda=call.device.type == "cuda", dtype_ok=call.dtype in (
            torch.float16, torch.bfloat16, torch.float32), bias=call.masked, needs_grad=call.needs_grad,
            head_dim=call.head_dim, batch_heads=call.batch_heads, queries=call.queries, row_stride=call.row_stride)

    def kernel(self, q, k: torch.Tensor, v, mask: Mask | None, want: Want, backend: str
               ) -> tuple[torch.Tensor, Intermediates]:
        """A_h = softmax(s^+) V^+ + alpha_h softmin(s^-) V^-, (B, H, N, D), on ``backend``, from :meth:`project`'s
        heads, the positive branch's then the negative's along dim -3 (a shared query or value once, in both slots
        here); the branches (before alpha) and the weight maps when ``want`` asks. The explicit path with a shared V
        (variants q, shared, sum) forms [softmax(s^+) + alpha softmin(s^-)] V, one product with V, as Table 12 writes
        it; a shared query's q k^T is computed once, as in the paper's operation count."""
        heads, bias = (q, k, v), self.deferred_bias()
        if bias is not None:  # the deferred bias, K's too (a constant per query row, yet cached keys must hold it)
            bias = bias.view(-1, 1, self.head_dim).split([t.shape[1] for t in heads])
            if backend != "kernel":  # the C kernel adds it as its input bias
                heads, bias = tuple(t + b for t, b in zip(heads, bias)), None

        def pair(t, neg):  # the positive and the negative branch's heads
            return t.chunk(2, dim=-3) if neg in self.qkv_blocks else (t, t)
        (q_pos, q_neg), k, (v_pos, v_neg) = pair(heads[0], "q_neg"), heads[1], pair(heads[2], "v_neg")
        dtype, p, found = q_pos.dtype, self.attn_drop.p if self.training else 0.0, Intermediates()
        if backend == "kernel":
            return dna_cpu.dna_attention(q_pos, q_neg, k, v_pos, v_neg, self.alpha, scale_pos=self.scale_pos,
                                         scale_neg=self.scale_neg, bias_pos=None if mask is None else
                                         mask.softmax_bias(dtype), bias_neg=None if mask is None else
                                         mask.negated(dtype), input_bias=None if bias is None else
                                         (*pair(bias[0], "q_neg"), bias[1], *pair(bias[2], "v_neg"))), found
        if backend == "triton":
            return dna_attention_triton(q_pos, q_neg, k, v_pos, v_neg, self.alpha, scale_pos=self.scale_pos,
                                        scale_neg=self.scale_neg), found
        if backend == "sdpa":
            bias_pos, causal = (None, False) if mask is None else mask.sdpa(dtype)
            bias_neg = None if mask is None or causal else mask.negated(dtype)
            # softmin with a negated scale is free where SDPA scales before the row maximum (the CPU); CUDA's flash
            # kernels take the maximum first, and the CPU's causal path returns NaN for a negative scale: -Q- there
            negate = q_neg.device.type != "cpu" or causal
            o_pos = F.scaled_dot_product_attention(q_pos, k, v_pos, attn_mask=bias_pos, dropout_p=p,
                                                   scale=self.scale_pos, is_causal=causal)
            o_neg = F.scaled_dot_product_attention(-q_neg if negate else q_neg, k, v_neg, attn_mask=bias_neg,
                                                   dropout_p=p, scale=self.scale_neg if negate else -self.scale_neg,
                                                   is_causal=causal)
        else:
            kt = k.transpose(-2, -1)
            qk_pos = q_pos @ kt
            qk_neg = qk_pos if q_neg is q_pos else q_neg @ kt
            w_pos = self.softmax(qk_pos * self.scale_pos, mask)
            neg_logits = qk_neg * -self.scale_neg  # softmin(s) = softmax(-s)
            bias_neg = None if mask is None else mask.negated(dtype)
            w_neg = (neg_logits if bias_neg is None else neg_logits + bias_neg).softmax(dim=-1)
            if want.weights:  # the output from the very maps reported, so gradients reach them (relevance)
                e_neg = w_neg if self.alpha is None else self.alpha.to(dtype).view(-1, 1, 1) * w_neg
                found.weights = {"pos": Branch(w_pos, w_pos), "neg": Branch(w_neg, e_neg)}
                if want.branches:
                    found.branches, found.values = (w_pos @ v_pos, w_neg @ v_neg), (v_pos, v_neg)
                return self.attn_drop(w_pos) @ v_pos + self.attn_drop(e_neg) @ v_neg, found
            if v_pos is v_neg and not want.branches:
                return self.attn_drop(combine(w_pos, w_neg, self.alpha)) @ v_pos, found
            o_pos, o_neg = self.attn_drop(w_pos) @ v_pos, self.attn_drop(w_neg) @ v_neg
        if want.branches:
            found.branches, found.values = (o_pos, o_neg), (v_pos, v_neg)
        return combine(o_pos, o_neg, self.alpha), found

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, variant={self.variant}, scale={self.scale_mode}"


__all__ = ["DnAAttention", "VARIANTS", "block_names", "combine"]
