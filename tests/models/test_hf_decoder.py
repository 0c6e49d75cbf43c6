"""attnlab.models.hf_decoder beyond the load-and-export-back round trip of test_llama.py: models trained in attnlab
(standard, QK-norm, folded sigma-Reparam; biases; tied or not) export to the Hugging Face layout that the real
``transformers`` loads with the same float64 logits; the loaded model's KV cache gives the recomputed logits and
transformers' own greedy tokens; what no layout holds is refused in one line, also by ``attnlab export --hf``."""

from __future__ import annotations

import json

import pytest
import torch

import attnlab
from tests.hf_models import move_norms_and_biases
from attnlab.cli import main
from attnlab.errors import ConfigError
from attnlab.models.gpt import KVCache, generate
from attnlab.models.hf_decoder import export_hf, llama_from_hf
from attnlab.reparam.fold import fold

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, block_size=32, embed_dim=32, depth=2, num_heads=4, num_kv_heads=2, mlp_hidden=48,
             rope_theta=321.0)


def _trained(preset: str, attn: str = "standard", steps: int = 3, **kwargs) -> torch.nn.Module:
    """A float64 model after a few AdamW steps on random tokens, so that norms, biases and both heads moved away
    from their initial values (ones, zeros, the tied copy)."""
    torch.manual_seed(0)
    model = attnlab.build_model(preset, attn=attn, **{**SMALL, **kwargs}).double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
    for _ in range(steps):
        x = torch.randint(0, SMALL["vocab_size"], (4, 12))
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _moved(model: torch.nn.Module) -> None:
    """Every norm weight left 1 and every bias left 0 (else an exporter that dropped them would pass)."""
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            assert not torch.allclose(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert p.abs().max() > 1e-3, name


# (preset, attn, build options, the layout transformers must read it as)
EXPORTS = {
    "llama-tied": ("llama_tiny", "standard", {}, "llama"),
    "llama-untied-head_dim": ("llama_tiny", "standard", {"tie_embeddings": False, "head_dim": 16}, "llama"),
    "llama-attention_bias": ("llama_tiny", "standard", {"qkv_bias": True, "proj_bias": True}, "llama"),
    "qwen2-qkv_bias": ("llama_tiny", "standard", {"qkv_bias": True, "tie_embeddings": False}, "qwen2"),
    "qwen3-preset": ("qwen3_tiny", "standard", {}, "qwen3"),
    "qwen3-qknorm-term": ("llama_tiny", "qknorm", {"tie_embeddings": False}, "qwen3"),
    "sigma-folded": ("llama_tiny", "sigma", {}, "llama"),
    "qknorm+sigma-folded": ("llama_tiny", "qknorm+sigma", {}, "qwen3"),
}


@pytest.mark.parametrize("case", EXPORTS)
def test_a_model_trained_in_attnlab_exports_to_transformers_with_the_same_logits(case, tmp_path, float64_rms_norm):
    preset, attn, options, kind = EXPORTS[case]
    model = _trained(preset, attn, **options)
    _moved(model)
    x = torch.randint(0, SMALL["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(x)
    if "sigma" in attn:
        with pytest.raises(ConfigError, match="fold them"):
            export_hf(model, tmp_path / "unfolded")
        fold(model)
    export_hf(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == kind and config["tie_word_embeddings"] == (options.get("tie_embeddings", True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM"}[kind]
    assert hf.config.num_key_value_heads == 2 and hf.config.rope_parameters["rope_theta"] == 321.0
    # every tensor written is one transformers uses (an unused one would be silently dropped by its loader)
    assert set(hf.state_dict()) >= set(load_file_keys(tmp_path / "hf"))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, want, rtol=1e-12, atol=1e-12)  # measured: 1e-15
        # and back into attnlab: the same model again
        torch.testing.assert_close(llama_from_hf(tmp_path / "hf").eval()(x), want, rtol=1e-12, atol=1e-12)


def load_file_keys(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


def _hf_model(kind: str, tie: bool):
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, tie_word_embeddings=tie)
    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    torch.manual_seed(1)
    model = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**config))
    return move_norms_and_biases(model.double().eval())


@pytest.mark.parametrize("kind,tie", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_the_kv_cache_of_a_loaded_model_gives_the_recomputed_logits_and_transformers_greedy_tokens(
        kind, tie, tmp_path, float64_rms_norm):
    hf = _hf_model(kind, tie)
    hf.save_pretrained(tmp_path / "hf")
    model = llama_from_hf(tmp_path / "hf").eval()
    tokens = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        # the prompt's first 5 tokens at once, then one token at a time through the cache of grouped keys
        cache = KVCache(len(model.blocks))
        steps = [model.head(model.forward_features(tokens[:, :5], cache))]
        steps += [model.head(model.forward_features(tokens[:, n:n + 1], cache)) for n in range(5, 14)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-12, atol=1e-12)
        assert cache.length == 14
        ours = generate(model, tokens[:, :6], 10, temperature=0, kv_cache=True)
        theirs = hf.generate(tokens[:, :6], max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, generate(model, tokens[:, :6], 10, temperature=0, kv_cache=False))


@pytest.mark.parametrize("change,words", [
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "sliding-window attention"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window attention"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn' rope scaling"),
    ({"num_attention_heads": None}, "has no num_attention_heads; give it as a positive integer"),
])
def test_a_qwen2_config_that_does_not_fit_is_refused_in_one_line(change, words, tmp_path):
    _hf_model("qwen2", tie=True).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=words) as err:
        llama_from_hf(tmp_path / "hf")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("options", [{"proj_bias": True}, {"qkv_bias": True, "qk_norm": True}])
def test_biases_no_layout_holds_are_refused_not_dropped(options, tmp_path):
    """Llama's and Qwen3's attention_bias bias q, k, v and o together, Qwen2 q, k, v alone: an output-projection
    bias alone, or q/k/v biases with QK-norm, would be dropped by transformers' loader without a word."""
    model = attnlab.build_model("llama_tiny", **{**SMALL, **options})
    with pytest.raises(ConfigError, match="build it with both or neither") as err:
        export_hf(model, tmp_path / "hf")
    assert "\n" not in str(err.value) and not (tmp_path / "hf").exists()
def test_attnlab_export_hf_writes_a_trained_llama_run_that_transformers_loads(tmp_path, capsys):
    from attnlab.train import RECIPES, load_run, train

    cfg = RECIPES["lm_demo_llama"].replace(attn="qknorm+sigma", max_steps=3, eval_every=3, eval_iters=1, batch_size=2,
                                           block_size=16, probe_every=0, runs_dir=str(tmp_path), progress=False)
    run = tmp_path / train(cfg)["name"]
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out
    trained, _ = load_run(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():  # float32 both: transformers' norms and attnlab's round differently
        torch.testing.assert_close(hf(x).logits, trained(x), rtol=1e-4, atol=1e-4)
    # the directory exists now, and a second export is refused rather than mixed into it
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 2
    assert "exists" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # argparse's one line: one of the two outputs
        main(["export", str(run), "--hf", str(tmp_path / "x"), "--out", str(tmp_path / "y.safetensors")])
    assert stop.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_attnlab_export_hf_refuses_a_run_that_is_not_softmax_llama(tmp_path, capsys):
    from attnlab.train import RECIPES, train

    cfg = RECIPES["lm_demo_llama"].replace(attn="diff", max_steps=1, eval_every=1, eval_iters=1,
                              batch_size=2, block_size=16, probe_every=0, runs_dir=str(tmp_path), progress=False)
    run = tmp_path / train(cfg)["name"]
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "standard, or qknorm" in err and "\n" not in err and not (tmp_path / "hf").exists()
