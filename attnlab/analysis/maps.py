"""Attention maps of every layer and branch, read from a real forward through each mechanism's explicit path.

Head redundancy and relevance need every attention module's (B, H, N, M) maps per branch, relevance inside the
autograd graph: an observer asks every forward for ``weights``, which runs the explicit backend, so the output is
computed from the very maps recorded; a record without ``weights`` (Nyström, Performer, channel maps) cannot be
measured (docs/methods.md, "Instruments: head redundancy, ..."). Branch b of head h: a weight map W (rows over keys)
and its signed coefficient c in the module's output o_h = sum_b c_b,h W_b,h V_b,h:

    standard (with or without ns), cog   "attn": W = softmax(s) (cog: sign(s) softmax(|s|)),   c = 1
    dna (Sec. 3.2)                       "pos": softmax(s^+), c = 1;   "neg": softmin(s^-), c = alpha_h
    diff                                 "pos": softmax(s1),  c = 1;   "neg": softmax(s2),  c = -lambda

Masked positions have weight 0 in every map; with key padding, the rows of padded queries are zero in the output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..attention.base import AttnlabAttention, Branch, Want
from ..errors import UnsupportedModelError
from ..models.convert import attention_modules


def measured_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every attention module, in forward order; UnsupportedModelError when there is none."""
    if not (found := attention_modules(model)):
        raise UnsupportedModelError(f"{type(model).__name__} has no attention module attnlab can measure.")
    return found


def unconverted(name: str, module: nn.Module) -> str:
    """Why timm's own attention module ``name`` cannot be measured, and what to do."""
    return (f"attention module {name!r} is timm's {type(module).__name__}; convert the model with "
            f"attnlab.convert(model, 'standard') first (it changes no output).")


def map_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every attention module, in forward order; UnsupportedModelError naming the first whose
    attention maps cannot be read."""
    found = measured_modules(model)
    for name, module in found:
        if not isinstance(module, AttnlabAttention):
            raise UnsupportedModelError(unconverted(name, module))
        if "weights" not in module.capabilities.intermediates:
            raise UnsupportedModelError(
                f"attention module {name!r} is {type(module).__name__}, which has no attention weight maps to read.")
    return found


@contextmanager
def _watching(modules, handles=()) -> Iterator[None]:
    """While open, notes which of ``modules`` (name, module) are called; after, removes the hooks ``handles`` and
    its own, whatever happens, then raises UnsupportedModelError for the first module never called (its hooks saw
    nothing)."""
    called: set[int] = set()
    handles = [*handles, *(m.register_forward_pre_hook(lambda mod, args: called.add(id(mod))) for _, m in modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    if (missed := next((name for name, m in modules if id(m) not in called), None)) is not None:
        raise UnsupportedModelError(
            f"attention module {missed!r} was not called through its forward (its block runs the module's steps "
            f"itself), so this instrument cannot see it; call the attention module itself in the block.")


@contextmanager
def capture_maps(model: nn.Module, record: Callable[[int, str, nn.Module, dict[str, Branch]], None]
                 ) -> Iterator[list[tuple[str, nn.Module]]]:
    """While open, every forward of an attention module of ``model`` runs its explicit backend and calls
    ``record(index, name, module, branches)`` with its weight maps (in the autograd graph). Yields the modules;
    UnsupportedModelError when one of them was never called."""
    modules = map_modules(model)
    observers = [m.observe(Want(weights=True), lambda mod, found, i=i, n=n: record(i, n, mod, found.weights))
                 for i, (n, m) in enumerate(modules)]
    with _watching(modules, observers):
        yield modules


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[torch.device]:
    """Eval mode for the block (every module's own flag restored after); yields the model's device."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield next(iter(model.parameters())).device
    finally:
        for m, mode in modes:
            m.training = mode


def forward_batches(model: nn.Module, images: torch.Tensor, batch_size: int, handles=(),
                    watch: list[tuple[str, nn.Module]] = ()) -> None:
    """``images`` through ``model`` in chunks of ``batch_size`` under :func:`eval_mode`; the hooks ``handles`` (what
    measures the forwards) are removed after, whatever happens. UnsupportedModelError when a module of ``watch``
    (name, module), the ones the hooks measure, was never called."""
    with _watching(watch, handles), eval_mode(model) as device:
        for chunk in images.split(batch_size):
            model(chunk.to(device))


__all__ = ["Branch", "capture_maps", "eval_mode", "forward_batches", "map_modules", "measured_modules", "unconverted"]
