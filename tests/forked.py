"""Real processes without a fresh interpreter's imports, for the tests that need a process (a pid to kill, an exit
code, a run that dies mid-epoch, a torchrun rank) but not an interpreter's start-up: importing torch, torchvision
and timm costs about 7 CPU-s on a 2-core machine, paid by dozens of such tests.

Each test process starts one zygote, an interpreter that has imported those libraries and nothing of attnlab or
tests/, and asks it to fork a child for each `popen`/`run`. The child starts as ``python ARGV`` would: its own argv,
environment, working directory, sys.path (PYTHONPATH read again), __main__, standard streams and thread count;
it runs the code, then exits as the interpreter would (exit code, traceback, atexit) or dies of its signal.

The zygote must be one thread after its imports, as under pytest-xdist, where tests/conftest.py gives each worker
one thread (a process-wide default of more starts BLAS threads at import, and a fork keeps only one of them).
Where the fork cannot be faithful the command runs in a fresh interpreter instead: no fork (not Linux), a flag
other than -c/-m/-u, an environment variable read by those libraries at import (TORCH*, HF_*, CUDA*, ...) set
otherwise than in the zygote, or imports that printed anything. ATTNLAB_TEST_FRESH=1 makes every run fresh;
ATTNLAB_TEST_FORKED_LOG=FILE records each request the zygote answers, with the reason where it declined.

Under torchrun, ``torchrun --no-python ... python -S tests/forked.py rank ARGV`` makes each rank such a child: the
rank process torchrun starts is a stand-in that forwards torchrun's signals to the child and exits as it does;
the child is killed when the stand-in dies (torchrun's SIGKILL). tests/train/test_forked.py checks all of this against
fresh interpreters.

Only the standard library at module level: the stand-in runs without site-packages.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

PRELOAD = ("torch", "torchvision", "timm", "numpy", "safetensors.torch", "yaml", "PIL.Image", "sklearn.datasets",
           "sklearn.model_selection")
# variables those libraries (or the interpreter) read at import: a child that sets them otherwise runs fresh
IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "TRITON", "CUDA", "NCCL", "MKL", "KMP", "OMP_", "GOMP", "HF_", "HUGGINGFACE",
                   "TIMM", "PYTHON", "LD_", "NUMPY", "OPENBLAS", "SKLEARN", "XDG_CACHE_HOME")
# ... except these, which they read later (torchrun's own) or which the child applies itself
LATE_ENV = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "PYTHONPATH", "PYTHONUNBUFFERED")
ZYGOTE_ENV = "ATTNLAB_TEST_ZYGOTE"
LOG_ENV = "ATTNLAB_TEST_FORKED_LOG"  # a file: one line per request, forked or why not
PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL

_zygote: dict[int, tuple[subprocess.Popen | None, str | None]] = {}  # test process -> (zygote, socket)
_ENV = dict(os.environ)  # the zygote's: as at collection, before any test's monkeypatch


# ----------------------------------------------------------------------------------------------- the client side
class Forked:
    """The part of ``subprocess.Popen`` the tests use, for a child of the zygote."""

    def __init__(self, args, conn: socket.socket, pid: int, stdout, stderr, text: bool):
        self.args, self._conn, self.pid, self.returncode = args, conn, pid, None
        self.stdout = os.fdopen(stdout, "r" if text else "rb") if stdout is not None else None
        self.stderr = os.fdopen(stderr, "r" if text else "rb") if stderr is not None else None

    def _status(self, timeout: float | None) -> bool:
        if self.returncode is None and select.select([self._conn], [], [], timeout)[0]:
            message = _receive(self._conn)
            self.returncode = message["returncode"] if message else -signal.SIGKILL  # the zygote itself was killed
            self._conn.close()
        return self.returncode is not None

    def poll(self):
        self._status(0)
        return self.returncode

    def wait(self, timeout: float | None = None):
        if not self._status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        out = {}
        readers = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f.read()), daemon=True)
                   for k, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
        for r in readers:
            r.start()
        for r in readers:
            r.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if r.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return out.get("out"), out.get("err")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(args, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False, rlimits=None):
    """``subprocess.Popen(args, ...)`` for ``args = [sys.executable, ...]``: a child of the zygote, or a fresh
    interpreter where that cannot be faithful (module docstring). ``rlimits``: ``{"RLIMIT_AS": (soft, hard)}``,
    set in the child before it runs anything of its own."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    cwd = os.getcwd() if cwd is None else str(cwd)
    socket_path = _socket() if args[0] == sys.executable and stdin != PIPE else None
    if socket_path is not None:
        ours, theirs = [], []
        for given, fd in ((stdin, 0), (stdout, 1), (stderr, 2)):
            if given == PIPE:
                read, write = os.pipe()
                ours.append(read)
                theirs.append(write)
            elif given == DEVNULL:
                ours.append(None)
                theirs.append(os.open(os.devnull, os.O_RDWR))
            elif given == subprocess.STDOUT:
                ours.append(None)
                theirs.append(os.dup(theirs[1]))
            else:
                ours.append(None)
                theirs.append(os.dup(fd if given is None else given if isinstance(given, int) else given.fileno()))
        try:
            conn, reply = _ask(socket_path, {"argv": args, "env": env, "cwd": cwd, "rlimits": rlimits or {}}, theirs)
        finally:
            for fd in theirs:
                os.close(fd)
        if "pid" in reply:
            return Forked(args, conn, reply["pid"], ours[1], ours[2], text)
        conn.close()
        for fd in ours:
            if fd is not None:
                os.close(fd)
    limit = (lambda: [resource.setrlimit(getattr(resource, k), v) for k, v in rlimits.items()]) if rlimits else None
    return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                            preexec_fn=limit)


def run(args, *, env=None, cwd=None, capture_output=False, text=False, timeout=None, stdout=None, stderr=None,
        rlimits=None):
    """``subprocess.run`` through :func:`popen`."""
    if capture_output:
        stdout = stderr = PIPE
    proc = popen(args, env=env, cwd=cwd, stdin=DEVNULL, stdout=stdout, stderr=stderr, text=text, rlimits=rlimits)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def torchrun_rank() -> list[str]:
    """What goes after ``torchrun --no-python [options]`` so that each rank is a child of this process's zygote:
    then the training script and its arguments (``-m attnlab train ...``) as after a plain ``torchrun``."""
    return [sys.executable, "-S", __file__, "rank"]


def rank_env(env: dict) -> dict:
    """``env`` with the zygote's socket for :func:`torchrun_rank` (the rank's stand-in finds the zygote by it)."""
    socket_path = _socket()
    return dict(env, **({ZYGOTE_ENV: socket_path} if socket_path else {}))


def _socket() -> str | None:
    """This test process's zygote, started on first use; None where a fork cannot stand in for an interpreter."""
    if os.environ.get("ATTNLAB_TEST_FRESH") == "1" or not hasattr(os, "fork") or sys.platform != "linux":
        return None
    if os.getpid() not in _zygote:
        directory = tempfile.mkdtemp(prefix="attnlab-zygote-")
        path = os.path.join(directory, "socket")
        proc = subprocess.Popen([sys.executable, __file__, "serve", path], stdin=DEVNULL, stdout=PIPE,
                                stderr=subprocess.STDOUT, text=True, env=_ENV)
        ready = proc.stdout.readline().strip()
        if ready != "ready":
            print(f"tests/forked.py: fresh interpreters instead of a zygote: {ready or proc.stdout.read()}",
                  file=sys.stderr)
            proc.kill()
            proc, path = None, None
        _zygote[os.getpid()] = (proc, path)

        def stop(proc=proc, directory=directory):
            if proc is not None:
                proc.kill()
                proc.wait()
            shutil.rmtree(directory, ignore_errors=True)

        import atexit

        atexit.register(stop)
    return _zygote[os.getpid()][1]


def _send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(conn, [struct.pack("!I", len(data)) + data], list(fds))


def _receive(conn: socket.socket, with_fds: bool = False):
    """One message (and the fds sent with it); None at end of stream."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3) if with_fds else (conn.recv(4), [], 0, None)
    head += _exactly(conn, 4 - len(head)) if head else b""
    message = json.loads(_exactly(conn, struct.unpack("!I", head)[0])) if len(head) == 4 else None
    return (message, fds) if with_fds else message


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size and (chunk := conn.recv(size - len(data))):
        data += chunk
    return data


def _ask(socket_path: str, request: dict, fds: list[int]) -> tuple[socket.socket, dict]:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(socket_path)
    _send(conn, request, fds)
    return conn, _receive(conn) or {"fresh": "the zygote did not answer"}


# ----------------------------------------------------------------------------------------------- the zygote
def _script(command: list[str]) -> tuple[list[str], bool]:
    """``python [-u ...] REST``: (REST, whether -u was given)."""
    rest = command[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    return rest, len(rest) < len(command) - 1


def _unfaithful(request: dict, own_env: dict, set_by_imports: dict) -> str | None:
    """Why forking from the zygote would not start ``request`` as a fresh interpreter would; None if it would.
    ``own_env``: the zygote's environment before its imports; ``set_by_imports``: what they set in it."""
    argv, _ = _script(request["argv"])
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-c", "-m")) or argv[0] in ("-c", "-m") and \
            len(argv) < 2:
        return f"interpreter options {request['argv'][1:3]}"
    env = request["env"]
    for name in sorted(set(env) | set(own_env)):
        if not name.startswith(IMPORT_TIME_ENV) or name.startswith(LATE_ENV) or env.get(name) == own_env.get(name):
            continue
        if name not in set_by_imports or env.get(name) not in (None, set_by_imports[name]):  # (or set alike)
            return f"{name} differs from the zygote's"
    threads = env.get("OMP_NUM_THREADS")
    if threads != own_env.get("OMP_NUM_THREADS") and not (threads or "").isdigit():
        return "OMP_NUM_THREADS unset or not a count"
    return None


def _serve(path: str) -> None:
    """Import PRELOAD, then fork a child for each request on the socket at ``path`` until the parent goes."""
    import importlib

    parent, own_env = os.getppid(), dict(os.environ)
    # what the imports print would be printed by every fresh interpreter: such a zygote refuses to stand in
    sys.stdout.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as printed:
        os.dup2(printed.fileno(), 1), os.dup2(printed.fileno(), 2)
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a library missing here is imported by the child, if at all
                pass
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved_out, 1), os.dup2(saved_err, 2)
        printed.seek(0)
        noise = printed.read().decode(errors="replace").strip()
    threads = len(os.listdir("/proc/self/task"))
    reason = (f"the imports printed {noise[:300]!r}" if noise else f"the imports started {threads - 1} threads"
              if threads > 1 else None)
    if reason:
        print(reason, flush=True)
        return
    base_path = sys.path[1:]  # less the zygote's own directory and PYTHONPATH
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if entry in base_path:
            base_path.remove(entry)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(0.5)
    set_by_imports = {k: v for k, v in os.environ.items() if own_env.get(k) != v}  # a fresh child's would too
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1), os.dup2(devnull, 2), os.dup2(devnull, 0)
    while os.getppid() == parent:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap the monitors
                pass
        except ChildProcessError:
            pass
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        request, fds = _receive(conn, with_fds=True)
        reason = ("a bad request" if request is None or len(fds) != 3 else
                  _unfaithful(request, own_env, set_by_imports))
        if own_env.get(LOG_ENV):
            with open(own_env[LOG_ENV], "a") as log:
                print(json.dumps({"fresh": reason, "argv": (request or {}).get("argv", [])[:4]}), file=log)
        if reason:
            _send(conn, {"fresh": reason})
        elif os.fork() == 0:
            listener.close()
            request["env"] = {**set_by_imports, **request["env"]}
            _monitor(conn, request, fds, base_path)
        for fd in fds:
            os.close(fd)
        conn.close()


def _monitor(conn: socket.socket, request: dict, fds: list[int], base_path: list[str]) -> None:
    """In a fork of the zygote: fork the child, tell the client its pid, wait for it and send its returncode;
    kill it if the client goes first (a torchrun stand-in killed by torchrun)."""
    try:
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(request, fds, base_path)
        for fd in fds:
            os.close(fd)
        _send(conn, {"pid": pid})
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                break
            if select.select([conn], [], [], 0.05)[0] and not conn.recv(1):
                os.kill(pid, signal.SIGKILL)
    finally:
        os._exit(0)


def _child(request: dict, fds: list[int], base_path: list[str]) -> None:
    """Become ``python ARGV`` in ``cwd`` with ``env``, and exit as that interpreter would."""
    import atexit
    import runpy
    import types

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    code = 1
    try:
        os.chdir(request["cwd"])
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # looked up again from TMPDIR, as a fresh interpreter would
        argv, unbuffered = _script(request["argv"])
        unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            setattr(sys, name, open(stream.fileno(), "w", buffering=1 if unbuffered or name == "stderr" else -1,
                                    encoding=stream.encoding, errors=stream.errors, closefd=False))
        sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)
        for name, limits in request.get("rlimits", {}).items():
            resource.setrlimit(getattr(resource, name), tuple(limits))
        # torch's default thread count follows MKL_NUM_THREADS before OMP_NUM_THREADS: with the former set (the
        # zygote's own, or the child would be unfaithful) the zygote's count is already a fresh interpreter's
        if env.get("OMP_NUM_THREADS", "").isdigit() and "MKL_NUM_THREADS" not in env:
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        first = "" if argv[0] == "-c" else os.getcwd() if argv[0] == "-m" else os.path.dirname(
            os.path.abspath(argv[0]))
        sys.path[:] = [first, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), *base_path]
        sys.path_importer_cache.clear()
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        try:
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            elif argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path first
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = _exit_code(stop.code)
        except BaseException as error:  # noqa: BLE001 - what the interpreter prints, less this frame
            error = error.with_traceback(error.__traceback__.tb_next)
            sys.excepthook(type(error), error, error.__traceback__)
            code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1  # the interpreter dies of SIGINT
        try:
            threading._shutdown()  # the interpreter waits for non-daemon threads, then runs atexit
        except Exception:  # noqa: BLE001
            pass
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: the interpreter's exit code 120
                code = 120 if code == 0 else code
    except BaseException:  # noqa: BLE001 - the set-up failed: say why
        import traceback

        traceback.print_exc()
    finally:
        _end(code)


def _exit_code(value) -> int:
    """The exit status of ``SystemExit(value)``, as the interpreter takes it (a message printed: status 1)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _end(returncode: int) -> None:
    """Exit with ``returncode``, or die of signal ``-returncode`` (subprocess's convention)."""
    if returncode < 0:
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    os._exit(returncode & 0xFF)


# ----------------------------------------------------------------------------------------------- torchrun's rank
def _rank(argv: list[str]) -> None:
    """A torchrun rank's stand-in: the rank itself is a child of the zygote named by $ATTNLAB_TEST_ZYGOTE."""
    command = [sys.executable, "-u", *argv]
    path = os.environ.get(ZYGOTE_ENV)
    reply = {"fresh": "no zygote"}
    if path:
        conn, reply = _ask(path, {"argv": command, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2])
    if "pid" not in reply:
        os.execv(sys.executable, command)
    pid = reply["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda number, frame: _forward(pid, number))
    message = _receive(conn)
    _end(message["returncode"] if message else -signal.SIGKILL)


def _forward(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it has just ended: its status is on the way
        pass


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(sys.argv[2])
    elif sys.argv[1] == "rank":
        _rank(sys.argv[2:])
