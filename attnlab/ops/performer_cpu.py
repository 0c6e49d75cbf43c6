"""The fused CPU kernel of Performer's FAVOR+ attention (``performer_kernel.c``): build on first use, call through
ctypes.

The kernel projects R tokens at a time, exponentiates their M features with a polynomial exp while they sit in L1,
and folds them into phi(k)^T v (keys) or reads them out against it (queries), so the (N, M) feature matrices that
torch ops write and read again never exist (measurements: docs/perf.md).

It serves forward passes that need no gradient on float32 CPU tensors with head dim 16, 32, 48 or 64 and a feature
count that is a multiple of 16 up to 1024; everything else uses :func:`attnlab.ops.lowrank.performer_attention`,
the tested reference it must match. The kernel is the ``torch.library`` custom op ``attnlab::performer_fused``
with a fake implementation (FakeTensor, ``torch.compile``) and a FLOP formula (the torch formulation's count on the
same shapes). Building and loading: :mod:`attnlab.ops.ckernel`; without a compiler, or with ``ATTNLAB_KERNELS=0``,
``impl="auto"`` quietly uses the torch path and ``impl="kernel"`` raises :class:`~attnlab.errors.ConfigError`.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from attnlab.ops import ckernel

__all__ = ["kernel_error", "performer_kernel", "supports", "unavailable"]

_ABI = 2  # ATTNLAB_PERFORMER_ABI in performer_kernel.c
_NT = 4   # Q, K, V, OUT


class _Args(ctypes.Structure):
    """performer_args in performer_kernel.c (its size is checked at load)."""

    _fields_ = [("ptr", ctypes.c_void_p * _NT), ("stride", (ctypes.c_int64 * 3) * _NT), ("wt", ctypes.c_void_p),
                ("H", ctypes.c_int64), ("N", ctypes.c_int64), ("D", ctypes.c_int64), ("M", ctypes.c_int64),
                ("half_norm_scale", ctypes.c_float), ("eps", ctypes.c_float)]


KERNEL = ckernel.CKernel("performer_kernel.c", abi=_ABI, op="attnlab::performer_fused", label="fused kernel", builds={
    torch.float32: ckernel.Build("attnlab_performer_f32", (ctypes.POINTER(_Args),), "attnlab_performer_supports",
                                 sizes={"attnlab_performer_args_size": ctypes.sizeof(_Args)})})


@torch.compiler.assume_constant_result
def unavailable() -> str | None:
    """Why the kernel cannot run in this process, or None (fixed for the process; see :class:`ckernel.CKernel`)."""
    return KERNEL.unavailable()


def supports(D: int, M: int) -> bool:
    """Whether the kernel takes head dim D and M features (``attnlab_performer_supports``)."""
    return D in (16, 32, 48, 64) and 16 <= M <= 1024 and M % 16 == 0


def kernel_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor) -> str | None:
    """Why the fused kernel cannot compute this FAVOR+ call right now, or None when it can."""
    if common := KERNEL.common_error(q, k, v, projection):
        return common
    if not (q.ndim == k.ndim == v.ndim and 2 <= q.ndim <= 4 and q.shape == k.shape == v.shape):
        return f"the fused kernel takes q, k, v of one shape (..., N, D), got {tuple(q.shape)}, {tuple(k.shape)}, " \
               f"{tuple(v.shape)}"
    M, D = projection.shape
    if D != q.shape[-1] or not supports(D, M):
        return (f"the fused kernel takes head dim 16, 32, 48 or 64 and a multiple of 16 features up to 1024, "
                f"got head dim {q.shape[-1]} and {M} features")
    return unavailable()


def performer_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor,
                     eps: float | None = None) -> torch.Tensor:
    """FAVOR+ by the fused kernel; the caller has checked :func:`kernel_error`. (B, H, N, D) inputs give an output
    laid out (B, N, H, D), so the head merge after it is a view. The denominator is floored at ``eps`` (default
    float32's smallest normal number), as :func:`attnlab.ops.lowrank.performer_attention` does."""
    return _OP(q, k, v, projection, torch.finfo(torch.float32).tiny if eps is None else eps)


def _as4(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (B, H, N, D) with unit feature stride (a view when it already has one)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(*[1] * (4 - x.ndim), *x.shape)


def _output(q: torch.Tensor) -> torch.Tensor:
    B, H, N, D = _as4(q).shape
    return q.new_empty(B, N, H, D).transpose(1, 2)


@KERNEL.custom_op
def _performer_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor,
                     eps: float) -> torch.Tensor:
    M, D = projection.shape
    wt = (projection * D ** -0.25).T.contiguous()
    tensors = [_as4(q), _as4(k), _as4(v), _output(q)]
    B, H, N, _ = tensors[0].shape
    args = _Args(H=H, N=N, D=D, M=M, wt=wt.data_ptr(), half_norm_scale=0.5 * D ** -0.5, eps=eps)
    for i, t in enumerate(tensors):
        args.ptr[i] = t.data_ptr()
        args.stride[i][:] = t.stride()[:3]
    KERNEL.run((ctypes.byref(args),), B * H)
    out = tensors[-1]
    return out if q.ndim == 4 else out.reshape(q.shape)


_OP = torch.ops.attnlab.performer_fused.default


@_performer_fused.register_fake
def _(q, k, v, projection, eps):
    out = _output(q)
    return out if q.ndim == 4 else out.reshape(q.shape)


@register_flop_formula(torch.ops.attnlab.performer_fused)
def _flops(q_shape, k_shape, v_shape, projection_shape, *args, **kwargs) -> int:
    """The torch formulation's count on the same shapes (:func:`attnlab.ops.lowrank.performer_attention`)."""
    return _torch_flops(tuple(q_shape), tuple(projection_shape))


@functools.cache
def _torch_flops(shape: tuple[int, ...], projection_shape: tuple[int, int]) -> int:
    from attnlab.ops.lowrank import performer_attention

    x, w = torch.empty(shape, device="meta"), torch.empty(projection_shape, device="meta")
    with FlopCounterMode(display=False) as counter:
        performer_attention(x, x, x, w)
    return counter.get_total_flops()
