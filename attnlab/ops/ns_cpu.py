"""The fused CPU kernel of NS-Attn's transform (``ns_kernel.c``): build on first use, call through ctypes.

Why a kernel: on the CPU the transform's arithmetic is ~2% of a ViT block, but in torch ops it costs a dense copy
of the attention kernel's strided output, batched GEMMs on 16 x 32 matrices and a transposing copy at head merge.
The C kernel reads each head matrix once from wherever it lies, does the Gram-space algebra of ``_ns_fast`` in
cache, and writes the result with the input's strides, so the head merge after it is a free view.

It serves forward passes that need no gradient (eval, ``torch.no_grad`` / ``inference_mode``) on float32 and
float64 CPU tensors; autograd, ``torch.compile`` tracing and other devices use the torch formulation. The shared
library is compiled with the system C compiler (``$CC``, else ``cc``) into ``$ATTNLAB_CACHE`` (default
``~/.cache/attnlab``) under a name that hashes the source, flags and CPU, and loaded once per process. Without a
compiler, or with ``ATTNLAB_NS_KERNEL=0``, ``impl="auto"`` quietly uses the torch formulation and
``impl="kernel"`` raises :class:`~attnlab.errors.ConfigError` with the reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["kernel_error", "ns_kernel"]

_SOURCE = Path(__file__).with_name("ns_kernel.c")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu99")
_SYMBOLS = {torch.float32: ("attnlab_ns_f32", ctypes.c_float, ()), torch.float64: ("attnlab_ns_f64", ctypes.c_double,
                                                                                   ("-DNS_DOUBLE",))}
_MIN_PER_THREAD = 64  # matrices; below this a thread hand-off costs more than it saves

_lock = threading.Lock()
_funcs: dict[torch.dtype, tuple[object, object]] = {}  # dtype -> (transform, supports)
_error: str | None = None
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0  # a forked child inherits the pool object but not its threads


def _cache_dir() -> Path:
    if os.environ.get("ATTNLAB_CACHE"):
        return Path(os.environ["ATTNLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnlab"


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _build(dtype: torch.dtype) -> object:
    symbol, ctype, defines = _SYMBOLS[dtype]
    compiler = os.environ.get("CC", "cc")
    flags = (*_FLAGS, *defines)
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), compiler, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"ns_kernel_{symbol}_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # unique name: concurrent builds do not clash
        os.close(fd)
        try:
            proc = subprocess.run([compiler, *flags, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise OSError(f"{compiler} failed: {proc.stderr.strip()[:500]}")
            os.replace(tmp, target)  # atomic: another process sees the old state or the whole file
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    lib = ctypes.CDLL(str(target))
    fn, supports = getattr(lib, symbol), getattr(lib, symbol.replace("_ns_", "_ns_supports_"))
    i64 = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[i64] * 9, ctypes.c_int, ctype, ctype, ctype, ctype, i64, i64]
    fn.restype = ctypes.c_int
    supports.argtypes = [i64, i64]
    supports.restype = ctypes.c_int
    return fn, supports


def _load(dtype: torch.dtype):
    """(transform, supports) for ``dtype``, built on first use; None when the build failed (see ``_error``)."""
    global _error
    if dtype in _funcs:
        return _funcs[dtype]
    with _lock:
        if dtype not in _funcs and _error is None:
            try:
                _funcs[dtype] = _build(dtype)
            except (OSError, AttributeError) as err:  # no compiler, read-only cache, failed build
                _error = f"the fused CPU kernel could not be built ({err})"
    return _funcs.get(dtype)


def kernel_error(x: torch.Tensor) -> str | None:
    """Why the fused kernel cannot transform ``x`` right now, or None when it can."""
    if x.device.type != "cpu":
        return f"the fused kernel runs on the CPU, the tensor is on {x.device}"
    if x.dtype not in _SYMBOLS:
        return f"the fused kernel takes float32 or float64, not {x.dtype}"
    if torch.is_grad_enabled() and x.requires_grad:
        return "the fused kernel is forward-only; this call needs a gradient"
    if torch.compiler.is_compiling():
        return "the fused kernel is opaque to torch.compile; compiled code uses the torch formulation"
    if x.ndim < 2:
        return f"the fused kernel takes (..., N, D) head matrices, got shape {tuple(x.shape)}"
    if os.environ.get("ATTNLAB_NS_KERNEL", "1") == "0":
        return "the fused kernel is switched off (ATTNLAB_NS_KERNEL=0)"
    funcs = _load(x.dtype)
    if funcs is None:
        return _error
    if not funcs[1](*x.shape[-2:]):
        return (f"the fused kernel has no instance for {x.shape[-2]} x {x.shape[-1]} head matrices (it takes "
                f"min(N, D) in 16, 32, 48, 64 and, when N < D, D in 32, 48, 64)")
    return None


def _threads(work: int) -> int:
    return max(1, min(torch.get_num_threads(), work // _MIN_PER_THREAD))


def ns_kernel(x: torch.Tensor, steps: int, eps: float, coeffs: tuple[float, float, float]) -> torch.Tensor:
    """T(x) by the fused kernel; the caller has checked :func:`kernel_error`. Output strides follow the input's
    when it is dense (an attention kernel's (B, N, H, D) buffer stays (B, N, H, D)), else it is contiguous."""
    global _pool, _pool_pid
    fn = _funcs[x.dtype][0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    # (B, H, N, D) for the kernel's two batch strides: a view whenever the leading dims allow one
    x4 = x.reshape(-1, *x.shape[-3:]) if x.ndim >= 4 else x.reshape(*[1] * (4 - x.ndim), *x.shape)
    y4 = torch.empty_like(x4)  # preserve_format: same strides as a dense input
    B, H, N, D = x4.shape
    args = (x4.data_ptr(), y4.data_ptr(), H, N, D, *x4.stride()[:3], *y4.stride()[:3], steps, eps, *coeffs)
    total = B * H
    threads = _threads(total)
    if threads == 1:
        status = fn(*args, 0, total)
        statuses = [status]
    else:  # ctypes releases the GIL, so the chunks run in parallel
        if _pool is None or _pool_pid != os.getpid() or _pool._max_workers < threads:
            _pool, _pool_pid = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="attnlab-ns"), os.getpid()
        bounds = [total * i // threads for i in range(threads + 1)]
        futures = [_pool.submit(fn, *args, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
        statuses = [f.result() for f in futures]
    if any(statuses):  # pragma: no cover - kernel_error checks the size first
        raise RuntimeError("ns_kernel: no kernel instance for this head shape")
    return y4.view(x.shape)  # splitting or dropping unit dims is always a view
