"""AdamW with a decay / no-decay split, and timm's warm-up + cosine schedule stepped every iteration."""

from __future__ import annotations

import logging
from fnmatch import fnmatch

import torch
from timm.scheduler import CosineLRScheduler
from torch import nn

# Parameters whose names contain one of these never get weight decay (besides every parameter with ndim <= 1).
NO_DECAY_NAMES = ("pos_embed", "cls_token", "dist_token", "reg_token", "relative_position_bias_table")


def no_weight_decay(name: str, param: torch.Tensor, model_says: frozenset[str] = frozenset()) -> bool:
    """True for parameters that AdamW should not decay.

    Weight decay pulls a parameter towards 0, which only makes sense for a matrix whose scale the following
    normalisation or softmax undoes. Biases and norm gains/shifts (all 1-D), learned scalars, position
    embeddings, the class token and Swin's relative-position bias tables are not such matrices: decaying them
    just drags offsets, scales and positional information towards 0.
    """
    return (
        param.ndim <= 1                      # biases, LayerNorm weight/bias, per-head scalars
        or name.endswith(".bias")
        or any(key in name for key in NO_DECAY_NAMES)
        or any(fnmatch(name, pattern) for pattern in model_says)  # timm's no_weight_decay() (names or globs)
    )


def _declared_no_decay(model: nn.Module):
    """Names timm's modules list in ``no_weight_decay()``: the model's own, and submodules' with their prefix (XCiT's
    XCA lists its learned ``temperature`` there, which a model-level call does not return)."""
    for prefix, module in model.named_modules():
        if callable(getattr(module, "no_weight_decay", None)):
            yield from (f"{prefix}.{name}" if prefix else name for name in module.no_weight_decay())


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: ``{"params": decay, "weight_decay": wd}`` and ``{"params": no_decay, "weight_decay": 0}``."""
    model_says = frozenset(_declared_no_decay(model))
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if no_weight_decay(name, param, model_says) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, name: str = "adamw",
                    momentum: float = 0.9) -> torch.optim.Optimizer:
    """AdamW (default) or timm's LARS over :func:`param_groups`.

    AdamW runs its fused kernel, which updates every tensor in one call; PyTorch picks it only on request, and on CPU
    the default per-tensor loop costs a small model more time than its backward pass. LARS scales each tensor's step
    by its trust ratio ||w|| / ||g|| only in the decay group, so biases and norms take plain momentum SGD steps.
    """
    groups = param_groups(model, weight_decay)
    if name == "lars":
        from timm.optim import Lars

        groups[0]["always_adapt"] = True  # trust ratio on weight matrices even when weight_decay is 0
        return Lars(groups, lr=lr, momentum=momentum)
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int, warmup_lr: float,
                    min_lr: float) -> CosineLRScheduler:
    """timm's CosineLRScheduler counted in optimizer steps (call ``step_update(num_updates)`` after each step).

    For update t (0-based), W = ``warmup_steps`` (at most T - 1), T = ``total_steps``:
      t < W:  lr = warmup_lr + t * (lr_peak - warmup_lr) / W
      t >= W: lr = min_lr + (lr_peak - min_lr) * (1 + cos(pi * (t - W) / (T - W))) / 2
    Stepping per iteration rather than per epoch keeps a 10-epoch warm-up smooth and makes the schedule
    independent of how many epochs have run, which resume relies on (the state is just ``num_updates``).
    """
    warmup_t = min(int(warmup_steps), max(total_steps - 1, 0))
    t_initial = max(total_steps - warmup_t, 1)
    # One step left after warm-up (a 1-epoch run whose warm-up fills it, or a 1-step run) is a cosine of one step:
    # timm warns that it "will have no effect", which is what the schedule above means, so that warning alone is
    # dropped, and only while this scheduler is built.
    quiet = _DropNoEffect() if t_initial == 1 else None
    logger = logging.getLogger(CosineLRScheduler.__module__)
    if quiet:
        logger.addFilter(quiet)
    try:
        return CosineLRScheduler(
            optimizer,
            t_initial=t_initial,
            lr_min=min_lr,
            warmup_t=warmup_t,
            warmup_lr_init=warmup_lr,
            warmup_prefix=True,  # cosine starts at the peak once warm-up ends ("warm-up followed by cosine decay")
            t_in_epochs=False,
        )
    finally:
        if quiet:
            logger.removeFilter(quiet)


class _DropNoEffect(logging.Filter):
    """Drops timm's "Cosine annealing scheduler will have no effect" warning (see :func:`build_scheduler`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will have no effect" not in record.getMessage()

