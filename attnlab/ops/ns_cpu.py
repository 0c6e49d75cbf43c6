"""The fused CPU kernel of NS-Attn's transform (``ns_kernel.c``): build on first use, call through ctypes.

Why a kernel: on the CPU the transform's arithmetic is ~2% of a ViT block, but in torch ops it costs a dense copy
of the attention kernel's strided output, batched GEMMs on 16 x 32 matrices and a transposing copy at head merge.
The C kernel reads each head matrix once from wherever it lies, does the Gram-space algebra of ``_ns_fast`` in
cache, and writes the result with the input's strides, so the head merge after it is a free view.

It serves forward passes that need no gradient (eval, ``torch.no_grad`` / ``inference_mode``) on float32 and
float64 CPU tensors; autograd, ``torch.compile`` tracing and other devices use the torch formulation. Building
and loading: :mod:`attnlab.ops.ckernel`. Without a compiler, or with ``ATTNLAB_KERNELS=0``, ``impl="auto"``
quietly uses the torch formulation and ``impl="kernel"`` raises :class:`~attnlab.errors.ConfigError` with the
reason.
"""

from __future__ import annotations

import ctypes

import torch

from attnlab.ops import ckernel

__all__ = ["kernel_error", "ns_kernel"]

_SOURCE = "ns_kernel.c"
_DTYPES = {torch.float32: ("f32", ctypes.c_float, ()), torch.float64: ("f64", ctypes.c_double, ("-DNS_DOUBLE",))}
_funcs: dict[torch.dtype, tuple[object, object, object]] = {}  # dtype -> (transform, supports, library)


def _load(dtype: torch.dtype):
    """(transform, supports, library) for ``dtype``, built on first use; None when the build failed."""
    if dtype not in _funcs:
        suffix, ctype, defines = _DTYPES[dtype]
        lib = ckernel.load(_SOURCE, defines)
        if lib is None:
            return None
        fn, supports = getattr(lib, f"attnlab_ns_{suffix}"), getattr(lib, f"attnlab_ns_supports_{suffix}")
        i64 = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[i64] * 9, ctypes.c_int, ctype, ctype, ctype, ctype, i64, i64,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
        supports.argtypes = [i64, i64]
        supports.restype = ctypes.c_int
        _funcs[dtype] = (fn, supports, lib)
    return _funcs[dtype]


def kernel_error(x: torch.Tensor) -> str | None:
    """Why the fused kernel cannot transform ``x`` right now, or None when it can."""
    if x.device.type != "cpu":
        return f"the fused kernel runs on the CPU, the tensor is on {x.device}"
    if x.dtype not in _DTYPES:
        return f"the fused kernel takes float32 or float64, not {x.dtype}"
    if torch.is_grad_enabled() and x.requires_grad:
        return "the fused kernel is forward-only; this call needs a gradient"
    if torch.compiler.is_compiling():
        return "the fused kernel is opaque to torch.compile; compiled code uses the torch formulation"
    if x.ndim < 2:
        return f"the fused kernel takes (..., N, D) head matrices, got shape {tuple(x.shape)}"
    off = ckernel.disabled()
    if off:
        return off
    funcs = _load(x.dtype)
    if funcs is None:
        return ckernel.load_error(_SOURCE, _DTYPES[x.dtype][2])
    if not funcs[1](*x.shape[-2:]):
        return (f"the fused kernel has no instance for {x.shape[-2]} x {x.shape[-1]} head matrices (it takes "
                f"min(N, D) in 16, 32, 48, 64 and, when N < D, D in 32, 48, 64)")
    return None


def ns_kernel(x: torch.Tensor, steps: int, eps: float, coeffs: tuple[float, float, float]) -> torch.Tensor:
    """T(x) by the fused kernel; the caller has checked :func:`kernel_error`. Output strides follow the input's
    when it is dense (an attention kernel's (B, N, H, D) buffer stays (B, N, H, D)), else it is contiguous."""
    fn, _, lib = _load(x.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    # (B, H, N, D) for the kernel's two batch strides: a view whenever the leading dims allow one
    x4 = x.reshape(-1, *x.shape[-3:]) if x.ndim >= 4 else x.reshape(*[1] * (4 - x.ndim), *x.shape)
    y4 = torch.empty_like(x4)  # preserve_format: same strides as a dense input
    B, H, N, D = x4.shape
    args = (x4.data_ptr(), y4.data_ptr(), H, N, D, *x4.stride()[:3], *y4.stride()[:3], steps, eps, *coeffs)
    ckernel.run_split(lib, fn, args, B * H, min_per_thread=64)  # a head matrix is ~1 us of work
    return y4.view(x.shape)  # splitting or dropping unit dims is always a view
