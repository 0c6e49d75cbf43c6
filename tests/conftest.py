"""One kernel cache for the whole test run: the fused CPU kernels are compiled once, by the first test that needs
them, and every later test and every subprocess it starts (they inherit the environment) loads that build. Tests of
the cache itself (tests/ops/test_ckernel.py, tests/security) give their subprocesses a fresh one. A cache the caller
set (.ci/run's no-compiler pass) is kept."""

import os
import shutil
import tempfile

_made: list[str] = []


def pytest_configure(config):
    if not os.environ.get("ATTNLAB_CACHE"):
        _made.append(tempfile.mkdtemp(prefix="attnlab-test-kernels-"))
        os.environ["ATTNLAB_CACHE"] = os.path.join(_made[0], "kernels")


def pytest_unconfigure(config):
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
