"""Training throughput (img/s) per model and variant, with each variant's ratio to standard measured in the same
run (rounds alternate the order; the median round is reported).

Default: the model step alone (forward, backward, AdamW) on one fixed synthetic batch. ``--end-to-end``: the
training loop's own ``train_one_epoch`` fed by the full recipe on the device pipeline (random CIFAR-sized uint8
pixels: crop, flip, AutoAugment, random erasing, Mixup/CutMix, repeated augmentation x3; evaluation excluded),
eager and/or under ``torch.compile`` as ``attnlab train --compile`` sets it up (mode auto: CUDA graphs on CUDA,
static shapes). Each variant is built, compiled and warmed up (outside the timing), then timed in rounds that
alternate with the first variant's (already compiled) model, and its row is printed at once: a run stopped
part-way keeps every row it printed, and a variant that fails prints a failed row and the next one runs.

    python benchmarks/train_throughput.py                              # vit_cifar, swin_cifar, CPU, batch 128
    python benchmarks/train_throughput.py --attn standard,ns --device cuda --amp bf16
    python benchmarks/train_throughput.py --end-to-end --models vit_cifar --attn standard,ns --steps 4
    python benchmarks/train_throughput.py --end-to-end --modes compiled --device cuda --attn standard,ns,dna
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import platform
import statistics
import time

import numpy as np
import torch
from common import compiler, failure, model_options

from attnlab.bench import input_shape, measure_train_throughput, resolve_device
from attnlab.models import build_model
from attnlab.spec import split_specs

E2E_HEADER = ("| model | variant | mode | img/s (median of rounds) | {base} img/s (same rounds) | ratio to {base} | "
              "build + compile + warm-up s | status |\n|---|---|---|---:|---:|---:|---:|---|")


class EndToEnd:
    """One (model, variant, mode): the model, its device pipeline, optimizer and schedule, as the trainer has them."""

    def __init__(self, name: str, spec: str, compiled: bool, args, device: torch.device, amp):
        from attnlab.data.cifar import CIFAR100_MEAN, CIFAR100_STD
        from attnlab.data.device_pipeline import AugmentRecipe, DevicePipeline
        from attnlab.train.optim import build_optimizer, build_scheduler

        # timm's RepeatAugSampler keeps a multiple of 256 samples per epoch
        n = max(256, math.ceil(args.batch_size * args.steps / 256) * 256)
        rng = np.random.default_rng(0)
        pixels = torch.from_numpy(rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8))
        labels = torch.from_numpy(rng.integers(0, args.num_classes, n))
        torch.manual_seed(0)
        self.model = build_model(name, num_classes=args.num_classes, attn=spec, **args.model_options).to(device)
        self.pipe = DevicePipeline(pixels, labels, num_classes=args.num_classes, batch_size=args.batch_size,
                                   device=device, mean=CIFAR100_MEAN, std=CIFAR100_STD, recipe=AugmentRecipe(),
                                   repeated_aug=3, chunk=min(8192, args.batch_size * args.steps))  # as trained
        self.optimizer = build_optimizer(self.model, 1e-3, 0.05)
        self.scheduler = build_scheduler(self.optimizer, total_steps=1000 * args.steps, warmup_steps=args.steps,
                                         warmup_lr=1e-6, min_lr=1e-5)
        compile_fn, self.cudagraphs = compiler(args.compile_backend, device, compiled)
        self.forward = compile_fn(self.model)
        self.device, self.amp, self.log_every, self.updates = device, amp, args.log_every, 0

    def epoch(self, e: int, steps: int) -> float:
        """img/s of ``steps`` steps of train_one_epoch (augmentation included, as in training)."""
        from timm.loss import SoftTargetCrossEntropy

        from attnlab.train.loop import train_one_epoch
        from attnlab.train.tasks.classify import classification_stats, classification_step

        sums, self.updates = train_one_epoch(
            self.forward, itertools.islice(self.pipe.epoch(e), steps), self.optimizer, self.scheduler,
            classification_step(SoftTargetCrossEntropy()), steps=steps, device=self.device, amp_dtype=self.amp,
            epoch=e, epochs=e, num_updates=self.updates, clip_grad=None, log_every=self.log_every, progress=False,
            cudagraphs=self.cudagraphs)
        return classification_stats(sums, sums["seconds"])["img_per_s"]


def end_to_end(name: str, specs: list[str], args, device: torch.device, amp) -> int:
    """Each variant's rows (module docstring), printed as measured; returns how many failed."""
    failed = 0
    for mode in args.modes:
        base, base_name = None, specs[0]
        for spec in specs:
            cells = [name, spec, mode]
            try:
                t0 = time.perf_counter()
                run = EndToEnd(name, spec, mode == "compiled", args, device, amp)
                run.epoch(0, max(1, args.warmup))  # compiles (both passes) and records CUDA graphs
                warm = time.perf_counter() - t0
                if args.precompile:
                    print(f"# {name} {spec} {mode}: built, compiled and warmed up in {warm:.1f} s", flush=True)
                    continue
                mine, theirs = [], []
                for r in range(args.rounds):  # against the first variant, order alternating
                    pair = [(run, mine)] if base is None else [(run, mine), (base, theirs)]
                    for who, rates in (pair if r % 2 == 0 else pair[::-1]):
                        rates.append(who.epoch(r + 1, args.steps))
                rate = statistics.median(mine)
                if base is None and spec == base_name:
                    base, theirs = run, mine
                ref = statistics.median(theirs) if theirs else None  # None: the first variant failed
                cells += [f"{rate:.1f}", f"{ref:.1f}" if ref else "-", f"{rate / ref:.3f}" if ref else "-",
                          f"{warm:.1f}", "ok"]
            except Exception as err:  # noqa: BLE001 - the row records it, the next variant runs
                failed += 1
                cells += ["-", "-", "-", "-", failure(err)]
            print("| " + " | ".join(cells) + " |", flush=True)
    return failed


def main() -> None:
    from attnlab.train.config import TrainConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit_cifar,swin_cifar")
    p.add_argument("--attn", default="standard", help="comma-separated specs; ratios are against the first")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "none"],
                   help="auto: bf16 autocast on CUDA, fp32 on CPU (as in training)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--end-to-end", action="store_true",
                   help="the full recipe through the training loop, eager and compiled (module docstring)")
    p.add_argument("--modes", default="eager,compiled", help="--end-to-end: eager, compiled or both")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled mode (aot_eager: the compiled paths, checked on a CPU)")
    p.add_argument("--precompile", action="store_true",
                   help="--end-to-end: build, compile and warm up each variant, time nothing (fills the compile cache)")
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--model-options", default=None, help="YAML mapping for build_model, e.g. '{depth: 1}'")
    p.add_argument("--log-every", type=int, default=TrainConfig().run.log_every,
                   help="train_one_epoch's log_every (the trainer's default)")
    args = p.parse_args()
    args.modes = args.modes.split(",")
    args.model_options = model_options(args.model_options)
    if not set(args.modes) <= {"eager", "compiled"}:
        p.error(f"--modes {','.join(args.modes)}: use eager, compiled or eager,compiled")

    device = resolve_device(args.device)
    amp = torch.bfloat16 if args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda") else None
    specs = split_specs(args.attn)
    print(f"# {datetime.date.today()}, torch {torch.__version__}, {platform.machine()}, threads "
          f"{torch.get_num_threads()}, device {device}, batch {args.batch_size}, amp {amp}", flush=True)
    if args.end_to_end:
        if not args.precompile:
            print(E2E_HEADER.format(base=specs[0]), flush=True)
        failed = sum(end_to_end(name, specs, args, device, amp) for name in args.models.split(","))
        raise SystemExit(1 if failed else 0)
    print("| model | variant | img/s (median of rounds) | ratio to " + specs[0] + " |")
    print("|---|---|---:|---:|")
    for name in args.models.split(","):
        models = {}
        for spec in specs:
            torch.manual_seed(0)
            models[spec] = build_model(name, num_classes=args.num_classes, attn=spec, **args.model_options).to(device)
        shape = input_shape(models[specs[0]])
        g = torch.Generator().manual_seed(0)
        batch = (torch.randn(args.batch_size, *shape, generator=g).to(device),
                 torch.randint(0, args.num_classes, (args.batch_size,), generator=g).to(device))
        rates = {s: [] for s in specs}
        for r in range(args.rounds):
            for spec in (specs if r % 2 == 0 else specs[::-1]):
                rates[spec].append(measure_train_throughput(models[spec], batch, steps=args.steps,
                                                            warmup=args.warmup, amp_dtype=amp))
        base = statistics.median(rates[specs[0]])
        for spec in specs:
            med = statistics.median(rates[spec])
            print(f"| {name} | {spec} | {med:.0f} | {med / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
