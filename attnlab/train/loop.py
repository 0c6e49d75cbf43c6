"""The training loop, written once for every task family: one :class:`~attnlab.train.run.Run` into
``runs/<name>/``. Reads top to bottom in the order a run meets it: the plan (train, resume or skip), the run
directory, model and data (from the run's Task), optimizer and schedule, (resume), then per epoch: train, evaluate,
log, checkpoint; finally ``result.json``. What an epoch is: docs/training.md, "A run, its task, its data".
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import numpy as np
import torch
import yaml
from safetensors.torch import save as safetensors_bytes
from torch import nn
from tqdm.auto import tqdm

from attnlab.errors import ConfigError, NonFiniteLossError
from . import distributed
from .checkpoint import (
    RESUME_KEYS,
    STATE,
    WEIGHTS,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    new_save_id,
    create_dir_with,
    get_rng_state,
    resume_point,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    weights_of,
)
from .config import TrainConfig
from .files import CONFIG, EMA_WEIGHTS, METRICS, RESULT
from .lock import RunLock
from .optim import build_optimizer, build_scheduler
from .run import Plan, Run, compile_mode


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of epoch ``epoch``'s data order and worker RNGs: a hash of (seed, epoch), so epochs never share a stream
    and an epoch's data is a function of (seed, epoch) alone, which resuming at an epoch boundary needs."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def provenance(device: torch.device) -> dict[str, str]:
    """Where and with what a run finished, for the report's header: UTC time, the machine, attnlab's version."""
    import datetime
    import platform

    from attnlab import __version__

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or
                                                                              platform.machine())
    return {"finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{where}, {platform.system()}, torch {torch.__version__}", "attnlab_version": __version__}


def check_run(cfg: TrainConfig, cache: dict | None = None) -> dict[str, Any]:
    """What :func:`train` would do with ``cfg``, checked without training (:meth:`Run.plan`), as a dict:
    ``{"name", "run_dir", "action", "epoch", "note", "result"}``."""
    run = Run(cfg)
    plan = run.plan(cache)
    return {"name": run.name, "run_dir": run.dir, "action": plan.action, "epoch": plan.epoch, "note": plan.note,
            "result": plan.result}


# ----------------------------------------------------------------------------------------------- one epoch
def _read_stats(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The step's device sums on the host, summed over the ranks: the one sync of a log point."""
    return dict(zip(sums, (float(v) for v in distributed.reduce_sums(*sums.values()))))


def _no_sync(model):
    """The context in which a micro-batch's backward skips the gradient reduction: DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)``, or None for one process."""
    if hasattr(model, "no_sync"):
        return model.no_sync
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if not hasattr(inner, "set_requires_gradient_sync"):
        return None

    @contextmanager
    def unsynced():
        inner.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)

    return unsynced


def train_one_epoch(model, batches: Iterator[Any], optimizer, scheduler, step_loss, *, steps: int, device,
                    amp_dtype, epoch: int, epochs: int, num_updates: int, clip_grad: float | None, log_every: int,
                    progress: bool, on_step=None, cudagraphs: bool = False, accum: int = 1,
                    describe=None) -> tuple[dict[str, float], int]:
    """``steps`` optimizer steps over ``batches`` (each step ``accum`` micro-batches, the loss of each scaled by
    1/accum), ``step_loss`` being the task's :meth:`~attnlab.train.tasks.base.Task.loss`. Returns (sums,
    num_updates): the epoch's sums over steps and ranks (``loss`` x seen, ``seen``, the task's own) and ``seconds``.
    ``on_step(num_updates)`` runs after every optimizer step (the probe and the EMA; the probe must leave the model
    in train mode); ``describe(sums, seconds) -> dict`` gives the progress bar's numbers (``train_stats``).

    No step waits for the device (docs/training.md, "One epoch"): the sums and a non-finite flag are read every
    ``log_every`` steps (on CUDA at least 100) and at the end, where a non-finite loss raises NonFiniteLossError.
    ``cudagraphs``: mark each forward's start for torch.compile's CUDA graphs, whose outputs the next replay
    overwrites. Under DDP and FSDP, all but the last micro-batch of a step skip the gradient reduction.
    """
    model.train()
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    zero = lambda dtype: torch.zeros((), dtype=dtype, device=device)  # noqa: E731
    sums: dict[str, torch.Tensor] = {"loss": zero(torch.float64), "seen": zero(torch.int64), "bad": zero(torch.int64)}
    bad_step, bad_loss = zero(torch.int64), zero(torch.float32)
    checked, stats = 0, {}
    no_sync = _no_sync(model) if accum > 1 else None
    every = max(log_every, 100) if device.type == "cuda" else log_every  # a CUDA read stalls the queued steps
    start = time.perf_counter()
    batches = iter(batches)
    bar = tqdm(range(1, steps + 1), total=steps, desc=f"epoch {epoch}/{epochs}", disable=not progress, leave=False,
               dynamic_ncols=True)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    for step in bar:
        optimizer.zero_grad(set_to_none=True)
        step_loss_sum = zero(torch.float32)
        for micro in range(accum):
            batch = next(batches)
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            with (no_sync() if no_sync is not None and micro < accum - 1 else nullcontext()):
                with autocast:
                    loss, batch_sums = step_loss(model, batch)
                (loss / accum if accum > 1 else loss).backward()
            value = loss.detach()
            seen = batch_sums.pop("seen")
            step_loss_sum = step_loss_sum + value.float() / accum
            sums["loss"] += value.double() * seen
            sums["seen"] += seen
            for key, v in batch_sums.items():
                sums[key] = sums[key] + v if key in sums else v.detach().double()
        if clip_grad:
            # the optimizer's tensors only: a frozen one may hold a gradient from elsewhere (a warm-up of its own)
            nn.utils.clip_grad_norm_(trained, clip_grad)
        optimizer.step()
        num_updates += 1
        scheduler.step_update(num_updates)
        if on_step is not None:
            on_step(num_updates)

        first_bad = ~torch.isfinite(step_loss_sum) & (bad_step == 0)
        bad_step.masked_fill_(first_bad, step)
        bad_loss.copy_(torch.where(first_bad, step_loss_sum, bad_loss))
        sums["bad"] += first_bad
        if step % every == 0 or step == steps:
            stats = _read_stats(sums)
            if stats["bad"]:  # a step since the last check (on this rank or another) had a non-finite loss
                where = int(bad_step) or None
                found = f"step {where}" if where else f"one of steps {checked + 1}-{step} on another rank"
                kept = (f"the last good checkpoint (epoch {epoch - 1}) was kept" if epoch > 1 else
                        "no checkpoint had been written yet")
                raise distributed.shared(NonFiniteLossError(
                    f"training loss became {float(bad_loss) if where else 'non-finite'} at epoch {epoch} {found} "
                    f"(found at the check after step {step}); training stopped and {kept}, so lower the learning "
                    f"rate or enable clip_grad."))
            checked = step
            if progress:
                shown = describe(stats, time.perf_counter() - start) if describe else {}
                bar.set_postfix({k.removeprefix("train_"): f"{v:.4g}" for k, v in shown.items()
                                 if k != "train_seconds"} | {"lr": f"{optimizer.param_groups[0]['lr']:.2e}"},
                                refresh=False)
    bar.close()
    stats["seconds"] = time.perf_counter() - start  # the last check read the device, so its work is done
    stats.pop("bad", None)
    return stats, num_updates


# ----------------------------------------------------------------------------------------------- the run
def train(cfg: TrainConfig, probe=None) -> dict[str, Any]:
    """Train ``cfg`` into ``<runs_dir>/<name>/`` and return the result dict (also written to result.json).

    ``cfg.run.resume``: continue from the last completed epoch, return the stored result of a finished run, or start
    afresh; without it an existing checkpoint is an error, so that no run is overwritten by accident. A NaN/inf
    loss raises NonFiniteLossError, keeping the last checkpoint. With ``cfg.run.probe_every > 0``,
    ``probe(model, inputs) -> dict`` (the command line passes ``attnlab.analysis.training_probe``, a layer above
    training) runs every that many steps; each epoch's metrics line lists its results under ``probes``.
    """
    run = Run(cfg)
    cfg = run.cfg
    if cfg.run.probe_every > 0 and probe is None:
        raise ConfigError(f"probe_every={cfg.run.probe_every} needs a probe: call train(cfg, "
                          f"probe=attnlab.analysis.training_probe) as `attnlab train` does, or set probe_every to 0.")
    threads = torch.get_num_threads()
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    # Denormal floats (a saturated softmax's gradients, e.g. speccond(lam=10)) make CPU matmuls several times
    # slower; GPUs flush them to zero anyway, so do the same on the CPU.
    flush = torch.set_flush_denormal(True)
    try:
        with distributed.session(run.device) as ranks:
            try:
                run.join(ranks)
                with RunLock(run.dir, enabled=ranks.is_main) as lock:  # one writer per run directory
                    return _train(run, probe, lock)
            except Exception as err:
                raise distributed.settle(err)  # under torchrun: the same error on every rank
    finally:
        torch.set_num_threads(threads)
        if flush:
            torch.set_flush_denormal(False)


def _train(run: Run, probe=None, lock: RunLock | None = None) -> dict[str, Any]:
    from attnlab.variants import training_hooks

    from .tb import require

    cfg, task, ranks, device, amp_dtype = run.cfg, run.task, run.ranks, run.device, run.amp_dtype
    micro_batch = distributed.rank_batch_size(cfg.batch_size, ranks) // cfg.grad_accum
    main = ranks.is_main  # rank 0 alone writes files, prints and logs
    require(cfg.run.log)
    sharded = cfg.run.parallel == "fsdp" and ranks.distributed  # one process trains the same model unsharded
    if sharded:
        _check_sharded(cfg)

    plan: Plan = run.plan(check=False)
    if plan.action == "skip":
        return plan.result
    resuming = plan.action == "resume"
    if plan.note and main and not resuming:  # a finished run trained again (its weights were all damaged)
        print(plan.note, file=sys.stderr, flush=True)

    # Model and data. Seeding first makes the initial weights a function of the seed.
    seed_everything(cfg.seed)
    model = run.build_model(pretrained=not resuming).to(device)  # a checkpoint replaces the weights
    # the newest pair that is intact and fits the model; with none (a kill in the first save) start afresh, saying so
    keys = RESUME_KEYS + (("ema",) if cfg.ema else ())
    found, note = resume_point(run.dir, model, keys) if resuming else (None, None)
    if note and main:
        print(f"{run.name}: {note}", file=sys.stderr, flush=True)
    if resuming and found is None and (cfg.pretrained or cfg.pretrained_file):
        seed_everything(cfg.seed)  # built again as a fresh run builds it, from its pretrained weights
        model = run.build_model().to(device)
    if found is None:  # a geometry the data cannot pass is one line before the run directory exists
        with torch.random.fork_rng(devices=[]):
            run.check_forward(model.eval(), device)
        model.train()
    # The run directory appears together with its config.yaml, so that a killed run continues with
    # `train --resume RUN_DIR`: before a download (minutes), else once the data has loaded (bad input makes none).
    config_file = {CONFIG: yaml.safe_dump(run.config_dict(), sort_keys=False).encode()}
    if cfg.run.download and main:
        create_dir_with(run.dir, config_file, lock)
    if cfg.run.download and ranks.distributed and not main:
        distributed.agree(None)  # rank 0 downloads first
    data = task.train_data(micro_batch, device)
    task.prepare_eval()
    if cfg.run.download and ranks.distributed and main:
        distributed.agree(None)

    per_epoch = cfg.eval_every or data.steps
    if per_epoch is None:
        raise ConfigError(f"dataset {cfg.dataset} is a stream without epochs; set eval_every (steps between "
                          f"evaluations) and max_steps.")
    total = cfg.max_steps or cfg.epochs * per_epoch
    epochs = math.ceil(total / per_epoch)

    if found is not None:
        model.load_state_dict(found.weights)
    if cfg.run.activation_checkpointing:
        from .fsdp import checkpoint_blocks

        checkpoint_blocks(model)
    if sharded:
        from . import fsdp

        fsdp.shard(model, device=device, bf16=amp_dtype == torch.bfloat16)
    optim, sched = cfg.optim, cfg.sched
    optimizer = build_optimizer(model, optim.lr, optim.weight_decay, optim.optimizer, optim.momentum, optim.beta2,
                                optim.layer_decay)
    hooks = training_hooks()  # terms that act during training (QK-clip's clip after each step), from the registry
    for hook in hooks:
        hook.attach(model, optimizer)  # a no-op on models without the term
    warmup = sched.warmup_steps if sched.warmup_steps is not None else int(round(sched.warmup_epochs * per_epoch))
    scheduler = build_scheduler(optimizer, total_steps=total, warmup_steps=warmup, warmup_lr=sched.warmup_lr,
                                min_lr=sched.min_lr, schedule=sched.lr_schedule)

    start_epoch, num_updates, history = 0, 0, []
    previous = None  # the checkpoint pair the first new checkpoint keeps as the previous one
    init_eval = None  # the evaluation before the first step (tasks with eval_at_init), kept in the checkpoint
    if found is not None:
        state, previous = found.state, found.files
        _load_optimizer(run, model, optimizer, state["optimizer"], sharded)
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, num_updates, history = int(state["epoch"]), int(state["num_updates"]), list(state["history"])
        init_eval = state.get("init_eval")
        set_rng_state(state["rng"])
    ema = None
    if cfg.ema:
        from timm.utils import ModelEmaV3

        # parameters averaged; buffers (sigma's power-iteration u, QK-clip's records) copied from the live model,
        # since an average of unit vectors is not a unit vector
        ema = ModelEmaV3(model, decay=cfg.ema_decay, exclude_buffers=True)
        if found is not None:
            ema.module.load_state_dict(found.state["ema"])
    # Every check a run makes before its first step has passed (data, block size, schedule, checkpoint): only now
    # does its directory appear, so that a refused run leaves nothing behind.
    if main:
        create_dir_with(run.dir, {**config_file, **run.data_files()}, lock)
        (run.dir / RESULT).unlink(missing_ok=True)  # a finished run trained again (its weights were all damaged)
    # metrics.jsonl rewritten from the checkpoint's history (dropping any epoch logged after it)
    if main:
        atomic_write_text(run.dir / METRICS, "".join(json.dumps(h) + "\n" for h in history))
    tb_log = None
    if cfg.run.log == "tensorboard" and main:
        from .tb import TensorBoardLog

        tb_log = TensorBoardLog(run.dir, start_step=num_updates)
    distributed.agree(None)  # set-up done on every rank (or every rank stops with the first rank's error)

    trained = model
    if ranks.distributed and not sharded:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    mode = compile_mode(cfg.run.compile_mode, device) if cfg.run.compile else None
    if cfg.run.compile:  # every model class shares its forward's code, whose recompile limit (8) earlier runs in this
        torch.compiler.reset()  # process (a grid's worker) would use up, after which dynamo falls back to eager
    # static shapes (dynamic=False): the train batches are full, evaluation pads its last batch
    compiled = (lambda m: torch.compile(m, mode=mode, dynamic=False)) if cfg.run.compile else (lambda m: m)  # noqa: E731
    forward = compiled(trained)
    # evaluation runs on rank 0 alone, outside DDP, whose forward would wait for the other ranks; a sharded model
    # needs every rank for each forward, so under FSDP every rank evaluates (the same batches)
    evaluate_with = forward if not ranks.distributed or sharded else compiled(model)
    cudagraphs = mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"
    params = sum(p.numel() for p in model.parameters())
    progress = cfg.run.progress and main
    if progress:
        tqdm.write(f"{run.name}: {params / 1e6:.2f}M parameters, {device.type}"
                   f"{' bf16' if amp_dtype else ' fp32'}, {per_epoch} steps/epoch"
                   + (f", resuming after epoch {start_epoch}" if start_epoch else ""))

    probes: list[dict[str, Any]] = []
    probe_inputs = task.inputs(cfg.run.probe_images).to(device) if cfg.run.probe_every > 0 and main else None

    def on_step(step: int) -> None:
        if ema is not None:
            ema.update(model, step=step)  # timm's decay is 0 at step 1: a copy
        if probe_inputs is not None and step % cfg.run.probe_every == 0:
            probes.append({"step": step, **probe(model, probe_inputs)})
            model.train()

    # the loss at initialisation (LR sensitivity), eager; on every rank of a sharded model (its forward gathers)
    if task.eval_at_init and found is None and (main or sharded):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            init_eval = task.evaluate(model, device=device, amp_dtype=amp_dtype)
        if progress:
            tqdm.write(f"{run.name}: before training {task.headline} {init_eval[task.headline]:.4f}")

    for epoch in range(start_epoch + 1, epochs + 1):
        epoch_start = time.perf_counter()
        probes.clear()
        if ranks.distributed:  # augmentation, mixing and drop-path: each rank its own streams
            seed_everything(distributed.rank_seed(cfg.seed, epoch, ranks.rank))
        steps = min(per_epoch, total - (epoch - 1) * per_epoch)
        with distributed.steps():
            sums, num_updates = train_one_epoch(
                forward, data.batches(epoch), optimizer, scheduler, task.loss, steps=steps, device=device,
                amp_dtype=amp_dtype, epoch=epoch, epochs=epochs, num_updates=num_updates, clip_grad=optim.clip_grad,
                log_every=cfg.run.log_every, progress=progress, cudagraphs=cudagraphs, accum=cfg.grad_accum,
                on_step=on_step if ema is not None or probe_inputs is not None else None, describe=task.train_stats)
        if sharded:  # collectives: every rank evaluates, gathers the weights and writes its optimizer shard
            evaluation = task.evaluate(evaluate_with, device=device, amp_dtype=amp_dtype,
                                       static_shapes=cfg.run.compile)
            save_id = distributed.from_main(new_save_id(epoch))
            full = fsdp.full_weights(model)
            optimizer_state = fsdp.save_optimizer(run.dir, save_id, model, optimizer)
        if not main:
            distributed.agree(None)  # while rank 0 evaluates and writes the epoch
            continue
        stats = task.train_stats(sums, sums["seconds"])
        if not sharded:
            evaluation = task.evaluate(evaluate_with, device=device, amp_dtype=amp_dtype,
                                       static_shapes=cfg.run.compile)
            save_id, full, optimizer_state = new_save_id(epoch), None, optimizer.state_dict()
        record = {"epoch": epoch, **{k: v for k, v in stats.items() if k != "train_seconds"}, **evaluation,
                  "lr": optimizer.param_groups[0]["lr"], "epoch_seconds": time.perf_counter() - epoch_start}
        if cfg.max_steps or cfg.eval_every:
            record["step"] = num_updates
        for hook in hooks:
            record.update(hook.stats(model))
        if ema is not None:  # the EMA weights on the same evaluation, eager (off by default; no second compile)
            record.update({f"ema_{k}": v for k, v in task.evaluate(ema.module, device=device,
                                                                   amp_dtype=amp_dtype).items()})
        if probes:
            record["probes"] = list(probes)
        history.append(record)
        if progress:
            tqdm.write(f"epoch {epoch}/{epochs}  {task.line(record)}")
        atomic_write_text(run.dir / METRICS, "".join(json.dumps(h) + "\n" for h in history))
        save_checkpoint(run.dir, model, {
            "epoch": epoch, "num_updates": num_updates, "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(), "sampler": {"seed": cfg.seed, "next_epoch": epoch + 1},
            "rng": get_rng_state(), "history": history, **({"init_eval": init_eval} if init_eval else {}),
            **({"ema": weights_of(ema.module)} if ema is not None else {}),
        }, previous=previous, save_id=save_id, weights=full)
        if sharded:
            fsdp.keep_optimizers(run.dir)
        if ema is not None:  # the EMA weights for use, beside the raw ones (the resumable copy is in the state)
            atomic_write_bytes(run.dir / EMA_WEIGHTS, safetensors_bytes(weights_of(ema.module),
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
    result = {"name": run.name, "task": task.name, "model": cfg.model, "dataset": cfg.dataset, "tag": cfg.tag,
              "attn": cfg.attn, "seed": cfg.seed, "epochs": epochs, **task.result(last), "metric": task.headline,
              "params": params, "seconds": sum(h["epoch_seconds"] for h in history),
              "extra": {k: v for k, v in last.items() if k.startswith("ema_")},
              "world_size": ranks.world_size, **provenance(device)}
    if cfg.max_steps or cfg.eval_every:
        result["steps"] = num_updates
    if init_eval:
        result["init"] = init_eval
    atomic_write_json(run.dir / RESULT, result)
    distributed.agree(None)
    return distributed.from_main(result)


def _check_sharded(cfg: TrainConfig) -> None:
    """ConfigError for what a sharded run cannot do yet (each works with --parallel ddp)."""
    for given, what in ((cfg.ema, "--ema (an averaged copy of a sharded model)"),
                        (cfg.run.probe_every > 0, "--probe-every (the probe runs on rank 0 alone)")):
        if given:
            raise ConfigError(f"{what} is not available with --parallel fsdp; drop it or use --parallel ddp.")


def _load_optimizer(run: Run, model: nn.Module, optimizer, state: Any, sharded: bool) -> None:
    """The optimizer's state from a checkpoint: a plain state dict (one process, DDP) or, from a sharded run, a
    torch.distributed.checkpoint directory (resharded to this world size, one process included)."""
    if isinstance(state, dict) and "dcp" in state:
        from . import fsdp

        fsdp.load_optimizer(run.dir, state, model, optimizer)
    elif sharded:
        raise ConfigError(f"run {run.name} was saved by one process or under --parallel ddp, whose optimizer state "
                          f"does not shard; resume it with --parallel ddp.")
    else:
        optimizer.load_state_dict(state)


__all__ = ["check_run", "epoch_seed", "train", "train_one_epoch"]
