"""Hugging Face ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` weights in and out of attnlab's
:class:`~attnlab.models.llama.Llama`, through one loader that dispatches on ``config.json``'s ``model_type``.

A checkpoint is a directory as ``save_pretrained`` writes it (``config.json`` and ``model.safetensors``), or the
safetensors file with its ``config.json`` beside it. Names map one to one (q, k, v projections fused into ``qkv`` in
that order; Qwen3's ``q_norm`` / ``k_norm`` are attnlab's per-head QK-norm); grouped keys, rope theta, tied
embeddings, Qwen2's q/k/v biases and any ``attention_bias`` come from the config. What attnlab's model does not
compute (rope scaling, sliding windows, an activation other than SiLU, MLP biases) is refused in one line.
:func:`export_hf` writes a model with ``standard`` attention (Llama or Qwen2 layout) or with QK-norm (Qwen3
layout) back, so that ``transformers`` loads it.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..attention.standard import StandardAttention
from ..errors import ConfigError, did_you_mean
from .llama import Llama, default_mlp_hidden, llama_geometry
from .options import flag, is_int, refuse
from .pretrained import load_strict, open_safetensors, read_state_dict, safetensors_header

MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: per layer: Hugging Face's name -> attnlab's (the q, k, v projections are fused apart)
_LAYER = {"input_layernorm.weight": "norm1.weight", "post_attention_layernorm.weight": "norm2.weight",
          "self_attn.o_proj.weight": "attn.proj.weight", "self_attn.o_proj.bias": "attn.proj.bias",
          "self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight",
          **{f"mlp.{n}.weight": f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}}


def checkpoint_files(path: str | Path) -> tuple[Path, Path]:
    """(config.json, weights file) of a checkpoint directory or of a safetensors file with its config beside it."""
    path = Path(path)
    weights = path / "model.safetensors" if path.is_dir() else path
    config = weights.parent / "config.json"
    for file, what in ((config, "config.json"), (weights, "model.safetensors")):
        if not file.is_file():
            raise ConfigError(f"{path} has no {what}; give a directory written by save_pretrained (config.json and "
                              f"one model.safetensors; sharded checkpoints are not read).")
    return config, weights


def read_config(path: str | Path) -> dict:
    config_file, _ = checkpoint_files(path)
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{config_file} is not readable JSON ({err}); give the config.json save_pretrained wrote.")
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file} holds no JSON object; give the config.json save_pretrained wrote.")
    return config


#: attnlab's option -> the config.json key it comes from (attention_bias: qkv_bias and, but for Qwen2, proj_bias)
_NAMES = dict(vocab_size="vocab_size", block_size="max_position_embeddings", embed_dim="hidden_size",
              depth="num_hidden_layers", num_heads="num_attention_heads", num_kv_heads="num_key_value_heads",
              head_dim="head_dim", mlp_hidden="intermediate_size", rope_theta="rope_theta", norm_eps="rms_norm_eps",
              tie_embeddings="tie_word_embeddings", qkv_bias="attention_bias", proj_bias="attention_bias")


def weight_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of the checkpoint's tensors, read from the safetensors header alone ({} where it cannot be read:
    reading the weights reports that)."""
    try:
        with open_safetensors(checkpoint_files(path)[1]) as f:
            return {k: shape for k, (_, shape) in safetensors_header(f).items()}
    except Exception:  # noqa: BLE001 - read_state_dict names what is wrong with the file
        return {}


def _hints(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """The sizes the weights show (attnlab's keys), to name as the right values of a config that lacks them."""
    hints = {}
    embed = shapes.get("model.embed_tokens.weight")
    if embed is not None and len(embed) == 2:
        hints.update(vocab_size=embed[0], embed_dim=embed[1])
    up = shapes.get("model.layers.0.mlp.up_proj.weight")
    if up is not None and len(up) == 2:
        hints["mlp_hidden"] = up[0]
    layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if layers:
        hints["depth"] = max(layers) + 1
    return hints


def hf_geometry(config: Mapping, source: str, shapes: Mapping[str, tuple[int, ...]] | None = None,
                owner: str | None = None) -> dict:
    """:class:`Llama`'s keyword arguments for a Hugging Face config, every value checked (by
    :func:`~attnlab.models.llama.llama_geometry`, under the config's own key names): ConfigError (one line) for
    what does not fit, naming the key, its value and a right one (``shapes``: the weights' shapes, which show the
    right sizes). ``owner``: how the sentence names the config (default ``source``'s config.json)."""
    owner = owner or f"{source}'s config.json"
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(f"{source} is a {kind!r} model; attnlab reads model_type {', '.join(MODEL_TYPES)}.")
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key) is not None and not isinstance(config[key], Mapping):
            raise refuse(owner, key, config[key], "a JSON object", 'one such as {"rope_type": "default"}, or null')
    # transformers 5 keeps the rotary settings in rope_parameters, older releases in rope_theta / rope_scaling
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    for key in ("use_sliding_window", "mlp_bias", "attention_bias", "tie_word_embeddings"):
        if config.get(key) is not None:
            flag(owner, key, config[key])
    layer_types = config.get("layer_types") or []
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise refuse(owner, "layer_types", config.get("layer_types"), "a list of layer kinds",
                     'a list of "full_attention", one per layer, or null')
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    for failed, why in (
            (rope_type != "default",
             f"uses {rope_type!r} rope scaling, which attnlab's rotary positions do not compute"),
            (config.get("hidden_act", "silu") != "silu",
             f"uses hidden_act {config.get('hidden_act')!r}, not SwiGLU's silu"),
            (config.get("mlp_bias") is True, "has MLP biases, which attnlab's SwiGLU does not hold"),
            (config.get("use_sliding_window") is True or any(t != "full_attention" for t in layer_types),
             "uses sliding-window attention, which attnlab's model does not")):
        if failed:
            raise ConfigError(f"{source} {why}; give a model without it.")
    hints = _hints(shapes or {})
    if is_int(config.get("hidden_size")) and config["hidden_size"] > 0:  # a config.json states intermediate_size
        hints.setdefault("mlp_hidden", default_mlp_hidden(config["hidden_size"]))
    for key in ("vocab_size", "embed_dim", "depth", "num_heads", "mlp_hidden"):
        if config.get(_NAMES[key]) is None:
            raise ConfigError(f"{owner} has no {_NAMES[key]}; give it as a positive integer"
                              + (f" ({hints[key]}, as the weights show)" if key in hints else "")
                              + ", as save_pretrained writes it.")
    theta_key = next((f"{outer}.rope_theta" for outer in ("rope_parameters", "rope_scaling")
                      if "rope_theta" in (config.get(outer) or {})), "rope_theta")
    attention_bias = config.get("attention_bias") is True

    def given(key: str, default: object) -> object:
        return default if config.get(key) is None else config[key]

    values = dict(vocab_size=config["vocab_size"], block_size=given("max_position_embeddings", 2048),
                  embed_dim=config["hidden_size"], depth=config["num_hidden_layers"],
                  num_heads=config["num_attention_heads"], num_kv_heads=config.get("num_key_value_heads"),
                  head_dim=config.get("head_dim"), mlp_hidden=config["intermediate_size"],
                  rope_theta=rope.get("rope_theta", given("rope_theta", 10000.0)),
                  norm_eps=given("rms_norm_eps", 1e-6), qkv_bias=kind == "qwen2" or attention_bias,
                  proj_bias=kind != "qwen2" and attention_bias, qk_norm=kind == "qwen3",
                  tie_embeddings=given("tie_word_embeddings", False))
    return llama_geometry(values, owner, {**_NAMES, "rope_theta": theta_key}, hints, unset="leave it out")


def to_attnlab(state: Mapping[str, torch.Tensor], geometry: dict, source: str) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict under attnlab's names (q, k, v fused into ``qkv``)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        key = key.removeprefix("model.")
        if key in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            if key == "lm_head.weight" and geometry["tie_embeddings"]:
                continue  # the embedding itself
            out[{"embed_tokens.weight": "wte.weight"}.get(key, key)] = tensor
        elif key.startswith("layers.") and key.count(".") >= 2:
            _, index, rest = key.split(".", 2)
            if rest.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")):
                continue
            if rest not in _LAYER:
                raise ConfigError(f"{source} holds {key!r}, which attnlab's Llama has no place for; give a model "
                                  f"of model_type llama, qwen2 or qwen3 as transformers writes it.")
            out[f"blocks.{index}.{_LAYER[rest]}"] = tensor
        elif key != "rotary_emb.inv_freq":
            raise ConfigError(f"{source} holds {key!r}, which attnlab's Llama has no place for.")
    for i in range(geometry["depth"]):
        for part in ("weight", "bias"):
            names = [f"model.layers.{i}.self_attn.{p}_proj.{part}" for p in "qkv"]
            have = [n for n in names if n in state]
            if have and len(have) < 3:
                raise ConfigError(f"{source} holds {have[0]!r} but not {next(n for n in names if n not in state)!r}; "
                                  f"give the q, k and v projections of every layer.")
            if have:
                parts = [state[n] for n in names]
                if len({t.shape[1:] for t in parts}) > 1:
                    raise ConfigError(f"{source} holds q, k, v projections of layer {i} whose shapes "
                                      f"{', '.join(str(tuple(t.shape)) for t in parts)} differ past the first "
                                      f"dimension; give weights of one geometry, as transformers writes them.")
                out[f"blocks.{i}.attn.qkv.{part}"] = torch.cat(parts)
    return out


def load_hf_decoder(model: nn.Module, path: str | Path) -> nn.Module:
    """Load Hugging Face Llama / Qwen2 / Qwen3 weights into ``model`` (a :class:`Llama` of the same geometry):
    what ``build_model("llama_tiny", pretrained_file=path, ...)`` uses. ConfigError naming the first difference."""
    source = f"Hugging Face checkpoint {path}"
    geometry = hf_geometry(read_config(path), source, weight_shapes(path), owner=str(checkpoint_files(path)[0]))
    if not isinstance(model, Llama):
        raise ConfigError(f"{source} holds Llama-shaped weights; load them into a Llama preset, not "
                          f"{type(model).__name__}.")
    ours = model.geometry
    if geometry["vocab_size"] != ours["vocab_size"]:  # in a run, the data's vocabulary sizes the model
        theirs, have = geometry["vocab_size"], ours["vocab_size"]
        fix = (f"build it with vocab_size={theirs} (in a run: --model-options '{{vocab_size: {theirs}}}'), which "
               f"takes every id below {have} too" if have < theirs else
               f"the checkpoint has no embedding for ids {theirs}..{have - 1}, so give data (a tokenizer) of at most "
               f"{theirs} tokens or a checkpoint of at least {have} (outside a run: build the model with "
               f"vocab_size={theirs})")
        raise ConfigError(f"{source} embeds {theirs} tokens (its vocab_size) but the model has {have} (in a run, "
                          f"the data's vocabulary, e.g. its tokenizer's): the two disagree; {fix}.")
    for key, value in geometry.items():
        if key != "block_size" and ours[key] != value:
            raise ConfigError(f"{source} has {key}={value} where the model has {ours[key]}; build it with "
                              f"{key}={value} (or use llama_from_hf).")
    return load_strict(model, to_attnlab(read_state_dict(checkpoint_files(path)[1]), geometry, source), source)


def llama_from_hf(path: str | Path, **overrides) -> Llama:
    """A :class:`Llama` of the checkpoint's own geometry, in its weights' dtype, with its weights (convert it
    afterwards for a variant). ``overrides``: :class:`Llama`'s keyword arguments to set apart from the config's."""
    source = f"Hugging Face checkpoint {path}"
    valid = inspect.signature(Llama).parameters
    unknown = next((key for key in overrides if key not in valid), None)
    if unknown is not None:
        raise ConfigError(f"{unknown!r} is not an argument of Llama{did_you_mean(unknown, valid)}; give one of "
                          f"{', '.join(valid)}.")
    geometry = hf_geometry(read_config(path), source, weight_shapes(path), owner=str(checkpoint_files(path)[0]))
    model = Llama(**{**geometry, **overrides})
    model.attnlab_model = "llama"
    state = read_state_dict(checkpoint_files(path)[1])
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    if dtype is None:
        raise ConfigError(f"{source} holds no floating-point tensor ({next(iter(state.values())).dtype} and the "
                          f"like); give float32, float16 or bfloat16 weights (dequantise a quantised checkpoint).")
    model.to(dtype)
    return load_strict(model, to_attnlab(state, geometry, source), source)


def export_hf(model: nn.Module, out_dir: str | Path) -> Path:
    """Write ``model`` (a :class:`Llama` with ``standard`` attention, QK-norm allowed) as a Hugging Face checkpoint
    directory: Qwen3's layout with QK-norm, Qwen2's with q/k/v biases alone, Llama's otherwise. The directory is
    written whole or not at all (a temporary one, then a rename); an existing ``out_dir`` is refused."""
    out_dir = Path(out_dir)
    if not isinstance(model, Llama):
        raise ConfigError(f"export_hf writes Llama-shaped models, not {type(model).__name__}.")
    attns = [block.attn for block in model.blocks]
    other = next((type(a).__name__ for a in attns if type(a) is not StandardAttention or a.heads()), None)
    if other:
        raise ConfigError(f"the Hugging Face layouts hold softmax attention (standard, or qknorm), not "
                          f"{getattr(model, 'attnlab_spec', other)!r}; export a standard or qknorm model, or fold "
                          f"its weight terms first (attnlab export).")
    if any(parametrize.is_parametrized(m) for m in model.modules()):
        raise ConfigError("the model reparametrises its weights (sigma, specnorm or speccond); fold them into plain "
                          "weights first (attnlab.reparam.fold), then export.")
    if out_dir.exists():
        raise ConfigError(f"{out_dir} exists; give a new directory for the checkpoint.")
    g = model.geometry
    qk_norm = not isinstance(attns[0].q_norm, nn.Identity)
    kind = "qwen3" if qk_norm else "qwen2" if g["qkv_bias"] and not g["proj_bias"] else "llama"
    # Llama's and Qwen3's attention_bias biases q, k, v and o alike; Qwen2 biases q, k, v only: no layout has o alone
    if kind != "qwen2" and g["qkv_bias"] != g["proj_bias"]:
        raise ConfigError(f"the {MODEL_TYPES[kind]} layout biases q, k, v and the output projection alike (or none); "
                          f"this model has qkv_bias={g['qkv_bias']} and proj_bias={g['proj_bias']}, so build it with "
                          f"both or neither.")
    config = {"architectures": [MODEL_TYPES[kind]], "model_type": kind, "vocab_size": g["vocab_size"],
              "hidden_size": g["embed_dim"], "intermediate_size": g["mlp_hidden"], "num_hidden_layers": g["depth"],
              "num_attention_heads": g["num_heads"], "num_key_value_heads": g["num_kv_heads"],
              "head_dim": g["head_dim"], "hidden_act": "silu", "max_position_embeddings": g["block_size"],
              "rms_norm_eps": g["norm_eps"], "rope_theta": g["rope_theta"], "tie_word_embeddings": g["tie_embeddings"],
              "rope_parameters": {"rope_theta": g["rope_theta"], "rope_type": "default"},
              "torch_dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    if kind != "qwen2":
        config["attention_bias"] = g["qkv_bias"]
    state = {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        if key.startswith("blocks."):
            _, index, rest = key.split(".", 2)
            if rest.startswith("attn.qkv."):
                part = rest.rsplit(".", 1)[1]
                for name, piece in zip("qkv", tensor.split(attns[0].qkv_widths())):
                    state[f"model.layers.{index}.self_attn.{name}_proj.{part}"] = piece.contiguous()
                continue
            hf = {v: k for k, v in _LAYER.items()}[rest]
            state[f"model.layers.{index}.{hf}"] = tensor
        else:
            state[{"wte.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(key, key)] = tensor
    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.replace(tmp, out_dir)
    except BaseException:
        for file in tmp.iterdir():
            file.unlink()
        tmp.rmdir()
        raise
    return out_dir


__all__ = ["MODEL_TYPES", "checkpoint_files", "export_hf", "hf_geometry", "llama_from_hf", "load_hf_decoder", "read_config",
           "to_attnlab"]
