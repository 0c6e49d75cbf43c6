"""Folding for inference: every parametrisation evaluated once and replaced by a plain weight.

A folded model has exactly the modules, parameters and state-dict names of a standard model (``qkv.weight``, not
``qkv.parametrizations.weight.original``), so it costs exactly what a standard model costs at inference. The folded
weights are the ones an eval-mode forward uses: power iterations are not advanced while folding.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..spec import Spec, parse_spec


def fold(model: nn.Module) -> nn.Module:
    """Replace every parametrisation of ``model`` by its current value as a plain parameter, in place; returns it.

    Outputs in eval mode are unchanged up to float rounding (the value is the one an eval forward computes). The
    model's ``attnlab_spec`` loses its weight terms (``sigma``, ``specnorm``, ``speccond``), which a folded model no
    longer carries; the original spec is kept in ``attnlab_folded_from``.
    """
    parametrized = [m for m in model.modules() if parametrize.is_parametrized(m)]
    for module in parametrized:
        _own_class(module)
        for chain in module.parametrizations.values():
            chain.eval()  # the eval-mode value: a sigma power iteration must not move while folding
        names = list(module.parametrizations.keys())
        with torch.no_grad():
            for name in names:
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
        # restored tensors go back first (weight before bias), so the state dict reads as a standard model's
        for table in (module._parameters, module._buffers):
            if any(n in table for n in names):
                items = sorted(table.items(), key=lambda kv: kv[0] not in names)
                table.clear()
                table.update(items)
    spec = getattr(model, "attnlab_spec", None)
    if spec is not None:
        kept = tuple(t for t in parse_spec(spec).terms if t.kind != "weight")
        model.attnlab_folded_from = spec
        model.attnlab_spec = str(Spec(kept))
    return model


def _own_class(module: nn.Module) -> None:
    """Give ``module`` a private copy of its parametrised class before parametrisations are removed: parametrize's
    class (which holds each parametrisation as a property) is shared by deep copies, and removing a property from it
    would break every copy of the model (``fold(copy.deepcopy(model))`` would break ``model``)."""
    cls = module.__class__
    contents = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    module.__class__ = type(cls.__name__, cls.__bases__, contents)


def folded_safetensors(model: nn.Module) -> bytes:
    """A folded copy of ``model``'s weights as safetensors bytes; ``model`` itself is left as it is.

    The metadata holds ``attnlab_spec`` (the spec a model must be built with to load it: the original spec without
    its weight terms) and ``attnlab_folded_from`` (the original spec).
    """
    from safetensors.torch import save

    folded = fold(copy.deepcopy(model))
    metadata = {"format": "pt"}
    for key in ("attnlab_spec", "attnlab_folded_from"):
        if getattr(folded, key, None) is not None:
            metadata[key] = str(getattr(folded, key))
    # standalone contiguous CPU copies: safetensors refuses tensors that share storage
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in folded.state_dict().items()}
    return save(tensors, metadata=metadata)


def export_folded(model: nn.Module, path: str | Path) -> Path:
    """Write :func:`folded_safetensors` of ``model`` to ``path``, created with the umask's permissions (safetensors'
    own writer makes every file 0600)."""
    data = folded_safetensors(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


__all__ = ["export_folded", "fold", "folded_safetensors"]
