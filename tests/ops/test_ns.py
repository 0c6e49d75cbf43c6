"""ns_transform (NS-Attn, Sec. 2 and Algorithm 1) against an SVD reference, its clamps, dtypes and gradients."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.errors import ConfigError
from attnlab.ops import ns_transform

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference as ref  # noqa: E402

IMPLS = ("fast", "reference")
A, B, C = 3.4445, -4.7750, 2.0315  # the paper's eq. 3


def _randn(*shape, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype) * scale


def _fro(t):
    return torch.linalg.matrix_norm(t.double())


# --- against the SVD reference (a step maps singular values t to p(t), keeps the singular vectors) -------------


@settings(max_examples=30, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    n=st.integers(1, 24),
    d=st.integers(1, 24),
    steps=st.sampled_from([1, 2]),
    impl=st.sampled_from(IMPLS),
    log_scale=st.floats(-3, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_svd_reference(lead, n, d, steps, impl, log_scale, seed):
    x = _randn(*lead, n, d, seed=seed, scale=10.0**log_scale)
    got = ns_transform(x, steps=steps, impl=impl)
    want = torch.from_numpy(ref.ns_svd_reference(x.numpy(), steps=steps))
    assert got.shape == x.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10 * 10.0**log_scale)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,d", [(65, 16), (16, 32)])  # ViT (N > D) and Swin (N < D) head shapes
def test_singular_values_follow_polynomial(impl, n, d):
    # Written from the paper's statement alone: singular values t of M / r go to p(t) (p(p(t)) for K = 2), then
    # the whole spectrum is rescaled to Frobenius norm r.
    x = _randn(n, d, seed=1)
    r = _fro(x)
    t = torch.linalg.svdvals(x) / r
    for steps in (1, 2):
        pt = t
        for _ in range(steps):
            pt = A * pt + B * pt**3 + C * pt**5
        want = (r * pt / pt.norm()).sort(descending=True).values
        got = torch.linalg.svdvals(ns_transform(x, steps=steps, impl=impl))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_hand_computed_diagonal():
    # X = diag(3, 4): r = 5, t = (0.6, 0.8), output diag(5 p(0.6), 5 p(0.8)) / ||(p(0.6), p(0.8))||.
    x = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
    p6 = A * 0.6 + B * 0.6**3 + C * 0.6**5
    p8 = A * 0.8 + B * 0.8**3 + C * 0.8**5
    nrm = math.hypot(p6, p8)
    want = torch.tensor([[5 * p6 / nrm, 0.0], [0.0, 5 * p8 / nrm]], dtype=torch.float64)
    for impl in IMPLS:
        torch.testing.assert_close(ns_transform(x, impl=impl), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_other_coefficients(impl):
    # (1, 0, 0) is the identity polynomial: T(M) = r M / ||M|| = M. The cubic NS (1.5, -0.5, 0) vs the reference.
    x = _randn(2, 7, 5, seed=2)
    torch.testing.assert_close(ns_transform(x, coeffs=(1.0, 0.0, 0.0), impl=impl), x, rtol=1e-12, atol=1e-12)
    cubic = (1.5, -0.5, 0.0)
    want = torch.from_numpy(ref.ns_svd_reference(x.numpy(), steps=2, abc=cubic))
    torch.testing.assert_close(ns_transform(x, steps=2, coeffs=cubic, impl=impl), want, rtol=1e-10, atol=1e-12)


# --- any number of steps, float32 and bf16 autocast, against the SVD reference ---------------------------------

HEAD_SHAPES = {"vit": (1, 12, 65, 16), "swin": (4, 3, 16, 32)}  # vit_cifar (N > D), swin_cifar windows (N < D)
F32_REL, BF16_REL = 1e-4, 8e-3  # per matrix, of its largest entry; bf16: the output's own rounding (2^-8)
_svd_cache = {}


def _head_inputs(model):
    """float64 copies of float32 head outputs: Gaussian, and with singular values spanning two decades (trained
    heads are far from Gaussian, Sec. 3.4) -- the polynomial amplifies the small directions by ~a per step."""
    shape = HEAD_SHAPES[model]
    k = min(shape[-2:])
    conditioned = torch.from_numpy(ref.matrices_with_singular_values(shape, np.logspace(0, -2, k), seed=1))
    return {"gaussian": _randn(*shape, seed=30).float().double(), "conditioned": conditioned.float().double()}


def _svd_want(model, kind, steps, x):
    key = (model, kind, steps, x.dtype)
    if key not in _svd_cache:
        _svd_cache[key] = torch.from_numpy(ref.ns_svd_reference(x.double().numpy(), steps=steps))
    return _svd_cache[key]


def _max_rel_error(got, want):
    """max over matrices of max |got - want| / max |want|"""
    err = (got.double() - want).abs().amax(dim=(-2, -1)) / want.abs().amax(dim=(-2, -1))
    return err.max().item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model", HEAD_SHAPES)
@pytest.mark.parametrize("steps", range(1, 9))
def test_many_steps_float32_and_bf16_autocast(impl, model, steps):
    # Within F32_REL of the float64 SVD reference for every K: the fast path's accumulated Gram polynomial once
    # drifted to ~1e-1 (Gaussian) and overflowed (conditioned) by K = 6-8.
    for kind, x64 in _head_inputs(model).items():
        want = _svd_want(model, kind, steps, x64)
        x = x64.float()
        got = ns_transform(x, steps=steps, impl=impl)
        assert got.dtype == torch.float32 and _max_rel_error(got, want) <= F32_REL, (kind, _max_rel_error(got, want))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = ns_transform(x, steps=steps, impl=impl)  # float32 in, float32 out: autocast is off inside
            half = ns_transform(x.bfloat16(), steps=steps, impl=impl)  # what a model under autocast passes
        assert inside.dtype == torch.float32 and _max_rel_error(inside, want) <= F32_REL, kind
        want_half = _svd_want(model, kind, steps, x.bfloat16())
        assert half.dtype == torch.bfloat16 and _max_rel_error(half, want_half) <= BF16_REL, kind


@pytest.mark.parametrize("model", HEAD_SHAPES)
@pytest.mark.parametrize("steps", range(1, 9))
def test_many_steps_float32_gradient(model, steps):
    # Training runs the fast path: its float32 gradient against the SVD reference's directional derivative
    # <g, dT(x)[v]> per matrix, by central differences in float64.
    x64 = _head_inputs(model)["conditioned"]
    g, v = _randn(*x64.shape, seed=31), _randn(*x64.shape, seed=32)
    h = 1e-6

    def svd(t):
        return torch.from_numpy(ref.ns_svd_reference(t.numpy(), steps=steps))

    want = ((svd(x64 + h * v) - svd(x64 - h * v)) * g).sum(dim=(-2, -1)) / (2 * h)
    x = x64.float().requires_grad_(True)
    (grad,) = torch.autograd.grad(ns_transform(x, steps=steps, impl="fast"), x, g.float())
    got = (grad.double() * v).sum(dim=(-2, -1))
    scale = grad.double().norm(dim=(-2, -1)) * v.norm(dim=(-2, -1))  # the size of the terms summed
    assert ((got - want).abs() / scale).max() <= F32_REL


# --- fast == reference ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("shape", [(2, 3, 65, 16), (4, 3, 16, 32), (3, 8, 8)])
def test_fast_equals_reference(shape, steps):
    x64 = _randn(*shape, seed=3)
    torch.testing.assert_close(
        ns_transform(x64, steps=steps, impl="fast"),
        ns_transform(x64, steps=steps, impl="reference"),
        rtol=1e-11,
        atol=1e-12,
    )
    # float32, including a square 8 x 8 matrix (sigma_min / r ~ 0.005): Z is re-formed every two steps, so K = 3
    # is as close as K = 1
    x32 = x64.float()
    torch.testing.assert_close(
        ns_transform(x32, steps=steps, impl="fast"),
        ns_transform(x32, steps=steps, impl="reference"),
        rtol=1e-4,
        atol=2e-5,
    )


def test_auto_is_fast():
    x = _randn(2, 9, 4, seed=4)
    assert torch.equal(ns_transform(x), ns_transform(x, impl="fast"))


# --- clamps and norms -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_zero_matrix_gives_zeros_and_zero_gradient(impl, dtype):
    x = torch.zeros(2, 3, 6, 4, dtype=dtype)
    x[0, 1] = _randn(6, 4, seed=5).to(dtype)  # one non-zero head next to zero heads
    x.requires_grad_(True)
    y = ns_transform(x, impl=impl)
    y.backward(torch.ones_like(y))
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[0, 1] = False
    assert (y[mask] == 0).all() and (x.grad[mask] == 0).all()
    # the zero heads do not disturb the non-zero one
    torch.testing.assert_close(y[0, 1], ns_transform(x.detach()[0, 1], impl=impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_tiny_norm_first_clamp(impl):
    # r ~ 1e-8 < eps: Z = M / eps (eq. 2 clamps), the polynomial acts as ~a I; ||Y|| ~ a r / eps > eps, so eq. 4
    # does not clamp and the norm is still restored.
    x = _randn(2, 10, 6, seed=6, scale=1e-9)
    r = _fro(x)
    assert (r < 1e-6).all() and (A * r / 1e-6 > 1e-6).all()
    y = ns_transform(x, impl=impl)
    torch.testing.assert_close(y, torch.from_numpy(ref.ns_svd_reference(x.numpy())), rtol=1e-9, atol=1e-22)
    torch.testing.assert_close(_fro(y), r, rtol=1e-12, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_tiny_norm_both_clamps(impl):
    # r ~ 1e-15: also ||Y|| ~ a r / eps < eps, so eq. 4 divides by eps and ||T(M)|| = r ||Y|| / eps < r.
    x = _randn(2, 10, 6, seed=7, scale=1e-16)
    r = _fro(x)
    y = ns_transform(x, impl=impl)
    torch.testing.assert_close(y, torch.from_numpy(ref.ns_svd_reference(x.numpy())), rtol=1e-9, atol=0)
    t = torch.linalg.svdvals(x) / 1e-6
    y_norm = (A * t + B * t**3 + C * t**5).norm(dim=-1)
    assert (y_norm < 1e-6).all()
    torch.testing.assert_close(_fro(y), r * y_norm / 1e-6, rtol=1e-9, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_eps_is_a_parameter(impl):
    # eps = 0.1 clamps a matrix of norm ~0.05 that the default eps leaves alone.
    x = _randn(3, 5, 4, seed=8)
    x = 0.05 * x / _fro(x)[:, None, None]
    for eps in (1e-6, 0.1):
        want = torch.from_numpy(ref.ns_svd_reference(x.numpy(), eps=eps))
        torch.testing.assert_close(ns_transform(x, eps=eps, impl=impl), want, rtol=1e-10, atol=1e-14)
    assert not torch.allclose(ns_transform(x, eps=0.1, impl=impl), ns_transform(x, impl=impl))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("steps", [1, 2])
def test_norm_preserved_without_clamps(impl, dtype, rtol, steps):
    x = _randn(4, 3, 20, 8, seed=9, dtype=dtype) * torch.logspace(-4, 4, 4, dtype=dtype)[:, None, None, None]
    torch.testing.assert_close(_fro(ns_transform(x, steps=steps, impl=impl)), _fro(x), rtol=rtol, atol=0)


# --- dtypes, shapes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_input_computed_in_float32(impl, dtype):
    x = _randn(2, 3, 17, 8, seed=10).to(dtype)
    y = ns_transform(x, impl=impl)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, ns_transform(x.float(), impl=impl).to(dtype))
    want = torch.from_numpy(ref.ns_svd_reference(x.double().numpy()))
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_autocast_does_not_lower_precision(impl):
    x = _randn(2, 3, 17, 8, seed=11, dtype=torch.float32)
    plain = ns_transform(x, impl=impl)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = ns_transform(x, impl=impl)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(9, 5), (2, 9, 5), (2, 3, 9, 5), (2, 1, 2, 5, 9)])
def test_leading_dims_each_matrix_alone(impl, shape):
    x = _randn(*shape, seed=12)
    y = ns_transform(x, impl=impl)
    assert y.shape == x.shape
    flat_x, flat_y = x.reshape(-1, *shape[-2:]), y.reshape(-1, *shape[-2:])
    for xi, yi in zip(flat_x, flat_y):
        torch.testing.assert_close(yi, ns_transform(xi, impl=impl), rtol=1e-12, atol=1e-13)


def test_noncontiguous_input():
    x = _randn(2, 16, 3, 5, seed=13).transpose(1, 2)  # (B, H, N, D) as a view of (B, N, H, D)
    torch.testing.assert_close(ns_transform(x), ns_transform(x.contiguous()), rtol=1e-12, atol=1e-13)


# --- gradients -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("steps", [1, 2, 3, 5])  # 3 and 5: through the fast path's re-formed Z
@pytest.mark.parametrize("shape", [(2, 6, 3), (2, 3, 6), (4, 4)])
def test_gradcheck(impl, steps, shape):
    x = _randn(*shape, seed=14).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: ns_transform(t, steps=steps, impl=impl), (x,))


def test_gradgradcheck_fast():
    # the fast path's hand-written Gram backward must stay differentiable, also on the re-formed Z (steps=3)
    for shape, steps in [((2, 5, 3), 1), ((2, 3, 5), 1), ((2, 5, 3), 3)]:
        x = _randn(*shape, seed=15).requires_grad_(True)
        assert torch.autograd.gradgradcheck(lambda t: ns_transform(t, steps=steps, impl="fast"), (x,))


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_fast_and_reference_gradients_agree(steps):
    x = _randn(2, 3, 33, 16, seed=16).requires_grad_(True)
    g = _randn(2, 3, 33, 16, seed=17)
    (ga,) = torch.autograd.grad(ns_transform(x, steps=steps, impl="fast"), x, g)
    (gb,) = torch.autograd.grad(ns_transform(x, steps=steps, impl="reference"), x, g)
    torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-11)


# --- errors and compilation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"steps": 0}, {"steps": 1.5}, {"steps": True}, {"eps": 0.0}, {"impl": "svd"}, {"coeffs": (1.0, 2.0)}],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ConfigError):
        ns_transform(_randn(3, 4), **kwargs)


@pytest.mark.parametrize("x", [torch.ones(5), torch.ones(3, 4, dtype=torch.int64)])
def test_bad_input(x):
    with pytest.raises(ConfigError):
        ns_transform(x)


@pytest.mark.slow
@pytest.mark.compiler
def test_compiles_without_graph_breaks():
    # fullgraph=True raises on any graph break; the fast path has no branch on tensor values.
    fn = torch.compile(ns_transform, fullgraph=True, dynamic=False)
    x = _randn(2, 3, 17, 8, seed=18, dtype=torch.float32)
    torch.testing.assert_close(fn(x, steps=3), ns_transform(x, steps=3, impl="reference"), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(fn(torch.zeros_like(x)).numpy(), np.zeros(x.shape, dtype=np.float32))  # same graph


def test_meta_tensors_give_shapes():
    # shape inference (e.g. building a model on the meta device) must not trip over the autocast guard
    assert ns_transform(torch.empty(2, 3, 65, 16, device="meta")).shape == (2, 3, 65, 16)
