"""GPT-2-shaped weights from elsewhere, loaded by meaning into :class:`attnlab.models.gpt.GPT`: checkpoints written
by nanoGPT's ``train.py`` and Hugging Face GPT-2 state dicts.

Both name the same modules the same way; ``_NAMES`` maps them to attnlab's, which are timm's (so that ``convert``
and every spec term see the attention modules they know); ``lm_head.weight`` must equal ``wte.weight`` (tied).
nanoGPT's ``model_args`` are checked against the model (the head count cannot be read from the shapes); Hugging
Face's ``Conv1D`` weights are transposed, and its GELU is ``gelu="tanh"``. docs/methods.md (Weights from nanoGPT and
Hugging Face) has the rest. Load before converting to a variant with other shapes (``dna``'s wider projection), or
let ``build_model(name, attn="dna(init=copy)", pretrained_file=path)`` do both in that order.
"""

from __future__ import annotations

import inspect
import json
import pickle
import re
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from ..errors import ConfigError, did_you_mean
from .gpt import GPT, gpt_options
from .options import positive_int
from .pretrained import load_strict, read_state_dict

#: (source name, attnlab name) with {i} a block index and {p} weight or bias
_NAMES = (
    ("wte.weight", "wte.weight"),
    ("wpe.weight", "wpe.weight"),
    ("h.{i}.ln_1.{p}", "blocks.{i}.norm1.{p}"),
    ("h.{i}.attn.c_attn.{p}", "blocks.{i}.attn.qkv.{p}"),
    ("h.{i}.attn.c_proj.{p}", "blocks.{i}.attn.proj.{p}"),
    ("h.{i}.ln_2.{p}", "blocks.{i}.norm2.{p}"),
    ("h.{i}.mlp.c_fc.{p}", "blocks.{i}.mlp.fc1.{p}"),
    ("h.{i}.mlp.c_proj.{p}", "blocks.{i}.mlp.fc2.{p}"),
    ("ln_f.{p}", "norm.{p}"),
)
_CONV1D = re.compile(r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
_BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")  # causal masks stored as buffers, not weights
_PREFIXES = ("_orig_mod.", "module.")


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
                      + "$")


_FORWARD = [(_pattern(src), dst) for src, dst in _NAMES]
_BACKWARD = [(_pattern(dst), src) for src, dst in _NAMES]


def _rename(key: str, table) -> str | None:
    for pattern, template in table:
        m = pattern.match(key)
        if m:
            return template.format(**m.groupdict())
    return None


def _strip_wrappers(key: str) -> str:
    """The key without torch.compile's (``_orig_mod.``) and DDP's (``module.``) prefixes."""
    for prefix in _PREFIXES:
        while key.startswith(prefix):
            key = key[len(prefix):]
    return key


def _strip(key: str) -> str:
    """The key without wrappers and without GPT-2's ``transformer.`` container."""
    return _strip_wrappers(key).removeprefix("transformer.")


def _convert(state_dict: Mapping[str, torch.Tensor], layout: str, source: str
             ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state_dict`` of ``layout`` (``nanogpt`` or ``hf``) in attnlab's names (``_NAMES``), and the source
    key of each."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    head = None
    for key, tensor in state_dict.items():
        name = _strip(str(key))
        if _BUFFERS.match(name):
            continue
        if name == "lm_head.weight":
            head = tensor
            continue
        new = _rename(name, _FORWARD)
        if new is None:
            raise ConfigError(f"{source} holds {key!r}, which is no part of GPT-2's layout; give a state dict of a "
                              f"GPT-2-shaped model.")
        if layout == "hf" and _CONV1D.match(name):
            tensor = tensor.t()  # Conv1D keeps (in, out); a Linear keeps (out, in)
        out[new], origin[new] = tensor, str(key)
    if head is not None and "wte.weight" in out and not (
            head.shape == out["wte.weight"].shape and torch.equal(head, out["wte.weight"])):
        raise ConfigError(f"{source} has an lm_head different from the token embedding wte; attnlab's GPT ties the "
                          f"two, so give weights of a tied model.")
    if head is not None and "wte.weight" not in out:
        out["wte.weight"], origin["wte.weight"] = head, "lm_head.weight"
    return out, origin


def _check_geometry(model: nn.Module, args: Mapping, source: str) -> None:
    """ConfigError when a checkpoint's recorded geometry disagrees with ``model`` (head count above all: the
    weights' shapes cannot show it)."""
    if not isinstance(model, GPT):
        raise ConfigError(f"{source} holds GPT weights; load them into a GPT (build_model('gpt2_small', ...)), not "
                          f"{type(model).__name__}.")
    own = {"n_head": ("num_heads", model.blocks[0].attn.num_heads), "n_layer": ("depth", len(model.blocks)),
           "n_embd": ("embed_dim", model.embed_dim), "block_size": ("block_size", model.block_size),
           "vocab_size": ("vocab_size", model.vocab_size)}
    for key, (option, value) in own.items():
        theirs = args.get(key)
        if theirs is not None and positive_int(f"the geometry recorded with {source}", key, theirs, value) != value:
            raise ConfigError(f"the model recorded with {source} has {key}={theirs} where this one has {value}; "
                              f"build it with {option}={theirs}.")


def _load(model: nn.Module, converted: tuple[dict[str, torch.Tensor], dict[str, str]], source: str) -> nn.Module:
    """Load ``converted`` (attnlab names) strictly, naming the source's own key in every mismatch: shapes first
    (the telling mismatch of a converted model), then what is missing."""
    converted, origin = converted
    own = model.state_dict()
    convert_first = ("load into the model before converting it (build_model(..., attn=SPEC, pretrained_file=PATH) "
                     "does both in that order)")
    for name, tensor in own.items():
        if name in converted and tuple(converted[name].shape) != tuple(tensor.shape):
            hint = convert_first if name.endswith("attn.qkv.weight") else "build the model with the weights' geometry"
            raise ConfigError(f"{source} holds {origin[name]!r} of shape "
                              f"{tuple(converted[name].shape)} where the model has {tuple(tensor.shape)}; {hint}.")
    for name in own:
        if name not in converted:
            theirs = _rename(name, _BACKWARD)
            if theirs is None:
                raise ConfigError(f"the model has {name!r}, which GPT-2 weights do not hold (a variant's own "
                                  f"parameter); {convert_first}.")
            raise ConfigError(f"{source} lacks GPT-2's {theirs!r} that the model needs for {name!r}; give weights of the "
                              f"same geometry and bias setting.")
    return load_strict(model, converted, source)


def load_nanogpt(model: nn.Module, state_dict: Mapping, *, source: str = "the nanoGPT checkpoint") -> nn.Module:
    """Load a nanoGPT ``train.py`` checkpoint into ``model`` (a :class:`~attnlab.models.gpt.GPT`) and return it;
    ``state_dict`` is the checkpoint dict (its ``model`` entry read, its ``model_args`` checked) or that entry."""
    args = state_dict.get("model_args") if isinstance(state_dict.get("model_args"), Mapping) else {}
    if isinstance(state_dict.get("model"), Mapping):
        state_dict = state_dict["model"]
    _check_geometry(model, args, source)
    return _load(model, _convert(state_dict, "nanogpt", source), source)


#: Hugging Face GPT-2 activations by the GELU attnlab computes for them (both tanh names are one formula)
_HF_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}
#: GPT2Config entries that change the forward, with the value attnlab's GPT computes (docs/methods.md)
_HF_FIXED = (("scale_attn_weights", True, "logits scaled by 1/sqrt(head_dim)"),
             ("scale_attn_by_inverse_layer_idx", False, "no extra 1/(layer + 1) on the logits"),
             ("layer_norm_epsilon", 1e-5, "LayerNorm eps 1e-5"))


def _check_hf_config(model: nn.Module, config: Mapping, source: str) -> None:
    """ConfigError when a GPT2Config asks for a forward that ``model`` does not compute."""
    for key, value, what in _HF_FIXED:
        if key in config and config[key] != value:
            raise ConfigError(f"{source} come with {key}={config[key]!r}, but attnlab's GPT computes {what} "
                              f"({key}={value!r}); these weights would give other logits here.")
    act = config.get("activation_function", "gelu_new")
    if not isinstance(act, str) or act not in _HF_GELU:
        raise ConfigError(f"{source} come with activation_function={act!r}; attnlab's GPT computes GELU exactly or "
                          f"by its tanh approximation (gelu, gelu_new, gelu_pytorch_tanh).")
    have = "tanh" if model.blocks[0].mlp.act.approximate == "tanh" else "exact"
    if have != _HF_GELU[act]:
        raise ConfigError(f"{source} use activation_function={act!r} but the model was built with gelu={have!r}; "
                          f"build it with gelu={_HF_GELU[act]!r}.")


def load_gpt2_hf(model: nn.Module, state_dict: Mapping[str, torch.Tensor], config: Mapping | None = None, *,
                 source: str = "the Hugging Face GPT-2 weights") -> nn.Module:
    """Load a Hugging Face GPT-2 state dict (``GPT2LMHeadModel`` or ``GPT2Model`` keys, Conv1D weights) into
    ``model`` and return it; ``config`` (its ``config.json`` as a dict) is checked against the model's geometry
    and against the forward it computes (activation, logit scaling, LayerNorm eps)."""
    _check_geometry(model, dict(config or {}, block_size=(config or {}).get("n_positions")), source)
    if config:
        _check_hf_config(model, config, source)
    return _load(model, _convert(state_dict, "hf", source), source)


def gpt_layout(state_dict: Mapping[str, torch.Tensor]) -> str:
    """``nanogpt``, ``hf`` (by the orientation of the first fused q/k/v weight) or ``attnlab`` (anything else)."""
    for key, tensor in state_dict.items():
        name = _strip(str(key))
        if name.endswith(".attn.c_attn.weight") and tensor.dim() == 2:
            return "hf" if tensor.shape[1] == 3 * tensor.shape[0] else "nanogpt"
    return "attnlab"


def _nanogpt_args(path: Path) -> dict:
    """``model_args`` of a nanoGPT checkpoint file (memory-mapped, weights only), or {} where there are none."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, ValueError, OSError, EOFError, pickle.UnpicklingError):  # legacy format: args optional
        return {}
    args = obj.get("model_args") if isinstance(obj, Mapping) else None
    return dict(args) if isinstance(args, Mapping) else {}


def _hf_config(path: Path) -> dict:
    """The ``config.json`` next to a Hugging Face weights file, or {}."""
    config = path.parent / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_gpt_file(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a weights file into a GPT by its layout (safetensors or a weights-only torch file, never run as code):
    a nanoGPT checkpoint, Hugging Face GPT-2 weights (``config.json`` beside them is checked when present), or
    attnlab's own state dict (strict). What ``build_model("gpt2_small", pretrained_file=path)`` and the CLI's
    ``--pretrained-file`` use."""
    path = Path(path)
    state = read_state_dict(path)
    layout = gpt_layout(state)
    if layout == "nanogpt":
        args = {} if path.suffix == ".safetensors" else _nanogpt_args(path)
        return load_nanogpt(model, {"model": state, "model_args": args}, source=f"nanoGPT checkpoint {path}")
    if layout == "hf":
        return load_gpt2_hf(model, state, _hf_config(path), source=f"Hugging Face GPT-2 weights {path}")
    return load_strict(model, {_strip_wrappers(k): v for k, v in state.items()}, f"pretrained file {path}")


#: GPT's option -> nanoGPT's model_args key and Hugging Face GPT-2's config.json key
_ARGS = {"vocab_size": ("vocab_size", "vocab_size"), "block_size": ("block_size", "n_positions"),
         "embed_dim": ("n_embd", "n_embd"), "depth": ("n_layer", "n_layer"), "num_heads": ("n_head", "n_head")}


def gpt_from_file(path: str | Path, **overrides) -> GPT:
    """A :class:`GPT` of the file's own geometry with its weights, from nanoGPT's checkpoint (``model_args``) or
    Hugging Face GPT-2 weights with their ``config.json`` beside them (its ``gelu_new`` read as ``gelu="tanh"``);
    ``overrides`` go to the constructor (``drop_rate=0.1``). Convert it afterwards for a variant. For attnlab's own
    files, which do not record the head count, use ``build_model(preset, pretrained_file=path)``. The recorded
    geometry is checked by :func:`~attnlab.models.gpt.gpt_options` under the file's own key names."""
    path = Path(path)
    valid = inspect.signature(GPT).parameters
    unknown = next((key for key in overrides if key not in valid), None)
    if unknown is not None:
        raise ConfigError(f"{unknown!r} is not an argument of GPT{did_you_mean(unknown, valid)}; give one of "
                          f"{', '.join(valid)}.")
    state = read_state_dict(path)
    layout = gpt_layout(state)
    if layout == "nanogpt":
        args = {} if path.suffix == ".safetensors" else _nanogpt_args(path)
        if "n_head" not in args:
            raise ConfigError(f"{path} records no model_args (n_head); build the model with build_model(preset, "
                              f"num_heads=..., pretrained_file=...).")
        owner, names = f"{path}'s model_args", {k: v[0] for k, v in _ARGS.items()}
        missing = next((v for v in names.values() if args.get(v) is None), None)
        if missing:
            raise ConfigError(f"{owner} record no {missing}; give a checkpoint written by nanoGPT's train.py, or "
                              f"build the model with build_model(preset, pretrained_file=...).")
        geo = {key: args[name] for key, name in names.items()}
        geo["bias"] = args.get("bias", True)
    elif layout == "hf":
        config = _hf_config(path)
        if "n_head" not in config:
            raise ConfigError(f"Hugging Face GPT-2 weights {path} come without a config.json beside them (the head "
                              f"count); put it there, or build the model with build_model(preset, num_heads=...).")
        owner, names = f"{path.parent / 'config.json'}", {k: v[1] for k, v in _ARGS.items()}
        wte = next(v for k, v in state.items() if _strip(str(k)) == "wte.weight")
        act = config.get("activation_function", "gelu_new")
        geo = dict(vocab_size=config.get("vocab_size", wte.shape[0]), block_size=config.get("n_positions", 1024),
                   embed_dim=config.get("n_embd", wte.shape[1]), depth=config.get("n_layer", 12),
                   num_heads=config["n_head"], bias=True,
                   gelu=_HF_GELU.get(act, "exact") if isinstance(act, str) else "exact")
    else:
        raise ConfigError(f"{path} is neither a nanoGPT checkpoint nor Hugging Face GPT-2 weights; for attnlab's own "
                          f"weights use build_model(preset, pretrained_file=...).")
    defaults = {k: v.default for k, v in valid.items()}
    gpt_options({**defaults, **geo}, owner, {**names, "bias": "bias"})  # the file's values, under its key names
    return load_gpt_file(GPT(**{**geo, **overrides}), path)


__all__ = ["gpt_from_file", "gpt_layout", "load_gpt2_hf", "load_gpt_file", "load_nanogpt"]
