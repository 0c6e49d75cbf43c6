"""Training throughput (img/s) of full training steps on synthetic data, per model and variant, with each
variant's ratio to standard measured in the same run (rounds alternate the order; the median round is reported).

    python benchmarks/train_throughput.py                              # vit_cifar, swin_cifar, CPU, batch 128
    python benchmarks/train_throughput.py --attn standard,ns --device cuda --amp bf16
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

from attnlab.bench import input_shape, measure_train_throughput, resolve_device
from attnlab.models import build_model
from attnlab.spec import split_specs


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
    args = p.parse_args()

    device = resolve_device(args.device)
    amp = torch.bfloat16 if args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda") else None
    specs = split_specs(args.attn)
    print(f"# torch {torch.__version__}, {platform.machine()}, threads {torch.get_num_threads()}, device {device}, "
          f"batch {args.batch_size}, amp {amp}")
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
