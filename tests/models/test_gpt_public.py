"""The GPT loaders against the public models themselves, in float64 on shared random weights: Hugging Face's
``GPT2LMHeadModel`` (the ``transformers`` package, in the test extra) saved with ``save_pretrained`` as safetensors,
and nanoGPT's ``GPT`` (``karpathy/nanoGPT``, ``model.py``, read through ``tests/public_code.py``; skipped without
it) saved as its ``train.py`` checkpoint. The warm starts that docs/methods.md says keep the source's logits
(``dna(init=copy)`` with a separate V-, ``sigma``'s W_hat = W) are checked against the source model itself.
``tests/models/test_gpt_loaders.py`` checks the same layouts against the float64 GPT-2 of ``tests/reference_gpt.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import attnlab
from attnlab.errors import ConfigError
from attnlab.models import gpt_from_file, load_gpt2_hf, load_nanogpt
from tests.public_code import load_module

L, H, C, T, V = 2, 3, 24, 16, 23  # n_layer, n_head, n_embd, block_size, vocab_size
GEO = dict(vocab_size=V, block_size=T, embed_dim=C, depth=L, num_heads=H)


def _randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter drawn at random (LayerNorm weights around 1), so each one shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.3 if p.ndim == 2 else 0.1)
                    + (1.0 if p.ndim == 1 and ("ln" in name) and name.endswith("weight") else 0.0))


def _check_logits(source: str, loader: str, ours, path, x, want) -> None:
    """The loaded model's logits equal the source's in float64 (to 1e-12), gpt_from_file's (built in float32) to
    1e-5; the figures are printed."""
    from_file = gpt_from_file(path).double().eval()
    with torch.no_grad():
        got, got_file = ours(x), from_file(x)
    print(f"{source}: max |logit difference| {(got - want).abs().max().item():.1e} ({loader}), "
          f"{(got_file - want).abs().max().item():.1e} (gpt_from_file)")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_file, want, rtol=1e-5, atol=1e-5)


def _tokens(B: int = 2, N: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, N), generator=torch.Generator().manual_seed(seed))


# ---- Hugging Face GPT-2 ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random small GPT2LMHeadModel (float64, eval) and the folder ``save_pretrained`` wrote it to."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=H, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    _randomise(model)
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def _hf_logits(model, x):
    with torch.no_grad():
        return model(x).logits


def test_hf_gpt2_safetensors_give_its_logits(hf):
    model, folder = hf
    x = _tokens()
    want = _hf_logits(model, x)
    state = load_file(folder / "model.safetensors")
    ours = load_gpt2_hf(attnlab.build_model("gpt_tiny", gelu="tanh", **GEO).double().eval(), state,
                        json.loads((folder / "config.json").read_text()))
    _check_logits("Hugging Face GPT-2", "load_gpt2_hf", ours, folder / "model.safetensors", x, want)
    exact = load_gpt2_hf(attnlab.build_model("gpt_tiny", **GEO).double().eval(), state)
    with torch.no_grad():
        assert (exact(x) - want).abs().max() > 1e-6  # exact GELU is not gelu_new: the comparison can fail


@pytest.mark.parametrize("spec,bound", [("dna(init=copy)", 1e-3), ("dna(init=copy,neg_init=-1e-4)", 1e-3),
                                        ("dna(variant=v,init=copy)", 1e-3), ("sigma", 1e-12)])
def test_warm_starts_keep_the_sources_logits(hf, spec, bound):
    """docs/methods.md: ``dna(init=copy)`` with its own V- (``qv``, ``v``) starts within a relative 1e-3 of the
    source (measured about 1e-4), and ``sigma``'s W_hat = W at step 0; the shared-V variants do not claim it."""
    model, folder = hf
    x = _tokens()
    want = _hf_logits(model, x)
    torch.set_default_dtype(torch.float64)  # converted in float64: sigma's gamma and sigma(W) too
    try:
        ours = attnlab.build_model("gpt_tiny", attn=spec, gelu="tanh", pretrained_file=folder / "model.safetensors",
                                   **GEO).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        rel = ((ours(x) - want).abs().max() / want.abs().max()).item()
    print(f"{spec} from Hugging Face GPT-2: max relative logit difference at step 0 {rel:.1e}")
    assert rel < bound
    if spec.startswith("dna"):
        assert rel > 1e-8  # the softmin branch is there (1e-4 of V), not a no-op


def test_shared_value_variants_do_not_start_at_the_source(hf):
    """Their softmin branch multiplies the full V, as docs/methods.md says: no warm start keeps the logits."""
    model, folder = hf
    x = _tokens()
    want = _hf_logits(model, x)
    ours = attnlab.build_model("gpt_tiny", attn="dna(variant=q,init=copy)", gelu="tanh",
                               pretrained_file=folder / "model.safetensors", **GEO).double().eval()
    with torch.no_grad():
        assert ((ours(x) - want).abs().max() / want.abs().max()) > 1e-2


def test_hf_options_attnlab_does_not_compute_are_refused(hf):
    """A config whose forward attnlab's GPT would not reproduce is one sentence naming the option."""
    _, folder = hf
    state = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    for key, value in (("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False),
                       ("layer_norm_epsilon", 1e-6), ("activation_function", "relu")):
        model = attnlab.build_model("gpt_tiny", gelu="tanh", **GEO)
        with pytest.raises(ConfigError, match=key) as err:
            load_gpt2_hf(model, state, dict(config, **{key: value}))
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="gelu"):  # gelu_new into a model built with the exact GELU
        load_gpt2_hf(attnlab.build_model("gpt_tiny", **GEO), state, config)
    load_gpt2_hf(attnlab.build_model("gpt_tiny", gelu="tanh", **GEO), state,
                 dict(config, activation_function="gelu_pytorch_tanh"))  # the same tanh approximation


# ---- nanoGPT ---------------------------------------------------------------------------------------------------------
def test_nanogpt_checkpoint_gives_its_logits(tmp_path):
    nano = load_module("karpathy/nanoGPT", "model.py", "nanogpt_model")
    args = dict(n_layer=L, n_head=H, n_embd=C, block_size=T, bias=True, vocab_size=V, dropout=0.0)
    torch.manual_seed(0)
    model = nano.GPT(nano.GPTConfig(**args)).double().eval()
    _randomise(model)
    x = _tokens()
    with torch.no_grad():
        want, _ = model(x, targets=x)  # with targets nanoGPT returns every position's logits
    # train.py's checkpoint of a compiled model: `_orig_mod.` on every key, lm_head tied to wte
    state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    path = tmp_path / "ckpt.pt"
    torch.save({"model": state, "optimizer": {}, "model_args": args, "iter_num": 5, "best_val_loss": 2.0,
                "config": {}}, path)
    ours = load_nanogpt(attnlab.build_model("gpt_tiny", **GEO).double().eval(),
                        torch.load(path, weights_only=True))
    _check_logits("nanoGPT", "load_nanogpt", ours, path, x, want)
