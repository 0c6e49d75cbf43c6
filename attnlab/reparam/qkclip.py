"""QK-clip (Kimi K2's MuonClip, without Muon): cap each head's largest attention logit by rescaling W_q and W_k.

During every training forward, each attention module records per head h the running maximum, since the last
optimizer step, of

    S_max,h = max over the batch, query i and key j of  (q_h,i . k_h,j) / sqrt(D)

over the positions the forward's mask allows, without additive biases (exact for every head that could exceed tau;
:func:`attnlab.ops.logits.screened_max_logits`). After each optimizer step, every head with S_max,h > tau is
rescaled with gamma_h = tau / S_max,h:

    W_q,h <- gamma_h^alpha W_q,h,        W_k,h <- gamma_h^(1 - alpha) W_k,h        (defaults tau = 100, alpha = 0.5)

so the recorded logits become exactly tau for that head's worst pair; other heads are untouched (bit for bit), W_v
never. Bias entries of the scaled rows scale with them; a shared key head (grouped-query attention) takes the
smallest factor of its group; per-rank maxima are all-reduced (MAX) under ``torch.distributed``. These choices and
the refused terms: docs/methods.md, "qkclip". The trainer calls :func:`attach_optimizer_hooks` once it has built the
optimizer; a custom loop may call :func:`clip_` after each ``optimizer.step()`` instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from ..attention.base import Want
from ..errors import SpecError
from ..variants import TrainingHooks
from .qknorm import has_qk_norm


class QKClip(nn.Module):
    """Per-module QK-clip state: ``tau``, ``alpha``, the running per-head maximum logit ``max_logit`` (H,), and what
    the last clip used (``last_max_logit``) and how many heads it rescaled (``last_clipped``), for logging. The
    buffers are non-persistent, so a ``qkclip`` checkpoint loads into a ``standard`` model."""

    def __init__(self, num_heads: int, tau: float = 100.0, alpha: float = 0.5) -> None:
        super().__init__()
        self.num_heads, self.tau, self.alpha = num_heads, float(tau), float(alpha)
        self.register_buffer("max_logit", torch.full((num_heads,), float("-inf")), persistent=False)
        self.register_buffer("last_max_logit", torch.full((num_heads,), float("-inf")), persistent=False)
        self.register_buffer("last_clipped", torch.zeros((), dtype=torch.long), persistent=False)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, tau={self.tau:g}, alpha={self.alpha:g}"


def apply(model: nn.Module, modules: list[nn.Module], tau: float = 100.0, alpha: float = 0.5) -> None:
    """Give every attention module a :class:`QKClip` state ``qk_clip`` and an observer that folds each training
    forward's per-head max logits into it (the weights change only when :func:`clip_` runs). SpecError for modules
    with QK-norm or a non-softmax kernel."""
    for index, module in enumerate(modules):
        if has_qk_norm(module):
            raise SpecError(
                f"qkclip cannot act on attention module {index}: it normalises q and k after the projection (QK-norm), "
                f"which divides out any rescaling of W_q and W_k, so the clip would have no effect; use qknorm or "
                f"qkclip.")
        if not module.capabilities.plain_softmax:
            raise SpecError(
                f"qkclip needs softmax attention (the standard kernel, optionally with ns), but attention module "
                f"{index} is {type(module).__name__}, whose logits are not q_h k_h^T / sqrt(D) of the fused "
                f"projection.")
    for module in modules:
        module.qk_clip = QKClip(module.num_heads, tau, alpha).to(module.qkv.weight.device)
        module.observe(Want(max_logits=module.qk_clip.tau), _record, training_only=True)


def _record(module: nn.Module, found) -> None:
    """Fold a training forward's per-head max logits (its kernel's intermediate) into ``module.qk_clip``."""
    if found.max_logits is not None:  # None on a meta model (shapes only)
        state = module.qk_clip
        torch.maximum(state.max_logit, found.max_logits.to(state.max_logit.dtype), out=state.max_logit)


def clipped_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` that carry QK-clip state, in forward order."""
    return [m for m in model.modules() if isinstance(getattr(m, "qk_clip", None), QKClip)]


@torch.no_grad()
def clip_(model: nn.Module) -> None:
    """Apply QK-clip to every module of ``model`` that has it, from the maxima recorded since the last call, and
    reset the record (module docstring). Modules that recorded nothing (-inf) are left alone."""
    modules = clipped_modules(model)
    if modules and dist.is_available() and dist.is_initialized():
        stacked = torch.cat([m.qk_clip.max_logit for m in modules])
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
        for m, part in zip(modules, stacked.split([m.num_heads for m in modules])):
            m.qk_clip.max_logit.copy_(part)
    for module in modules:
        state: QKClip = module.qk_clip
        qkv = module.qkv
        if parametrize.is_parametrized(qkv, "weight"):
            raise SpecError("qkclip rescales the rows of qkv.weight, but this model reparametrises it "
                            "(sigma-Reparam, spectral norm or conditioning); drop one of the two terms.")
        s, D = state.max_logit, module.head_dim
        over = s > state.tau
        # on the CPU a host check is free and spares the multiplications in the common case (no head over tau);
        # on a GPU it would be a sync per module, so there every step multiplies (unclipped rows by exactly 1.0)
        if s.device.type != "cpu" or bool(over.any()):
            gamma = torch.where(over, state.tau / s, torch.ones_like(s))
            q_factor, k_factor = gamma.pow(state.alpha), gamma.pow(1.0 - state.alpha)  # 1.0 ** x is exactly 1.0
            k_factor = k_factor.view(module.num_kv_heads, -1).amin(dim=1)  # a key head's query group: the smallest
            v_rows = qkv.out_features - (module.num_heads + module.num_kv_heads) * D
            rows = torch.cat([q_factor.repeat_interleave(D), k_factor.repeat_interleave(D), s.new_ones(v_rows)])
            qkv.weight.mul_(rows.to(qkv.weight.dtype).unsqueeze(1))
            if qkv.bias is not None:
                qkv.bias.mul_(rows.to(qkv.bias.dtype))
        state.last_max_logit.copy_(s)
        state.last_clipped.copy_(over.sum())
        s.fill_(float("-inf"))


def attach_optimizer_hooks(model: nn.Module, optimizer: torch.optim.Optimizer):
    """Run :func:`clip_` on ``model`` after every ``optimizer.step()`` (a step the AMP GradScaler skips keeps its
    maxima for the next); the hook handle, or None (and nothing done) when ``model`` has no ``qkclip`` term."""
    if not clipped_modules(model):
        return None
    return optimizer.register_step_post_hook(lambda opt, args, kwargs: clip_(model))


def clip_stats(model: nn.Module) -> dict[str, float]:
    """What the last clip saw: ``qkclip/max_logit`` (largest recorded S_max: exact when it exceeds tau, otherwise a
    bound <= tau) and ``qkclip/clipped_heads``; empty without ``qkclip``. A host sync on a GPU: call it to log."""
    modules = clipped_modules(model)
    if not modules:
        return {}
    return {
        "qkclip/max_logit": max(float(m.qk_clip.last_max_logit.max()) for m in modules),
        "qkclip/clipped_heads": float(sum(int(m.qk_clip.last_clipped) for m in modules)),
    }


#: how the trainer runs QK-clip (through the variant registry): the clip after each step, and its metrics
TRAINING = TrainingHooks(attach=attach_optimizer_hooks, stats=clip_stats)

__all__ = ["QKClip", "TRAINING", "apply", "attach_optimizer_hooks", "clip_", "clip_stats", "clipped_modules"]
