"""Real attnlab processes for the fault tests: one that pauses inside training, and what the tests ask of processes
(imported as `from process_helpers import ...`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import forked
from cli_runner import in_process

# `python -c PAUSING CLI-ARGS...`: attnlab's command line, where training forward number $ATTNLAB_TEST_PAUSE_AT
# (default 1) writes this process's pid to $ATTNLAB_TEST_READY and then waits until a file named that plus ".go"
# exists: the test acts while the run is held, then lets it go on (or kills it).
PAUSING = textwrap.dedent("""
    import os, sys, time
    import attnlab.models as models

    build = models.build_model
    ready, at = os.environ["ATTNLAB_TEST_READY"], int(os.environ.get("ATTNLAB_TEST_PAUSE_AT", "1"))

    def build_and_pause(*args, **kwargs):
        model = build(*args, **kwargs)
        count = [0]
        def hook(module, inputs, output):
            if module.training:
                count[0] += 1
                if count[0] == at:
                    with open(ready + ".part", "w") as f:
                        f.write(str(os.getpid()))
                    os.replace(ready + ".part", ready)
                    while not os.path.exists(ready + ".go"):
                        time.sleep(0.05)
        model.register_forward_hook(hook)
        return model

    models.build_model = build_and_pause
    from attnlab.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def attnlab(*argv) -> subprocess.CompletedProcess:
    """``attnlab ARGV`` run inside this process as a fresh one would run it (tests/cli_runner.py): the readers and
    resumes that follow a fault need no interpreter of their own; the faulty runs themselves are real processes."""
    return in_process(list(argv))


def start_paused(ready: Path, *argv, pause_at: int = 1) -> subprocess.Popen:
    """Start ``attnlab ARGV`` that pauses at training forward ``pause_at`` (see PAUSING); wait with :func:`wait_for`
    for ``ready`` to exist, let it go on with :func:`go`."""
    env = dict(os.environ, ATTNLAB_TEST_READY=str(ready), ATTNLAB_TEST_PAUSE_AT=str(pause_at))
    return forked.popen([sys.executable, "-c", PAUSING, *map(str, argv)], env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)


def go(ready: Path) -> None:
    Path(f"{ready}.go").touch()


def wait_for(condition, what: str, proc: subprocess.Popen | None = None, timeout: float = 300.0):
    """Poll ``condition()`` until it returns something true and return that; fail naming ``what`` after
    ``timeout`` seconds (a guard against hanging, not a measurement) or if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the process ended (rc {proc.returncode}) before {what}: {err[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux /proc)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]
