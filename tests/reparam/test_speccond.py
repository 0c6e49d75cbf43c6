"""`speccond`: W + lam * I_k block by block against an element loop, the corrected Theorem 3.8 as a property on
random matrices, `auto` meeting its bound, lam kept through state dicts, qkv+mlp targets, gradients unchanged."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

import attnlab
from attnlab.errors import SpecError, UnsupportedModelError
from attnlab.models import attention_modules
from attnlab.reparam.speccond import AUTO_MARGIN, SpectralConditioning, apply_speccond, condition_numbers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_reparam as ref  # noqa: E402

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)


def _model(spec, seed=0):
    torch.manual_seed(seed)
    return attnlab.build_model("vit_digits", **TINY_VIT, attn=spec)


@pytest.mark.parametrize("lam", [10.0, 0.37])
def test_effective_weight_is_w_plus_lam_identity_per_block(lam):
    model = _model(f"speccond(lam={lam})")
    for block in model.blocks:
        qkv = block.attn.qkv
        raw = qkv.parametrizations.weight.original.detach().double().numpy()
        expected = ref.add_identity_blocks(raw, lam, blocks=3)
        np.testing.assert_allclose(qkv.weight.detach().double().numpy(), expected, rtol=0, atol=1e-6)
        assert not parametrize.is_parametrized(block.attn.proj)
        assert not parametrize.is_parametrized(block.mlp.fc1)


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (5, 5)])
def test_rectangular_identity(shape):
    w = torch.randn(shape, dtype=torch.float64)
    out = SpectralConditioning(w, 2.5)(w)
    np.testing.assert_allclose(out.numpy(), ref.add_identity_blocks(w.numpy(), 2.5, 1), rtol=0, atol=1e-12)


def test_mlp_targets_and_gradient_passes_through():
    model = _model("standard")
    apply_speccond(model, [m for _, m in attention_modules(model)], lam=1.5, targets="qkv+mlp")
    block = model.blocks[1]
    for layer in (block.mlp.fc1, block.mlp.fc2):
        raw = layer.parametrizations.weight.original.detach().double().numpy()
        np.testing.assert_allclose(layer.weight.detach().double().numpy(), ref.add_identity_blocks(raw, 1.5, 1),
                                   atol=1e-6)
    fc1 = block.mlp.fc1
    x = torch.randn(3, fc1.in_features)
    g = torch.randn(3, fc1.out_features)
    (fc1(x) * g).sum().backward()
    torch.testing.assert_close(fc1.parametrizations.weight.original.grad, g.T @ x)  # d(W + C)/dW = identity


def test_mlp_targets_need_an_mlp():
    class Fake(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(4, 12)

        def qkv_widths(self):
            return [4, 4, 4]

    holder = nn.Sequential(Fake())
    with pytest.raises(UnsupportedModelError, match="targets=qkv"):
        apply_speccond(holder, [holder[0]], lam=1.0, targets="qkv+mlp")


def test_bad_lam():
    with pytest.raises(SpecError, match="lam"):
        attnlab.parse_spec("speccond(lam=big)")
    with pytest.raises(SpecError, match="lam"):
        attnlab.parse_spec("speccond(lam=-1)")


@st.composite
def _theorem_case(draw):
    m = draw(st.integers(2, 7))
    n = draw(st.integers(2, 7))
    k = min(m, n)
    s_max = draw(st.floats(2.05, 20.0))
    s_min = draw(st.floats(1e-3, 0.39))
    middle = sorted((draw(st.floats(s_min, s_max)) for _ in range(k - 2)), reverse=True)
    seed = draw(st.integers(0, 2**31 - 1))
    lam = s_max + 1.0 + draw(st.floats(1e-3, 10.0))  # condition (1): lam - sigma_max > 1
    return m, n, [s_max, *middle, s_min], seed, lam


@settings(max_examples=60, deadline=None)
@given(_theorem_case())
def test_theorem_3_8_condition_number_drops(case):
    m, n, singular, seed, lam = case
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((m, m)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    k = min(m, n)
    a = u[:, :k] @ np.diag(singular) @ v[:, :k].T
    assert abs(ref.kappa(a) - singular[0] / singular[-1]) < 1e-6 * ref.kappa(a)
    conditioned = SpectralConditioning(torch.from_numpy(a), lam)(torch.from_numpy(a)).numpy()
    assert ref.kappa(conditioned) < ref.kappa(a)
    # and the bound the proof goes through: kappa(A + lam I_k) <= (sigma_max + lam) / (lam - sigma_max)
    assert ref.kappa(conditioned) <= (singular[0] + lam) / (lam - singular[0]) * (1 + 1e-9)


def test_auto_meets_the_bound_and_survives_state_dict():
    model = _model("speccond(lam=auto)")
    lams = {float(b.attn.qkv.parametrizations.weight[0].lam) for b in model.blocks}
    assert len(lams) == 1
    lam = lams.pop()
    tops = []
    for block in model.blocks:
        raw = block.attn.qkv.parametrizations.weight.original.detach().double().numpy()
        for part in np.split(raw, 3, axis=0):
            top = ref.spectral_norm(part)
            assert lam - top > 1.0  # condition (1) of the corrected Theorem 3.8, every block
            tops.append(top)
    assert lam == pytest.approx(max(tops) + 1.0 + AUTO_MARGIN, rel=1e-5)  # the smallest such lam, plus the margin
    fresh = _model("speccond(lam=auto)", seed=3)  # other weights would give another auto lam
    assert float(fresh.blocks[0].attn.qkv.parametrizations.weight[0].lam) != pytest.approx(lam)
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert float(fresh.blocks[0].attn.qkv.parametrizations.weight[0].lam) == pytest.approx(lam)
    torch.testing.assert_close(fresh.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight)


def test_condition_numbers_helper_against_svd():
    w = torch.randn(12, 5, dtype=torch.float64)
    ours = condition_numbers(w, blocks=3)
    theirs = [ref.kappa(part) for part in np.split(w.numpy(), 3, axis=0)]
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-10)
