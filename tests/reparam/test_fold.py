"""`fold`: folded models give the unfolded eval outputs within float32 rounding, carry plain weights only (a standard
model's state-dict names), leave deep copies intact; `export_folded` writes loadable safetensors."""

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.nn.utils import parametrize

import attnlab
from attnlab.reparam import export_folded, fold


def _trained(name, spec, shape):
    """A model whose reparametrisations have moved off their initial values (one SGD step, u advanced)."""
    torch.manual_seed(0)
    model = attnlab.build_model(name, attn=spec).train()
    x = torch.randn(shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model(x).square().mean().backward()
    opt.step()
    with torch.no_grad():
        model(x)
    return model.eval(), x


CASES = [
    ("vit_digits", "sigma", (3, 1, 8, 8)),
    ("vit_digits", "specnorm(targets=attn)", (3, 1, 8, 8)),
    ("vit_digits", "speccond(lam=auto)", (3, 1, 8, 8)),
    ("vit_digits", "speccond+sigma", (3, 1, 8, 8)),
    ("swin_cifar", "sigma", (2, 3, 32, 32)),
]


@pytest.mark.parametrize("name,spec,shape", CASES)
def test_fold_keeps_outputs(name, spec, shape):
    model, x = _trained(name, spec, shape)
    with torch.no_grad():
        expected = model(x)
    folded = fold(copy.deepcopy(model))
    assert not any(parametrize.is_parametrized(m) for m in folded.modules())
    assert not any("parametrizations" in k for k in folded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(folded(x), expected, rtol=1e-5, atol=1e-5)
        # the deep copy shared parametrize's class with `model`: folding it must not break the original
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert folded.attnlab_folded_from == model.attnlab_spec


def test_folded_model_is_a_standard_model():
    model, x = _trained("vit_digits", "sigma+speccond", (3, 1, 8, 8))
    folded = fold(copy.deepcopy(model))
    assert folded.attnlab_spec == "standard"
    plain = attnlab.build_model("vit_digits", attn=folded.attnlab_spec)
    assert list(plain.state_dict()) == list(folded.state_dict())
    plain.load_state_dict(folded.state_dict(), strict=True)
    plain.eval()
    types = [type(m) for m in plain.modules()]
    assert types == [type(m) for m in folded.modules()]  # exactly the modules of a standard model
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-5)


def test_fold_in_training_mode_does_not_move_u():
    model, x = _trained("vit_digits", "sigma", (3, 1, 8, 8))
    with torch.no_grad():
        expected = model(x)  # eval
    model.train()
    fold(model)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_export_folded(tmp_path):
    model, x = _trained("vit_digits", "ns+sigma", (3, 1, 8, 8))
    path = export_folded(model, tmp_path / "sub" / "model.safetensors")
    assert parametrize.is_parametrized(model.blocks[0].attn.qkv)  # the model itself is untouched
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["attnlab_spec"] == "ns" and meta["attnlab_folded_from"] == "ns+sigma"
    plain = attnlab.build_model("vit_digits", attn=meta["attnlab_spec"]).eval()
    plain.load_state_dict(load_file(str(path)), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-5)


def test_fold_is_exported_at_top_level():
    assert attnlab.fold is fold
    model = nn.Linear(3, 3)
    assert fold(model) is model  # nothing to fold: unchanged
