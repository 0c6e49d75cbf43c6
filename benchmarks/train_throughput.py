"""Training throughput (img/s) per model and variant, with each variant's ratio to standard measured in the same
run (rounds alternate the order; the median round is reported).

Default: the model step alone (forward, backward, AdamW) on one fixed synthetic batch. ``--end-to-end``: the
training loop's own ``train_one_epoch`` fed by the full recipe on the device pipeline (random CIFAR-sized uint8
pixels: crop, flip, AutoAugment, random erasing, Mixup/CutMix, repeated augmentation x3; evaluation excluded),
eager and under ``torch.compile`` (the trainer's --compile: mode auto, static shapes), with the compiled/eager
ratio. Compilation happens in a warm-up epoch outside the timing.

    python benchmarks/train_throughput.py                              # vit_cifar, swin_cifar, CPU, batch 128
    python benchmarks/train_throughput.py --attn standard,ns --device cuda --amp bf16
    python benchmarks/train_throughput.py --end-to-end --models vit_cifar --attn standard,ns --steps 4
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics

import numpy as np
import torch

from attnlab.bench import input_shape, measure_train_throughput, resolve_device
from attnlab.models import build_model
from attnlab.spec import split_specs


def end_to_end(name: str, specs: list[str], args, device: torch.device, amp) -> None:
    """Full-recipe img/s of train_one_epoch, eager and compiled, per variant (see the module docstring)."""
    import itertools

    from timm.loss import SoftTargetCrossEntropy

    from attnlab.data.cifar import CIFAR100_MEAN, CIFAR100_STD
    from attnlab.data.device_pipeline import AugmentRecipe, DevicePipeline
    from attnlab.train.loop import compile_mode, train_one_epoch
    from attnlab.train.optim import build_optimizer, build_scheduler

    n = args.batch_size * args.steps
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8))
    labels = torch.from_numpy(rng.integers(0, 100, n))
    runs = {}
    for spec in specs:
        for compiled in (False, True):
            torch.manual_seed(0)
            model = build_model(name, num_classes=100, attn=spec).to(device)
            pipe = DevicePipeline(pixels, labels, num_classes=100, batch_size=args.batch_size, device=device,
                                  mean=CIFAR100_MEAN, std=CIFAR100_STD, recipe=AugmentRecipe(), repeated_aug=3,
                                  chunk=n)
            optimizer = build_optimizer(model, 1e-3, 0.05)
            scheduler = build_scheduler(optimizer, epochs=1000, steps_per_epoch=args.steps, warmup_epochs=1,
                                        warmup_lr=1e-6, min_lr=1e-5)
            mode = compile_mode("auto", device)
            forward = torch.compile(model, mode=mode, dynamic=False) if compiled else model
            runs[spec, compiled] = (forward, pipe, optimizer, scheduler,
                                    compiled and mode == "reduce-overhead" and device.type == "cuda")
    rates = {key: [] for key in runs}
    updates = dict.fromkeys(runs, 0)

    def epoch(key, e, steps):
        forward, pipe, optimizer, scheduler, cudagraphs = runs[key]
        stats, updates[key] = train_one_epoch(
            forward, itertools.islice(pipe.epoch(e), steps), optimizer, scheduler, SoftTargetCrossEntropy(),
            steps=steps, device=device, amp_dtype=amp, epoch=e, epochs=e, num_updates=updates[key], clip_grad=None,
            log_every=10, progress=False, cudagraphs=cudagraphs)
        return stats["img_per_s"]

    keys = list(runs)
    for key in keys:  # compile and warm up (a few steps) outside the timing
        epoch(key, 0, min(args.warmup, args.steps))
    for r in range(args.rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            rates[key].append(epoch(key, r + 1, args.steps))
    base = statistics.median(rates[specs[0], False])
    for spec in specs:
        eager, comp = (statistics.median(rates[spec, c]) for c in (False, True))
        print(f"| {name} | {spec} | {eager:.1f} | {comp:.1f} | {comp / eager:.2f} | {eager / base:.3f} | "
              f"{comp / statistics.median(rates[specs[0], True]):.3f} |", flush=True)


def main() -> None:
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
    args = p.parse_args()

    device = resolve_device(args.device)
    amp = torch.bfloat16 if args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda") else None
    specs = split_specs(args.attn)
    print(f"# {datetime.date.today()}, torch {torch.__version__}, {platform.machine()}, threads "
          f"{torch.get_num_threads()}, device {device}, batch {args.batch_size}, amp {amp}")
    if args.end_to_end:
        print("| model | variant | eager img/s | compiled img/s | compiled / eager | eager ratio to "
              f"{specs[0]} | compiled ratio to {specs[0]} |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name in args.models.split(","):
            end_to_end(name, specs, args, device, amp)
        return
    print("| model | variant | img/s (median of rounds) | ratio to " + specs[0] + " |")
    print("|---|---|---:|---:|")
    for name in args.models.split(","):
        models = {}
        for spec in specs:
            torch.manual_seed(0)
            models[spec] = build_model(name, num_classes=100, attn=spec).to(device)
        shape = input_shape(models[specs[0]])
        g = torch.Generator().manual_seed(0)
        batch = (torch.randn(args.batch_size, *shape, generator=g).to(device),
                 torch.randint(0, 100, (args.batch_size,), generator=g).to(device))
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
