"""``attnlab ...`` run inside the test's own process, read as a fresh interpreter's run would be read: a fresh one
spends seconds importing torch, which the error-contract and hostile-file tests would pay hundreds of times.
tests/cli/test_bad_inputs.py checks that the two print and exit alike."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path


def in_process(argv: list[str], cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``attnlab.cli.main(argv)`` in ``cwd``: what reaches stdout and stderr, from Python or from C (the file
    descriptors are redirected too), warnings shown as a fresh interpreter shows them, a traceback and exit code 1
    for an uncaught exception; the working directory, environment and torch's thread count restored after."""
    import torch

    from attnlab.cli import main

    argv = [str(a) for a in argv]
    old_cwd, old_env, threads = os.getcwd(), dict(os.environ), torch.get_num_threads()
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            if cwd is not None:
                os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
                warnings.simplefilter("default")  # resets the "once" memories of earlier runs
                try:
                    code = main(argv)
                except SystemExit as stop:  # argparse's own errors
                    code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
                except BaseException:  # noqa: BLE001 - what the interpreter would print
                    traceback.print_exc()
                    code = 1
                out.flush(), err.flush()
        finally:
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
            os.chdir(old_cwd)
            os.environ.clear()
            os.environ.update(old_env)
            torch.set_num_threads(threads)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(["attnlab", *argv], code, out.read(), err.read())
