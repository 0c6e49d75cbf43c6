"""Issue 45 (the decoder): every value the Llama/Qwen decoder reads, from a Hugging Face ``config.json``, from
``build_model``'s options or from the constructor, is checked in one place (``llama_geometry``; ``gpt_options`` for
GPT) and refused in one sentence that names the key, the value and a right one; zero is no default and flags are
booleans; rope_theta and norm_eps are finite and positive (theta above 1); a checkpoint tensor of another kind
(integer into a floating-point parameter) is refused, not cast; the refusals' remedies can be followed. Valid
configs of the real Hugging Face shapes (Llama 2, Llama 3, Qwen2, Qwen3, written by ``transformers`` itself) still
give their geometry."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import attnlab
from attnlab.errors import AttnlabError, ConfigError
from attnlab.models.gpt import GPT
from attnlab.models.hf_decoder import export_hf, hf_geometry, llama_from_hf
from attnlab.models.llama import Llama
from attnlab.ops.rotary import THETA_MAX, Rotary

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=777.0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny LlamaForCausalLM saved by transformers itself (its config.json as transformers writes it)."""
    root = tmp_path_factory.mktemp("hf45")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(root / "hf")
    return root / "hf"


def _changed(hf_dir, tmp_path, change: dict, drop: tuple = ()):
    """A copy of ``hf_dir`` whose config.json has ``change`` applied (values set; ``drop``: keys removed)."""
    out = tmp_path / "hf"
    shutil.copytree(hf_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(change)
    for key in drop:
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    return out


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, AttnlabError)
    return text


# ---- 1: a config.json checked value by value --------------------------------------------------------------------
# (what config.json says, keys removed, what the one line says: key, value and a right value)
CONFIGS = {
    "heads-0": ({"num_attention_heads": 0}, ("head_dim",), "num_attention_heads is 0, not a positive integer "
                                                           "dividing hidden_size 32 into even head_dims (rotary "
                                                           "positions pair features); give one such as 1 (head_dim "
                                                           "32), or set head_dim"),
    "heads-negative": ({"num_attention_heads": -4}, (), "num_attention_heads is -4, not a positive integer"),
    "heads-float": ({"num_attention_heads": 4.0}, (), "num_attention_heads is 4.0, not a positive integer"),
    "heads-not-dividing": ({"num_attention_heads": 3}, ("head_dim",), "num_attention_heads is 3, not a positive "
                                                                      "integer dividing hidden_size 32 into even "
                                                                      "head_dims"),
    "heads-0-with-head_dim": ({"num_attention_heads": 0, "head_dim": 8}, (),
                              "num_attention_heads is 0, not a positive integer; give one such as 4 "
                              "(hidden_size / head_dim)"),
    "hidden-negative": ({"hidden_size": -32}, (), "hidden_size is -32, not a positive integer; give one such as 32"),
    "layers-0": ({"num_hidden_layers": 0}, (), "num_hidden_layers is 0, not a positive integer; give one such as 2"),
    "intermediate-string": ({"intermediate_size": "48"}, (), "intermediate_size is '48', not a positive integer; "
                                                             "give one such as 48"),
    "vocab-missing": ({}, ("vocab_size",), "has no vocab_size; give it as a positive integer (50, as the weights "
                                           "show)"),
    "vocab-bool": ({"vocab_size": True}, (), "vocab_size is True, not a positive integer; give one such as 50"),
    "positions-0": ({"max_position_embeddings": 0}, (), "max_position_embeddings is 0, not a positive integer"),
    "kv-heads-0": ({"num_key_value_heads": 0}, (), "num_key_value_heads is 0, not a positive integer dividing "
                                                   "num_attention_heads 4; give 1, 2 or 4 (or leave it out for 4)"),
    "kv-heads-not-dividing": ({"num_key_value_heads": 3}, (), "num_key_value_heads is 3, not a positive integer "
                                                              "dividing num_attention_heads 4; give 1, 2 or 4"),
    "kv-heads-negative": ({"num_key_value_heads": -2}, (), "num_key_value_heads is -2"),
    "head_dim-0": ({"head_dim": 0}, (), "head_dim is 0, not a positive even integer"),
    "head_dim-odd": ({"head_dim": 7}, (), "head_dim is 7, not a positive even integer (rotary positions pair "
                                          "features); give one such as 8"),
    "theta-string": ({"rope_theta": "abc", "rope_parameters": None}, (), "rope_theta is 'abc', not a finite number "
                                                                         "above 1"),
    "theta-0": ({"rope_theta": 0.0, "rope_parameters": None}, (), "rope_theta is 0.0, not a finite number above 1"),
    "theta-negative": ({"rope_theta": -1e4, "rope_parameters": None}, (), "rope_theta is -10000.0"),
    "theta-nan": ({"rope_theta": math.nan, "rope_parameters": None}, (), "rope_theta is nan"),
    "theta-inf": ({"rope_theta": math.inf, "rope_parameters": None}, (), "rope_theta is inf"),
    "theta-parameters-0": ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, (),
                           "rope_parameters.rope_theta is 0, not a finite number above 1 and at most 3.403e+38; "
                           "give one such as 10000.0"),
    "parameters-not-object": ({"rope_parameters": "default"}, (), "rope_parameters is 'default', not a JSON object"),
    "eps-0": ({"rms_norm_eps": 0}, (), "rms_norm_eps is 0, not a finite number above 0; give one such as 1.0e-06"),
    "eps-negative": ({"rms_norm_eps": -1}, (), "rms_norm_eps is -1"),
    "eps-string": ({"rms_norm_eps": "1e-6"}, (), "rms_norm_eps is '1e-6'"),
    "tie-string": ({"tie_word_embeddings": "yes"}, (), "tie_word_embeddings is 'yes', not a boolean; give true or "
                                                       "false"),
    "attention_bias-int": ({"attention_bias": 1}, (), "attention_bias is 1, not a boolean"),
    "layer_types-string": ({"layer_types": "full_attention"}, (), "layer_types is 'full_attention', not a list"),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_a_config_json_value_that_cannot_be_is_refused_in_one_line_with_a_right_value(case, hf_dir, tmp_path):
    change, drop, words = CONFIGS[case]
    path = _changed(hf_dir, tmp_path, change, drop)
    for load in (llama_from_hf, lambda p: attnlab.build_model("llama_tiny", pretrained_file=str(p))):
        with pytest.raises(ConfigError) as err:
            load(path)
        text = _one_line(err)
        assert words in text and "give" in text, text


# real config.json shapes (the published sizes, written by transformers' own config classes)
REAL = {
    "llama-2-7b": ("LlamaConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
                   dict(num_kv_heads=32, head_dim=128, rope_theta=1e4, norm_eps=1e-5, tie_embeddings=False)),
    "llama-3-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
                   dict(num_kv_heads=8, head_dim=128, rope_theta=5e5, norm_eps=1e-5)),
    "qwen2-0.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                       max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                       tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
                                       max_window_layers=24),
                   dict(num_kv_heads=2, head_dim=64, rope_theta=1e6, qkv_bias=True, proj_bias=False,
                        tie_embeddings=True)),
    "qwen3-0.6b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                       rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False),
                   dict(num_kv_heads=8, head_dim=128, rope_theta=1e6, qk_norm=True, tie_embeddings=True)),
}


@pytest.mark.parametrize("name", REAL)
def test_real_llama_and_qwen_config_shapes_still_give_their_geometry(name):
    cls, sizes, want = REAL[name]
    config = getattr(transformers, cls)(**sizes).to_dict()
    g = hf_geometry(json.loads(json.dumps(config)), name)
    assert g["embed_dim"] == sizes["hidden_size"] and g["depth"] == sizes["num_hidden_layers"]
    assert g["mlp_hidden"] == sizes["intermediate_size"] and g["vocab_size"] == sizes["vocab_size"]
    assert {k: g[k] for k in want} == want
    # absent optional keys take Hugging Face's defaults (num_key_value_heads: the heads; head_dim: dim / heads)
    bare = {k: v for k, v in config.items() if k not in ("num_key_value_heads", "head_dim", "rms_norm_eps")}
    g = hf_geometry(bare, name)
    assert g["num_kv_heads"] == sizes["num_attention_heads"] and g["norm_eps"] == 1e-6
    assert g["head_dim"] == sizes["hidden_size"] // sizes["num_attention_heads"]


# ---- 2, 3: the constructor and build_model's options --------------------------------------------------------------
OPTIONS = {
    "kv-heads-0": ({"num_kv_heads": 0}, "num_kv_heads is 0, not a positive integer dividing num_heads 4; give 1, 2 "
                                        "or 4 (or leave it unset for 4)"),
    "kv-heads-negative": ({"num_kv_heads": -2}, "num_kv_heads is -2, not a positive integer dividing num_heads 4"),
    "head_dim-0": ({"head_dim": 0}, "head_dim is 0, not a positive even integer (rotary positions pair features); "
                                    "give one such as 32 (or leave it unset"),
    "mlp_hidden-0": ({"mlp_hidden": 0}, "mlp_hidden is 0, not a positive integer; give one such as 352 (or leave it "
                                        "unset for that default)"),
    "tie-maybe": ({"tie_embeddings": "maybe"}, "tie_embeddings is 'maybe', not a boolean; give true or false"),
    "qk_norm-3": ({"qk_norm": 3}, "qk_norm is 3, not a boolean; give true or false"),
    "qkv_bias-1": ({"qkv_bias": 1}, "qkv_bias is 1, not a boolean"),
    "theta-0": ({"rope_theta": 0}, "rope_theta is 0, not a finite number above 1 and at most 3.403e+38; give one "
                                   "such as 10000.0"),
    "theta-negative": ({"rope_theta": -1e4}, "rope_theta is -10000.0, not a finite number above 1"),
    "theta-nan": ({"rope_theta": math.nan}, "rope_theta is nan, not a finite number above 1"),
    "theta-inf": ({"rope_theta": math.inf}, "rope_theta is inf, not a finite number above 1"),
    "theta-past-float32": ({"rope_theta": 1e39}, "rope_theta is 1e+39, not a finite number above 1 and at most"),
    "theta-1": ({"rope_theta": 1.0}, "rope_theta is 1.0, not a finite number above 1"),
    "theta-string": ({"rope_theta": "1e4"}, "rope_theta is '1e4'"),
    "eps-0": ({"norm_eps": 0.0}, "norm_eps is 0.0, not a finite number above 0; give one such as 1.0e-06"),
    "eps-negative": ({"norm_eps": -1}, "norm_eps is -1, not a finite number above 0"),
    "eps-nan": ({"norm_eps": math.nan}, "norm_eps is nan"),
    "eps-inf": ({"norm_eps": math.inf}, "norm_eps is inf"),
    "heads-not-dividing": ({"num_heads": 5}, "num_heads is 5, not a positive integer dividing embed_dim 128 into "
                                             "even head_dims (rotary positions pair features); give one such as 4 "
                                             "(head_dim 32), or set head_dim"),
    "vocab-float": ({"vocab_size": 2.5}, "vocab_size is 2.5, not a positive integer; give one such as 256"),
    "depth-bool": ({"depth": True}, "depth is True, not a positive integer"),
}


@pytest.mark.parametrize("case", OPTIONS)
def test_a_llama_option_that_cannot_be_is_refused_before_anything_is_built(case):
    options, words = OPTIONS[case]
    for build in (lambda: Llama(**options), lambda: attnlab.build_model("llama_tiny", **options)):
        with pytest.raises(ConfigError) as err:
            build()
        assert f"Llama's {words}" in _one_line(err), str(err.value)


def test_unset_options_take_their_defaults_and_valid_values_build_what_they_say():
    g = Llama(num_kv_heads=None, head_dim=None, mlp_hidden=None).geometry
    assert (g["num_kv_heads"], g["head_dim"], g["mlp_hidden"]) == (4, 32, 352)
    g = attnlab.build_model("llama_tiny", num_kv_heads=1, head_dim=16, mlp_hidden=64, rope_theta=500000,
                            norm_eps=1, tie_embeddings=False, qk_norm=True).geometry
    assert (g["num_kv_heads"], g["head_dim"], g["mlp_hidden"], g["rope_theta"], g["norm_eps"]) == (1, 16, 64, 5e5, 1.0)
    assert g["qk_norm"] is True and g["tie_embeddings"] is False
    model = attnlab.build_model("llama_tiny", embed_dim=96, num_heads=3, num_kv_heads=1, depth=1)  # head_dim 32
    assert model.geometry["head_dim"] == 32 and torch.isfinite(model(torch.zeros(1, 5, dtype=torch.long))).all()


def test_the_rotary_base_bounds_are_where_the_float32_frequencies_stop_being_d_over_2_distinct_turns():
    """theta_i = base^(-2i/D) (RoFormer, arXiv:2104.09864, eq. 15) in float32, as the model computes them: within
    (1, float32 max] every pair turns at its own finite, positive, falling rate; past float32's max only pair 0
    turns; at 1 all turn alike; Rotary refuses the bases outside."""
    D = 64
    for base in (1.0001, 10000.0, THETA_MAX):
        f = Rotary(D, base).inv_freq
        assert torch.isfinite(f).all() and (f > 0).all() and (f[1:] < f[:-1]).all(), base
    i = torch.arange(0, D, 2).float() / D
    assert (1.0 / (1e39 ** i)).count_nonzero() == 1  # what float32 would compute past the bound: one pair turning
    assert (1.0 / (1.0 ** i) == 1).all()
    for base in (0.0, -1e4, 1.0, 0.5, math.nan, math.inf, 1e39, "1e4", True):
        with pytest.raises(ConfigError, match="rotary base theta is .* not a finite number above 1"):
            Rotary(D, base)


GPT_OPTIONS = {
    "bias-maybe": ({"bias": "maybe"}, "bias is 'maybe', not a boolean; give true or false"),
    "mlp_ratio-0": ({"mlp_ratio": 0}, "mlp_ratio is 0, not a finite number above 0; give one such as 4.0"),
    "mlp_ratio-tiny": ({"mlp_ratio": 1e-4}, "mlp_ratio is 0.0001, not a ratio giving embed_dim 128 at least one "
                                            "hidden unit"),
    "drop-1.5": ({"drop_rate": 1.5}, "drop_rate is 1.5, not a probability in [0, 1); give one such as 0.0"),
    "attn_drop-negative": ({"attn_drop_rate": -0.1}, "attn_drop_rate is -0.1, not a probability in [0, 1)"),
    "gelu-list": ({"gelu": ["tanh"]}, "gelu is ['tanh'], not one of exact, tanh; give exact"),
    "heads-0": ({"num_heads": 0}, "num_heads is 0, not a positive integer dividing embed_dim 128; give one such as 2"),
    "vocab-0": ({"vocab_size": 0}, "vocab_size is 0, not a positive integer; give one such as 256"),
}


@pytest.mark.parametrize("case", GPT_OPTIONS)
def test_a_gpt_option_that_cannot_be_is_refused_in_one_line_with_a_right_value(case):
    options, words = GPT_OPTIONS[case]
    for build in (lambda: GPT(**options), lambda: attnlab.build_model("gpt_tiny", **options)):
        with pytest.raises(ConfigError) as err:
            build()
        assert f"GPT's {words}" in _one_line(err), str(err.value)


def test_a_nanogpt_checkpoints_recorded_geometry_is_checked_under_its_own_names(tmp_path):
    from tests.models.test_gpt_loaders import nanogpt_checkpoint, nanogpt_weights

    from attnlab.models import gpt_from_file

    ckpt = nanogpt_checkpoint(nanogpt_weights())
    for change, words in (({"n_head": 0}, "model_args's n_head is 0, not a positive integer dividing n_embd"),
                          ({"n_embd": "32"}, "model_args's n_embd is '32', not a positive integer"),
                          ({"vocab_size": None}, "model_args record no vocab_size")):
        torch.save({**ckpt, "model_args": {**ckpt["model_args"], **change}}, tmp_path / "ckpt.pt")
        with pytest.raises(ConfigError) as err:
            gpt_from_file(tmp_path / "ckpt.pt")
        assert words in _one_line(err), str(err.value)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with pytest.raises(ConfigError, match="'dropout' is not an argument of GPT"):
        gpt_from_file(tmp_path / "ckpt.pt", dropout=0.1)
    assert gpt_from_file(tmp_path / "ckpt.pt", drop_rate=0.1).drop.p == 0.1


# ---- the Python loader: the same errors, never raw ones -----------------------------------------------------------
def _edit_weights(path, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    save_file(edit(state), str(path / "model.safetensors"), metadata={"format": "pt"})


def test_the_loader_refuses_in_one_line_what_raised_raw_errors(hf_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        llama_from_hf(hf_dir, rope_thetta=1e4)
    assert "'rope_thetta' is not an argument of Llama (did you mean 'rope_theta'?)" in _one_line(err)
    with pytest.raises(ConfigError) as err:
        llama_from_hf(hf_dir, num_kv_heads=0)
    assert "Llama's num_kv_heads is 0" in _one_line(err)
    path = _changed(hf_dir, tmp_path, {})
    _edit_weights(path, lambda s: {**s, "model.layers.0": torch.zeros(2)})
    with pytest.raises(ConfigError) as err:
        llama_from_hf(path)
    assert "holds 'layers.0', which attnlab's Llama has no place for" in _one_line(err)
    _edit_weights(path, lambda s: {k: v for k, v in s.items()
                                   if k not in ("model.layers.0", "model.layers.1.self_attn.k_proj.weight")})
    with pytest.raises(ConfigError) as err:
        llama_from_hf(path)
    assert "holds 'model.layers.1.self_attn.q_proj.weight' but not 'model.layers.1.self_attn.k_proj.weight'" in \
        _one_line(err)
    _edit_weights(path, lambda s: {**s, "model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 30)})
    with pytest.raises(ConfigError) as err:
        llama_from_hf(path)
    assert "whose shapes (32, 32), (16, 30), (16, 32) differ past the first dimension" in _one_line(err)
    _edit_weights(path, lambda s: {k: torch.zeros(16, 32) if "k_proj" in k else v for k, v in s.items()})
    _edit_weights(path, lambda s: {k: v.to(torch.int8) for k, v in s.items()})  # a quantised file, nothing floating
    with pytest.raises(ConfigError) as err:
        llama_from_hf(path)
    assert "holds no floating-point tensor (torch.int8 and the like); give float32" in _one_line(err)


# ---- 4: a tensor of another kind is refused, a floating-point one of another precision loaded --------------------
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.uint8])
def test_an_integer_or_boolean_tensor_for_a_floating_point_parameter_is_refused_not_cast(dtype, hf_dir, tmp_path):
    path = _changed(hf_dir, tmp_path, {})
    key = "model.layers.1.mlp.up_proj.weight"
    _edit_weights(path, lambda s: {**s, key: s[key].round().to(dtype)})
    for load in (llama_from_hf,
                 lambda p: attnlab.build_model("llama_tiny", pretrained_file=str(p), **_tiny_geometry())):
        with pytest.raises(ConfigError) as err:
            load(path)
        text = _one_line(err)
        assert f"holds 'blocks.1.mlp.up_proj.weight' as {dtype} where llama" in text, text
        assert " has a floating-point torch.float32 tensor; give floating-point weights (float32, float16" in text
    # attnlab's own state dict, through the preset's strict loader
    model = attnlab.build_model("gpt_tiny", depth=1)
    state = {k: (v.to(dtype) if k == "blocks.0.mlp.fc1.weight" else v) for k, v in model.state_dict().items()}
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "own.safetensors"))
    with pytest.raises(ConfigError, match=f"holds 'blocks.0.mlp.fc1.weight' as {dtype} where gpt_tiny has a "
                                          f"floating-point torch.float32 tensor"):
        attnlab.build_model("gpt_tiny", depth=1, pretrained_file=str(tmp_path / "own.safetensors"))


def _tiny_geometry() -> dict:
    return dict(vocab_size=50, block_size=64, embed_dim=32, depth=2, num_heads=4, num_kv_heads=2, mlp_hidden=48,
                rope_theta=777.0, norm_eps=1e-6, tie_embeddings=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_floating_point_tensor_of_another_precision_loads_rounded_to_the_models(dtype, hf_dir, tmp_path):
    path = _changed(hf_dir, tmp_path, {})
    key = "model.layers.1.mlp.up_proj.weight"
    _edit_weights(path, lambda s: {**s, key: s[key].to(dtype)})
    from safetensors.torch import load_file

    want = load_file(str(path / "model.safetensors"))[key].float()
    model = attnlab.build_model("llama_tiny", pretrained_file=str(path), **_tiny_geometry())
    assert model.blocks[1].mlp.up_proj.weight.dtype == torch.float32
    assert torch.equal(model.blocks[1].mlp.up_proj.weight.detach(), want)


# ---- 5: the remedies can be followed --------------------------------------------------------------------------------
def test_a_checkpoint_of_theta_0_is_refused_at_load_naming_a_right_theta(hf_dir, tmp_path):
    path = _changed(hf_dir, tmp_path, {"rope_theta": 0.0, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 0.0}})
    with pytest.raises(ConfigError) as err:
        attnlab.build_model("llama_tiny", pretrained_file=str(path))
    text = _one_line(err)
    assert "rope_parameters.rope_theta is 0.0" in text and "give one such as 10000.0" in text
    assert "rope_theta=0.0" not in text


def test_a_vocabulary_that_disagrees_says_so_and_names_what_fits(tmp_path):
    export_hf(attnlab.build_model("llama_tiny", depth=1), tmp_path / "ck")  # 256 token embeddings
    with pytest.raises(ConfigError) as err:
        attnlab.build_model("llama_tiny", depth=1, vocab_size=300, pretrained_file=str(tmp_path / "ck"))
    text = _one_line(err)
    assert "embeds 256 tokens (its vocab_size) but the model has 300" in text and "the two disagree" in text
    assert "no embedding for ids 256..299, so give data (a tokenizer) of at most 256 tokens" in text
    with pytest.raises(ConfigError) as err:
        attnlab.build_model("llama_tiny", depth=1, vocab_size=200, pretrained_file=str(tmp_path / "ck"))
    assert "build it with vocab_size=256" in _one_line(err)
    # the remedy, followed, loads
    assert attnlab.build_model("llama_tiny", depth=1, vocab_size=256, pretrained_file=str(tmp_path / "ck"))


# ---- issue 46 item 5: Llama and GPT share a base; Llama builds through its own __init__ ----------------------------
def test_llama_and_gpt_are_two_decoders_of_one_base_with_their_state_dict_names():
    from attnlab.models.gpt import DecoderLM, generate

    assert issubclass(Llama, DecoderLM) and issubclass(GPT, DecoderLM) and not issubclass(Llama, GPT)
    model = attnlab.build_model("llama_tiny", depth=1)
    assert not hasattr(model, "wpe") and not hasattr(model, "drop")  # nothing of GPT-2's built
    assert list(model.state_dict())[:4] == ["wte.weight", "blocks.0.norm1.weight", "blocks.0.attn.qkv.weight",
                                            "blocks.0.attn.proj.weight"]
    assert generate(model, [1, 2], 3, temperature=0).shape == (1, 5)
