"""AdamW with a decay / no-decay split, and timm's warm-up + cosine schedule stepped every iteration."""

from __future__ import annotations

import logging
import re
from fnmatch import fnmatch

import torch
from timm.scheduler import CosineLRScheduler
from torch import nn

# Parameters whose names contain one of these never get weight decay (besides every parameter with ndim <= 1).
NO_DECAY_NAMES = ("pos_embed", "cls_token", "dist_token", "reg_token", "relative_position_bias_table")


def no_weight_decay(name: str, param: torch.Tensor, model_says: frozenset[str] = frozenset()) -> bool:
    """True for parameters that AdamW should not decay: for them 0 is not a neutral value (docs/training.md,
    "Optimizer"). Biases, norm gains and shifts, learned scalars, position embeddings, the class token and Swin's
    relative-position bias tables, and what the model's ``no_weight_decay()`` lists (``model_says``)."""
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


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
    """Two AdamW groups: ``{"params": decay, "weight_decay": wd}`` and ``{"params": no_decay, "weight_decay": 0}``.

    With ``layer_decay`` (ViTDet's and BEiT's layer-wise learning-rate decay), the groups split further by depth,
    each with ``lr_scale`` = layer_decay ** (L + 1 - i) for a parameter of layer i (:func:`layer_ids`; timm's
    schedulers multiply each group's learning rate by its ``lr_scale``); the two groups at scale 1 come first.
    """
    model_says = frozenset(_declared_no_decay(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ids, num_layers = layer_ids([n for n, _ in named]) if layer_decay is not None else ({}, 0)
    groups: dict[tuple[int, bool], dict] = {}
    depths = (num_layers + 1, *range(num_layers + 1)) if layer_decay is not None else (1,)
    for depth in depths:  # scale 1 first, then from the input up
        for decays in (True, False):
            groups[depth, decays] = {"params": [], "weight_decay": weight_decay if decays else 0.0}
            if layer_decay is not None:
                groups[depth, decays]["lr_scale"] = layer_decay ** (num_layers + 1 - depth)
    for name, param in named:  # without layer_decay every parameter is at depth num_layers + 1 = 1
        groups[ids.get(name, num_layers + 1), not no_weight_decay(name, param, model_says)]["params"].append(param)
    return list(groups.values())  # decay and no-decay alternate (a group may be empty)


_BLOCK = re.compile(r"(?:^|\.)(?:layers\.(\d+)\.)?blocks\.(\d+)\.")
_STAGE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_INPUT = ("patch_embed", "pos_embed", "cls_token", "reg_token", "dist_token", "absolute_pos_embed")


def layer_ids(names: list[str]) -> tuple[dict[str, int], int]:
    """Each parameter's layer for layer-wise decay, and the number of layers L: 0 for the input (patch and
    position embeddings, tokens), i + 1 for the i-th transformer block in forward order (ViT ``blocks.i``; Swin
    ``layers.s.blocks.b`` counted across stages, a stage's patch merging with its first block), L + 1 (no decay)
    for everything else (final norms, heads, a detector's pyramid and heads), as ViTDet's ``get_vit_lr_decay_rate``
    assigns them."""
    blocks = sorted({(int(m[1] or 0), int(m[2])) for n in names if (m := _BLOCK.search(n))})
    index = {b: i + 1 for i, b in enumerate(blocks)}
    first_of_stage = {}
    for stage, block in blocks:
        first_of_stage.setdefault(stage, index[stage, block])
    ids = {}
    for name in names:
        if (m := _BLOCK.search(name)):
            ids[name] = index[int(m[1] or 0), int(m[2])]
        elif any(f".{key}" in f".{name}" for key in _INPUT):
            ids[name] = 0
        elif (m := _STAGE.search(name)) and int(m[1]) in first_of_stage:
            ids[name] = first_of_stage[int(m[1])]
    return ids, len(blocks)


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, name: str = "adamw",
                    momentum: float = 0.9, beta2: float = 0.999, layer_decay: float | None = None
                    ) -> torch.optim.Optimizer:
    """AdamW (default), timm's LARS or momentum SGD over :func:`param_groups`.

    AdamW runs its fused kernel, which updates every tensor in one call; PyTorch picks it only on request, and on CPU
    the default per-tensor loop costs a small model more time than its backward pass. LARS scales each tensor's step
    by its trust ratio ||w|| / ||g|| only in the decay group, so biases and norms take plain momentum SGD steps.
    """
    groups = param_groups(model, weight_decay, layer_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "lars":
        from timm.optim import Lars

        for group in groups[::2]:  # the decay groups
            group["always_adapt"] = True  # trust ratio on weight matrices even when weight_decay is 0
        return Lars(groups, lr=lr, momentum=momentum)
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, beta2), fused=fused or None)


#: ViTDet's step schedule: the learning rate drops tenfold at these fractions of training (detectron2's 100-epoch
#: ViTDet config: iterations 163,889 and 177,546 of 184,375)
STEP_MILESTONES = (8 / 9, 26 / 27)


def build_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int, warmup_lr: float,
                    min_lr: float, schedule: str = "cosine"):
    """timm's CosineLRScheduler counted in optimizer steps (call ``step_update(num_updates)`` after each step).

    For update t (0-based), W = ``warmup_steps`` (at most T - 1), T = ``total_steps``:
      t < W:  lr = warmup_lr + t * (lr_peak - warmup_lr) / W
      t >= W: lr = min_lr + (lr_peak - min_lr) * (1 + cos(pi * (t - W) / (T - W))) / 2
    Per-iteration stepping makes the schedule a function of ``num_updates`` alone, which resume relies on.
    ``schedule="step"``: ViTDet's instead, the same warm-up then lr_peak x 0.1 ** (milestones passed), the
    milestones at :data:`STEP_MILESTONES` of ``total_steps`` (counted from step 0, warm-up included);
    ``min_lr`` is unused.
    """
    warmup_t = min(int(warmup_steps), max(total_steps - 1, 0))
    if schedule == "step":
        from timm.scheduler import MultiStepLRScheduler

        return MultiStepLRScheduler(optimizer, decay_t=[round(f * total_steps) for f in STEP_MILESTONES],
                                    decay_rate=0.1, warmup_t=warmup_t, warmup_lr_init=warmup_lr,
                                    warmup_prefix=False, t_in_epochs=False)
    # One step left after warm-up (a 1-epoch run whose warm-up fills it, or a 1-step run) is a cosine of one step:
    # timm warns that it "will have no effect", which is what the schedule above means, so that warning alone is
    # dropped, and only while this scheduler is built.
    logger = logging.getLogger(CosineLRScheduler.__module__)
    quiet = lambda record: "will have no effect" not in record.getMessage()  # noqa: E731
    logger.addFilter(quiet)
    try:  # warmup_prefix: the cosine starts at the peak once warm-up ends ("warm-up followed by cosine decay")
        return CosineLRScheduler(optimizer, t_initial=max(total_steps - warmup_t, 1), lr_min=min_lr,
                                 warmup_t=warmup_t, warmup_lr_init=warmup_lr, warmup_prefix=True, t_in_epochs=False)
    finally:
        logger.removeFilter(quiet)
