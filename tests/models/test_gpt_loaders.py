"""nanoGPT checkpoints and Hugging Face GPT-2 weights, written by this test in those layouts (nanoGPT's train.py
checkpoint dict with `_orig_mod.` keys and its mask buffers; GPT-2's Conv1D (in, out) weights, with and without the
`transformer.` container, as safetensors next to a config.json), loaded by meaning and checked against the float64
GPT-2 of tests/reference_gpt.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import attnlab
from attnlab.errors import ConfigError
from attnlab.models import gpt_from_file, load_gpt2_hf, load_gpt_file, load_nanogpt
from tests.reference_gpt import reference_gpt

L, H, C, T, V = 2, 3, 24, 16, 23  # n_layer, n_head, n_embd, block_size, vocab_size
GEO = dict(vocab_size=V, block_size=T, embed_dim=C, depth=L, num_heads=H)
MODEL_ARGS = dict(n_layer=L, n_head=H, n_embd=C, block_size=T, bias=True, vocab_size=V, dropout=0.0)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def nanogpt_weights(seed=0) -> dict:
    """GPT-2-shaped weights in nanoGPT's keys and (out, in) Linear layout; lm_head is wte (tied)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C),
              "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)}
    for i in range(L):
        p = f"transformer.h.{i}"
        shapes |= {f"{p}.ln_1.weight": (C,), f"{p}.ln_1.bias": (C,), f"{p}.attn.c_attn.weight": (3 * C, C),
                   f"{p}.attn.c_attn.bias": (3 * C,), f"{p}.attn.c_proj.weight": (C, C), f"{p}.attn.c_proj.bias": (C,),
                   f"{p}.ln_2.weight": (C,), f"{p}.ln_2.bias": (C,), f"{p}.mlp.c_fc.weight": (4 * C, C),
                   f"{p}.mlp.c_fc.bias": (4 * C,), f"{p}.mlp.c_proj.weight": (C, 4 * C), f"{p}.mlp.c_proj.bias": (C,)}
    w = {k: torch.randn(s, generator=g) * (0.3 if len(s) == 2 else 0.1) + (1.0 if k.endswith("ln_1.weight") else 0.0)
         for k, s in shapes.items()}
    w["lm_head.weight"] = w["transformer.wte.weight"]
    return w


def nanogpt_checkpoint(w: dict) -> dict:
    """What nanoGPT's train.py saves after torch.compile: `_orig_mod.` keys, mask buffers (no flash), and more."""
    model = {f"_orig_mod.{k}": v for k, v in w.items()}
    for i in range(L):
        model[f"_orig_mod.transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
    return {"model": model, "optimizer": {"state": {}, "param_groups": [{"lr": 6e-4, "params": [0, 1]}]},
            "model_args": dict(MODEL_ARGS), "iter_num": 250, "best_val_loss": torch.tensor(1.47),
            "config": {"dataset": "shakespeare_char", "batch_size": 64, "compile": True}}


def hf_weights(w: dict, container: bool = True) -> dict:
    """The same weights as Hugging Face's GPT2LMHeadModel (container) or GPT2Model stores them: Conv1D transposed,
    `attn.bias` / `attn.masked_bias` buffers, separate tensors (safetensors refuses shared ones)."""
    out = {}
    for k, v in w.items():
        if k == "lm_head.weight" and not container:
            continue
        name = k if container else k.removeprefix("transformer.")
        out[name] = (v.t() if k.endswith(CONV1D) else v).contiguous().clone()
    prefix = "transformer." if container else ""
    for i in range(L):
        out[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
        out[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return out


@pytest.fixture(scope="module")
def w():
    return nanogpt_weights()


@pytest.fixture(scope="module")
def x():
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))


def fresh(**kw):
    return attnlab.build_model("gpt_tiny", **{**GEO, **kw}).double().eval()


def check_matches(model, w, x, gelu="exact"):
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_gpt(w, x, H, gelu=gelu), rtol=1e-10, atol=1e-10)


def test_nanogpt_checkpoint_dict(w, x):
    check_matches(load_nanogpt(fresh(), nanogpt_checkpoint(w)), w, x)


def test_nanogpt_bare_state_dict(w, x):
    check_matches(load_nanogpt(fresh(), {k: v for k, v in w.items() if k != "lm_head.weight"}), w, x)


@pytest.mark.parametrize("container", [True, False])
def test_hf_state_dict(w, x, container):
    check_matches(load_gpt2_hf(fresh(gelu="tanh"), hf_weights(w, container)), w, x, gelu="tanh")


def test_files_by_layout(tmp_path, w, x):
    """nanoGPT's ckpt.pt (weights-only torch file), HF safetensors + config.json, and attnlab's own file."""
    torch.save(nanogpt_checkpoint(w), tmp_path / "ckpt.pt")
    check_matches(load_gpt_file(fresh(), tmp_path / "ckpt.pt"), w, x)
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(hf_weights(w, container=False), hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps({"n_layer": L, "n_head": H, "n_embd": C, "n_positions": T,
                                                "vocab_size": V, "activation_function": "gelu_new"}))
    check_matches(load_gpt_file(fresh(gelu="tanh"), hf / "model.safetensors"), w, x, gelu="tanh")
    own = load_gpt_file(fresh(), tmp_path / "ckpt.pt")
    save_file({k: v.contiguous() for k, v in own.state_dict().items()}, tmp_path / "own.safetensors")
    check_matches(load_gpt_file(fresh(), tmp_path / "own.safetensors"), w, x)


def test_model_of_the_files_own_geometry(tmp_path, w, x):
    torch.save(nanogpt_checkpoint(w), tmp_path / "ckpt.pt")
    check_matches(gpt_from_file(tmp_path / "ckpt.pt").double().eval(), w, x)
    save_file(hf_weights(w, container=False), tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="without a config.json"):
        gpt_from_file(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": L, "n_head": H, "n_embd": C, "n_positions": T,
                                                       "vocab_size": V, "activation_function": "gelu_new"}))
    model = gpt_from_file(tmp_path / "model.safetensors").double().eval()
    check_matches(model, w, x, gelu="tanh")  # gelu_new read as the tanh GELU: HF's logits
    model = attnlab.convert(gpt_from_file(tmp_path / "model.safetensors"), "qknorm")
    assert type(model.blocks[0].attn).__name__ == "StandardAttention"


def test_build_model_warm_starts_a_variant(tmp_path, w, x):
    """build_model(..., attn="dna(init=copy)", pretrained_file=ckpt): loaded, then converted next to the original."""
    torch.save(nanogpt_checkpoint(w), tmp_path / "ckpt.pt")
    plain = attnlab.build_model("gpt_tiny", pretrained_file=tmp_path / "ckpt.pt", **GEO).double().eval()
    dna = attnlab.build_model("gpt_tiny", attn="dna(init=copy)", pretrained_file=tmp_path / "ckpt.pt",
                              **GEO).double().eval()
    check_matches(plain, w, x)
    with torch.no_grad():
        ref = plain(x)
        assert 0 < (dna(x) - ref).abs().max() < 1e-2 * ref.abs().max()


def test_errors_name_the_first_mismatch(tmp_path, w):
    ckpt = nanogpt_checkpoint(w)
    with pytest.raises(ConfigError, match="n_head=3 where this one has 4; build it with num_heads=3"):
        load_nanogpt(attnlab.build_model("gpt_tiny", **{**GEO, "num_heads": 4}), ckpt)
    with pytest.raises(ConfigError, match=r"'transformer.h.0.attn.c_attn.weight' of shape \(72, 24\) where the "
                                          r"model has \(120, 24\); load into the model before converting"):
        load_nanogpt(attnlab.build_model("gpt_tiny", attn="dna", **GEO), {k: v for k, v in w.items()})
    with pytest.raises(ConfigError, match="lacks GPT-2's 'h.1.mlp.c_fc.bias'"):
        load_nanogpt(fresh(), {k: v for k, v in w.items() if k != "transformer.h.1.mlp.c_fc.bias"})
    with pytest.raises(ConfigError, match="holds 'transformer.h.0.attn.rope', which is no part of GPT-2"):
        load_nanogpt(fresh(), {**w, "transformer.h.0.attn.rope": torch.zeros(3)})
    with pytest.raises(ConfigError, match="lm_head different from the token embedding"):
        load_nanogpt(fresh(), {**w, "lm_head.weight": torch.zeros(V, C)})
    with pytest.raises(ConfigError, match="wpe.weight' of shape"):
        load_gpt2_hf(fresh(block_size=32), hf_weights(w))
    with pytest.raises(ConfigError, match="block_size=32 where this one has 16; build it with block_size=32"):
        load_gpt2_hf(fresh(), hf_weights(w), {"n_head": H, "n_positions": 32})
    with pytest.raises(ConfigError, match="load them into a GPT"):
        load_nanogpt(attnlab.build_model("vit_digits"), ckpt)
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_gpt_file(fresh(), tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match="does not exist"):
        attnlab.build_model("gpt_tiny", pretrained_file=tmp_path / "missing.pt")
    model = attnlab.build_model("gpt_tiny", attn="sigma", **GEO)
    with pytest.raises(ConfigError, match="before converting"):
        load_nanogpt(model, w)
