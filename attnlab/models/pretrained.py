"""Weights from elsewhere: timm's pretrained checkpoints (the hub cache, or a file the user brings) and the DnA
authors' state dicts ("DnA: Denoising Attention for Visual Tasks"), loaded by meaning into attnlab's modules.

Files are read without running code: safetensors, or ``torch.load(weights_only=True)`` (tensors and plain
containers only; a pickle that would construct anything else is refused). A safetensors header is checked before
any tensor is read: at most ``MAX_HEADER_BYTES``, and, given the model, the same names and shapes as its state
dict, so a file of a million tiny tensors or of another model costs nothing to refuse.

The DnA authors' three layouts (``forward``, ``legacy``, ``separate``) and ``sign`` are tabled in docs/methods.md
(Loading the DnA authors' checkpoints); attnlab's own DnA layout is one ``qkv`` with rows Q+, Q-, K, V+, V- and
``alpha`` (H,).
"""

from __future__ import annotations

import logging
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Mapping

import timm
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import ConfigError, ModelNotFoundError
from ..variants import VARIANTS

DNA_LAYOUTS = ("auto", "forward", "legacy", "separate")
_LEGACY_ORDER = ("q_pos", "k", "v_pos", "q_neg", "v_neg")
_CONTAINER_KEYS = ("state_dict", "model", "module", "state_dict_ema", "model_ema",
                   "model_state")  # model_state: the SlowFast / TimeSformer checkpoints
# A safetensors header lists every tensor in about 100 bytes: 16 MiB is ~150k tensors, where timm's largest models
# have a few thousand. safetensors itself parses up to 100 MB of header, which a hostile file fills with entries.
MAX_HEADER_BYTES = 16 * 2**20


def safetensors_header(f) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in ``f`` (an open ``safe_open`` file), read from its header."""
    return {k: (sl.get_dtype(), tuple(sl.get_shape())) for k in f.keys() for sl in (f.get_slice(k),)}


def open_safetensors(path: str | Path, device: str = "cpu"):
    """``safe_open(path)`` once the header's declared size is known to be at most ``MAX_HEADER_BYTES``;
    ValueError otherwise (a file too short to hold a header, or a header too large)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ValueError("too short for a safetensors header")
    size = int.from_bytes(head, "little")
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"a {size}-byte header, more than the {MAX_HEADER_BYTES >> 20} MiB attnlab reads")
    return safe_open(str(path), framework="pt", device=device)


def mismatch(own: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]], model: str) -> str | None:
    """How the shapes ``given`` (name -> shape) differ from ``model``'s own (its first missing, mismatching or
    unexpected key), or None when they are the same."""
    for name, shape in own.items():
        if name not in given:
            return f"lacks {name!r} that {model} needs"
        if tuple(given[name]) != tuple(shape):
            return f"holds {name!r} with shape {tuple(given[name])} where {model} has {tuple(shape)}"
    extra = next((k for k in given if k not in own), None)
    return None if extra is None else f"holds {extra!r}, which {model} does not have"


def shapes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state_dict.items()}


def read_state_dict(path: str | Path, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file or a weights-only torch file (a bare state dict, or one under
    ``state_dict`` / ``model`` / ``module`` / ``model_state``), on the CPU; ConfigError for a missing, damaged or hostile file.
    ``model``: a safetensors file must hold its state dict's names and shapes, checked from the header before
    any tensor is read (ConfigError as :func:`load_strict` words it)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"pretrained file {path} does not exist; give a .safetensors or a weights-only torch file.")
    with path.open("rb") as f:
        head = f.read(8)
    try:
        if path.suffix == ".safetensors" or not (zipfile.is_zipfile(path) or head[:1] == b"\x80"):
            with open_safetensors(path) as f:
                if model is not None:
                    header = {re.sub(r"^module\.", "", k): shape for k, (_, shape) in safetensors_header(f).items()}
                    why = mismatch(shapes(model.state_dict()), header, _model_name(model))
                    if why:
                        raise ConfigError(f"pretrained file {path} {why}; give weights of the same architecture.")
                state = {k: f.get_tensor(k) for k in f.keys()}
        else:  # torch.save's zip archive, or its legacy pickle format
            state = torch.load(path, map_location="cpu", weights_only=True)
    except ConfigError:  # the header does not fit the model
        raise
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError,
            AttributeError, TypeError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"pretrained file {path} cannot be read as safetensors or a weights-only torch file "
                          f"({why[:120]}); give a state dict saved with safetensors or torch.save.") from None
    if isinstance(state, Mapping):  # the first container key that holds a mapping
        state = next((state[key] for key in _CONTAINER_KEYS if isinstance(state.get(key), Mapping)), state)
    if not isinstance(state, Mapping) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"pretrained file {path} holds no state dict of tensors; give a file written from "
                          f"model.state_dict().")
    return {re.sub(r"^module\.", "", str(k)): v for k, v in state.items()}


def kind_mismatch(own: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], model: str) -> str | None:
    """How the dtypes ``given`` differ in kind from ``model``'s own tensors, or None: a floating-point parameter
    takes a floating-point tensor of any precision (Hugging Face checkpoints are commonly bfloat16 or float16; the
    copy rounds them to the model's dtype), an integer or boolean buffer a tensor of neither floating nor complex
    kind. An integer (quantised) or boolean tensor would be cast to floats silently, a complex one lose its
    imaginary part: both are refused."""
    for name, tensor in own.items():
        theirs = given.get(name)
        if theirs is None:
            continue
        if tensor.is_floating_point() and not theirs.is_floating_point():
            return (f"holds {name!r} as {theirs.dtype} where {model} has a floating-point {tensor.dtype} tensor; give "
                    f"floating-point weights (float32, float16 or bfloat16; dequantise a quantised checkpoint)")
        if not tensor.is_floating_point() and not tensor.is_complex() and (theirs.is_floating_point()
                                                                            or theirs.is_complex()):
            return (f"holds {name!r} as {theirs.dtype} where {model} has a {tensor.dtype} tensor; give that "
                    f"{tensor.dtype} buffer as saved from model.state_dict()")
    return None


def load_strict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], source: str) -> nn.Module:
    """``model.load_state_dict(state_dict)`` that names the first missing, unexpected or mismatching key (shape, or
    dtype kind: :func:`kind_mismatch`) in a ConfigError (a state dict for another model) instead of torch's
    multi-line RuntimeError or a silent cast."""
    own = model.state_dict()
    why = mismatch(shapes(own), shapes(state_dict), _model_name(model))
    if why:
        raise ConfigError(f"{source} {why}; give weights of the same architecture.")
    why = kind_mismatch(own, state_dict, _model_name(model))
    if why:
        raise ConfigError(f"{source} {why}.")
    model.load_state_dict(state_dict)
    return model


def _model_name(model: nn.Module) -> str:
    return getattr(model, "attnlab_model", None) or type(model).__name__


def create_pretrained(name: str, kwargs: dict[str, Any], file: str | Path | None = None) -> nn.Module:
    """timm's ``create_model(name, pretrained=True, **kwargs)``: its own loading (checkpoint filter, input-channel
    adaptation, a new classifier when ``num_classes`` differs), from the hub cache or from ``file``."""
    if not timm.is_model(name):
        raise ModelNotFoundError(f"--pretrained needs a timm model name with weights, not {name!r}; see "
                                 f"timm.list_pretrained(), or give a preset with --pretrained-file alone.")
    overlay: dict[str, Any] = {}
    if file is not None:
        state = read_state_dict(file)
        overlay["state_dict"] = state
        cfg = timm.models.get_pretrained_cfg(name)
        classifier = getattr(cfg, "classifier", None) if cfg is not None else None
        for head in (classifier,) if isinstance(classifier, str) else (classifier or ()):
            if f"{head}.weight" in state:  # the file's own head size: kept when the model asks for it
                overlay["num_classes"] = state[f"{head}.weight"].shape[0]
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry warnings would break the CLI's one-line error
    try:
        return timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay or None, **kwargs)
    except RuntimeError as err:
        text = str(err)
        bad = re.search(r"size mismatch for ([\w.]+)", text) or re.search(r'(?:Missing|Unexpected) key\(s\) in '
                                                                         r'state_dict: "([\w.]+)"', text)
        source = f"pretrained file {file}" if file is not None else f"timm's weights for {name}"
        if bad:
            raise ConfigError(f"{source} does not fit {name}: first mismatching key {bad[1]!r}; give weights of the "
                              f"same architecture and options.") from None
        if file is None:
            raise ConfigError(f"timm has no pretrained weights for {name} ({text.splitlines()[0][:100]}); give "
                              f"--pretrained-file.") from None
        raise
    except (OSError, ValueError) as err:  # offline, no cached file (huggingface_hub's errors derive from these)
        if file is not None:
            raise
        raise ConfigError(f"cannot fetch timm's weights for {name} ({type(err).__name__}: offline and not in the "
                          f"hub cache?); give --pretrained-file PATH.") from None
    finally:
        hub_log.setLevel(level)


# ---- the DnA authors' state dicts ----------------------------------------------------------------------------------
def dna_authors_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], layout: str = "auto",
                           sign: str = "+") -> dict[str, torch.Tensor]:
    """``state_dict`` in one of the DnA authors' layouts (docs/methods.md) rewritten in attnlab's names for
    ``model``, a model converted to ``dna``: their fused ``qqkvv`` (or ``qkv`` + ``q_neg`` + ``v_neg``) becomes
    ``qkv`` with rows in this module's order, ``neg_scalers`` becomes ``alpha``; every other key is kept.

    ``layout``: ``forward``, ``legacy``, ``separate``, or ``auto`` (``separate`` when ``q_neg`` / ``v_neg`` keys
    exist, else ``forward``; ``legacy`` has the same shapes as ``forward`` and is never inferred). ``sign="-"``:
    a file whose forward subtracts the softmin branch (V- negated, or alpha when V is shared).
    """
    if layout not in DNA_LAYOUTS:
        raise ConfigError(f"DnA authors' layout {layout!r} is not valid; use one of: {', '.join(DNA_LAYOUTS)}.")
    if sign not in ("+", "-"):
        raise ConfigError(f"sign {sign!r} is not valid; use '+' (softmin branch added) or '-' (subtracted).")
    dna = VARIANTS["dna"].load()  # the registry's class: models import no mechanism
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, dna)]
    if not modules:
        raise ConfigError("the model has no DnA attention module; build it with attn='dna' (the variant the "
                          "checkpoint holds) before loading the DnA authors' weights.")
    out = dict(state_dict)
    for name, module in modules:
        p = f"{name}." if name else ""
        A, H = module.attn_dim, module.num_heads
        kind = layout
        if kind == "auto":
            kind = "separate" if f"{p}q_neg.weight" in out or f"{p}v_neg.weight" in out else "forward"
        rows = {"weight": {}, "bias": {}}
        for part in ("weight", "bias"):
            if kind == "separate":
                qkv = out.pop(f"{p}qkv.{part}", None)
                if qkv is None:
                    continue
                rows[part].update(zip(("q_pos", "k", "v_pos"), qkv.split(A)))
                for neg in ("q_neg", "v_neg"):
                    t = out.pop(f"{p}{neg}.{part}", None)
                    if t is not None:
                        rows[part][neg] = t
            else:
                fused = out.pop(f"{p}qqkvv.{part}", None)
                if fused is None:
                    fused = out.pop(f"{p}qkv.{part}", None)
                if fused is None:
                    continue
                if fused.shape[0] % A:
                    raise ConfigError(f"{p}qqkvv.{part} has {fused.shape[0]} rows, not a multiple of {A}; give the "
                                      f"weights of a model with the same width.")
                order = _LEGACY_ORDER if kind == "legacy" else ("q_pos", "q_neg", "k", "v_pos", "v_neg")
                blocks = fused.split(A)
                if kind == "legacy" and len(blocks) != 5:
                    raise ConfigError(f"the legacy layout holds the five blocks Q+, K, V+, Q-, V-, but {p}qqkvv has "
                                      f"{len(blocks)}; use layout='forward' for the shared-value module.")
                if kind == "forward" and len(blocks) != 5:
                    order = tuple(module.qkv_blocks)  # Q+, Q-, K, V (shared value): their forward's order
                rows[part].update(zip(order, blocks))
        if not rows["weight"]:
            raise ConfigError(f"the checkpoint has no {p}qqkvv.weight (nor {p}qkv.weight) for the DnA module "
                              f"{name!r}; give a state dict of the same model in the authors' naming.")
        alpha = out.pop(f"{p}neg_scalers", None)
        if alpha is None:
            alpha = out.pop(f"{p}alpha", None)
        if sign == "-":
            if "v_neg" in rows["weight"]:
                rows = {part: {k: (-t if k == "v_neg" else t) for k, t in r.items()} for part, r in rows.items()}
            elif alpha is not None:
                alpha = -alpha
        for part, named in rows.items():
            if not named:
                continue
            aliases = {"q": "q_pos", "v": "v_pos"}
            missing = [b for b in module.qkv_blocks if aliases.get(b, b) not in named]
            if missing:
                raise ConfigError(f"the checkpoint lacks the {missing[0]} rows of {p}{part} that dna(variant="
                                  f"{module.variant}) needs; build the model with the variant the checkpoint holds.")
            extra = [b for b in named if b not in {aliases.get(b, b) for b in module.qkv_blocks}]
            if extra:
                raise ConfigError(f"the checkpoint holds {extra[0]} rows in {p}{part} that dna(variant="
                                  f"{module.variant}) has no place for; build the model with the variant the "
                                  f"checkpoint holds (qv for five blocks).")
            out[f"{p}qkv.{part}"] = torch.cat([named[aliases.get(b, b)] for b in module.qkv_blocks])
        if alpha is not None:
            if alpha.numel() != H:
                raise ConfigError(f"{p}neg_scalers has {alpha.numel()} values for {H} heads; give the weights of a "
                                  f"model with the same heads.")
            out[f"{p}alpha"] = alpha.reshape(H)
    return out


def load_dna_authors(model: nn.Module, source: str | Path | Mapping[str, torch.Tensor], layout: str = "auto",
                     sign: str = "+") -> nn.Module:
    """Load a DnA authors' checkpoint (a path or a state dict; ``layout``, ``sign``: :func:`dna_authors_state_dict`)
    into ``model`` (built with ``attn="dna"`` of the checkpoint's variant) by meaning, and return it."""
    name = f"checkpoint {source}" if isinstance(source, (str, Path)) else "the checkpoint"
    state = read_state_dict(source) if isinstance(source, (str, Path)) else source
    return load_strict(model, dna_authors_state_dict(model, state, layout, sign), name)


__all__ = ["DNA_LAYOUTS", "MAX_HEADER_BYTES", "create_pretrained", "dna_authors_state_dict", "kind_mismatch",
           "load_dna_authors", "load_strict", "mismatch", "open_safetensors", "read_state_dict", "safetensors_header"]
