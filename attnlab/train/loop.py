"""The training loop: one run of a TrainConfig into ``runs/<name>/``.

Reads top to bottom in the order a run meets it: device and precision, run directory, model and data,
optimizer and schedule, (resume), then per epoch: train, evaluate, log, checkpoint; finally ``result.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from tqdm.auto import tqdm

from attnlab.errors import ConfigError, NonFiniteLossError

from . import distributed
from .checkpoint import (
    STATE,
    WEIGHTS,
    atomic_write_json,
    atomic_write_text,
    create_dir_with,
    find_checkpoint,
    get_rng_state,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from .config import RUNTIME_KEYS, TrainConfig, config_to_dict, run_name, uses_mixing, validate
from .optim import build_optimizer, build_scheduler

CONFIG, METRICS, RESULT = "config.yaml", "metrics.jsonl", "result.json"


# ----------------------------------------------------------------------------------------------- small pieces
def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device {device!r} is not a torch device; use auto, cpu, cuda or cuda:N.") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but CUDA is not available; use --device cpu or auto.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ConfigError(f"device {device!r} was asked for but this machine has {n} CUDA device(s); "
                          f"use cuda:0 to cuda:{n - 1}.")
    return dev


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default (no loss scaling needed, unlike fp16); fp32 on CPU, where bf16 is slow."""
    if amp == "none" or (amp == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of epoch ``epoch``'s data order and worker RNGs: a hash of (seed, epoch), so epochs never share a stream.

    Deriving it rather than carrying a generator forward makes an epoch's data a function of (seed, epoch) alone,
    which is what resuming at an epoch boundary needs.
    """
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def run_dir_of(cfg: TrainConfig) -> Path:
    """``<runs_dir>/<run_name>``, with the attention spec in its canonical form."""
    from attnlab import parse_spec

    return Path(cfg.runs_dir) / run_name(cfg, str(parse_spec(cfg.attn)))


def _resolved_config(cfg: TrainConfig, spec: str, name: str) -> dict[str, Any]:
    """What config.yaml holds: every field, with the canonical spec and the run's name, ``resume`` off."""
    return config_to_dict(dataclasses.replace(cfg, attn=spec, name=name, resume=False))


def _check_same_run(run_dir: Path, ours: dict[str, Any]) -> None:
    saved = yaml.safe_load((run_dir / CONFIG).read_text()) or {}
    differ = sorted(k for k in ours if k not in RUNTIME_KEYS and saved.get(k) != ours[k])
    if differ:
        raise ConfigError(f"cannot resume {run_dir}: its config.yaml differs in {', '.join(differ)}; resume with the "
                          f"same settings or pass another --name.")


def _read_result(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / RESULT).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{run_dir / RESULT} cannot be read ({err}); delete it to train the run again.") from None


def _train_sampler(cfg: TrainConfig, train_set, generator: torch.Generator,
                   ranks: distributed.Ranks = distributed.SINGLE):
    """This rank's share of the epoch's order (the whole order in one process); timm's RepeatAugSampler strides
    its list over the ranks, and the plain shuffle is strided the same way (``distributed.ShardedSampler``)."""
    if cfg.repeated_aug > 1:
        from timm.data.distributed_sampler import RepeatAugSampler

        return RepeatAugSampler(train_set, num_replicas=ranks.world_size, rank=ranks.rank, shuffle=True,
                                num_repeats=cfg.repeated_aug)
    order = RandomSampler(train_set, generator=generator)
    return distributed.ShardedSampler(order, ranks.world_size, ranks.rank) if ranks.distributed else order


def _check_steps(cfg: TrainConfig, sampled: int) -> int:
    """Optimizer steps per epoch (full batches only); raises ConfigError if there are none."""
    if sampled // cfg.batch_size == 0:
        raise ConfigError(f"batch_size {cfg.batch_size} is larger than the {sampled} training images of an "
                          f"epoch of {cfg.dataset}; use a smaller batch size.")
    return sampled // cfg.batch_size


def check_run(cfg: TrainConfig, cache: dict | None = None) -> dict[str, Any]:
    """Resolve everything :func:`train` needs before its first step, and say what it would do, without training.

    Raises the AttnlabError that ``train(cfg)`` would raise: options, spec, device, dataset (name, options, files,
    at least one batch per epoch), model, and a run directory it could not continue (another config, no intact
    checkpoint, a checkpoint without ``cfg.resume``). Returns ``{"name", "run_dir", "action", "epoch", "note",
    "result"}``: action ``"skip"`` (finished; ``result`` holds its result.json), ``"resume"`` (after completed
    epoch ``epoch``; ``note`` says why if not from the latest checkpoint) or ``"train"``. ``cache``, a dict kept
    across calls, makes a grid load each dataset and build each model once.
    """
    from attnlab import parse_spec
    from attnlab.data import build_dataset, dataset_info

    cache = {} if cache is None else cache
    cfg = validate(cfg)
    spec = str(parse_spec(cfg.attn))
    name = run_name(cfg, spec)
    run_dir = Path(cfg.runs_dir) / name
    resolve_device(cfg.device)
    data_key = ("data", cfg.dataset, cfg.data_dir, cfg.download, cfg.augment, repr(sorted(cfg.data_options.items())))
    if data_key not in cache:
        info = dataset_info(cfg.dataset, data_dir=cfg.data_dir, **cfg.data_options)
        n_train = len(build_dataset(cfg.dataset, True, data_dir=cfg.data_dir, download=cfg.download,
                                    augment=cfg.augment, **cfg.data_options))
        build_dataset(cfg.dataset, False, data_dir=cfg.data_dir, download=cfg.download, augment="none",
                      **cfg.data_options)
        cache[data_key] = (info, n_train)
    info, n_train = cache[data_key]
    _check_steps(cfg, len(_train_sampler(cfg, range(n_train), torch.Generator())))
    model_key = ("model", cfg.model, spec, cfg.norm, cfg.drop_path, repr(sorted(cfg.model_options.items())), info,
                 cfg.pretrained, cfg.pretrained_file)
    if model_key not in cache:
        with torch.random.fork_rng(devices=[]):  # leave the caller's random streams as they were
            build_run_model(cfg, info)
        cache[model_key] = True

    plan = {"name": name, "run_dir": run_dir, "action": "train", "epoch": 0, "note": None, "result": None}
    finished, resumable = (run_dir / RESULT).exists(), has_checkpoint(run_dir)
    if resumable and not cfg.resume:
        raise ConfigError(f"run directory {run_dir} already holds a checkpoint; pass --resume to continue it or "
                          f"--name to start another run.")
    if cfg.resume and (run_dir / CONFIG).exists() and (resumable or finished):
        _check_same_run(run_dir, _resolved_config(cfg, spec, name))
    if cfg.resume and finished:
        plan.update(action="skip", result=_read_result(run_dir))
    elif resumable:
        found = find_checkpoint(run_dir)
        plan.update(action="resume", epoch=found.epoch, note=found.note)
    return plan


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------- one epoch
def train_one_epoch(model, loader, optimizer, scheduler, criterion, mixup_fn, *, device, amp_dtype, epoch: int,
                    epochs: int, num_updates: int, clip_grad: float | None, log_every: int, progress: bool,
                    on_step=None):
    """One pass over ``loader``. Returns (stats, num_updates). Raises NonFiniteLossError at a NaN/inf loss.
    ``on_step(num_updates)`` runs after every optimizer step (the probe; it must leave the model in train mode)."""
    model.train()
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    loss_sum, correct, seen = 0.0, 0, 0
    start = time.perf_counter()
    bar = tqdm(loader, desc=f"epoch {epoch}/{epochs}", disable=not progress, leave=False, dynamic_ncols=True)
    for step, (images, labels) in enumerate(bar, start=1):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        targets = labels
        if mixup_fn is not None:
            images, targets = mixup_fn(images, labels)  # soft targets; label smoothing folded in
        with autocast:
            logits = model(images)
        loss = criterion(logits.float(), targets)
        loss_value = loss.item()
        if distributed.any_rank(not math.isfinite(loss_value)):
            raise distributed.shared(NonFiniteLossError(
                f"training loss became {loss_value} at epoch {epoch} step {step}; training stopped and the last "
                f"good checkpoint (epoch {epoch - 1}) was kept, so lower the learning rate or enable clip_grad."))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        optimizer.step()
        num_updates += 1
        scheduler.step_update(num_updates)
        if on_step is not None:
            on_step(num_updates)

        n = labels.shape[0]
        loss_sum += loss_value * n
        correct += int((logits.argmax(-1) == labels).sum())  # against the unmixed label
        seen += n
        if progress and (step % log_every == 0 or step == len(loader)):
            bar.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{100 * correct / seen:.2f}",
                            img_s=f"{seen / (time.perf_counter() - start):.0f}",
                            lr=f"{optimizer.param_groups[0]['lr']:.2e}", refresh=False)
    bar.close()
    loss_sum, correct, seen = (float(v) for v in distributed.reduce_sums(loss_sum, correct, seen))  # all ranks
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    stats = {"train_loss": loss_sum / max(seen, 1), "train_acc": 100.0 * correct / max(seen, 1),
             "train_seconds": seconds, "img_per_s": seen / seconds if seconds > 0 else 0.0}
    return stats, num_updates


@torch.no_grad()
def evaluate(model, loader, *, device, amp_dtype, num_classes: int) -> dict[str, float]:
    """Test loss (plain cross-entropy, no smoothing) and top-1 / top-5 accuracy in percent."""
    model.eval()
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    k = min(5, num_classes)
    loss_sum, top1, topk, seen = 0.0, 0, 0, 0
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast:
            logits = model(images)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        hits = logits.topk(k, dim=-1).indices == labels[:, None]
        top1 += int(hits[:, 0].sum())
        topk += int(hits.any(dim=-1).sum())
        seen += labels.shape[0]
    seen = max(seen, 1)
    return {"test_loss": loss_sum / seen, "top1": 100.0 * top1 / seen, "top5": 100.0 * topk / seen}


# ----------------------------------------------------------------------------------------------- the run
def train(cfg: TrainConfig, probe=None) -> dict[str, Any]:
    """Train ``cfg`` into ``<runs_dir>/<name>/`` and return the result dict (also written to result.json).

    ``cfg.resume``: continue from the last completed epoch if the run directory holds a checkpoint (on CPU the
    final weights equal an uninterrupted run's), return the stored result if it already finished, start afresh
    otherwise. Without it an existing checkpoint is an error, so that no run is overwritten by accident.
    Raises NonFiniteLossError (epoch and step in the message) at a NaN/inf loss, keeping the last checkpoint.
    With ``cfg.probe_every > 0``, ``probe(model, images) -> dict`` runs every that many steps on the first
    ``cfg.probe_images`` test images; each epoch's metrics line lists its results under ``probes`` as
    ``{"step": n, ...}``. The caller supplies the probe (the command line passes
    ``attnlab.analysis.training_probe``), since the instruments sit in a layer above training.
    """
    cfg = validate(cfg)
    if cfg.probe_every > 0 and probe is None:
        raise ConfigError(f"probe_every={cfg.probe_every} needs a probe: call train(cfg, "
                          f"probe=attnlab.analysis.training_probe) as `attnlab train` does, or set probe_every to 0.")
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # Denormal floats (a saturated softmax's gradients, e.g. speccond(lam=10)) make CPU matmuls several times
    # slower; GPUs flush them to zero anyway, so do the same on the CPU.
    flush = torch.set_flush_denormal(True)
    try:
        with distributed.session(resolve_device(cfg.device)) as ranks:
            try:
                return _train(cfg, probe, ranks)
            except Exception as err:
                raise distributed.settle(err)  # under torchrun: the same error on every rank
    finally:
        torch.set_num_threads(threads)
        if flush:
            torch.set_flush_denormal(False)


def build_run_model(cfg: TrainConfig, info, pretrained: bool = True) -> nn.Module:
    """The model a run trains: the preset sized for the dataset (``info``), drop-path and model options applied,
    starting from the pretrained weights the config names (``pretrained=False``: not read, as for a checkpoint)."""
    from attnlab.models import build_model

    model_kwargs = dict(in_chans=info.in_chans, img_size=info.image_size)
    if pretrained and (cfg.pretrained or cfg.pretrained_file):
        model_kwargs.update(pretrained=True, pretrained_file=cfg.pretrained_file)
    if cfg.drop_path is not None:
        model_kwargs["drop_path_rate"] = cfg.drop_path
    model_kwargs.update(cfg.model_options)
    return build_model(cfg.model, num_classes=info.num_classes, attn=cfg.attn, norm=cfg.norm, **model_kwargs)


def load_run(run_dir: str | Path, map_location: str | torch.device = "cpu") -> tuple[nn.Module, TrainConfig]:
    """A run's model in eval mode with its last checkpoint's weights, on ``map_location`` (``"cpu"``, ``"cuda:1"``,
    ``"meta"`` for the structure alone), and its config (read from the run's files alone)."""
    from attnlab.data import dataset_info
    from attnlab.train.config import load_config

    run_dir = Path(run_dir)
    if not (run_dir / CONFIG).exists() or not has_checkpoint(run_dir):
        raise ConfigError(f"{run_dir} is not a run directory with a checkpoint (config.yaml, checkpoint.safetensors).")
    cfg = load_config(run_dir / CONFIG)
    model = build_run_model(cfg, dataset_info(cfg.dataset, data_dir=cfg.data_dir, **cfg.data_options),
                            pretrained=False)
    weights, _ = load_checkpoint(run_dir, map_location="cpu")
    model.load_state_dict(weights)
    # built on the CPU and then moved, as training does: sigma's set-up calls .item(), which meta cannot
    return model.to(map_location).eval(), cfg


def _train(cfg: TrainConfig, probe=None, ranks: distributed.Ranks = distributed.SINGLE) -> dict[str, Any]:
    from attnlab import parse_spec
    from attnlab.data import build_dataset, dataset_info
    from attnlab.variants import training_hooks

    spec = str(parse_spec(cfg.attn))
    name = run_name(cfg, spec)
    run_dir = Path(cfg.runs_dir) / name
    device = distributed.rank_device(resolve_device(cfg.device), ranks)
    amp_dtype = resolve_amp(cfg.amp, device)
    cfg = dataclasses.replace(cfg, world_size=ranks.world_size)  # recorded in config.yaml
    resolved = _resolved_config(cfg, spec, name)
    rank_batch = distributed.rank_batch_size(cfg.batch_size, ranks)
    if uses_mixing(cfg) and rank_batch % 2:
        raise ConfigError(f"batch_size {cfg.batch_size} over {ranks.world_size} ranks gives {rank_batch} images per "
                          f"rank, but Mixup/CutMix pair each rank's images and need an even number; use a multiple "
                          f"of {2 * ranks.world_size}.")
    main = ranks.is_main  # rank 0 alone writes files, prints and logs
    from .tb import require

    require(cfg.log)

    resuming = has_checkpoint(run_dir)
    if resuming and not cfg.resume:
        raise ConfigError(f"run directory {run_dir} already holds a checkpoint; pass --resume to continue it or "
                          f"--name to start another run.")
    if cfg.resume and (run_dir / CONFIG).exists() and (resuming or (run_dir / RESULT).exists()):
        _check_same_run(run_dir, resolved)
        if (run_dir / RESULT).exists():
            return _read_result(run_dir)
    # read before anything is built, so that a run with no intact checkpoint stops at once
    found = find_checkpoint(run_dir, map_location="cpu") if resuming else None

    # Model and data. Seeding first makes the initial weights a function of the seed.
    seed_everything(cfg.seed)
    info = dataset_info(cfg.dataset, data_dir=cfg.data_dir, **cfg.data_options)
    model = build_run_model(cfg, info, pretrained=found is None).to(device)  # a checkpoint replaces the weights
    # The run directory appears together with its config.yaml, so that a killed run continues with
    # `train --resume RUN_DIR`: before a download (minutes), else once the data has loaded (bad input makes none).
    config_file = {CONFIG: yaml.safe_dump(resolved, sort_keys=False).encode()}
    if cfg.download and main:
        create_dir_with(run_dir, config_file)
    if cfg.download and ranks.distributed and not main:
        distributed.agree(None)  # rank 0 downloads first
    train_set = build_dataset(cfg.dataset, True, data_dir=cfg.data_dir, download=cfg.download, augment=cfg.augment,
                              **cfg.data_options)
    test_set = build_dataset(cfg.dataset, False, data_dir=cfg.data_dir, download=cfg.download, augment="none",
                             **cfg.data_options)
    if cfg.download and ranks.distributed and main:
        distributed.agree(None)
    if main:
        create_dir_with(run_dir, config_file)

    # One generator drives the sampler and the workers' seeds (the DataLoader draws its base seed from it);
    # it is re-seeded from (seed, epoch) at the start of every epoch. Workers are not persistent so that each
    # epoch's workers are seeded anew from it; torch seeds random, numpy and torch in each worker.
    # The order has a generator of its own, seeded from (seed, epoch) alike on every rank, so that N ranks split
    # the one-process order; under torchrun data_gen seeds each rank's workers from (seed, epoch, rank).
    data_gen, order_gen = torch.Generator(), torch.Generator()
    sampler = _train_sampler(cfg, train_set, order_gen, ranks)
    pin = device.type == "cuda"
    train_loader = DataLoader(train_set, batch_size=rank_batch, sampler=sampler, drop_last=True,
                              num_workers=cfg.num_workers, pin_memory=pin, generator=data_gen)
    test_loader = DataLoader(test_set, batch_size=2 * cfg.batch_size, shuffle=False, num_workers=cfg.num_workers,
                             pin_memory=pin, generator=torch.Generator().manual_seed(0))
    steps_per_epoch = _check_steps(cfg, len(sampler) * ranks.world_size)

    mixup_fn = None
    if uses_mixing(cfg):
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy

        mixup_fn = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
                         switch_prob=cfg.mixup_switch_prob, mode="batch", label_smoothing=cfg.label_smoothing,
                         num_classes=info.num_classes)
        criterion = SoftTargetCrossEntropy()
    else:
        criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.optimizer, cfg.momentum)
    hooks = training_hooks()  # terms that act during training (QK-clip's clip after each step), from the registry
    for hook in hooks:
        hook.attach(model, optimizer)  # a no-op on models without the term
    scheduler = build_scheduler(optimizer, epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
                                warmup_epochs=cfg.warmup_epochs, warmup_lr=cfg.warmup_lr, min_lr=cfg.min_lr)

    start_epoch, num_updates, history = 0, 0, []
    previous = None  # the checkpoint pair the first new checkpoint keeps as the previous one
    if found is not None:
        if found.note and main:
            print(f"{name}: {found.note}", file=sys.stderr, flush=True)
        weights, state, previous = found.weights, found.state, found.files
        model.load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, num_updates, history = int(state["epoch"]), int(state["num_updates"]), list(state["history"])
        set_rng_state(state["rng"])
    # metrics.jsonl rewritten from the checkpoint's history (dropping any epoch logged after it)
    if main:
        atomic_write_text(run_dir / METRICS, "".join(json.dumps(h) + "\n" for h in history))
    tb_log = None
    if cfg.log == "tensorboard" and main:
        from .tb import TensorBoardLog

        tb_log = TensorBoardLog(run_dir, start_step=num_updates)
    distributed.agree(None)  # set-up done on every rank (or every rank stops with the first rank's error)

    trained = model
    if ranks.distributed:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    forward = torch.compile(trained) if cfg.compile else trained
    # evaluation runs on rank 0 alone, outside DDP, whose forward would wait for the other ranks
    evaluate_with = forward if not ranks.distributed else torch.compile(model) if cfg.compile else model
    params = count_params(model)
    progress = cfg.progress and main
    if progress:
        tqdm.write(f"{name}: {params / 1e6:.2f}M parameters, {device.type}"
                   f"{' bf16' if amp_dtype else ' fp32'}, {steps_per_epoch} steps/epoch"
                   + (f", resuming after epoch {start_epoch}" if start_epoch else ""))

    probes: list[dict[str, Any]] = []
    on_step = None
    if cfg.probe_every > 0 and main:
        probe_images = torch.stack([test_set[i][0] for i in range(min(cfg.probe_images, len(test_set)))]).to(device)

        def on_step(step: int) -> None:
            if step % cfg.probe_every == 0:
                probes.append({"step": step, **probe(model, probe_images)})
                model.train()

    for epoch in range(start_epoch + 1, cfg.epochs + 1):
        epoch_start = time.perf_counter()
        probes.clear()
        order_gen.manual_seed(epoch_seed(cfg.seed, epoch))
        data_gen.manual_seed(epoch_seed(cfg.seed, epoch))
        if ranks.distributed:  # augmentation, mixing and drop-path: each rank its own streams
            data_gen.manual_seed(distributed.rank_seed(cfg.seed, epoch, ranks.rank))
            distributed.seed_rank(cfg.seed, epoch, ranks.rank)
        if cfg.repeated_aug > 1:
            sampler.set_epoch(epoch_seed(cfg.seed, epoch))  # timm's sampler shuffles with seed = its "epoch"
        with distributed.steps():
            stats, num_updates = train_one_epoch(
                forward, train_loader, optimizer, scheduler, criterion, mixup_fn, device=device, amp_dtype=amp_dtype,
                epoch=epoch, epochs=cfg.epochs, num_updates=num_updates, clip_grad=cfg.clip_grad,
                log_every=cfg.log_every, progress=progress, on_step=on_step)
        if not main:
            distributed.agree(None)  # while rank 0 evaluates and writes the epoch
            continue
        test = evaluate(evaluate_with, test_loader, device=device, amp_dtype=amp_dtype, num_classes=info.num_classes)
        record = {"epoch": epoch, "train_loss": stats["train_loss"], "train_acc": stats["train_acc"], **test,
                  "lr": optimizer.param_groups[0]["lr"], "epoch_seconds": time.perf_counter() - epoch_start,
                  "img_per_s": stats["img_per_s"]}
        for hook in hooks:
            record.update(hook.stats(model))
        if probes:
            record["probes"] = list(probes)
        history.append(record)
        if progress:
            tqdm.write(f"epoch {epoch}/{cfg.epochs}  train_loss {record['train_loss']:.4f}  test_loss "
                       f"{record['test_loss']:.4f}  top1 {record['top1']:.2f}  top5 {record['top5']:.2f}  "
                       f"{record['img_per_s']:.0f} img/s")
        atomic_write_text(run_dir / METRICS, "".join(json.dumps(h) + "\n" for h in history))
        save_checkpoint(run_dir, model, {
            "epoch": epoch, "num_updates": num_updates, "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "sampler": {"seed": cfg.seed, "next_epoch": epoch + 1},
            "rng": get_rng_state(), "history": history,
        }, previous=previous)
        previous = (WEIGHTS, STATE)
        if tb_log is not None:
            tb_log.epoch(record, num_updates)
        distributed.agree(None)
    if not main:
        distributed.agree(None)  # while rank 0 writes result.json
        return distributed.from_main(None)
    if tb_log is not None:
        tb_log.close()
    last = history[-1]
    result = {"name": name, "model": cfg.model, "dataset": cfg.dataset, "tag": cfg.tag, "attn": spec, "seed": cfg.seed,
              "epochs": cfg.epochs, "top1": last["top1"], "top5": last["top5"], "test_loss": last["test_loss"],
              "params": params, "seconds": sum(h["epoch_seconds"] for h in history), "extra": {},
              "world_size": ranks.world_size}
    atomic_write_json(run_dir / RESULT, result)
    distributed.agree(None)
    return distributed.from_main(result)
