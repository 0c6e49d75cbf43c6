"""The training loop: one run of a TrainConfig into ``runs/<name>/``.

Reads top to bottom in the order a run meets it: device and precision, run directory, model and data,
optimizer and schedule, (resume), then per epoch: train, evaluate, log, checkpoint; finally ``result.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save as safetensors_bytes
from torch import nn
from torch.utils.data import DataLoader, RandomSampler
from tqdm.auto import tqdm

from attnlab.errors import ConfigError, NonFiniteLossError
from attnlab.ops.sdpa import short_sequence_products

from . import distributed
from .checkpoint import (
    RESUME_KEYS,
    STATE,
    WEIGHTS,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    create_dir_with,
    find_weights,
    get_rng_state,
    has_checkpoint,
    resume_point,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    weights_of,
)
from .config import RUNTIME_KEYS, TrainConfig, config_to_dict, run_name, uses_mixing, validate
from .lock import RunLock, check_unlocked
from .optim import build_optimizer, build_scheduler

CONFIG, METRICS, RESULT = "config.yaml", "metrics.jsonl", "result.json"
EMA_WEIGHTS = "ema.safetensors"  # the EMA of the weights (cfg.ema), written with each checkpoint


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


COMPILE_MODES = {"cuda": "reduce-overhead", "cpu": "default"}  # 'auto' per device type; measured in docs/perf.md


def compile_mode(mode: str, device: torch.device) -> str:
    """torch.compile's mode for ``mode`` ('auto': CUDA graphs on CUDA, where the step's shapes are static)."""
    return COMPILE_MODES.get(device.type, "default") if mode == "auto" else mode


TENSOR_DATASETS = ("cifar10", "cifar100", "digits", "synthetic")  # what the device pipeline holds


def data_on_device(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the run's train split lives on the device (``cfg.data_on_device``; None: on CUDA for the tensor
    datasets), or ConfigError for a dataset the device pipeline cannot hold."""
    from attnlab.data.registry import _name

    tensor = _name(cfg.dataset) in TENSOR_DATASETS
    if cfg.data_on_device is None:
        return tensor and device.type == "cuda"
    if cfg.data_on_device and not tensor:
        raise ConfigError(f"data_on_device is on, but the device pipeline holds the tensor datasets "
                          f"({', '.join(TENSOR_DATASETS)}), not {cfg.dataset}; drop --data-on-device.")
    return cfg.data_on_device


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
    at least one batch per epoch), model, and a run directory it could not continue (another config, a checkpoint
    without ``cfg.resume``, another process holding its lock). Returns ``{"name", "run_dir", "action", "epoch",
    "note", "result"}``: action ``"skip"`` (finished; ``result`` holds its result.json), ``"resume"`` (after
    completed epoch ``epoch``; ``note`` says why if not from the latest checkpoint) or ``"train"`` (``note`` says
    why when checkpoint files without an intact pair make it start afresh). ``cache``, a dict kept
    across calls, makes a grid load each dataset and build each model once.
    """
    from attnlab import parse_spec
    from attnlab.data import build_dataset, dataset_info

    cache = {} if cache is None else cache
    cfg = validate(cfg)
    spec = str(parse_spec(cfg.attn))
    name = run_name(cfg, spec)
    run_dir = Path(cfg.runs_dir) / name
    data_on_device(cfg, resolve_device(cfg.device))
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
    check_unlocked(run_dir)  # another process is training it
    finished, resumable = (run_dir / RESULT).exists(), has_checkpoint(run_dir)
    if resumable and not cfg.resume:
        raise ConfigError(f"run directory {run_dir} already holds a checkpoint; pass --resume to continue it or "
                          f"--name to start another run.")
    if cfg.resume and (run_dir / CONFIG).exists() and (resumable or finished):
        _check_same_run(run_dir, _resolved_config(cfg, spec, name))
    if cfg.resume and finished:
        plan.update(action="skip", result=_read_result(run_dir))
    elif resumable:
        found, note = resume_point(run_dir)  # None: no intact pair, the run starts afresh
        plan.update(action="resume" if found else "train", epoch=found.epoch if found else 0, note=note)
    return plan


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------- one epoch
def host_batches(loader, device: torch.device, mixup_fn=None) -> Iterator[tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]]:
    """(images, targets, labels) on ``device`` from a CPU loader: ``targets`` mixed by ``mixup_fn`` (soft, label
    smoothing folded in) or the labels; the device pipeline yields the same triples."""
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        targets = labels
        if mixup_fn is not None:
            images, targets = mixup_fn(images, labels)
        yield images, targets, labels


def _read_stats(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The step's device sums on the host, summed over the ranks: the one sync of a log point."""
    return dict(zip(sums, (float(v) for v in distributed.reduce_sums(*sums.values()))))


def train_one_epoch(model, batches, optimizer, scheduler, criterion, *, steps: int, device, amp_dtype, epoch: int,
                    epochs: int, num_updates: int, clip_grad: float | None, log_every: int, progress: bool,
                    on_step=None, cudagraphs: bool = False):
    """One pass over ``batches`` ((images, targets, labels) on the device, ``steps`` of them). Returns (stats,
    num_updates). ``on_step(num_updates)`` runs after every optimizer step (the probe and the EMA; the probe must
    leave the model in train mode).

    Nothing in a step waits for the device: loss, accuracy and a non-finite flag (the first bad step and its loss)
    accumulate there and are read every ``log_every`` steps and at the end, where a non-finite loss raises
    NonFiniteLossError naming its step and the window it was found in. ``cudagraphs``: mark each step's start for
    torch.compile's CUDA graphs (mode reduce-overhead), whose outputs the next replay overwrites.
    """
    model.train()
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    zero = lambda dtype: torch.zeros((), dtype=dtype, device=device)  # noqa: E731
    sums = {"loss": zero(torch.float64), "correct": zero(torch.int64), "seen": zero(torch.int64),
            "bad": zero(torch.int64)}
    bad_step, bad_loss = zero(torch.int64), zero(torch.float32)
    checked, stats = 0, {"loss": 0.0, "correct": 0.0, "seen": 0.0}
    start = time.perf_counter()
    bar = tqdm(batches, total=steps, desc=f"epoch {epoch}/{epochs}", disable=not progress, leave=False,
               dynamic_ncols=True)
    for step, (images, targets, labels) in enumerate(bar, start=1):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast, short_sequence_products():
            logits = model(images)
        loss = criterion(logits.float(), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        optimizer.step()
        num_updates += 1
        scheduler.step_update(num_updates)
        if on_step is not None:
            on_step(num_updates)

        value = loss.detach()
        first_bad = ~torch.isfinite(value) & (bad_step == 0)
        bad_step.masked_fill_(first_bad, step)
        bad_loss.copy_(torch.where(first_bad, value.float(), bad_loss))
        sums["bad"] += first_bad
        sums["loss"] += value.double() * labels.shape[0]
        sums["correct"] += (logits.detach().argmax(-1) == labels).sum()  # against the unmixed label
        sums["seen"] += labels.shape[0]
        if step % log_every == 0 or step == steps:
            stats = _read_stats(sums)
            if stats["bad"]:  # a step since the last check (on this rank or another) had a non-finite loss
                where = int(bad_step) or None
                found = f"step {where}" if where else f"one of steps {checked + 1}-{step} on another rank"
                raise distributed.shared(NonFiniteLossError(
                    f"training loss became {float(bad_loss) if where else 'non-finite'} at epoch {epoch} {found} "
                    f"(found at the check after step {step}); training stopped and the last good checkpoint "
                    f"(epoch {epoch - 1}) was kept, so lower the learning rate or enable clip_grad."))
            checked = step
            if progress:
                seen = max(stats["seen"], 1.0)
                bar.set_postfix(loss=f"{stats['loss'] / seen:.4f}", acc=f"{100 * stats['correct'] / seen:.2f}",
                                img_s=f"{seen / (time.perf_counter() - start):.0f}",
                                lr=f"{optimizer.param_groups[0]['lr']:.2e}", refresh=False)
    bar.close()
    seconds = time.perf_counter() - start  # the last check read the device, so its work is done
    seen = max(stats["seen"], 1.0)
    stats = {"train_loss": stats["loss"] / seen, "train_acc": 100.0 * stats["correct"] / seen,
             "train_seconds": seconds, "img_per_s": stats["seen"] / seconds if seconds > 0 else 0.0}
    return stats, num_updates


@torch.no_grad()
def evaluate(model, loader, *, device, amp_dtype, num_classes: int, pad_to: int | None = None) -> dict[str, float]:
    """Test loss (plain cross-entropy, no smoothing) and top-1 / top-5 accuracy in percent.

    ``pad_to``: pad a smaller last batch with zero images to this size and drop their logits, so that a compiled
    model sees one shape (in eval mode every image is computed on its own, so the others' logits are unchanged).
    """
    model.eval()
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    k = min(5, num_classes)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, top-1 hits, top-k hits: read once at the end
    seen = 0
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        n = labels.shape[0]
        if pad_to is not None and n < pad_to:
            images = torch.cat([images, images.new_zeros((pad_to - n, *images.shape[1:]))])
        with autocast:
            logits = model(images)
        logits = logits[:n].float()
        hits = logits.topk(k, dim=-1).indices == labels[:, None]
        sums += torch.stack([F.cross_entropy(logits, labels, reduction="sum").double(),
                             hits[:, 0].sum().double(), hits.any(dim=-1).sum().double()])
        seen += n
    loss_sum, top1, topk = sums.tolist()
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
                with RunLock(run_dir_of(cfg), enabled=ranks.is_main) as lock:  # one writer per run directory
                    return _train(cfg, probe, ranks, lock)
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
    found = find_weights(run_dir, model=model)  # the weights alone: a reader never loads the trainer state
    note = found.fallback("using")  # analysis and eval read a run too: say which epoch they measure
    if note:
        print(f"{run_dir.name}: {note}", file=sys.stderr, flush=True)
    model.load_state_dict(found.weights)
    # built on the CPU and then moved, as training does: sigma's set-up calls .item(), which meta cannot
    return model.to(map_location).eval(), cfg


def _train(cfg: TrainConfig, probe=None, ranks: distributed.Ranks = distributed.SINGLE,
           lock: RunLock | None = None) -> dict[str, Any]:
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

    # Model and data. Seeding first makes the initial weights a function of the seed.
    seed_everything(cfg.seed)
    info = dataset_info(cfg.dataset, data_dir=cfg.data_dir, **cfg.data_options)
    model = build_run_model(cfg, info, pretrained=not resuming).to(device)  # a checkpoint replaces the weights
    # the newest pair that is intact and fits the model; with none (a kill in the first save) start afresh, saying so
    found, note = None, None
    if resuming:
        found, note = resume_point(run_dir, model, RESUME_KEYS + (("ema",) if cfg.ema else ()))
    if note and main:
        print(f"{name}: {note}", file=sys.stderr, flush=True)
    if resuming and found is None and (cfg.pretrained or cfg.pretrained_file):
        seed_everything(cfg.seed)  # built again as a fresh run builds it, from its pretrained weights
        model = build_run_model(cfg, info).to(device)
    # The run directory appears together with its config.yaml, so that a killed run continues with
    # `train --resume RUN_DIR`: before a download (minutes), else once the data has loaded (bad input makes none).
    config_file = {CONFIG: yaml.safe_dump(resolved, sort_keys=False).encode()}
    if cfg.download and main:
        create_dir_with(run_dir, config_file, lock)
    if cfg.download and ranks.distributed and not main:
        distributed.agree(None)  # rank 0 downloads first
    on_device = data_on_device(cfg, device)
    if on_device:  # the train split and its augmentation on the device (attnlab.data.device_pipeline)
        from attnlab.data import build_device_pipeline

        pipe = build_device_pipeline(
            cfg.dataset, device=device, batch_size=rank_batch, seed=cfg.seed, data_dir=cfg.data_dir,
            download=cfg.download, augment=cfg.augment, repeated_aug=cfg.repeated_aug,
            num_replicas=ranks.world_size, rank=ranks.rank, mixup=cfg.mixup, cutmix=cfg.cutmix,
            mix_prob=cfg.mixup_prob, switch_prob=cfg.mixup_switch_prob, label_smoothing=cfg.label_smoothing,
            **cfg.data_options)
    else:
        train_set = build_dataset(cfg.dataset, True, data_dir=cfg.data_dir, download=cfg.download,
                                  augment=cfg.augment, **cfg.data_options)
    test_set = build_dataset(cfg.dataset, False, data_dir=cfg.data_dir, download=cfg.download, augment="none",
                             **cfg.data_options)
    if cfg.download and ranks.distributed and main:
        distributed.agree(None)
    if main:
        create_dir_with(run_dir, config_file, lock)

    # One generator drives the sampler and the workers' seeds (the DataLoader draws its base seed from it);
    # it is re-seeded from (seed, epoch) at the start of every epoch. Workers are not persistent so that each
    # epoch's workers are seeded anew from it; torch seeds random, numpy and torch in each worker.
    # The order has a generator of its own, seeded from (seed, epoch) alike on every rank, so that N ranks split
    # the one-process order; under torchrun data_gen seeds each rank's workers from (seed, epoch, rank).
    # The device pipeline's epoch is a function of (seed, epoch, rank) and needs neither.
    data_gen, order_gen = torch.Generator(), torch.Generator()
    pin = device.type == "cuda"
    if not on_device:
        sampler = _train_sampler(cfg, train_set, order_gen, ranks)
        train_loader = DataLoader(train_set, batch_size=rank_batch, sampler=sampler, drop_last=True,
                                  num_workers=cfg.num_workers, pin_memory=pin, generator=data_gen)
        steps_per_epoch = _check_steps(cfg, len(sampler) * ranks.world_size)
    else:
        steps_per_epoch = len(pipe)
    test_loader = DataLoader(test_set, batch_size=2 * cfg.batch_size, shuffle=False, num_workers=cfg.num_workers,
                             pin_memory=pin, generator=torch.Generator().manual_seed(0))

    mixup_fn = None
    if uses_mixing(cfg):
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy

        if not on_device:  # the pipeline mixes itself, with the same numbers
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
        weights, state, previous = found.weights, found.state, found.files
        model.load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, num_updates, history = int(state["epoch"]), int(state["num_updates"]), list(state["history"])
        set_rng_state(state["rng"])
    ema = None
    if cfg.ema:
        from timm.utils import ModelEmaV3

        # parameters averaged; buffers (sigma's power-iteration u, QK-clip's records) copied from the live model,
        # since an average of unit vectors is not a unit vector
        ema = ModelEmaV3(model, decay=cfg.ema_decay, exclude_buffers=True)
        if found is not None:
            ema.module.load_state_dict(found.state["ema"])
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
    mode = compile_mode(cfg.compile_mode, device) if cfg.compile else None
    if cfg.compile:  # every model class shares its forward's code, whose recompile limit (8) earlier runs in this
        torch.compiler.reset()  # process (a grid's worker) would use up, after which dynamo falls back to eager
    # static shapes (dynamic=False): the train batches are full, evaluate pads its last batch
    compiled = (lambda m: torch.compile(m, mode=mode, dynamic=False)) if cfg.compile else (lambda m: m)  # noqa: E731
    forward = compiled(trained)
    # evaluation runs on rank 0 alone, outside DDP, whose forward would wait for the other ranks
    evaluate_with = forward if not ranks.distributed else compiled(model)
    cudagraphs = mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"
    params = count_params(model)
    progress = cfg.progress and main
    if progress:
        tqdm.write(f"{name}: {params / 1e6:.2f}M parameters, {device.type}"
                   f"{' bf16' if amp_dtype else ' fp32'}, {steps_per_epoch} steps/epoch"
                   + (f", resuming after epoch {start_epoch}" if start_epoch else ""))

    probes: list[dict[str, Any]] = []
    after_step = []
    if ema is not None:
        after_step.append(lambda step: ema.update(model, step=step))  # timm's decay is 0 at step 1: a copy
    if cfg.probe_every > 0 and main:
        probe_images = torch.stack([test_set[i][0] for i in range(min(cfg.probe_images, len(test_set)))]).to(device)

        def run_probe(step: int) -> None:
            if step % cfg.probe_every == 0:
                probes.append({"step": step, **probe(model, probe_images)})
                model.train()
        after_step.append(run_probe)

    def on_step(step: int) -> None:
        for fn in after_step:
            fn(step)

    for epoch in range(start_epoch + 1, cfg.epochs + 1):
        epoch_start = time.perf_counter()
        probes.clear()
        order_gen.manual_seed(epoch_seed(cfg.seed, epoch))
        data_gen.manual_seed(epoch_seed(cfg.seed, epoch))
        if ranks.distributed:  # augmentation, mixing and drop-path: each rank its own streams
            data_gen.manual_seed(distributed.rank_seed(cfg.seed, epoch, ranks.rank))
            distributed.seed_rank(cfg.seed, epoch, ranks.rank)
        if cfg.repeated_aug > 1 and not on_device:
            sampler.set_epoch(epoch_seed(cfg.seed, epoch))  # timm's sampler shuffles with seed = its "epoch"
        batches = pipe.epoch(epoch) if on_device else host_batches(train_loader, device, mixup_fn)
        with distributed.steps():
            stats, num_updates = train_one_epoch(
                forward, batches, optimizer, scheduler, criterion, steps=steps_per_epoch, device=device,
                amp_dtype=amp_dtype, epoch=epoch, epochs=cfg.epochs, num_updates=num_updates,
                clip_grad=cfg.clip_grad, log_every=cfg.log_every, progress=progress,
                on_step=on_step if after_step else None,
                cudagraphs=cudagraphs)
        if not main:
            distributed.agree(None)  # while rank 0 evaluates and writes the epoch
            continue
        test = evaluate(evaluate_with, test_loader, device=device, amp_dtype=amp_dtype, num_classes=info.num_classes,
                        pad_to=test_loader.batch_size if cfg.compile else None)
        record = {"epoch": epoch, "train_loss": stats["train_loss"], "train_acc": stats["train_acc"], **test,
                  "lr": optimizer.param_groups[0]["lr"], "epoch_seconds": time.perf_counter() - epoch_start,
                  "img_per_s": stats["img_per_s"]}
        for hook in hooks:
            record.update(hook.stats(model))
        if ema is not None:  # the EMA weights on the same test set, eager (off by default; no second compile)
            ema_test = evaluate(ema.module, test_loader, device=device, amp_dtype=amp_dtype,
                                num_classes=info.num_classes)
            record.update({f"ema_{k}": v for k, v in ema_test.items()})
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
            **({"ema": weights_of(ema.module)} if ema is not None else {}),
        }, previous=previous)
        if ema is not None:  # the EMA weights for use, beside the raw ones (the resumable copy is in the state)
            atomic_write_bytes(run_dir / EMA_WEIGHTS, safetensors_bytes(weights_of(ema.module),
                                                                        metadata={"epoch": str(epoch)}))
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
              "params": params, "seconds": sum(h["epoch_seconds"] for h in history),
              "extra": {k: last[k] for k in ("ema_top1", "ema_top5", "ema_test_loss") if k in last},
              "world_size": ranks.world_size}
    atomic_write_json(run_dir / RESULT, result)
    distributed.agree(None)
    return distributed.from_main(result)
