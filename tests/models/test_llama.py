"""The Llama- and Qwen-shaped presets: Hugging Face's LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (the
real transformers package, random small configs, nothing downloaded) load with the same float64 logits and export
back (a round trip); every registered spec term trains on them or refuses in one line; the KV cache of grouped keys
gives the recomputed samples."""

from __future__ import annotations

import json

import pytest
import torch

import attnlab
from tests.hf_models import move_norms_and_biases
from attnlab.errors import AttnlabError, ConfigError
from attnlab.models import attention_modules
from attnlab.models.gpt import generate
from attnlab.models.hf_decoder import export_hf, llama_from_hf
from attnlab.variants import VARIANTS

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
KINDS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True}),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16})}


def _hf(kind: str, tie: bool, **extra):
    config_name, model_name, own = KINDS[kind]
    config = getattr(transformers, config_name)(**TINY, rope_theta=777.0, tie_word_embeddings=tie, **own, **extra)
    torch.manual_seed(0)
    return move_norms_and_biases(getattr(transformers, model_name)(config).double().eval())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", KINDS)
def test_hugging_face_weights_load_and_export_with_the_same_logits(kind, tie, tmp_path, float64_rms_norm):
    hf = _hf(kind, tie)
    hf.save_pretrained(tmp_path / "hf")
    ours = llama_from_hf(tmp_path / "hf").eval()
    assert ours.blocks[0].attn.num_kv_heads == 2 and ours.blocks[0].attn.rotary.theta == 777.0
    assert (ours.lm_head is None) == tie and (kind == "qwen3") == (ours.geometry["qk_norm"])
    x = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, rtol=1e-12, atol=1e-12)
    export_hf(ours, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == kind
    back = getattr(transformers, KINDS[kind][1]).from_pretrained(tmp_path / "back", dtype=torch.float64).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want, rtol=1e-12, atol=1e-12)


def test_the_presets_load_by_meaning_and_hugging_face_float32_norms_agree_closely(tmp_path):
    hf = _hf("qwen3", tie=False)
    hf.save_pretrained(tmp_path / "hf")
    geo = dict(vocab_size=50, block_size=64, embed_dim=32, depth=2, num_heads=4, num_kv_heads=2, head_dim=16,
               mlp_hidden=48, rope_theta=777.0, tie_embeddings=False)
    model = attnlab.build_model("qwen3_tiny", attn="standard", pretrained_file=str(tmp_path / "hf"), **geo)
    x = torch.randint(0, 50, (1, 9))
    with torch.no_grad():  # unpatched: Hugging Face's norms in float32, ours in the model's float32 too
        torch.testing.assert_close(model(x), hf.float()(x).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="num_kv_heads=2 where the model has 4"):
        attnlab.build_model("qwen3_tiny", pretrained_file=str(tmp_path / "hf"), **{**geo, "num_kv_heads": 4})


@pytest.mark.parametrize("extra,words", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "MLP biases"),
])
def test_a_config_that_does_not_fit_is_refused_in_one_line(extra, words, tmp_path):
    _hf("llama", tie=True, **extra).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match=words) as err:
        llama_from_hf(tmp_path / "hf")
    assert "\n" not in str(err.value)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ConfigError, match="reads model_type llama, qwen2, qwen3"):
        llama_from_hf(tmp_path / "hf")


def test_only_softmax_attention_exports(tmp_path):
    model = attnlab.build_model("llama_tiny", attn="dna", depth=1)
    with pytest.raises(ConfigError, match="standard, or qknorm"):
        export_hf(model, tmp_path / "x")
    with pytest.raises(ConfigError, match="fold them"):
        export_hf(attnlab.build_model("llama_tiny", attn="sigma", depth=1), tmp_path / "y")
    export_hf(attnlab.build_model("llama_tiny", attn="qknorm", depth=1), tmp_path / "z")
    assert json.loads((tmp_path / "z" / "config.json").read_text())["model_type"] == "qwen3"
    with pytest.raises(ConfigError, match="exists"):
        export_hf(attnlab.build_model("llama_tiny", depth=1), tmp_path / "z")


SPECS = list(VARIANTS) + ["dna(variant=q)", "qknorm+sigma", "qknorm+speccond", "speccond(targets=qkv+mlp)", "performer(features=16)"]


@pytest.mark.parametrize("spec", SPECS)
def test_every_term_trains_on_llama_or_refuses_in_one_line(spec):
    torch.manual_seed(0)
    try:
        model = attnlab.build_model("llama_tiny", attn=spec, depth=2)
    except AttnlabError as err:
        assert "\n" not in str(err) and "causal" in str(err), str(err)
        return
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # causal: a later token never reaches an earlier output
    model.eval()
    with torch.no_grad():
        later = x.clone()
        later[:, 9:] = (later[:, 9:] + 1) % 256
        torch.testing.assert_close(model(later)[:, :9], model(x)[:, :9], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["standard", "qknorm", "dna", "diff"])
def test_the_kv_cache_of_grouped_keys_samples_what_recomputing_samples(spec):
    torch.manual_seed(0)
    model = attnlab.build_model("qwen3_tiny" if spec == "standard" else "llama_tiny", attn=spec, depth=2).double()
    assert all(m.num_kv_heads == 2 for _, m in attention_modules(model))
    prompt = torch.randint(0, 256, (2, 5))
    cached = generate(model, prompt, 12, temperature=0, kv_cache=True)
    plain = generate(model, prompt, 12, temperature=0, kv_cache=False)
    assert torch.equal(cached, plain)


def test_the_llama_lr_study_preset_trains_each_variant_with_the_per_layer_probe(tmp_path):
    """`attnlab compare --preset lm_demo_llama`'s grid (the note's four methods x three peak rates on llama_tiny),
    one run of each variant cut to 4 steps: the probe records every layer's max logit."""
    from attnlab.analysis import training_probe
    from attnlab.train import RECIPES, train
    from attnlab.train.config import GRID_PRESETS

    grid = GRID_PRESETS["lm_demo_llama"]
    assert grid["models"] == ["llama_tiny"] and grid["variants"] == ["standard", "qknorm", "qkclip", "sigma"]
    assert sorted(v["lr"] for v in grid["variations"].values()) == [1e-3, 1e-2, 3e-2]
    for attn in grid["variants"]:
        cfg = RECIPES["lm_demo_llama"].replace(attn=attn, max_steps=4, eval_every=2, eval_iters=1,
                                  batch_size=2, block_size=16, probe_every=2, probe_images=2, runs_dir=str(tmp_path),
                                  progress=False)
        run = tmp_path / train(cfg, probe=training_probe)["name"]
        probes = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["probes"][-1]
        assert {f"max_logit/layer_{i}" for i in range(4)} <= set(probes), attn
