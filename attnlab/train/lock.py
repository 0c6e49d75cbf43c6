"""One writer per run directory: an exclusive OS lock, and the removal of what killed writers left behind.

The writer holds an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock``, which names its pid and host; the kernel
releases it however the process ends (SIGKILL included), so it is never stale, and a second writer stops with
:class:`RunLockedError`. Readers never take it. A new run directory is locked before it appears, inside the
temporary directory that :func:`attnlab.train.checkpoint.create_dir_with` renames to it. Temporary names
(:func:`temp_name`) carry their writer's pid; the next holder removes those whose process is gone. Without
``fcntl`` (Windows), or on a file system that cannot lock (``ENOLCK``, ``ENOTSUP``), there is no lock.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import secrets
import shutil
import socket
import time
import weakref
from pathlib import Path

from attnlab.errors import AttnlabError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK = ".lock"
_TEMP = re.compile(r"^\.(?P<name>.+?)\.(?:(?P<pid>\d+)\.)?[0-9a-f]{12}\.tmp$")  # without a pid: older versions
_held: weakref.WeakSet[RunLock] = weakref.WeakSet()
_NO_LOCKS = (errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP)  # a file system that cannot lock: no lock there


class RunLockedError(AttnlabError):
    """Another process holds the run directory's lock: it is training (or setting up) that run."""


def temp_name(path: Path) -> Path:
    """A fresh temporary name beside ``path`` that names this process: ``.NAME.PID.RANDOM.tmp``."""
    return path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _stale(name: str, target: str | None = None) -> bool:
    """Whether ``name`` is a temporary name (of ``target``, if given) whose writing process has ended."""
    m = _TEMP.match(name)
    if m is None or (target is not None and m["name"] != target):
        return False
    return m["pid"] is None or (int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])))


def remove_stale(run_dir: Path) -> None:
    """Remove the temporary files in ``run_dir``, and the temporary directories of ``create_dir_with`` beside
    it, that processes which have ended left behind."""
    for path in (*run_dir.iterdir(), *run_dir.parent.glob(f".{glob.escape(run_dir.name)}.*.tmp")):
        if not _stale(path.name, None if path.parent == run_dir else run_dir.name):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _holder(lock_file: Path) -> str:
    """'process PID' (with ' on HOST' when another machine) as the lock file says, or 'another process'."""
    try:
        pid, _, host = lock_file.read_text().strip().partition(" ")
    except OSError:
        pid = host = ""
    if not pid.isdigit():
        return "another process"
    return f"process {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")


def _locked_error(run_dir: Path, lock_file: Path) -> RunLockedError:
    return RunLockedError(f"run directory {run_dir} is being written by {_holder(lock_file)}, which holds "
                          f"{lock_file}; one run directory has one writer at a time: wait for that process to end "
                          f"(or stop it), or pass --name to train another run.")


def check_unlocked(run_dir: str | Path) -> None:
    """RunLockedError if a process holds ``run_dir``'s lock (a shared probe: the lock is not kept)."""
    lock_file = Path(run_dir) / LOCK
    if fcntl is None:
        return
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:  # no lock file (or none this user can open): nobody holds it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _locked_error(Path(run_dir), lock_file) from None
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
    finally:
        os.close(fd)  # closing drops the probe's shared lock


class RunLock:
    """The exclusive lock of ``run_dir`` for one writer, as a context manager: entering takes it if ``run_dir``
    exists (else :func:`~attnlab.train.checkpoint.create_dir_with` takes it when it makes the directory), leaving
    releases it; :class:`RunLockedError` when another process holds it. ``enabled=False`` (the other ranks under
    torchrun, which write nothing) makes it a no-op."""

    def __init__(self, run_dir: str | Path, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled and fcntl is not None
        self._fd: int | None = None
        self._file: Path | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None or not self.enabled

    def __enter__(self) -> RunLock:
        if self.enabled and self.run_dir.is_dir():
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self, directory: Path | None = None) -> None:
        """Take the lock of the run directory, or of ``directory``: a temporary directory about to be renamed to
        it (then call :meth:`moved`). On the run directory itself, stale temporaries are removed once it is held."""
        if not self.enabled or self._fd is not None:
            return
        lock_file = (directory or self.run_dir) / LOCK
        for attempt in range(100):
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if attempt < 5:  # a reader's probe (check_unlocked) holds it for a moment
                    time.sleep(0.05)
                    continue
                raise _locked_error(self.run_dir, lock_file) from None
            except OSError as err:
                os.close(fd)
                if err.errno not in _NO_LOCKS:
                    raise OSError(err.errno, err.strerror, str(lock_file)) from None
                lock_file.unlink(missing_ok=True)
                self.enabled = False  # this file system cannot lock: write unlocked, as without fcntl
                return
            try:
                same = os.stat(lock_file).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its last holder removed that file as we opened it: lock the new one
        else:  # pragma: no cover
            raise _locked_error(self.run_dir, lock_file)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self._fd, self._file = fd, lock_file
        _held.add(self)
        if directory is None:
            remove_stale(self.run_dir)

    def moved(self) -> None:
        """The temporary directory holding the lock has been renamed to the run directory."""
        self._file = self.run_dir / LOCK
        remove_stale(self.run_dir)

    def release(self) -> None:
        """Remove the lock file (while still holding it, so that no one locks a file about to vanish) and unlock."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _held.discard(self)
        with contextlib.suppress(OSError):
            if os.stat(self._file).st_ino == os.fstat(fd).st_ino:
                os.unlink(self._file)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _drop_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of the lock files, so that the lock ends with the
    process that took it; closing a copy does not unlock the parent's."""
    for lock in list(_held):
        if lock._fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock._fd)
            lock._fd = None
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)
