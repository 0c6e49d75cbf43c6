"""Shared fixtures of the ops tests."""

import os

import pytest


@pytest.fixture(scope="module")
def private_kernel_cache(tmp_path_factory):
    """Build the C kernels into a temporary cache (ATTNLAB_CACHE) for one test module, never ~/.cache."""
    old = os.environ.get("ATTNLAB_CACHE")
    os.environ["ATTNLAB_CACHE"] = str(tmp_path_factory.mktemp("kernels"))
    yield
    if old is None:
        os.environ.pop("ATTNLAB_CACHE")
    else:
        os.environ["ATTNLAB_CACHE"] = old
