"""convert(model, "standard") must change no output bit, keep state-dict names, and refuse models it can't handle."""

import copy

import pytest
import timm
import torch
from torch import nn

import attnlab
from attnlab.attention.base import AttnlabAttention
from attnlab.errors import UnsupportedModelError
from tests.backends import set_fused

CASES = [
    ("vit_cifar", (2, 3, 32, 32)),
    ("swin_cifar", (2, 3, 32, 32)),  # stages 1-2 use shifted windows, so the mask path runs
    ("deit_tiny_patch16_224", (2, 3, 224, 224)),
]


def _pair(name, fused=True):
    torch.manual_seed(0)
    original = attnlab.build_model(name, num_classes=10, attn=None).eval()
    set_fused(original, fused)
    converted = attnlab.convert(copy.deepcopy(original), "standard").eval()
    return original, converted


@pytest.mark.parametrize("name,shape", CASES)
@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
def test_convert_standard_is_bit_identical(name, shape, fused):
    original, converted = _pair(name, fused)
    n_attn = sum(isinstance(m, AttnlabAttention) for m in converted.modules())
    assert n_attn == sum(type(m).__name__ in ("Attention", "WindowAttention") for m in original.modules()) > 0
    assert all((m.backend == "auto") == fused for m in converted.modules() if isinstance(m, AttnlabAttention))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(original(x), converted(x))


@pytest.mark.parametrize("name,shape", CASES[:2])
def test_state_dict_round_trip(name, shape):
    original, converted = _pair(name)
    assert list(original.state_dict()) == list(converted.state_dict())
    fresh = attnlab.build_model(name, num_classes=10)  # different random weights
    fresh.load_state_dict(original.state_dict(), strict=True)
    fresh.eval()
    x = torch.randn(shape)
    with torch.no_grad():
        assert torch.equal(fresh(x), original(x))


def test_swin_mask_is_used():
    """The shifted-window mask must reach the kernel: dropping it changes the output of a shifted block."""
    _, converted = _pair("swin_cifar")
    block = converted.layers[0].blocks[1]
    assert block.shift_size != (0, 0) and block.attn_mask is not None
    x = torch.randn(2, 16, 16, 96)
    with torch.no_grad():
        with_mask = block(x)
        block.attn_mask = None
        without = block(x)
    assert not torch.allclose(with_mask, without)


def test_unsupported_model_names_what_it_found():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)
            self.fc = nn.Linear(8, 8)

    with pytest.raises(UnsupportedModelError, match="MultiheadAttention"):
        attnlab.convert(Toy(), "standard")
    with pytest.raises(UnsupportedModelError, match="no attention-like module"):
        attnlab.convert(timm.create_model("resnet10t"), "standard")


def test_vit_cifar_parameter_count():
    model = attnlab.build_model("vit_cifar", num_classes=100)
    assert sum(p.numel() for p in model.parameters()) == 2_714_980
    # the paper's ViT keeps drop-path 0.1 in every block, not timm's linear rise
    rates = [b.drop_path1.drop_prob for b in model.blocks]
    assert rates == [0.1] * 9


def test_swin_cifar_geometry():
    model = attnlab.build_model("swin_cifar", num_classes=100)
    stages = [(len(s.blocks), s.blocks[0].attn.num_heads, s.blocks[0].attn.head_dim, s.blocks[0].attn.dim)
              for s in model.layers]
    assert stages == [(2, 3, 32, 96), (6, 6, 32, 192), (4, 12, 32, 384)]
    assert all(b.attn.window_size == (4, 4) for s in model.layers for b in s.blocks)
    rates = [b.drop_path1.drop_prob if hasattr(b.drop_path1, "drop_prob") else 0.0
             for s in model.layers for b in s.blocks]
    assert rates[0] == 0.0 and abs(rates[-1] - 0.1) < 1e-6 and rates == sorted(rates)
    # parameters as timm builds them: count independently from the architecture's formula
    expected = sum(p.numel() for p in timm.models.swin_transformer.SwinTransformer(
        img_size=32, patch_size=2, embed_dim=96, depths=(2, 6, 4), num_heads=(3, 6, 12), head_dim=32,
        window_size=4, mlp_ratio=2.0, num_classes=100).parameters())
    assert sum(p.numel() for p in model.parameters()) == expected


def test_unknown_model():
    with pytest.raises(attnlab.ModelNotFoundError, match="vit_cifar"):
        attnlab.build_model("no_such_model")


def test_same_seed_same_shared_weights_across_variants():
    torch.manual_seed(3)
    a = attnlab.build_model("vit_digits", attn="standard")
    torch.manual_seed(3)
    b = attnlab.build_model("vit_digits", attn=None)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_reconverting_keeps_weights_or_refuses():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", attn="ns").eval()
    x = torch.randn(2, 1, 8, 8)
    reference = attnlab.convert(copy.deepcopy(model), "standard")
    with torch.no_grad():  # ns -> standard keeps every weight: same as a standard model with those weights
        fresh = attnlab.build_model("vit_digits").eval()
        fresh.load_state_dict(model.state_dict())
        assert torch.equal(reference(x), fresh(x))
    wide = attnlab.build_model("vit_digits", attn="dna")
    with pytest.raises(UnsupportedModelError, match="build the model afresh"):
        attnlab.convert(wide, "standard")


@pytest.mark.parametrize("name", ["vit_cifar", "swin_cifar"])
def test_support_table_agrees_with_convert(name):
    # what `variants --support` lists as applying converts, and every kernel term it refuses is refused by convert
    from attnlab.errors import SpecError
    from attnlab.models.convert import term_support
    from attnlab.variants import VARIANTS

    (group,) = term_support(attnlab.build_model(name, num_classes=10, attn=None, depth=1)
                            if name == "vit_cifar" else attnlab.build_model(name, num_classes=10, attn=None))
    for term in VARIANTS:
        if VARIANTS[term].kind != "kernel":
            continue
        model = attnlab.build_model(name, num_classes=10, attn=None, **({"depth": 1} if name == "vit_cifar" else {}))
        if term in group["applies"]:
            attnlab.convert(model, term)
        else:
            with pytest.raises((UnsupportedModelError, SpecError), match=group["refused"][term].split(";")[0]):
                attnlab.convert(model, term)
    if name == "swin_cifar":
        assert {"nystrom", "performer"} <= set(group["refused"])
