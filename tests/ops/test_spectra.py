"""Gram spectra, p1 and effective rank (NS-Attn Sec. 3.4, eq. 6-8) on spectra worked out by hand."""

import math
import sys
from pathlib import Path

import pytest
import torch

from attnlab.ops import effective_rank, gram_eigenvalues, gram_spectrum, leading_fraction, ns_transform

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference as ref  # noqa: E402


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("d", [1, 4, 16])
def test_identity(d):
    # G = I: all d eigenvalues equal, p_i = 1/d, H = ln d, r_eff = d.
    p = gram_spectrum(torch.eye(d))
    torch.testing.assert_close(p, torch.full((d,), 1.0 / d, dtype=torch.float64))
    assert leading_fraction(p).item() == pytest.approx(1.0 / d, rel=1e-12)
    assert effective_rank(p).item() == pytest.approx(d, rel=1e-12)


def test_rank_one():
    # M = u v^T: one non-zero eigenvalue, p = (1, 0, ...), H = 0, r_eff = 1.
    u, v = _t([1.0, -2.0, 0.5, 3.0]), _t([0.3, 1.0, -1.0, 2.0, 0.1, 4.0])
    p = gram_spectrum(torch.outer(u, v))
    torch.testing.assert_close(p, _t([1.0, 0.0, 0.0, 0.0]), rtol=0, atol=1e-12)
    assert leading_fraction(p).item() == pytest.approx(1.0, rel=1e-12)
    assert effective_rank(p).item() == pytest.approx(1.0, rel=1e-9)


def test_diag_2110():
    # M = diag(2, 1, 1, 0): eigenvalues of M M^T are 4, 1, 1, 0 (sum 6), p = (2/3, 1/6, 1/6, 0),
    # H = (2/3) ln(3/2) + (1/3) ln 6, r_eff = (3/2)^(2/3) 6^(1/3) = 13.5^(1/3).
    m = torch.diag(_t([1.0, 2.0, 0.0, 1.0]))  # unsorted on purpose
    torch.testing.assert_close(gram_eigenvalues(m), _t([4.0, 1.0, 1.0, 0.0]))
    p = gram_spectrum(m)
    torch.testing.assert_close(p, _t([2 / 3, 1 / 6, 1 / 6, 0.0]))
    assert leading_fraction(p).item() == pytest.approx(2 / 3, rel=1e-12)
    assert effective_rank(p).item() == pytest.approx(13.5 ** (1 / 3), rel=1e-12)


def test_more_rows_than_columns_keeps_all_rows():
    # The paper's Swin case: a 32 x 16 matrix has all 32 eigenvalues of its 32 x 32 Gram, 16 of them zero.
    m = torch.zeros(4, 2, dtype=torch.float64)
    m[0, 0], m[1, 1] = 3.0, 4.0  # eigenvalues 16, 9, 0, 0
    p = gram_spectrum(m)
    torch.testing.assert_close(p, _t([16 / 25, 9 / 25, 0.0, 0.0]))
    h = -(16 / 25) * math.log(16 / 25) - (9 / 25) * math.log(9 / 25)
    assert effective_rank(p).item() == pytest.approx(math.exp(h), rel=1e-12)
    assert gram_spectrum(torch.randn(3, 32, 16)).shape == (3, 32)


def test_zero_matrix_is_flagged_not_nan():
    m = torch.zeros(2, 5, 7)
    m[1] = torch.eye(5, 7)
    p = gram_spectrum(m)
    assert torch.isfinite(p).all()
    assert (p[0] == 0).all() and p[0].sum() == 0  # the flag: an all-zero spectrum
    assert leading_fraction(p)[0].item() == 0.0
    torch.testing.assert_close(effective_rank(p), _t([0.0, 5.0]))


def test_random_against_eigh_reference():
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 4, 16, 65), (5, 32, 16)]:  # ViT and Swin feature-view matrices
        m = torch.randn(*shape, generator=g) * torch.rand(shape[-1], generator=g)  # uneven spectra
        p = gram_spectrum(m)
        assert p.dtype == torch.float64 and p.shape == shape[:-1]
        want = torch.from_numpy(ref.gram_spectrum_reference(m.numpy()))
        torch.testing.assert_close(p, want, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(p.sum(-1), torch.ones(shape[:-2], dtype=torch.float64))
        r_eff = effective_rank(p)
        for idx in torch.cartesian_prod(*[torch.arange(s) for s in shape[:-2]]).reshape(-1, len(shape) - 2):
            i = tuple(idx.tolist())
            assert r_eff[i].item() == pytest.approx(ref.effective_rank_reference(want[i].numpy()), rel=1e-9)


def test_scale_invariant():
    m = torch.randn(3, 8, 20, dtype=torch.float64)
    torch.testing.assert_close(gram_spectrum(1e-3 * m), gram_spectrum(m))


def test_ns_step_flattens_a_concentrated_spectrum():
    # The design goal of Sec. 2.2, by hand: singular values (0.9, 0.3, 0.3, 0.1) have unit norm, so t = sigma;
    # p1 = 0.81 before; after one step the eigenvalues are p(t)^2, p(0.3) > p(0.9), so p1 = p(0.3)^2 / sum.
    sigma = [0.9, 0.3, 0.3, 0.1]
    u = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(9, 4, dtype=torch.float64))[0]
    m = u @ torch.diag(_t(sigma)) @ v.T  # D x N = 4 x 9
    p_before = gram_spectrum(m)
    assert leading_fraction(p_before).item() == pytest.approx(0.81, rel=1e-12)

    a, b, c = 3.4445, -4.7750, 2.0315
    lam = sorted(((a * s + b * s**3 + c * s**5) ** 2 for s in sigma), reverse=True)
    p_after = gram_spectrum(ns_transform(m.T).T)
    torch.testing.assert_close(p_after, _t(lam) / sum(lam))
    assert leading_fraction(p_after) < leading_fraction(p_before)
    assert effective_rank(p_after) > effective_rank(p_before)
