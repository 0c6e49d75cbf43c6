"""Nyströmformer attention (attnlab.attention.nystrom, ops.lowrank) against independent float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnlab
from attnlab.analysis.jacobian import head_function
from attnlab.attention.base import Want
from attnlab.errors import SpecError, UnsupportedModelError
from attnlab.models import attention_modules
from attnlab.ops.lowrank import iterative_pinv, nystrom_attention, segment_means
from tests.reference_lowrank import nystrom_reference, softmax_attention


def qkv(n=16, d=8, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, n, d, generator=g, dtype=torch.float64) for _ in range(3)]


def test_landmarks_equal_to_tokens_with_exact_pinv_is_softmax_attention():
    q, k, v = qkv()
    out = nystrom_attention(q, k, v, landmarks=16, scale=8 ** -0.5, pinv_iters=None)
    np.testing.assert_allclose(out.numpy(), softmax_attention(q, k, v), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("n,m", [(16, 4), (15, 4), (23, 7)])
def test_fewer_landmarks_match_eq15_reference(n, m):
    q, k, v = qkv(n=n)
    out = nystrom_attention(q, k, v, landmarks=m, scale=8 ** -0.5, pinv_iters=None)
    np.testing.assert_allclose(out.numpy(), nystrom_reference(q, k, v, m), rtol=1e-8, atol=1e-10)


def test_segment_means_cover_every_token_once():
    x = torch.arange(10, dtype=torch.float64).reshape(1, 10, 1)
    # segments [0, 3), [3, 6), [6, 10)
    assert segment_means(x, 3).flatten().tolist() == [1.0, 4.0, 7.5]


def test_iterative_pinv_converges_to_the_pseudo_inverse():
    q, k, _ = qkv(n=6, d=4, heads=1)
    a = ((q @ k.mT) / 2).softmax(dim=-1)[0, 0]
    exact = np.linalg.pinv(a.numpy())
    assert np.abs(iterative_pinv(a, 2).numpy() - exact).max() > 1e-3  # not there after 2 steps
    np.testing.assert_allclose(iterative_pinv(a, 40).numpy(), exact, rtol=1e-6, atol=1e-8)


def test_module_with_all_landmarks_equals_standard_model():
    torch.manual_seed(0)
    standard = attnlab.build_model("vit_digits", attn="standard").double().eval()
    torch.manual_seed(0)
    nys = attnlab.build_model("vit_digits", attn="nystrom(landmarks=16,pinv=exact)").double().eval()
    assert nys.state_dict().keys() == standard.state_dict().keys()
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(nys(x), standard(x), rtol=1e-9, atol=1e-9)


def test_head_output_is_the_forward_of_one_head():
    """The Jacobian instrument differentiates the module's kernel on one head; it must be what the forward computes."""
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", attn="nystrom(landmarks=5,conv=3)+speccond").double().eval()
    _, module = attention_modules(model)[0]
    torch.nn.init.normal_(module.conv.weight)
    x = torch.randn(2, 16, module.dim, dtype=torch.float64)
    full = module.kernel(*module.project(x), None, Want(), "explicit")[0]
    w, b = module.qkv.weight, module.qkv.bias
    A, D = module.attn_dim, module.head_dim
    for h in range(module.num_heads):
        rows = [slice(p * A + h * D, p * A + (h + 1) * D) for p in range(3)]
        out = head_function(module, h)(x[1], *(w[r] for r in rows), *(b[r] for r in rows))
        torch.testing.assert_close(out, full[1, h])
    jac = attnlab.analysis.jacobian.jacobian_conditioning(model, torch.randn(1, 1, 8, 8, dtype=torch.float64),
                                                          heads=[0])
    assert torch.isfinite(jac.kappa).all()


def test_refusals():
    with pytest.raises(UnsupportedModelError, match="Swin's window attention"):
        attnlab.build_model("swin_cifar", attn="nystrom", depths=(1, 1, 1))
    with pytest.raises(SpecError, match="odd kernel"):
        attnlab.build_model("vit_digits", attn="nystrom(conv=4)")


@pytest.mark.parametrize("m", [16, 20])
def test_landmarks_at_least_tokens_is_exact_softmax_whatever_the_pinv(m):
    # the authors fall back to softmax when there is nothing to approximate; Eq. 16's iteration would land ~4% off
    q, k, v = qkv()
    out = nystrom_attention(q, k, v, landmarks=m, scale=8 ** -0.5, pinv_iters=6)
    np.testing.assert_allclose(out.numpy(), softmax_attention(q, k, v), rtol=1e-12, atol=1e-12)


def test_z0_per_head_by_default_and_the_authors_batch_maximum_selectable():
    from tests.reference_lowrank import pinv_eq16

    q, k, _ = qkv(n=8, d=4, heads=2, seed=3)
    a = ((q @ k.mT) * 0.5).softmax(dim=-1)  # (2, 2, 8, 8): rows sum to 1
    a[1, 1] = a[1, 1] * 3  # one matrix with larger column sums than the rest
    for z0 in ("head", "authors", "lucidrains"):
        got = iterative_pinv(a, 3, z0=z0)
        for b in range(2):
            for h in range(2):
                m = a[b, h].numpy()
                cols, rows = np.abs(a.numpy()).sum(-2), np.abs(a.numpy()).sum(-1)
                scale = {"head": np.abs(m).sum(0).max() * np.abs(m).sum(1).max(),  # ||A||_1 ||A||_inf of this one
                         "authors": cols.max(),  # one maximum column sum over the whole batch and every head
                         "lucidrains": cols.max() * rows.max()}[z0]
                np.testing.assert_allclose(got[b, h].numpy(), pinv_eq16(m, 3, scale), rtol=1e-10, atol=1e-12)
    # per head, sample 0 does not depend on sample 1; with the authors' one maximum it does
    other = a.clone()
    other[1] = other[1] * 2
    assert torch.equal(iterative_pinv(a, 3)[0], iterative_pinv(other, 3)[0])
    assert not torch.allclose(iterative_pinv(a, 3, z0="authors")[0], iterative_pinv(other, 3, z0="authors")[0])
    assert "nystrom(z0=authors)" == str(attnlab.parse_spec("nystrom(z0=authors)"))


@pytest.mark.parametrize("n,m", [(16, 4), (15, 4)])
def test_key_padding_as_the_authors_mask_it(n, m):
    from tests.reference_lowrank import nystrom_padded_reference

    q, k, v = qkv(n=n)
    real = torch.ones(2, n, dtype=torch.bool)
    real[0, -5:] = False
    real[1, :2] = False
    out = nystrom_attention(q, k, v, landmarks=m, scale=8 ** -0.5, pinv_iters=None, key_padding=real[:, None, :])
    for b in range(2):
        if n % m:
            continue  # the authors' form needs m | N; attnlab's uneven segments are checked unmasked above
        np.testing.assert_allclose(out[b].numpy(), nystrom_padded_reference(q[b], k[b], v[b], m, real[b].numpy()),
                                   rtol=1e-8, atol=1e-10)
    # padded tokens' q, k, v do not reach any output
    noise = torch.randn_like(q)
    pad = ~real[:, None, :, None]
    again = nystrom_attention(torch.where(pad, noise, q), torch.where(pad, noise, k), torch.where(pad, noise, v),
                              landmarks=m, scale=8 ** -0.5, pinv_iters=6, key_padding=real[:, None, :])
    torch.testing.assert_close(again, nystrom_attention(q, k, v, landmarks=m, scale=8 ** -0.5, pinv_iters=6,
                                                        key_padding=real[:, None, :]), rtol=0, atol=0)
