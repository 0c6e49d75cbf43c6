"""``build_model(..., pretrained_file=PATH)``: timm's own loading from a file the test saves (this machine has no
network), then the conversion, so a warm start is one call. Round trips through safetensors and a weights-only torch
file; errors name the first mismatching key."""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import save_file

import attnlab
from attnlab.errors import ConfigError, ModelNotFoundError
from attnlab.models.pretrained import read_state_dict

TINY = dict(img_size=32, depth=2)  # timm's vit_tiny_patch16_224 cut down: 4 tokens, 2 blocks
NAME = "vit_tiny_patch16_224"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    torch.manual_seed(0)
    model = timm.create_model(NAME, num_classes=7, **TINY).eval()
    folder = tmp_path_factory.mktemp("weights")
    save_file(model.state_dict(), folder / "w.safetensors")
    torch.save(model.state_dict(), folder / "w.pt")
    torch.save({"model": model.state_dict(), "epoch": 3}, folder / "wrapped.pth")
    return model, folder


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("file", ["w.safetensors", "w.pt", "wrapped.pth"])
def test_round_trip_gives_the_saved_model(source, x, file):
    model, folder = source
    loaded = attnlab.build_model(NAME, num_classes=7, pretrained=True, pretrained_file=folder / file, **TINY).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_warm_start_is_one_call(source, x):
    """dna(init=copy) from the file: Q+, K, V+ are the pretrained ones and the output stays next to the original."""
    model, folder = source
    dna = attnlab.build_model(NAME, num_classes=7, attn="dna(init=copy)", pretrained_file=folder / "w.safetensors",
                              **TINY).eval()
    qkv = model.blocks[1].attn.qkv.weight
    torch.testing.assert_close(dna.blocks[1].attn.projection("q_pos")[0], qkv[:192])
    torch.testing.assert_close(dna.blocks[1].attn.projection("v_pos")[0], qkv[384:])
    with torch.no_grad():
        ref = model(x)
        assert (dna(x) - ref).abs().max() < 1e-3 * ref.abs().max()


def test_other_class_count_gets_a_new_head(source, x):
    src, folder = source
    model = attnlab.build_model(NAME, num_classes=3, pretrained_file=folder / "w.pt", **TINY).eval()
    assert model.head.weight.shape == (3, 192)
    # everything but the classifier is the file's: same tensors, same features
    got = model.state_dict()
    body = {k: v for k, v in src.state_dict().items() if not k.startswith("head.")}
    assert set(got) - set(body) == {"head.weight", "head.bias"}
    assert all(torch.equal(got[k], v) for k, v in body.items())
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), src.forward_features(x))


def test_preset_takes_its_own_state_dict(tmp_path):
    torch.manual_seed(0)
    src = attnlab.build_model("vit_digits", attn="standard").eval()
    save_file(src.state_dict(), tmp_path / "d.safetensors")
    model = attnlab.build_model("vit_digits", attn="ns", pretrained_file=tmp_path / "d.safetensors").eval()
    torch.testing.assert_close(model.state_dict()["blocks.0.attn.qkv.weight"], src.state_dict()["blocks.0.attn.qkv.weight"])


def test_mismatching_weights_name_the_first_key(source):
    _, folder = source
    with pytest.raises(ConfigError, match="first mismatching key 'blocks.2.norm1.weight'"):
        attnlab.build_model(NAME, num_classes=7, pretrained_file=folder / "w.pt", img_size=32, depth=3)
    with pytest.raises(ConfigError, match="'cls_token' with shape|first mismatching key 'cls_token'"):
        attnlab.build_model("vit_small_patch16_224", num_classes=7, pretrained_file=folder / "w.pt", **TINY)
    with pytest.raises(ConfigError, match="lacks 'cls_token'|holds 'cls_token'|'pos_embed' with shape"):
        attnlab.build_model("vit_digits", pretrained_file=folder / "w.pt")


def test_bad_files_and_models_are_one_sentence(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ConfigError, match="cannot be read as safetensors or a weights-only torch file"):
        read_state_dict(garbage)
    with pytest.raises(ConfigError, match="does not exist"):
        read_state_dict(tmp_path / "missing.safetensors")
    torch.save({"lr": 0.1}, tmp_path / "nostate.pt")
    with pytest.raises(ConfigError, match="no state dict of tensors"):
        read_state_dict(tmp_path / "nostate.pt")
    with pytest.raises(ModelNotFoundError, match="--pretrained needs a timm model name"):
        attnlab.build_model("no_such_model", pretrained=True, pretrained_file=garbage)
    with pytest.raises(ConfigError, match="has no published weights"):
        attnlab.build_model("vit_digits", pretrained=True)


def test_a_run_starts_from_its_pretrained_file_and_a_loaded_run_does_not_read_it(tmp_path):
    from attnlab.train import RECIPES
    from attnlab.train.run import Run

    torch.manual_seed(0)
    src = attnlab.build_model("vit_digits", attn="standard")
    save_file(src.state_dict(), tmp_path / "d.safetensors")
    run = Run(RECIPES["demo"].replace(attn="dna(init=copy)",
                                      pretrained_file=str(tmp_path / "d.safetensors")))
    model = run.build_model()
    torch.testing.assert_close(model.blocks[0].attn.projection("k")[0], src.blocks[0].attn.qkv.weight[48:96])
    (tmp_path / "d.safetensors").unlink()  # a checkpoint replaces the weights: the file is not needed then
    run.build_model(pretrained=False)
    with pytest.raises(ConfigError, match="does not exist"):
        run.build_model()
