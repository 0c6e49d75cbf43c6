"""Build, cache and call attnlab's small C kernels (``ns_kernel.c``, ``dna_kernel.c``, ``performer_kernel.c``)
through ctypes; :class:`CKernel` is what the wrappers (``ops/*_cpu.py``) share.

A kernel is one plain C file (no Python or torch headers). On first use in a process it is compiled with the system
C compiler (``$CC``, else ``cc``; gcc or clang) into ``$ATTNLAB_CACHE`` (default ``~/.cache/attnlab``) under a
name that hashes the source, the flags and the CPU (``-march=native``), then loaded with ctypes. A failed build
(no compiler, read-only cache) is remembered and reported by :func:`load_error`; callers then use their torch
path. ``ATTNLAB_KERNELS=0`` switches every kernel off.

Safety: a cached library runs in this process, so nothing is trusted there that another user could have put there:
the cache directory is created private (mode 0700), and a cache directory, library or record that belongs to another
user, or that group or others can write, is refused (the kernel is not used; :func:`load_error` says why). A library
is built in a fresh private temporary directory, then renamed into the cache beside its record (``NAME.so.sha256``:
the sha256 of what it was built from and of the library's bytes); a cached library is loaded only when both match,
through the file descriptor its bytes were hashed from, else it is built again.

:func:`load` checks each kernel's ``attnlab_abi()`` and struct sizes (``abi_sizes``) against what the Python side was
written for. A kernel built with ``-fopenmp`` parallelises inside C on torch's own libgomp threads (a Python thread
pool would compete with torch's spinning workers: docs/perf.md); without OpenMP, :func:`run_split` spreads the work
items over Python threads (ctypes releases the GIL).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

__all__ = ["Build", "CKernel", "cache_dir", "disabled", "load", "load_error", "run_split"]

# -O3: with GCC 12 the DnA kernel runs 1.6-2x faster than at -O2 and builds in about 2 s (docs/perf.md, "Fused CPU
# kernels: -O2 against -O3")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu99")
_OPENMP = "-fopenmp"

_lock = threading.Lock()
_libs: dict[tuple[str, tuple[str, ...]], ctypes.CDLL] = {}
_errors: dict[tuple[str, tuple[str, ...]], str] = {}
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0  # a forked child inherits the pool object but not its threads
_loaded_fds: list[int] = []  # kept open: dlopen knows "/proc/self/fd/N" by name, so N must never name another file


class _Refused(OSError):
    """A cache directory or file that someone other than this user could have written."""


def disabled() -> str | None:
    """The reason kernels are off (an environment switch), or None."""
    if os.environ.get("ATTNLAB_KERNELS", "1") == "0":
        return "the fused CPU kernels are switched off (ATTNLAB_KERNELS=0)"
    return None


def cache_dir() -> Path:
    """attnlab's cache: ``$ATTNLAB_CACHE``, else ``$XDG_CACHE_HOME/attnlab`` or ``~/.cache/attnlab``."""
    if os.environ.get("ATTNLAB_CACHE"):
        return Path(os.environ["ATTNLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnlab"


def _check_private(path: Path, st: os.stat_result, what: str) -> None:
    """_Refused unless ``st`` (of ``path``) belongs to this user and neither group nor others can write it (POSIX;
    elsewhere there are no such owners and modes)."""
    if not hasattr(os, "getuid"):
        return
    if st.st_uid != os.getuid():
        raise _Refused(f"{what} {path} belongs to another user (uid {st.st_uid}), so it may hold anyone's code; set "
                       f"ATTNLAB_CACHE to a directory of yours")
    if st.st_mode & 0o022:  # ours, but anyone could have planted a library there: never trusted, never repaired
        raise _Refused(f"{what} {path} can be written by group or others (mode {stat.S_IMODE(st.st_mode):o}), so it "
                       f"may hold anyone's code; delete it, or set ATTNLAB_CACHE to a private directory")


def _private_dir(path: Path) -> Path:
    """``path``, created with mode 0700 if missing; _Refused when another user owns it or could write into it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(path, path.stat(), "the kernel cache")
    return path


def _open_private(path: Path) -> int | None:
    """A file descriptor of the regular file ``path`` (not followed if a link), None if there is none; _Refused if
    another user owns it or group or others can write it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as err:
        raise _Refused(f"the cached file {path} cannot be opened as a plain file ({err.strerror}); delete it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(f"the cached file {path} is not a plain file; delete it")
        _check_private(path, st, "the cached file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_fd(fd: int) -> bytes:
    with open(fd, "rb", closefd=False) as f:
        f.seek(0)
        return f.read()


def _dlopen(fd: int, path: Path) -> ctypes.CDLL:
    """Load the library open as ``fd`` (what was hashed), by its /proc name where there is one, else by ``path``."""
    if os.path.isdir("/proc/self/fd"):
        _loaded_fds.append(fd)
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    try:
        return ctypes.CDLL(str(path))
    finally:
        os.close(fd)


def _load_cached(target: Path, source_key: str) -> ctypes.CDLL | None:
    """The cached library ``target`` if its record (``target.sha256``, as private as the library) names
    ``source_key`` and the sha256 of the bytes read from it; None when either is missing or differs (build it
    again); _Refused when either file is someone else's."""
    lib_fd = _open_private(target)
    if lib_fd is None:
        return None
    try:
        record_fd = _open_private(target.with_name(target.name + ".sha256"))
        if record_fd is None:
            os.close(lib_fd)
            return None
        try:
            record = json.loads(_read_fd(record_fd))
        except ValueError:
            record = {}
        finally:
            os.close(record_fd)
        if not isinstance(record, dict) or record.get("source") != source_key or \
                record.get("library") != hashlib.sha256(_read_fd(lib_fd)).hexdigest():
            os.close(lib_fd)
            return None
    except BaseException:
        os.close(lib_fd)
        raise
    return _dlopen(lib_fd, target)


def _compile(compiler: str, flags: tuple[str, ...], source: Path, target: Path, source_key: str) -> ctypes.CDLL:
    """Build ``source`` in a fresh private directory (the linker may re-create its output file, so a private file
    alone is not enough), record its hashes, rename both into the cache and load what was hashed."""
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))  # mode 0700; unique: concurrent builds
    try:
        out = work / target.name
        proc = subprocess.run([compiler, *flags, "-o", str(out), str(source), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(f"{compiler} failed: {proc.stderr.strip()[:500]}")
        os.chmod(out, 0o700)  # the linker's mode follows the umask, which may let others write
        lib_fd = os.open(out, os.O_RDONLY)
        try:
            record = {"source": source_key, "library": hashlib.sha256(_read_fd(lib_fd)).hexdigest()}
            record_fd = os.open(work / "record", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(record_fd, "w") as f:
                json.dump(record, f)
            os.replace(work / "record", target.with_name(target.name + ".sha256"))
            os.replace(out, target)  # atomic: another process sees the old pair or the whole new one
        except BaseException:
            os.close(lib_fd)
            raise
        return _dlopen(lib_fd, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _build(source: Path, defines: tuple[str, ...]) -> ctypes.CDLL:
    """The library, with ``built_with_openmp`` set: its entry points then split their range over OpenMP threads
    (torch's own libgomp, loaded first), else :func:`run_split` splits it over Python threads."""
    try:
        lib = _build_with(source, (*defines, _OPENMP))
        lib.built_with_openmp = True
    except _Refused:
        raise
    except OSError:  # a compiler without OpenMP (e.g. clang without libomp): Python threads split the work
        lib = _build_with(source, defines)
        lib.built_with_openmp = False
    return lib


def _build_with(source: Path, defines: tuple[str, ...]) -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    flags = (*_FLAGS, *defines)
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what its #include "..." lines read
    parts = [source.read_text(), *headers, compiler, *flags, _cpu_id()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    target = _private_dir(cache_dir()) / f"{source.stem}_{key[:16]}.so"
    return _load_cached(target, key) or _compile(compiler, flags, source, target, key)


def _handshake(lib: ctypes.CDLL, name: str, abi: int, abi_sizes: dict[str, int]) -> None:
    """OSError unless ``lib`` reports interface version ``abi`` and, from each ``abi_sizes`` function, the size
    (in bytes) the Python side declares for that struct."""
    try:
        version = lib.attnlab_abi
    except AttributeError:
        raise OSError(f"{name} exports no attnlab_abi(); it predates the version handshake") from None
    version.restype = ctypes.c_int64
    if version() != abi:
        raise OSError(f"{name} has interface version {version()}, the Python side expects {abi}")
    for fn_name, size in abi_sizes.items():
        fn = getattr(lib, fn_name)
        fn.restype = ctypes.c_int64
        if fn() != size:
            raise OSError(f"{name}: {fn_name}() is {fn()} bytes, the Python side declares {size}")


def load(name: str, defines: tuple[str, ...] = (), *, abi: int, abi_sizes: dict[str, int] | None = None
         ) -> ctypes.CDLL | None:
    """The compiled ``attnlab/ops/<name>`` with ``-D`` ``defines``, checked to report interface version ``abi``
    and the struct sizes ``abi_sizes`` (exported function name -> bytes); None when it cannot be built or fails
    the check (see :func:`load_error`). Built once per process."""
    key = (name, defines)
    if key in _libs:
        return _libs[key]
    with _lock:
        if key not in _libs and key not in _errors:
            try:
                lib = _build(Path(__file__).with_name(name), defines)
                _handshake(lib, name, abi, abi_sizes or {})
                _libs[key] = lib
            except _Refused as err:  # a cache that others could have written: nothing from it runs here
                _errors[key] = f"the fused CPU kernel is not used: {err}"
            except OSError as err:  # no compiler, failed build, load or handshake
                _errors[key] = f"the fused CPU kernel could not be built ({err})"
    return _libs.get(key)


def load_error(name: str, defines: tuple[str, ...] = ()) -> str | None:
    return _errors.get((name, defines))


def run_split(lib: ctypes.CDLL, fn: Callable[..., int], args: tuple, total: int, min_per_thread: int = 1) -> None:
    """Run ``fn(*args, start, end, threads)`` over the work items ``[0, total)`` on up to torch's thread count,
    with at least ``min_per_thread`` items per thread (below that a hand-off costs more than it saves): inside C
    when ``lib`` was built with OpenMP, else as contiguous chunks over Python threads.

    ``fn`` returns 0 on success; anything else raises RuntimeError (the callers check shapes first)."""
    global _pool, _pool_pid
    threads = max(1, min(torch.get_num_threads(), total // min_per_thread))
    if threads == 1 or lib.built_with_openmp:
        statuses = [fn(*args, 0, total, threads)]
    else:
        if _pool is None or _pool_pid != os.getpid() or _pool._max_workers < threads:
            _pool, _pool_pid = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="attnlab"), os.getpid()
        bounds = [total * i // threads for i in range(threads + 1)]
        futures = [_pool.submit(fn, *args, lo, hi, 1) for lo, hi in zip(bounds[:-1], bounds[1:])]
        statuses = [f.result() for f in futures]
    if any(statuses):  # pragma: no cover - callers check supported shapes first
        raise RuntimeError(f"{getattr(fn, '__name__', fn)}: the kernel rejected its arguments")


@dataclass(frozen=True)
class Build:
    """One build of a kernel source: its entry point ``entry(*args, start, end, threads) -> status`` (``argtypes``
    of ``args``), its ``supports(int64, int64) -> int``, ``-D`` defines, the struct sizes :func:`load` checks."""

    entry: str
    argtypes: tuple
    supports: str
    defines: tuple[str, ...] = ()
    sizes: dict[str, int] = field(default_factory=dict)


class CKernel:
    """The C kernel ``source`` behind the custom op ``op``, one build per dtype, checked for interface version ``abi``
    and called through :func:`run_split`; ``label`` names it in the reasons it gives."""

    def __init__(self, source: str, *, abi: int, op: str, label: str, builds: dict[torch.dtype, Build]):
        self.source, self.abi, self.op, self.label, self.builds = source, abi, op, label, builds

    def library(self, dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
        """The ``dtype`` build (once per process) with its entry point and ``supports`` declared, else None."""
        build = self.builds[dtype]
        lib = load(self.source, build.defines, abi=self.abi, abi_sizes=build.sizes)
        if lib is not None and "declared" not in lib.__dict__:
            for name, argtypes in ((build.entry, (*build.argtypes, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)),
                                   (build.supports, (ctypes.c_int64, ctypes.c_int64))):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            lib.declared = True
        return lib

    def unavailable(self, dtype: torch.dtype = torch.float32) -> str | None:
        """Why the ``dtype`` build cannot run in this process (switched off, not built), or None. Fixed for the
        process: the wrappers' ``unavailable()`` let ``torch.compile`` ask it once (``assume_constant_result``)."""
        off = disabled()
        if off or self.library(dtype) is not None:
            return off
        defines = self.builds[dtype].defines
        return load_error(self.source, defines) or f"the fused CPU kernel {self.source} could not be loaded"

    def common_error(self, *tensors: torch.Tensor | None, masks: bool = False, cpu: bool = True,
                     dtype_ok: bool = True, needs_grad: bool = False) -> str | None:
        """The first shared clause a call fails, or None: its ``tensors`` (None skipped, boolean ones too with
        ``masks``) or, before they exist, its properties must be on the CPU, of a built dtype, needing no gradient."""
        tensors = [t for t in tensors if t is not None]
        off = [t.device for t in tensors if t.device.type != "cpu"]
        odd = [t.dtype for t in tensors if t.dtype not in self.builds and not (masks and t.dtype == torch.bool)]
        if off or not cpu:
            return f"the {self.label} runs on the CPU" + (f", not {off[0]}" if off else "")
        if odd or not dtype_ok:
            names = " or ".join(str(d).removeprefix("torch.") for d in self.builds)
            return f"the {self.label} takes {names}" + (f", not {odd[0]}" if odd else "")
        if needs_grad or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return f"the {self.label} is forward-only; this call needs a gradient"
        return None

    def custom_op(self, fn: Callable) -> torch.library.CustomOpDef:
        """``fn`` as the CPU custom op ``op``, which torch sees where it cannot see a ctypes call."""
        return torch.library.custom_op(self.op, fn, mutates_args=(), device_types="cpu")

    def run(self, args: tuple, total: int, *, dtype: torch.dtype = torch.float32, min_per_thread: int = 1) -> None:
        """The ``dtype`` build's entry point over ``total`` work items (:func:`run_split`); RuntimeError if unbuilt."""
        lib = self.library(dtype)
        if lib is None:
            raise RuntimeError(f"{self.op} cannot run: {self.unavailable(dtype)}")
        run_split(lib, getattr(lib, self.builds[dtype].entry), args, total, min_per_thread)
