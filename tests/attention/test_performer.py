"""Performer's FAVOR+ (attnlab.attention.performer, ops.lowrank): the feature map's unbiasedness and convergence
to softmax attention, checked against float64 references; the seeded redraw policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils._python_dispatch

import attnlab
from attnlab.analysis.jacobian import head_function
from attnlab.attention.base import Want
from attnlab.models import attention_modules
from attnlab.ops.lowrank import orthogonal_gaussian, performer_attention, positive_features
from tests.reference_lowrank import favor_attention, softmax_attention


def test_feature_map_is_an_unbiased_estimate_of_exp_dot():
    """E[phi(x) . phi(y)] = exp(x . y) (Lemma 1). 4000 independent draws of M = 16 orthogonal features each, fixed
    seed; the mean must lie within 4 standard errors of exp(x . y) (and within 3 %) for every pair."""
    g = torch.Generator().manual_seed(0)
    d, m, draws = 8, 16, 4000
    x = torch.randn(5, d, generator=g, dtype=torch.float64) * 0.4
    y = torch.randn(5, d, generator=g, dtype=torch.float64) * 0.4
    samples = []
    for _ in range(draws):
        w = orthogonal_gaussian(m, d, generator=g, dtype=torch.float64)
        samples.append((positive_features(x, w, stabilise="none") * positive_features(y, w, stabilise="none")).sum(-1))
    samples = torch.stack(samples).numpy()  # (draws, pairs)
    exact = np.exp((x * y).sum(-1).numpy())
    mean, stderr = samples.mean(0), samples.std(0, ddof=1) / np.sqrt(draws)
    assert (np.abs(mean - exact) < 4 * stderr).all(), (mean, exact, stderr)
    assert (np.abs(mean / exact - 1) < 0.03).all()


def test_orthogonal_rows_within_each_block():
    w = orthogonal_gaussian(20, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for block in (w[:8], w[8:16], w[16:]):
        gram = block @ block.T
        np.testing.assert_allclose(gram - torch.diag(torch.diagonal(gram)), 0, atol=1e-10)


def test_approaches_softmax_attention_as_features_grow():
    """Max error over outputs falls with M (logits kept moderate: the estimator's variance grows as
    exp(||x + y||^2), heavy-tailed for long q, k) and is below 0.01 at M = 32768."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g, dtype=torch.float64) * s for s in (0.4, 0.4, 1.0))
    exact = softmax_attention(q, k, v)
    errors = []
    for m in (8, 64, 512, 4096, 32768):
        w = orthogonal_gaussian(m, 8, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
        errors.append(np.abs(performer_attention(q, k, v, w, eps=0.0).numpy() - exact).max())
    assert all(a > b for a, b in zip(errors, errors[1:])) and errors[-1] < 0.01, errors


def test_stabilisers_cancel():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 10, 4, generator=g, dtype=torch.float64) for _ in range(3))
    w = orthogonal_gaussian(32, 4, generator=g, dtype=torch.float64)
    phi_q, phi_k = (positive_features(t * 4 ** -0.25, w, stabilise="none") for t in (q, k))
    plain = (phi_q @ (phi_k.mT @ v)) / (phi_q @ phi_k.sum(-2).unsqueeze(-1))
    torch.testing.assert_close(performer_attention(q, k, v, w, eps=0.0), plain)


def test_seeded_redraw_policy():
    def model(spec):
        return attnlab.build_model("vit_digits", attn=spec)

    a, b = model("performer(features=16,redraw=2,seed=5)"), model("performer(features=16,redraw=2,seed=5)")
    mods_a = [m for _, m in attention_modules(a)]
    mods_b = [m for _, m in attention_modules(b)]
    assert torch.equal(mods_a[0].projection, mods_b[0].projection)
    assert not torch.equal(mods_a[0].projection, mods_a[1].projection)  # each block its own draw
    first = mods_a[0].projection.clone()
    x = torch.randn(2, 1, 8, 8)
    a.eval()(x)
    a.eval()(x)
    assert torch.equal(mods_a[0].projection, first)  # evaluation never redraws
    a.train()
    a(x)
    a(x)
    assert torch.equal(mods_a[0].projection, first)
    a(x)  # the third training forward uses draw 1
    assert torch.equal(mods_a[0].projection, mods_a[0].draw(1))
    assert not torch.equal(first, mods_a[0].draw(1))
    other = model("performer(features=16,redraw=2,seed=6)")
    assert not torch.equal(attention_modules(other)[0][1].projection, first)
    never = model("performer(features=16,seed=5)").train()
    for _ in range(3):
        never(x)
    assert torch.equal(attention_modules(never)[0][1].projection, first)
    # the schedule travels with the state dict
    b.load_state_dict(a.state_dict())
    assert int(mods_b[0].forwards) == 3 and torch.equal(mods_b[0].projection, mods_a[0].projection)


def test_head_output_is_the_forward_of_one_head():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", attn="performer(features=32)+speccond").double().eval()
    _, module = attention_modules(model)[1]
    x = torch.randn(2, 16, module.dim, dtype=torch.float64)
    full = module.kernel(*module.project(x), None, Want(), "explicit")[0]
    w, b = module.qkv.weight, module.qkv.bias
    A, D = module.attn_dim, module.head_dim
    for h in range(module.num_heads):
        rows = [slice(p * A + h * D, p * A + (h + 1) * D) for p in range(3)]
        torch.testing.assert_close(head_function(module, h)(x[0], *(w[r] for r in rows), *(b[r] for r in rows)),
                                   full[0, h])
    jac = attnlab.analysis.jacobian.jacobian_conditioning(model, torch.randn(1, 1, 8, 8, dtype=torch.float64),
                                                          heads=[0])
    assert torch.isfinite(jac.kappa).all()


@pytest.mark.parametrize("scale", [1.0, 2.0, 3.0])
def test_denominator_guard_only_guards_at_large_logits(scale):
    # the same features, the exact ratio: a constant added to the (rescaled) denominator moved it by 4e-3 at x3
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g, dtype=torch.float64) for _ in range(3))
    q, k = q * scale, k * scale
    w = orthogonal_gaussian(64, 16, generator=g, dtype=torch.float64)
    want = favor_attention(q, k, v, w)
    np.testing.assert_allclose(performer_attention(q, k, v, w).numpy(), want, rtol=1e-9, atol=1e-12)
    # a query without any key: 0, not 0 / 0
    real = torch.zeros(1, 1, 24, dtype=torch.bool)
    assert torch.equal(performer_attention(q, k, v, w, key_padding=real), torch.zeros_like(q))


class _NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value on the host (what .item() / int(tensor) dispatch to)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("redraw", [1, 3])
def test_redraw_per_call_or_every_n_without_reading_the_device(redraw):
    model = attnlab.build_model("vit_digits", attn=f"performer(features=16,redraw={redraw},seed=2)").train()
    module = attention_modules(model)[0][1]
    x = torch.randn(2, 1, 8, 8)
    draws = []
    with _NoHostReads() as mode:
        for _ in range(4):
            model(x)
            draws.append(module.projection.clone())
    assert mode.reads == 0
    for i, draw in enumerate(draws):  # forward i ran with draw i // redraw (the buffer holds it afterwards)
        assert torch.equal(draw, module.draw(i // redraw))
    assert int(module.forwards) == 4
    again = attnlab.build_model("vit_digits", attn=f"performer(features=16,redraw={redraw},seed=2)").train()
    again.load_state_dict(model.state_dict())  # resumed: the next draw follows the saved count
    again(x)
    assert torch.equal(attention_modules(again)[0][1].projection, module.draw(4 // redraw))
