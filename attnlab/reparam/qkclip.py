"""QK-clip (Kimi K2's MuonClip, without Muon): cap each head's largest attention logit by rescaling W_q and W_k.

During every training forward, each attention module records per head h

    S_max,h = max over the batch, query i and key j of  (q_h,i . k_h,j) / sqrt(D)

(running maximum since the last optimizer step, so gradient-accumulation micro-batches all count; exact for every
head that could exceed tau, the Cauchy-Schwarz bound max_i ||q_i|| max_j ||k_j|| / sqrt(D) <= tau for the others,
so the clip is the same as with exact maxima everywhere). After each optimizer step, every head with
S_max,h > tau is rescaled with gamma_h = tau / S_max,h:

    W_q,h <- gamma_h^alpha W_q,h,        W_k,h <- gamma_h^(1 - alpha) W_k,h        (defaults tau = 100, alpha = 0.5)

(with grouped-query attention a key head serves several query heads; it takes the smallest gamma^(1 - alpha) of
its group, so each head of the group ends at or below tau, the one that set the factor exactly at tau)

so that the logits the step recorded become exactly tau for that head's worst query-key pair. Heads at or below tau
are untouched (multiplied by exactly 1.0: bit-identical), W_v is never touched, and the record is reset.

Only the positions the forward's mask allows count, and no additive bias (the rescaling can only move q . k). The
bias entries of the scaled rows of the fused ``qkv`` are scaled with them. The maximum is taken in float32, tile by
tile (:func:`attnlab.ops.logits.screened_max_logits`), as the attention forward's ``max_logits`` intermediate that
an observer of every training forward reads; per-rank maxima are all-reduced (MAX) under ``torch.distributed``. Only softmax kernels are supported. These choices where the Kimi K2
report leaves room, with their reasons, and the refused terms: docs/methods.md, "qkclip".

The trainer creates the optimizer after ``convert``; it calls :func:`attach_optimizer_hooks` (a no-op for models
without ``qkclip``). A custom loop may call :func:`clip_` after each ``optimizer.step()`` instead.
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
    """Per-module QK-clip state: ``tau``, ``alpha`` and the running per-head maximum logit ``max_logit`` (H,).

    ``max_logit`` is a non-persistent buffer (it follows ``.to(device)`` but is not in the state dict, so a
    ``qkclip`` checkpoint loads into a ``standard`` model); ``last_max_logit`` keeps the value the last clip used
    and ``last_clipped`` how many heads it rescaled, for logging.
    """

    def __init__(self, num_heads: int, tau: float = 100.0, alpha: float = 0.5) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.tau = float(tau)
        self.alpha = float(alpha)
        self.register_buffer("max_logit", torch.full((num_heads,), float("-inf")), persistent=False)
        self.register_buffer("last_max_logit", torch.full((num_heads,), float("-inf")), persistent=False)
        self.register_buffer("last_clipped", torch.zeros((), dtype=torch.long), persistent=False)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, tau={self.tau:g}, alpha={self.alpha:g}"


def _check(module: nn.Module, index: int) -> None:
    if has_qk_norm(module):
        raise SpecError(
            f"qkclip cannot act on attention module {index}: it normalises q and k after the projection (QK-norm), "
            f"which divides out any rescaling of W_q and W_k, so the clip would have no effect; use qknorm or qkclip.")
    if not module.capabilities.plain_softmax:
        raise SpecError(
            f"qkclip needs softmax attention (the standard kernel, optionally with ns), but attention module {index} "
            f"is {type(module).__name__}, whose logits are not q_h k_h^T / sqrt(D) of the fused projection.")


def apply(model: nn.Module, modules: list[nn.Module], tau: float = 100.0, alpha: float = 0.5) -> None:
    """Give every attention module a :class:`QKClip` state ``qk_clip`` and an observer that folds each training
    forward's per-head max logits into it.

    The weights change only when the clip runs: after ``optimizer.step()`` through :func:`attach_optimizer_hooks`,
    or by calling :func:`clip_`. Raises SpecError for modules with QK-norm or a non-softmax kernel.
    """
    for index, module in enumerate(modules):
        _check(module, index)
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
    """Apply QK-clip to every module of ``model`` that has it, from the maxima recorded since the last call.

    For head h with S_max,h > tau: q rows and q bias of head h times gamma^alpha, k rows and k bias times
    gamma^(1 - alpha), gamma = tau / S_max,h. Other heads are multiplied by exactly 1.0 (so no host sync is needed
    on a GPU). Resets the record. Modules that recorded nothing (-inf) are left alone.
    """
    modules = clipped_modules(model)
    if not modules:
        return
    if dist.is_available() and dist.is_initialized():
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
        H, D = module.num_heads, module.head_dim
        s = state.max_logit
        over = s > state.tau
        # on the CPU a host check is free and spares the multiplications in the common case (no head over tau);
        # on a GPU it would be a sync per module, so there every step multiplies (unclipped rows by exactly 1.0)
        if s.device.type != "cpu" or bool(over.any()):
            ones = torch.ones_like(s)
            gamma = torch.where(over, state.tau / s, ones)
            q_factor = torch.where(over, gamma.pow(state.alpha), ones)
            k_factor = torch.where(over, gamma.pow(1.0 - state.alpha), ones)
            # one factor per output row of qkv: q block, k block (a key head that serves a group of query heads takes
            # the smallest of their factors, so every head of the group ends at or below tau), 1.0 for the v block
            k_factor = k_factor.view(module.num_kv_heads, -1).amin(dim=1)
            rows = torch.cat([q_factor.repeat_interleave(D), k_factor.repeat_interleave(D),
                              torch.ones(qkv.out_features - (H + module.num_kv_heads) * D, device=s.device,
                                         dtype=s.dtype)])
            qkv.weight.mul_(rows.to(qkv.weight.dtype).unsqueeze(1))
            if qkv.bias is not None:
                qkv.bias.mul_(rows.to(qkv.bias.dtype))
        state.last_max_logit.copy_(s)
        state.last_clipped.copy_(over.sum())
        s.fill_(float("-inf"))


def attach_optimizer_hooks(model: nn.Module, optimizer: torch.optim.Optimizer):
    """Run :func:`clip_` on ``model`` after every ``optimizer.step()``; returns the hook handle, or None (and does
    nothing) when ``model`` has no ``qkclip`` term. The trainer calls this for every model once it has built the
    optimizer. A step the AMP GradScaler skips does not call the hook; its maxima stay recorded for the next one."""
    if not clipped_modules(model):
        return None
    return optimizer.register_step_post_hook(lambda opt, args, kwargs: clip_(model))


def clip_stats(model: nn.Module) -> dict[str, float]:
    """What the last clip saw: ``qkclip/max_logit`` (largest recorded S_max over heads: exact when it exceeds tau,
    otherwise a bound <= tau) and ``qkclip/clipped_heads``.
    Empty for models without ``qkclip``. Reads device tensors (a host sync on a GPU): call it when logging."""
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
