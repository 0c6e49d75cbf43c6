"""Representational robustness (DnA Sec. 4.5, Figure 9): known answers and the float64 reference."""

import math

import pytest
import torch

import attnlab
from attnlab.analysis import psnr, representational_robustness, token_distance
from attnlab.errors import AttnlabError
from tests import reference_instruments as ref


def test_token_distance_known_answers_and_reference():
    torch.manual_seed(0)
    base = torch.randn(6)
    same = base.expand(5, 6) + torch.arange(5.0).view(5, 1)  # equal after centring each token over its features
    assert token_distance(same).item() == pytest.approx(0, abs=1e-12)
    orth = torch.zeros(3, 6)  # centred, mutually orthogonal: (1, -1, 0, ...) on disjoint coordinates
    for i in range(3):
        orth[i, 2 * i], orth[i, 2 * i + 1] = 1, -1
    assert token_distance(orth).item() == pytest.approx(1, abs=1e-12)
    tokens = torch.randn(4, 7, 5)
    want = torch.tensor([ref.token_distance(t) for t in tokens], dtype=torch.float64)
    assert torch.allclose(token_distance(tokens), want, atol=1e-12)


def test_psnr():
    clean = torch.rand(2, 3, 4, 4)
    assert psnr(clean, clean, 1.0) == math.inf
    assert psnr(clean, clean + 0.1, 2.0) == pytest.approx(10 * math.log10(4 / 0.01))
    noisy = clean + torch.randn(clean.shape)
    assert psnr(clean, noisy, 1.0) == pytest.approx(ref.psnr(clean, noisy, 1.0))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return attnlab.build_model("vit_digits", num_classes=10, attn="dna", in_chans=1, img_size=8)


def test_zero_noise_changes_nothing(model):
    torch.manual_seed(1)
    images, labels = torch.randn(5, 1, 8, 8), torch.randint(0, 10, (5,))
    out = representational_robustness(model, images, labels, sigmas=(0.0, 1.0), batch_size=2)
    zero, one = out["noisy"]
    assert zero["psnr"] == math.inf and zero["change"] == [0.0, 0.0] and zero["distance"] == out["clean"]
    assert zero["agreement"] == 1.0 and zero["top1_drop"] == 0.0
    assert math.isfinite(one["psnr"]) and any(c != 0 for c in one["change"])
    assert len(out["layers"]) == 2 and all(0 <= d <= 2 for d in out["clean"])


def test_block_outputs_against_reference(model):
    torch.manual_seed(2)
    images = torch.randn(2, 1, 8, 8)
    seen = []
    handle = model.blocks[1].register_forward_hook(lambda m, a, o: seen.append(o.detach()))
    try:
        out = representational_robustness(model, images, sigmas=(), batch_size=2)
    finally:
        handle.remove()
    want = sum(ref.token_distance(t) for t in seen[0]) / 2  # vit_digits has no class token
    assert out["clean"][1] == pytest.approx(want, abs=1e-9)
    assert "top1_clean" not in out


def test_bad_arguments_are_one_sentence(model):
    with pytest.raises(AttnlabError, match="non-negative"):
        representational_robustness(model, torch.randn(1, 1, 8, 8), sigmas=(-1.0,))
    with pytest.raises(AttnlabError, match="one label per image"):
        representational_robustness(model, torch.randn(2, 1, 8, 8), torch.tensor([1]))
