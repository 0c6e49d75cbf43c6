"""The fused CPU kernel of ns_transform (impl="kernel", ns_kernel.c) against the SVD reference and Algorithm 1.

The kernel is compiled on first use; these tests build it into the test run's temporary cache (ATTNLAB_CACHE,
set by tests/conftest.py), so they never touch the user's ~/.cache.
"""

import os
import sys
from pathlib import Path

import forked
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.errors import ConfigError
from attnlab.ops import ns_cpu, ns_transform
from attnlab.ops.ns_cpu import kernel_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("ns_kernel")

FEATURE_D = (16, 32, 48, 64)  # D <= N: Gram side n = D
TOKEN_ND = ((16, 32), (16, 64), (32, 48), (32, 64), (48, 64))  # N < D: Gram side n = N


def _randn(*shape, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype) * scale


def _svd(x, steps=1, eps=1e-6):
    return torch.from_numpy(ref.ns_svd_reference(x.double().numpy(), steps=steps, eps=eps))


@st.composite
def _head_shapes(draw):
    if draw(st.booleans()):
        d = draw(st.sampled_from(FEATURE_D))
        n = draw(st.integers(d, d + 40))
    else:
        n, d = draw(st.sampled_from(TOKEN_ND))
    return n, d


@settings(max_examples=25, deadline=None)
@given(
    shape=_head_shapes(),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    steps=st.sampled_from([1, 2, 3, 4, 7]),  # 3 and more: Z re-formed in y (feature space) or in place (tokens)
    log_scale=st.floats(-3, 3),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_svd_reference(shape, lead, steps, log_scale, strided, seed):
    n, d = shape
    if strided and len(lead) >= 1:  # an attention kernel's output: (B, H, N, D) as a view of (B, N, H, D)
        x = _randn(*lead[:-1], n, lead[-1], d, seed=seed, scale=10.0**log_scale).transpose(-3, -2)
    else:
        x = _randn(*lead, n, d, seed=seed, scale=10.0**log_scale)
    got = ns_transform(x, steps=steps, impl="kernel")
    assert got.shape == x.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, _svd(x, steps), rtol=1e-9, atol=1e-10 * 10.0**log_scale)


@pytest.mark.parametrize("steps", [1, 2, 3, 6])
@pytest.mark.parametrize("shape", [(4, 3, 65, 16), (8, 3, 16, 32), (2, 2, 197, 64), (2, 2, 49, 32), (2, 2, 60, 48)])
def test_float32_matches_reference(shape, steps):
    x = _randn(*shape, seed=1)
    want = ns_transform(x, steps=steps, impl="reference")  # Algorithm 1 in float64
    got = ns_transform(x.float(), steps=steps, impl="kernel")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=3e-5)


HEAD_SHAPES = {"vit": (1, 12, 65, 16), "swin": (4, 3, 16, 32)}  # vit_cifar (N > D), swin_cifar windows (N < D)
F32_REL, BF16_REL = 1e-4, 8e-3  # per matrix, of its largest entry; bf16: the output's own rounding (2^-8)


def _max_rel_error(got, want):
    """max over matrices of max |got - want| / max |want|"""
    err = (got.double() - want).abs().amax(dim=(-2, -1)) / want.abs().amax(dim=(-2, -1))
    return err.max().item()


@pytest.mark.parametrize("model", HEAD_SHAPES)
@pytest.mark.parametrize("steps", range(1, 9))
def test_many_steps_float32_and_bf16_autocast(model, steps):
    # kernel and auto (the kernel, without gradient) within F32_REL of the float64 SVD reference for every K, on
    # the attention kernel's strided layout; accumulating all K steps in Gram space once overflowed by K = 6-8.
    shape = HEAD_SHAPES[model]
    k = min(shape[-2:])
    conditioned = ref.matrices_with_singular_values(shape, np.logspace(0, -2, k), seed=1)  # trained heads: Sec. 3.4
    for kind, x64 in {"gaussian": _randn(*shape, seed=30), "conditioned": torch.from_numpy(conditioned)}.items():
        x = x64.float().transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, N, D) view of (B, N, H, D)
        want, want_half = _svd(x, steps), _svd(x.bfloat16(), steps)
        with torch.no_grad():
            for impl in ("kernel", "auto"):
                got = ns_transform(x, steps=steps, impl=impl)
                assert got.dtype == torch.float32 and _max_rel_error(got, want) <= F32_REL, (kind, impl)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    inside = ns_transform(x, steps=steps, impl=impl)
                    half = ns_transform(x.bfloat16(), steps=steps, impl=impl)  # what a model under autocast passes
                assert torch.equal(inside, got), (kind, impl)
                assert half.dtype == torch.bfloat16 and _max_rel_error(half, want_half) <= BF16_REL, (kind, impl)


def test_writes_with_the_input_strides():
    # the point of the kernel: no copy in, and the head merge after it ((B, H, N, D) -> (B, N, H*D)) is a view
    base = _randn(2, 65, 3, 16, seed=2, dtype=torch.float32)
    x = base.transpose(1, 2)
    y = ns_transform(x, impl="kernel")
    assert y.stride() == x.stride()
    assert y.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(y, ns_transform(x.contiguous(), impl="reference"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_matrix_and_both_clamps(dtype):
    x = _randn(3, 20, 16, seed=3, dtype=dtype)
    x[0] = 0.0
    x[1] *= 1e-9  # r < eps: the first clamp
    x[2] *= 1e-3
    tol = 1e-5 if dtype == torch.float32 else 1e-9

    def close(got, want):  # per matrix, relative to its own scale
        for g, w in zip(got.double(), want):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol * float(w.abs().max()))

    y = ns_transform(x, impl="kernel")
    assert torch.equal(y[0], torch.zeros_like(y[0])) and not y.isnan().any()
    close(y, _svd(x))
    for eps in (1e-3, 1e-12):  # eps is a parameter of the kernel too
        close(ns_transform(x, eps=eps, impl="kernel"), _svd(x, eps=eps))


def test_norm_preserved_without_clamps():
    x = _randn(5, 40, 32, seed=4, dtype=torch.float32)
    torch.testing.assert_close(torch.linalg.matrix_norm(ns_transform(x, impl="kernel")), torch.linalg.matrix_norm(x),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_input_computed_in_float32(dtype):
    x = _randn(2, 33, 16, seed=5).to(dtype)
    y = ns_transform(x, impl="kernel")
    assert y.dtype == dtype
    assert torch.equal(y, ns_transform(x.float(), impl="kernel").to(dtype))


def test_threads_split_the_matrices_without_changing_results():
    x = _randn(64, 4, 20, 16, seed=6, dtype=torch.float32)  # 256 matrices: split over two threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ns_transform(x, impl="kernel")
        torch.set_num_threads(2)
        two = ns_transform(x, impl="kernel")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_auto_uses_the_kernel_only_without_gradient():
    x = _randn(2, 3, 33, 16, seed=7, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ns_transform(x), ns_transform(x, impl="kernel"))
    xg = x.clone().requires_grad_(True)
    y = ns_transform(xg)
    assert y.grad_fn is not None
    assert torch.equal(y.detach(), ns_transform(x, impl="fast"))
    # unsupported head shapes go to the torch path
    small = _randn(2, 9, 5, seed=8, dtype=torch.float32)
    assert torch.equal(ns_transform(small), ns_transform(small, impl="fast"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_and_python_agree_on_supported_shapes(dtype):
    c_supports = getattr(ns_cpu.KERNEL.library(dtype), ns_cpu.KERNEL.builds[dtype].supports)
    for N in range(8, 80, 8):
        for D in range(8, 80, 8):
            assert bool(c_supports(N, D)) == ns_cpu.supports(N, D), (N, D)


@pytest.mark.parametrize(
    "x,needle",
    [
        (_randn(2, 9, 5), "no instance for 9 x 5"),
        (_randn(2, 20, 16, dtype=torch.float32).requires_grad_(True), "needs a gradient"),
        (torch.ones(2, 20, 16, dtype=torch.int32), "floating"),
    ],
)
def test_forced_kernel_explains_why_not(x, needle):
    with pytest.raises(ConfigError, match=needle):
        ns_transform(x, impl="kernel")


def test_switch_off_with_environment(monkeypatch):
    x = _randn(2, 20, 16, dtype=torch.float32)
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    assert "ATTNLAB_KERNELS=0" in kernel_error(x)
    with torch.no_grad():
        assert torch.equal(ns_transform(x), ns_transform(x, impl="fast"))


def test_without_a_compiler_auto_falls_back(tmp_path):
    # a fresh process (the kernel is built once per process) with a compiler that does not exist
    code = (
        "import torch\n"
        "from attnlab.ops import ns_transform\n"
        "from attnlab.errors import ConfigError\n"
        "x = torch.randn(2, 20, 16)\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(ns_transform(x), ns_transform(x, impl='fast'))\n"
        "try:\n"
        "    ns_transform(x, impl='kernel')\n"
        "except ConfigError as err:\n"
        "    print(err)\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), ATTNLAB_CACHE=str(tmp_path / "cache"))
    out = forked.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "could not be built" in out.stdout
