"""Attention maps of every layer and branch, read from a real forward through each mechanism's explicit path.

The instruments that look at attention weights (head redundancy, relevance) need the (B, H, N, M) maps of every
attention module, per branch for two-branch mechanisms, and relevance needs them inside the autograd graph. Each
mechanism owns its maps: ``module.explicit_maps(x, mask) -> (output, {branch: Branch})`` recomputes the module's
output on its explicit (non-SDPA) path with the call's mask. A forward hook calls it and returns its output in
place of the module's, so gradients of the model's output reach the maps; the hook checks that the recomputed
output matches the module's own. A mechanism whose record does not declare ``explicit_maps`` (Nyström, Performer,
channel maps, or a subclass that changed ``attend``) cannot be measured. Branches as the mechanisms name them, each a
weight map W (rows over keys) and its signed coefficient c in the module's output o_h = sum_b c_b,h W_b,h V_b,h:

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

from ..attention.base import AttnlabAttention, Branch
from ..errors import UnsupportedModelError
from ..models.convert import attention_modules


def measured_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every attention module, in forward order; UnsupportedModelError when there is none."""
    found = attention_modules(model)
    if not found:
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
        if not module.capabilities.explicit_maps:
            raise UnsupportedModelError(
                f"attention module {name!r} is {type(module).__name__}, which has no explicit attention maps "
                f"(explicit_maps) to read.")
    return found


@contextmanager
def capture_maps(model: nn.Module, record: Callable[[int, str, nn.Module, dict[str, Branch]], None]
                 ) -> Iterator[list[tuple[str, nn.Module]]]:
    """While open, every forward of an attention module of ``model`` calls ``record(index, name, module,
    branches)`` and returns the explicit path's output (so the maps sit in the autograd graph). Yields the modules."""
    modules = map_modules(model)

    def hook(index, name):
        def run(module, args, kwargs, output):
            x, mask = module.forward_mask(args, kwargs)
            out, branches = module.explicit_maps(x, mask)
            gap = (out.detach() - output.detach()).abs().max().item()
            if not gap <= 1e-3 * (1 + output.detach().abs().max().item()):
                raise UnsupportedModelError(
                    f"attention module {name!r} ({type(module).__name__}) computes something other than its "
                    f"explicit attention path (largest difference {gap:.3g}), so its maps cannot be read.")
            record(index, name, module, branches)
            return out
        return run

    handles = [m.register_forward_hook(hook(i, n), with_kwargs=True) for i, (n, m) in enumerate(modules)]
    called: set[int] = set()
    handles += [m.register_forward_pre_hook(lambda mod, args: called.add(id(mod))) for _, m in modules]
    try:
        yield modules
    finally:
        for h in handles:
            h.remove()
    missed = next((name for name, m in modules if id(m) not in called), None)
    if missed is not None:
        raise not_called(missed)


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


def not_called(name: str) -> UnsupportedModelError:
    """The refusal for an attention module whose forward a pass never called (its hooks saw nothing)."""
    return UnsupportedModelError(
        f"attention module {name!r} was not called through its forward (its block runs the module's steps itself, "
        f"as ViTDet's blocks with relative positions do), so this instrument cannot see it; build the model without "
        f"them (ViTDet: model option rel_pos=False).")


def forward_batches(model: nn.Module, images: torch.Tensor, batch_size: int, handles=(),
                    watch: list[tuple[str, nn.Module]] = ()) -> None:
    """``images`` through ``model`` in chunks of ``batch_size`` under :func:`eval_mode`; the hooks ``handles`` (what
    measures the forwards) are removed after, whatever happens. UnsupportedModelError (:func:`not_called`) when a
    module of ``watch`` (name, module), the ones the hooks measure, was never called."""
    called: set[int] = set()
    handles = [*handles, *(m.register_forward_pre_hook(lambda mod, args: called.add(id(mod))) for _, m in watch)]
    try:
        with eval_mode(model) as device:
            for chunk in images.split(batch_size):
                model(chunk.to(device))
    finally:
        for h in handles:
            h.remove()
    missed = next((name for name, m in watch if id(m) not in called), None)
    if missed is not None:
        raise not_called(missed)


__all__ = ["Branch", "capture_maps", "eval_mode", "forward_batches", "map_modules", "measured_modules", "not_called",
           "unconverted"]
