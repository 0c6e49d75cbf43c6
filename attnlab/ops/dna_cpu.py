"""DnA's two branches in one fused CPU kernel (``dna_kernel.c``), for forward passes without gradient.

    o = softmax(scale_pos q+ k^T + bias_pos) v+ + alpha_h * softmax(-scale_neg q- k^T + bias_neg) v-

(``bias_neg`` in negated-logit form, as :func:`attnlab.attention.dna.negative_bias` builds it) computed per head
and query row in one pass over K, with the combined output written in the (B, N, H, D) layout head merge reads: about
0.75 of two SDPA calls' time on 2 CPU cores (docs/perf.md). float32, CPU, head dim 16 / 32 / 48 / 64, at most 1024
keys, no dropout, no gradient; everything else goes to SDPA (:func:`attnlab.attention.dna.dna_attention` picks).
Building: :mod:`attnlab.ops.ckernel`. It is the custom op ``attnlab::dna_fused`` (the ctypes call inside it), with
a fake implementation (FakeTensor and ``torch.compile`` trace it without a graph break) and a FLOP formula, the two
SDPA calls it replaces, so ``FlopCounterMode`` counts a model the same with and without gradient.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_flop_count

from attnlab.ops import ckernel

__all__ = ["call_error", "dna_attention", "kernel_error", "supports"]

_ABI = 2  # ATTNLAB_DNA_ABI in dna_kernel.c
_HEAD_DIMS = (16, 32, 48, 64)  # attnlab_dna_supports in dna_kernel.c (a test checks that the two agree)
_MAX_KEYS = 1024
_NT = 8  # QP, QN, K, VP, VN, OUT, BP, BN in dna_kernel.c


class _Args(ctypes.Structure):
    _fields_ = [
        ("ptr", ctypes.c_void_p * _NT),
        ("stride", (ctypes.c_int64 * 3) * _NT),
        ("in_bias", ctypes.c_void_p * 5),
        ("alpha", ctypes.c_void_p),
        ("H", ctypes.c_int64), ("N", ctypes.c_int64), ("M", ctypes.c_int64), ("D", ctypes.c_int64),
        ("scale_pos", ctypes.c_float), ("scale_neg", ctypes.c_float),
    ]


KERNEL = ckernel.CKernel("dna_kernel.c", abi=_ABI, op="attnlab::dna_fused", label="fused DnA kernel", builds={
    torch.float32: ckernel.Build("attnlab_dna_f32", (ctypes.POINTER(_Args),), "attnlab_dna_supports",
                                 sizes={"attnlab_dna_args_size": ctypes.sizeof(_Args)})})


def kernel_error(q: torch.Tensor, k: torch.Tensor, *others: torch.Tensor | None) -> str | None:
    """Why the fused kernel cannot run on these (B, H, N, D) queries / (B, H, M, D) keys (and the other tensors of
    the call: values, alpha, biases), or None when it can."""
    if q.ndim != 4 or k.ndim != 4:
        return "the fused DnA kernel takes (B, H, N, D) tensors"
    common = KERNEL.common_error(q, k, *others, masks=True)
    return common or call_error(cpu=True, float32=True, needs_grad=False, head_dim=q.shape[-1], keys=k.shape[-2])


def call_error(*, cpu: bool, float32: bool, needs_grad: bool, head_dim: int, keys: int) -> str | None:
    """Why the fused kernel cannot run a call with these properties (decidable before the projection runs), or
    None when it can."""
    if common := KERNEL.common_error(cpu=cpu, dtype_ok=float32, needs_grad=needs_grad):
        return common
    if not supports(head_dim, keys):
        return f"the fused DnA kernel takes head dim 16, 32, 48 or 64 and <= 1024 keys, got {head_dim}, {keys}"
    return unavailable()


def supports(head_dim: int, keys: int) -> bool:
    """Whether the kernel has an instance for this head dim and number of keys (``attnlab_dna_supports``)."""
    return head_dim in _HEAD_DIMS and 1 <= keys <= _MAX_KEYS


@torch.compiler.assume_constant_result
def unavailable() -> str | None:
    """Why the kernel cannot run in this process (switched off, no compiler, failed build), or None. Fixed for
    the process: ``torch.compile`` evaluates it once while tracing, outside the graph."""
    return KERNEL.unavailable()


def _additive(bias: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A float bias broadcast to ``shape`` (B, H, N, M) as a view, rows of M contiguous floats."""
    if bias is None:
        return None
    if bias.dtype == torch.bool:  # True = attend
        bias = torch.zeros(bias.shape, dtype=torch.float32).masked_fill_(~bias, float("-inf"))
    while bias.ndim < 4:
        bias = bias.unsqueeze(0)
    bias = bias.expand(shape)
    return bias if bias.stride(-1) == 1 else bias.contiguous()


def _check_layout(q_pos, q_neg, k, v_pos, v_neg, alpha, bias_pos, bias_neg, input_bias) -> None:
    """The kernel reads raw float32 memory: refuse anything it would misread."""
    B, H, N, D = q_pos.shape
    M = k.shape[-2]
    expected = {"q_pos": (B, H, N, D), "q_neg": (B, H, N, D), "k": (B, H, M, D), "v_pos": (B, H, M, D),
                "v_neg": (B, H, M, D)}
    named = dict(q_pos=q_pos, q_neg=q_neg, k=k, v_pos=v_pos, v_neg=v_neg, alpha=alpha, bias_pos=bias_pos,
                 bias_neg=bias_neg)
    named.update((f"input_bias[{i}]", b) for i, b in enumerate(input_bias or ()))
    for name, t in named.items():
        if t is None:
            continue
        mask = name.startswith("bias") and t.dtype == torch.bool
        if t.device.type != "cpu" or (t.dtype != torch.float32 and not mask):
            raise ValueError(f"dna_attention: {name} is {t.dtype} on {t.device}; the kernel reads float32 CPU tensors")
        if name in expected and tuple(t.shape) != expected[name]:
            raise ValueError(f"dna_attention: {name} has shape {tuple(t.shape)}, expected {expected[name]}")
    if alpha is not None and alpha.numel() != H:
        raise ValueError(f"dna_attention: alpha has {alpha.numel()} values for {H} heads")
    if input_bias is not None and (len(input_bias) != 5
                                   or any(b is not None and b.numel() != H * D for b in input_bias)):
        raise ValueError(f"dna_attention: input_bias takes 5 tensors of H * D = {H * D} values (or None), in the "
                         "order q_pos, q_neg, k, v_pos, v_neg")


def dna_attention(q_pos: torch.Tensor, q_neg: torch.Tensor, k: torch.Tensor, v_pos: torch.Tensor,
                  v_neg: torch.Tensor, alpha: torch.Tensor | None, *, scale_pos: float, scale_neg: float,
                  bias_pos: torch.Tensor | None = None, bias_neg: torch.Tensor | None = None,
                  input_bias: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """softmax(scale_pos q+ k^T + bias_pos) v+ + alpha_h softmin(scale_neg q- k^T - bias_neg) v-, (B, H, N, D).

    q_*: (B, H, N, D); k, v_*: (B, H, M, D); alpha: (H,) or None (= 1); biases broadcastable to (B, H, N, M),
    ``bias_neg`` in negated-logit form. Pass the same tensor as q_pos and q_neg (or v_pos and v_neg) for a shared
    query (value); it is then used once. ``input_bias``: five (H, D) tensors or None, in the order q_pos, q_neg,
    k, v_pos, v_neg, added to every token's vector before use (a projection's bias: the kernel adds it as it
    copies each head, so the projection can be a bias-free GEMM). The result is a (B, H, N, D) view of a
    (B, N, H, D) buffer. The caller has checked :func:`kernel_error`; tensors the kernel would misread (another
    dtype or device, mismatched shapes) raise ValueError here.
    """
    return _OP(q_pos, q_neg, k, v_pos, v_neg, alpha, scale_pos, scale_neg, bias_pos, bias_neg,
               list(input_bias) if input_bias else [])


@KERNEL.custom_op
def _dna_fused(q_pos: torch.Tensor, q_neg: torch.Tensor, k: torch.Tensor, v_pos: torch.Tensor, v_neg: torch.Tensor,
               alpha: Optional[torch.Tensor], scale_pos: float, scale_neg: float, bias_pos: Optional[torch.Tensor],
               bias_neg: Optional[torch.Tensor], input_bias: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    input_bias = input_bias or None
    _check_layout(q_pos, q_neg, k, v_pos, v_neg, alpha, bias_pos, bias_neg, input_bias)
    B, H, N, D = q_pos.shape
    M = k.shape[-2]
    ts = [t if t.stride(-1) == 1 else t.contiguous() for t in (q_pos, q_neg, k, v_pos, v_neg)]
    if _same(q_neg, q_pos):
        ts[1] = ts[0]
    if _same(v_neg, v_pos):
        ts[4] = ts[3]
    out = torch.empty(B, N, H, D, dtype=q_pos.dtype).transpose(1, 2)
    ts.append(out)
    ts += [_additive(bias_pos, (B, H, N, M)), _additive(bias_neg, (B, H, N, M))]
    alpha = (torch.ones(H) if alpha is None else alpha.detach()).contiguous()
    args = _Args()
    for i, t in enumerate(ts):
        if t is not None:
            args.ptr[i] = t.data_ptr()
            args.stride[i][:] = t.stride()[:3]
    if input_bias is not None:
        input_bias = [None if b is None else b.detach().reshape(H, D).contiguous() for b in input_bias]
        for i, b in enumerate(input_bias):
            if b is not None:
                args.in_bias[i] = b.data_ptr()
    args.alpha = alpha.data_ptr()
    args.H, args.N, args.M, args.D = H, N, M, D
    args.scale_pos, args.scale_neg = scale_pos, -scale_neg
    KERNEL.run((ctypes.byref(args),), B * H, min_per_thread=max(1, 2**16 // (N * M)))
    return out


_OP = torch.ops.attnlab.dna_fused.default


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor passed twice (a shared query or value): the same memory with the same layout."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


@_dna_fused.register_fake
def _(q_pos, q_neg, k, v_pos, v_neg, alpha, scale_pos, scale_neg, bias_pos, bias_neg, input_bias):
    _check_layout(q_pos, q_neg, k, v_pos, v_neg, alpha, bias_pos, bias_neg, input_bias or None)
    B, H, N, D = q_pos.shape
    return q_pos.new_empty(B, N, H, D).transpose(1, 2)


@register_flop_formula(torch.ops.attnlab.dna_fused)
def _flops(q_shape, q_neg_shape, k_shape, v_pos_shape, *args, **kwargs) -> int:
    """The two SDPA calls the kernel replaces (each q k^T and weights @ v), so counts agree across backends."""
    return 2 * sdpa_flop_count(q_shape, k_shape, v_pos_shape)
