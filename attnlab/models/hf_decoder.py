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

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..attention.standard import StandardAttention
from ..errors import ConfigError
from .llama import Llama
from .pretrained import load_strict, read_state_dict

MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
#: the geometry a config must state (everything else has Hugging Face's default)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: per layer: Hugging Face's name -> attnlab's (the q, k, v projections are fused apart)
_LAYER = {"input_layernorm.weight": "norm1.weight", "post_attention_layernorm.weight": "norm2.weight",
          "self_attn.o_proj.weight": "attn.proj.weight", "self_attn.o_proj.bias": "attn.proj.bias",
          "self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight",
          **{f"mlp.{n}.weight": f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}}


def _files(path: str | Path) -> tuple[Path, Path]:
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
    config_file, _ = _files(path)
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{config_file} is not readable JSON ({err}); give the config.json save_pretrained wrote.")
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file} holds no JSON object; give the config.json save_pretrained wrote.")
    return config


def hf_geometry(config: Mapping, source: str) -> dict:
    """:class:`Llama`'s keyword arguments for a Hugging Face config; ConfigError (one line) for what does not fit."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(f"{source} is a {kind!r} model; attnlab reads model_type {', '.join(MODEL_TYPES)}.")
    # transformers 5 keeps the rotary settings in rope_parameters, older releases in rope_theta / rope_scaling
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    for failed, why in (
            (rope.get("rope_type", rope.get("type", "default")) != "default",
             f"uses {rope.get('rope_type', rope.get('type'))!r} rope scaling, which attnlab's rotary positions do not "
             f"compute"),
            (config.get("hidden_act", "silu") != "silu", f"uses hidden_act {config.get('hidden_act')!r}, not SwiGLU's silu"),
            (bool(config.get("mlp_bias")), "has MLP biases, which attnlab's SwiGLU does not hold"),
            (bool(config.get("use_sliding_window"))
             or any(layer != "full_attention" for layer in config.get("layer_types") or ()),
             "uses sliding-window attention, which attnlab's model does not")):
        if failed:
            raise ConfigError(f"{source} {why}; give a model without it.")
    missing = [k for k in _REQUIRED if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)]
    if missing:
        raise ConfigError(f"{source}'s config.json has no integer {', '.join(missing)}; give the config.json "
                          f"save_pretrained wrote.")
    heads = config["num_attention_heads"]
    attention_bias = bool(config.get("attention_bias", False))
    return dict(vocab_size=config["vocab_size"], block_size=config.get("max_position_embeddings", 2048),
                embed_dim=config["hidden_size"], depth=config["num_hidden_layers"], num_heads=heads,
                num_kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                mlp_hidden=config["intermediate_size"], rope_theta=theta,
                norm_eps=float(config.get("rms_norm_eps", 1e-6)), qkv_bias=kind == "qwen2" or attention_bias,
                proj_bias=kind != "qwen2" and attention_bias, qk_norm=kind == "qwen3",
                tie_embeddings=bool(config.get("tie_word_embeddings", False)))


def to_attnlab(state: Mapping[str, torch.Tensor], geometry: dict, source: str) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict under attnlab's names (q, k, v fused into ``qkv``)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        key = key.removeprefix("model.")
        if key in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            if key == "lm_head.weight" and geometry["tie_embeddings"]:
                continue  # the embedding itself
            out[{"embed_tokens.weight": "wte.weight"}.get(key, key)] = tensor
        elif key.startswith("layers."):
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
            if all(n in state for n in names):
                out[f"blocks.{i}.attn.qkv.{part}"] = torch.cat([state[n] for n in names])
    return out


def load_hf_decoder(model: nn.Module, path: str | Path) -> nn.Module:
    """Load Hugging Face Llama / Qwen2 / Qwen3 weights into ``model`` (a :class:`Llama` of the same geometry):
    what ``build_model("llama_tiny", pretrained_file=path, ...)`` uses. ConfigError naming the first difference."""
    source = f"Hugging Face checkpoint {path}"
    geometry = hf_geometry(read_config(path), source)
    if not isinstance(model, Llama):
        raise ConfigError(f"{source} holds Llama-shaped weights; load them into a Llama preset, not "
                          f"{type(model).__name__}.")
    for key, value in geometry.items():
        if key != "block_size" and model.geometry[key] != value:
            raise ConfigError(f"{source} has {key}={value} where the model has {model.geometry[key]}; build it with "
                              f"{key}={value} (or use llama_from_hf).")
    return load_strict(model, to_attnlab(read_state_dict(_files(path)[1]), geometry, source), source)


def llama_from_hf(path: str | Path, **overrides) -> Llama:
    """A :class:`Llama` of the checkpoint's own geometry, in its weights' dtype, with its weights (convert it
    afterwards for a variant)."""
    source = f"Hugging Face checkpoint {path}"
    geometry = hf_geometry(read_config(path), source)
    model = Llama(**{**geometry, **overrides})
    model.attnlab_model = "llama"
    state = read_state_dict(_files(path)[1])
    model.to(next(t.dtype for t in state.values() if t.is_floating_point()))
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


__all__ = ["MODEL_TYPES", "export_hf", "hf_geometry", "llama_from_hf", "load_hf_decoder", "read_config", "to_attnlab"]
