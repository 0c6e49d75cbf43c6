"""Training throughput: images per second of full training steps (forward, loss, backward, optimizer step)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.bench.latency import _check_counts, _sync


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    # The NS-Attn recipe's optimizer (AdamW, lr 1e-3, weight decay 0.05).
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05)


def measure_train_throughput(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], *, steps: int, warmup: int,
                             optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
                             amp_dtype: torch.dtype | None = None,
                             clock: Callable[[], float] | None = None) -> float:
    """Images per second of ``steps`` timed training steps after ``warmup`` untimed ones, on one fixed batch.

    One step: ``zero_grad``, forward (under ``torch.autocast(device, amp_dtype)`` when ``amp_dtype`` is given),
    cross-entropy loss (``targets`` may be class indices or soft labels of the logits' shape, as after Mixup),
    backward, optimizer step (with a ``GradScaler`` for float16 on CUDA). Throughput = steps * B / elapsed seconds,
    the device synchronised before reading the clock.

    The model is put in train mode and its weights are updated: pass a copy if the weights matter.

    Args:
        model: the network, on the same device as ``batch``.
        batch: ``(images, targets)`` already on the device.
        steps: timed steps (>= 1).
        warmup: untimed steps first (>= 0), e.g. to let cuDNN / torch.compile settle.
        optimizer_factory: ``params -> optimizer``; default AdamW(lr=1e-3, weight_decay=0.05).
        amp_dtype: e.g. ``torch.bfloat16`` for mixed precision; None for full precision.
        clock: host clock in seconds (default ``time.perf_counter``), injectable for tests.
    """
    _check_counts(steps=steps, warmup=warmup)
    images, targets = batch
    device = images.device
    clock = clock or time.perf_counter
    optimizer = (optimizer_factory or _default_optimizer)(model.parameters())
    use_scaler = amp_dtype == torch.float16 and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if use_scaler else None

    def autocast():
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=amp_dtype)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            logits = model(images)
            loss = F.cross_entropy(logits.float(), targets)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()

    model.train()
    for _ in range(warmup):
        step()
    _sync(device)
    t0 = clock()
    for _ in range(steps):
        step()
    _sync(device)
    elapsed = clock() - t0
    if elapsed <= 0:
        raise RuntimeError(f"the clock did not advance over {steps} training steps (elapsed {elapsed} s).")
    return steps * images.shape[0] / elapsed
