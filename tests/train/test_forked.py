"""tests/forked.py's children read as fresh interpreters: the same probe run both ways prints, exits and dies alike;
a torchrun stand-in passes signals on and takes its rank with it; what cannot be faithful runs fresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import forked
import pytest
from process_helpers import alive, wait_for

PROBE = textwrap.dedent("""
    import atexit, json, os, sys
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path[:2], "name": __name__,
        "env": os.environ.get("PROBE"), "preimported": sorted(m for m in sys.modules if m.split(".")[0] in
                                                              ("attnlab", "process_helpers", "forked")),
        "stdin": sys.stdin.read(), "tmp": __import__("tempfile").gettempdir(),
    }))
    import torch
    print(torch.get_num_threads())
    atexit.register(lambda: print("atexit ran", flush=True))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
""")


def forks() -> bool:
    """Whether this process forks from a zygote: one whose imports started no thread (one thread per worker, as
    tests/conftest.py gives `make test`'s workers, unless the caller's environment asks for more)."""
    return forked._socket() is not None


def both(argv, **kwargs):
    """``argv`` run by tests/forked.py and by a fresh interpreter."""
    fork = forked.popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    assert isinstance(fork, forked.Forked) == forks()
    fresh = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             **kwargs)
    return [(p.communicate(timeout=300), p.returncode) for p in (fork, fresh)]


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_child_starts_and_ends_as_a_fresh_interpreter(tmp_path, threads):
    env = dict(os.environ, PROBE="x", OMP_NUM_THREADS=threads, PYTHONPATH=os.pathsep.join([str(tmp_path), "/nowhere"]),
               TMPDIR=str(tmp_path))
    fork, fresh = both(["-c", PROBE, "3", "more"], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert fork == fresh
    (out, err), code = fork
    probe = json.loads(out.splitlines()[0])
    assert probe["argv"] == ["-c", "3", "more"] and probe["cwd"] == str(tmp_path) and probe["env"] == "x"
    assert probe["path"] == ["", str(tmp_path)] and probe["name"] == "__main__" and probe["preimported"] == []
    assert probe["tmp"] == str(tmp_path)  # not the zygote's, which tempfile had already looked up
    assert out.splitlines()[2:] == ["atexit ran"] and err == "to stderr\n" and code == 3
    if "MKL_NUM_THREADS" not in env:  # torch's thread count follows MKL_NUM_THREADS first, as a fresh one's does
        assert out.splitlines()[1] == threads


def test_a_module_and_a_script_run_as_they_would(tmp_path):
    script = tmp_path / "bin" / "script.py"
    script.parent.mkdir()
    (script.parent / "sibling.py").write_text("WHERE = 'next to the script'\n")
    script.write_text("import sys, sibling\nprint(sys.argv, sys.path[0], sibling.WHERE)\nraise SystemExit('why')\n")
    fork, fresh = both([str(script), "a"], cwd=tmp_path)
    assert fork == fresh == ((f"[{str(script)!r}, 'a'] {script.parent} next to the script\n", "why\n"), 1)
    fork, fresh = both(["-m", "attnlab", "variants", "--json"], cwd=tmp_path)
    assert fork == fresh and fork[1] == 0 and json.loads(fork[0][0])


def test_a_traceback_an_uncaught_interrupt_and_a_signal_read_alike(tmp_path):
    fork, fresh = both(["-c", "def f():\n    raise ValueError('bad')\nf()"], cwd=tmp_path)
    assert fork == fresh and fork[1] == 1 and fork[0][1].startswith("Traceback") and "forked" not in fork[0][1]
    fork, fresh = both(["-c", "raise KeyboardInterrupt"], cwd=tmp_path)
    assert fork[1] == fresh[1] == -signal.SIGINT and fork[0][1].splitlines()[-1] == "KeyboardInterrupt"
    fork, fresh = both(["-c", "import os, signal; print('going', flush=True); os.kill(os.getpid(), signal.SIGKILL)"],
                       cwd=tmp_path)
    assert fork == fresh == (("going\n", ""), -signal.SIGKILL)


def test_popen_is_killed_and_waited_on_as_a_process(tmp_path):
    proc = forked.popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n" and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.terminate()
    assert proc.wait(timeout=60) == -signal.SIGTERM and not alive(proc.pid)
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, "-c", "import time; time.sleep(300)"], timeout=0.5)


def test_what_a_fork_cannot_reproduce_runs_fresh(tmp_path):
    # torch reads TORCH_LOGS at import: the zygote imported it without
    env = dict(os.environ, TORCH_LOGS="dynamo")
    assert isinstance(forked.popen([sys.executable, "-c", "pass"], env=env), subprocess.Popen)
    assert isinstance(forked.popen([sys.executable, "-X", "dev", "-c", "pass"]), subprocess.Popen)
    assert isinstance(forked.popen(["/bin/true"]), subprocess.Popen)


STAND_IN = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *a: (print("rank got SIGTERM", flush=True), sys.exit(143)))
    open(sys.argv[1], "w").write(f"{os.getpid()} {os.environ['RANK']}")
    time.sleep(300)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_torchrun_stand_in_passes_signals_on_and_takes_its_rank_with_it(tmp_path, sig):
    ready = tmp_path / "rank"
    env = forked.rank_env(dict(os.environ, RANK="1"))
    stand_in = subprocess.Popen([*forked.torchrun_rank(), "-c", STAND_IN, str(ready)], env=env,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)  # as torchrun starts it
    pid, rank = map(int, wait_for(lambda: ready.exists() and ready.read_text(), "the rank", stand_in).split())
    assert rank == 1 and (pid != stand_in.pid) == forks()
    os.killpg(stand_in.pid, sig)  # torchrun signals the stand-in's process group
    out, _ = stand_in.communicate(timeout=60)
    if sig == signal.SIGTERM:
        assert stand_in.returncode == 143 and out == "rank got SIGTERM\n"
    else:
        assert stand_in.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while alive(pid):
        assert time.monotonic() < deadline, "the rank outlived its stand-in"
        time.sleep(0.05)
