"""attnlab.ops.rotary against RoFormer's own statement (Su et al., arXiv:2104.09864, Sec. 3.2): in the rotate-half
layout the feature pair (i, i + D/2) is the complex number x_i + j x_{i+D/2}, multiplied by exp(j m theta_i) at
position m, theta_i = base^(-2i/D); so q_m . k_n depends on m - n alone."""

from __future__ import annotations

import torch

from attnlab.ops.rotary import Rotary


def _complex_reference(t: torch.Tensor, theta: float, offset: int = 0) -> torch.Tensor:
    """t (..., N, D) float64 rotated by complex multiplication, with exact float64 angles."""
    D = t.shape[-1]
    z = torch.complex(t[..., : D // 2], t[..., D // 2:])
    m = torch.arange(offset, offset + t.shape[-2], dtype=torch.float64)
    freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    z = z * torch.polar(torch.ones(len(m), D // 2, dtype=torch.float64), m[:, None] * freq[None, :])
    return torch.cat([z.real, z.imag], dim=-1)


def test_rotary_is_complex_multiplication_by_the_position_angle():
    torch.manual_seed(0)
    t = torch.randn(2, 3, 40, 16, dtype=torch.float64)
    for theta, offset in ((10000.0, 0), (1e6, 0), (777.0, 25)):
        (got,) = Rotary(16, theta)(t, offset=offset)
        # Rotary computes its angles in float32, as Hugging Face does: measured 3e-6 at most here (positions < 65)
        torch.testing.assert_close(got, _complex_reference(t, theta, offset), rtol=0, atol=1e-5)
    # the cache's continuation: tokens 25.. rotated with offset 25 are the full sequence's rows 25..
    (full,) = Rotary(16, 777.0)(t)
    (tail,) = Rotary(16, 777.0)(t[..., 25:, :], offset=25)
    torch.testing.assert_close(tail, full[..., 25:, :], rtol=0, atol=0)


def test_rotated_dot_products_depend_on_the_relative_position_only():
    torch.manual_seed(1)
    q, k = torch.randn(2, 32, dtype=torch.float64)
    rot = Rotary(32, 500.0)
    qs, ks = rot(q.expand(30, 32), k.expand(30, 32))  # the same q and k at positions 0..29, rotated together
    logits = qs @ ks.T  # logits[m, n] = q_m . k_n
    for shift in (-7, 0, 3, 11):
        diagonal = torch.diagonal(logits, offset=shift)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=0, atol=1e-5)
    assert (logits.diagonal(0) - logits.diagonal(5)[0]).abs().max() > 1e-2  # and it does depend on it
