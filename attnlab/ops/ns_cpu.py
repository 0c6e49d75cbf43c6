"""The fused CPU kernel of NS-Attn's transform (``ns_kernel.c``): build on first use, call through ctypes.

It reads each head matrix once from wherever it lies (the attention kernel's strided output), does the Gram-space
algebra of ``_ns_fast`` in cache and writes the result with the input's strides, so the head merge after it is a
free view (why that pays: docs/methods.md, "The fused CPU kernel"). It serves forward passes that need no gradient
on float32 and float64 CPU tensors; autograd and other devices use the torch formulation. Building and loading:
:mod:`attnlab.ops.ckernel`. The kernel is the custom op ``attnlab::ns_fused`` with a fake implementation (FakeTensor,
``torch.compile`` without a graph break) and a FLOP formula: the fast path's count on the same shape. Without a
compiler, or with ``ATTNLAB_KERNELS=0``, ``impl="auto"`` quietly uses the torch formulation and ``impl="kernel"``
raises :class:`~attnlab.errors.ConfigError` with the reason.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from attnlab.ops import ckernel

__all__ = ["call_error", "kernel_error", "ns_kernel", "supports", "unavailable"]

_ABI = 2  # ATTNLAB_NS_ABI in ns_kernel.c
# (min(N, D), D) pairs with a compiled instance: NS_SHAPES in ns_kernel.c (a test checks that the two agree)
_SHAPES = {(16, 16), (32, 32), (48, 48), (64, 64), (16, 32), (16, 48), (16, 64), (32, 48), (32, 64), (48, 64)}


def _build(suffix: str, real: type, defines: tuple[str, ...] = ()) -> ckernel.Build:
    """The build for ``real`` (c_float, c_double): its entry takes x, y, H, N, D, six strides, steps, eps, a, b, c."""
    args = (ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 9, ctypes.c_int, *[real] * 4)
    return ckernel.Build(f"attnlab_ns_{suffix}", args, f"attnlab_ns_supports_{suffix}", defines,
                         {"attnlab_ns_real_size": ctypes.sizeof(real)})


KERNEL = ckernel.CKernel("ns_kernel.c", abi=_ABI, op="attnlab::ns_fused", label="fused kernel", builds={
    torch.float32: _build("f32", ctypes.c_float), torch.float64: _build("f64", ctypes.c_double, ("-DNS_DOUBLE",))})


def kernel_error(x: torch.Tensor) -> str | None:
    """Why the fused kernel cannot transform ``x`` right now, or None when it can."""
    if common := KERNEL.common_error(x):
        return common
    if x.ndim < 2:
        return f"the fused kernel takes (..., N, D) head matrices, got shape {tuple(x.shape)}"
    if not supports(*x.shape[-2:]):
        return (f"the fused kernel has no instance for {x.shape[-2]} x {x.shape[-1]} head matrices (it takes "
                f"min(N, D) in 16, 32, 48, 64 and, when N < D, D in 32, 48, 64)")
    return unavailable(x.dtype == torch.float64)


def call_error(*, cpu: bool, dtype: torch.dtype, needs_grad: bool, N: int, D: int) -> str | None:
    """Why the kernel cannot transform (..., N, D) head matrices of a call with these properties (half precision is
    transformed in float32), or None when it can."""
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    if common := KERNEL.common_error(cpu=cpu, dtype_ok=work in KERNEL.builds, needs_grad=needs_grad):
        return common
    if not supports(N, D):
        return (f"the fused kernel has no instance for {N} x {D} head matrices (it takes min(N, D) in 16, 32, 48, "
                f"64 and, when N < D, D in 32, 48, 64)")
    return unavailable(work == torch.float64)


def supports(N: int, D: int) -> bool:
    """Whether the kernel has an instance for N x D head matrices (``attnlab_ns_supports_*``)."""
    return (min(N, D), D) in _SHAPES


@torch.compiler.assume_constant_result
def unavailable(double: bool = False) -> str | None:
    """Why the float32 (``double``: float64) kernel cannot run in this process, or None. Fixed for the process:
    ``torch.compile`` evaluates it once while tracing, outside the graph."""
    return KERNEL.unavailable(torch.float64 if double else torch.float32)


def ns_kernel(x: torch.Tensor, steps: int, eps: float, coeffs: tuple[float, float, float]) -> torch.Tensor:
    """T(x) by the fused kernel; the caller has checked :func:`kernel_error`. Output strides follow the input's
    when it is dense (an attention kernel's (B, N, H, D) buffer stays (B, N, H, D)), else it is contiguous."""
    return _OP(x, steps, eps, *coeffs)


def _layout(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x4, y4): ``x`` as (B, H, N, D) with unit feature stride (a view whenever the leading dims allow one, for
    the kernel's two batch strides) and an empty output of the same strides when dense."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x4 = x.reshape(-1, *x.shape[-3:]) if x.ndim >= 4 else x.reshape(*[1] * (4 - x.ndim), *x.shape)
    return x4, torch.empty_like(x4)  # preserve_format: same strides as a dense input


@KERNEL.custom_op
def _ns_fused(x: torch.Tensor, steps: int, eps: float, a: float, b: float, c: float) -> torch.Tensor:
    x4, y4 = _layout(x)
    B, H, N, D = x4.shape
    args = (x4.data_ptr(), y4.data_ptr(), H, N, D, *x4.stride()[:3], *y4.stride()[:3], steps, eps, a, b, c)
    KERNEL.run(args, B * H, dtype=x.dtype, min_per_thread=64)  # a head matrix is ~1 us of work
    return y4.view(x.shape)  # splitting or dropping unit dims is always a view


_OP = torch.ops.attnlab.ns_fused.default


@_ns_fused.register_fake
def _(x, steps, eps, a, b, c):
    return _layout(x)[1].view(x.shape)


@register_flop_formula(torch.ops.attnlab.ns_fused)
def _flops(x_shape, steps, *args, **kwargs) -> int:
    """The fast path's count on the same shape (:func:`attnlab.ops.ns._ns_fast`): the kernel does its algebra."""
    return math.prod(x_shape[:-2]) * _fast_flops(x_shape[-2], x_shape[-1], steps)


@functools.cache
def _fast_flops(N: int, D: int, steps: int) -> int:
    from attnlab.ops.ns import NS_COEFFS, NS_EPS, _ns_fast  # ns imports this module

    with FlopCounterMode(display=False) as counter:
        _ns_fast(torch.empty(1, N, D, device="meta"), steps, NS_EPS, NS_COEFFS)
    return counter.get_total_flops()
