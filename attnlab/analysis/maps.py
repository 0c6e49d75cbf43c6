"""Attention maps of every layer and branch, read from a real forward through each mechanism's explicit path.

The instruments that look at attention weights (head redundancy, relevance) need the (B, H, N, N) maps of every
attention module, per branch for two-branch mechanisms, and relevance needs them inside the autograd graph. A
forward hook recomputes each module's output on the explicit (non-SDPA) path from the module's own pieces
(``project``, ``add_bias``, ``weights``, ``merge``) and returns it in place of the module's output, so gradients of
the model's output reach the maps; the hook checks that the recomputed output matches the module's own.

Branches per mechanism, each an attention-weight map W (rows over keys) and its signed coefficient c in the
module's output o_h = sum_b c_b,h W_b,h V_b,h:

    standard (with or without ns), cog   "attn": W = softmax(s) (cog: sign(s) softmax(|s|)),   c = 1
    dna (Sec. 3.2)                       "pos": softmax(s^+), c = 1;   "neg": softmin(s^-), c = alpha_h
    diff                                 "pos": softmax(s1),  c = 1;   "neg": softmax(s2),  c = -lambda
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..models.convert import attention_modules


@dataclass
class Branch:
    """One branch of one layer: ``weights`` W (B, H, N, M) and ``effective`` c_h W (the same tensor when c = 1),
    the map the module's output is linear in."""

    weights: torch.Tensor
    effective: torch.Tensor


def kind_of(module: nn.Module) -> str | None:
    """``softmax``, ``cog``, ``dna`` or ``diff`` for a module whose maps this file can read (its declared
    ``map_kind`` capability; a subclass that overrides ``attend`` computes something else and loses it), else None."""
    return getattr(type(module), "map_kind", None)


def map_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every attention module, in forward order; UnsupportedModelError naming the first whose
    attention maps cannot be read."""
    found = attention_modules(model)
    if not found:
        raise UnsupportedModelError(f"{type(model).__name__} has no attention module attnlab can measure.")
    for name, module in found:
        if not hasattr(module, "project"):
            raise UnsupportedModelError(
                f"attention module {name!r} is timm's {type(module).__name__}; convert the model with "
                f"attnlab.convert(model, 'standard') first (it changes no output).")
        if kind_of(module) is None:
            raise UnsupportedModelError(
                f"attention module {name!r} is {type(module).__name__}, whose attention maps attnlab cannot read; "
                f"maps are read from standard, ns, cog, dna and diff modules.")
    return found


def _bias_args(module: nn.Module, args: tuple, kwargs: dict):
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    x = next(iter(bound.values()))
    attn_mask, mask = bound.get("attn_mask"), bound.get("mask")
    if bound.get("is_causal", False):
        attn_mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
    return x, mask, attn_mask


def explicit_forward(module: nn.Module, x: torch.Tensor, mask=None, attn_mask=None
                     ) -> tuple[torch.Tensor, dict[str, Branch]]:
    """The module's output for x (B, N, dim) computed on the explicit path, and its branches' maps."""
    kind = kind_of(module)
    if kind == "dna":
        q, k, (v_pos, v_neg) = module.project(x)
        w_pos, w_neg = module.weights(q, k, mask, attn_mask)
        alpha = torch.ones(module.num_heads, dtype=w_neg.dtype, device=w_neg.device) if module.alpha is None \
            else module.alpha.to(w_neg.dtype)
        e_neg = alpha.view(-1, 1, 1) * w_neg
        o = w_pos @ v_pos + e_neg @ v_neg
        branches = {"pos": Branch(w_pos, w_pos), "neg": Branch(w_neg, e_neg)}
    elif kind == "diff":
        q, k, v = module.project(x)
        d = module.qk_head_dim
        w1, w2 = (module.add_bias((qh * module.scale) @ kh.transpose(-2, -1), mask, attn_mask).softmax(dim=-1)
                  for qh, kh in ((q[..., :d], k[..., :d]), (q[..., d:], k[..., d:])))
        e2 = -module.lambda_full().to(w2.dtype) * w2
        o = module.sub_norm(w1 @ v + e2 @ v) * (1 - module.lambda_init)
        branches = {"pos": Branch(w1, w1), "neg": Branch(w2, e2)}
    else:
        q, k, v = module.project(x)
        if kind == "cog" and module.signed:
            w = module.weights(q, k, mask, attn_mask)
        else:
            w = module.add_bias((q * module.scale) @ k.transpose(-2, -1), mask, attn_mask).softmax(dim=-1)
        o = w @ v
        branches = {"attn": Branch(w, w)}
    return module.merge(module.head_transform(o), x), branches


@contextmanager
def capture_maps(model: nn.Module, record: Callable[[int, str, nn.Module, dict[str, Branch]], None]
                 ) -> Iterator[list[tuple[str, nn.Module]]]:
    """While open, every forward of an attention module of ``model`` calls ``record(index, name, module,
    branches)`` and returns the explicit path's output (so the maps sit in the autograd graph). Yields the modules."""
    modules = map_modules(model)

    def hook(index, name):
        def run(module, args, kwargs, output):
            x, mask, attn_mask = _bias_args(module, args, kwargs)
            out, branches = explicit_forward(module, x, mask, attn_mask)
            gap = (out.detach() - output.detach()).abs().max().item()
            if not gap <= 1e-3 * (1 + output.detach().abs().max().item()):
                raise UnsupportedModelError(
                    f"attention module {name!r} ({type(module).__name__}) computes something other than its "
                    f"explicit attention path (largest difference {gap:.3g}), so its maps cannot be read.")
            record(index, name, module, branches)
            return out
        return run

    handles = [m.register_forward_hook(hook(i, n), with_kwargs=True) for i, (n, m) in enumerate(modules)]
    try:
        yield modules
    finally:
        for h in handles:
            h.remove()


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


__all__ = ["Branch", "capture_maps", "eval_mode", "explicit_forward", "kind_of", "map_modules"]
