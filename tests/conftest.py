"""Session-wide settings for the test run.

One kernel cache: the fused CPU kernels are compiled once, by the first test that needs them, and every later test
and every subprocess it starts (they inherit the environment) loads that build. Tests of the cache itself
(tests/ops/test_ckernel.py, tests/security) give their subprocesses a fresh one. A cache the caller set (.ci/run's
no-compiler pass) is kept.

One core's worth of threads per pytest-xdist worker: N workers that each run torch's default of one thread per core
spin against each other (two workers on two cores spent 3.5x the CPU time on tests/attention and tests/analysis,
docs/perf.md). Subprocesses inherit the setting; a test that needs more threads sets its own environment. Inductor's
C++ builds follow it too (TORCHINDUCTOR_COMPILE_THREADS): at one thread a worker builds in its own process instead
of starting a pool of compile processes, each a fresh interpreter importing torch.

Longest first: the files with tests that build C++ (marked compiler), then those with end-to-end tests (marked slow),
then the rest, each file's tests together and in order (a module fixture is set up once per worker); pyproject's
--maxschedchunk=1 makes pytest-xdist hand each worker its next test when it is nearly done, instead of a quarter of
the suite at the start, so the short tests fill the tail (docs/perf.md, "Test suite time").
"""

import os
import shutil
import tempfile

_made: list[str] = []


def pytest_configure(config):
    if not os.environ.get("ATTNLAB_CACHE"):
        _made.append(tempfile.mkdtemp(prefix="attnlab-test-kernels-"))
        os.environ["ATTNLAB_CACHE"] = os.path.join(_made[0], "kernels")
    workers = getattr(config.option, "numprocesses", None) or 0  # pytest-xdist's -n, in the controller
    if isinstance(workers, int) and workers > 0:
        for name in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
            os.environ.setdefault(name, str(max(1, (os.cpu_count() or 1) // workers)))


def pytest_collection_modifyitems(config, items):
    rank: dict = {}
    for item in items:
        rank[item.path] = min(rank.get(item.path, 2), 0 if item.get_closest_marker("compiler") else
                              1 if item.get_closest_marker("slow") else 2)
    items.sort(key=lambda item: rank[item.path])


def pytest_unconfigure(config):
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
