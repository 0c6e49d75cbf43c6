"""Shared fixtures of the ops tests. Tests that need a fused CPU kernel (or a C compiler) take one of the fixtures
below, which skip them with the reason where it cannot run: no C compiler, no OpenMP, ATTNLAB_KERNELS=0 (.ci/run
runs tests/ops that way too). The kernels build into the test run's one cache (tests/conftest.py)."""

import os
import shutil

import pytest


@pytest.fixture
def dna_kernel():
    """Skip, saying why, where the fused DnA kernel cannot run (no C compiler, ATTNLAB_KERNELS=0)."""
    from attnlab.ops import dna_cpu

    why = dna_cpu.unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture
def ns_kernel():
    """Skip, saying why, where the fused NS-Attn kernel cannot run (no C compiler, ATTNLAB_KERNELS=0)."""
    from attnlab.ops import ns_cpu

    why = ns_cpu.unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture
def performer_kernel():
    """Skip, saying why, where the fused Performer kernel cannot run (no C compiler, ATTNLAB_KERNELS=0)."""
    from attnlab.ops import performer_cpu

    why = performer_cpu.unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture
def c_compiler():
    """Skip where tests that build kernels in a subprocess cannot: kernels switched off, or no C compiler."""
    from attnlab.ops import ckernel

    why = ckernel.disabled()
    cc = os.environ.get("CC", "cc")
    if why is None and shutil.which(cc) is None:
        why = f"no C compiler ({cc!r} is not on PATH)"
    if why:
        pytest.skip(why)
