"""Head redundancy (DnA App. C.5 (C)): known answers and the float64 reference."""

import pytest
import torch

import attnlab
from attnlab.analysis import head_distance, head_redundancy
from attnlab.analysis.maps import capture_maps, eval_mode
from attnlab.errors import UnsupportedModelError
from attnlab.models.convert import attention_modules
from tests import reference_instruments as ref


def test_identical_heads_give_zero_and_orthogonal_maps_give_one():
    torch.manual_seed(0)
    one = torch.rand(5, 7).softmax(-1)
    assert head_distance(one.expand(4, 5, 7)).item() == pytest.approx(0, abs=1e-12)
    # head h attends only to key h: disjoint supports, mutually orthogonal
    orth = torch.zeros(4, 5, 7)
    for h in range(4):
        orth[h, :, h] = 1
    assert head_distance(orth).item() == pytest.approx(1, abs=1e-12)


def test_against_reference():
    torch.manual_seed(1)
    maps = torch.randn(3, 5, 6, 6).softmax(-1)
    got = head_distance(maps)
    assert torch.allclose(got, torch.tensor([ref.head_distance(m) for m in maps], dtype=torch.float64), atol=1e-12)


def _same_heads(model):
    """Copy head 0's q and k rows (every projection block) to every head, so all heads attend identically."""
    for _, m in attention_modules(model):
        H, D = m.num_heads, m.head_dim
        with torch.no_grad():
            w = m.qkv.weight.view(-1, H, D, m.qkv.in_features)
            w[:] = w[:, :1].clone()
            if m.qkv.bias is not None:
                b = m.qkv.bias.view(-1, H, D)
                b[:] = b[:, :1].clone()


@pytest.mark.parametrize("attn", ["standard", "dna", "diff"])
def test_model_with_identical_heads(attn):
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", num_classes=10, attn=attn, in_chans=1, img_size=8)
    images = torch.randn(3, 1, 8, 8)
    before = head_redundancy(model, images, batch_size=2)
    assert len(before) == 2 and all(layer["branches"][b]["distance"] > 1e-4 for layer in before
                                    for b in layer["branches"])
    assert set(before[0]["branches"]) == ({"attn"} if attn == "standard" else {"pos", "neg"})
    _same_heads(model)
    for layer in head_redundancy(model, images, batch_size=2):
        for branch in layer["branches"].values():
            assert branch["distance"] == pytest.approx(0, abs=1e-6)


def test_model_maps_match_reference_on_swin():
    torch.manual_seed(0)
    model = attnlab.build_model("swin_cifar", num_classes=10, attn="dna")
    images = torch.randn(1, 3, 32, 32)
    seen = {}

    def record(index, name, module, branches):
        seen.setdefault(index, branches["neg"].weights.detach())

    with capture_maps(model, record), eval_mode(model), torch.no_grad():
        model(images)
    got = head_redundancy(model, images)
    for index, maps in list(seen.items())[:2]:  # (windows, H, N, N): the mean over windows
        want = sum(ref.head_distance(w) for w in maps) / maps.shape[0]
        assert got[index]["branches"]["neg"]["distance"] == pytest.approx(want, abs=1e-9)


def test_timm_modules_are_refused_in_one_sentence():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=16, depth=1, num_classes=2)
    with pytest.raises(UnsupportedModelError, match="convert the model"):
        head_redundancy(model, torch.randn(1, 3, 32, 32))
