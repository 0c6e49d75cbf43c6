"""Forward latency of attention variants with the NS-Attn paper's protocol (Section 3.5): all variants load
identical parameters, inputs resident on the device, `--rounds` rounds of `--warmup` untimed and `--iters` timed
forwards with the order alternating between rounds; CUDA events on GPU, a monotonic clock on CPU. Prints ms/batch as
mean and sample SD across round means and the overhead against the first variant.

Example: attnlab bench --model vit_cifar --attn standard,ns --batch-size 128"""

from __future__ import annotations

import argparse

from .checks import count


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vit_cifar", help="preset or timm model name (default: vit_cifar)")
    p.add_argument("--attn", default="standard,ns", help="comma-separated variant specs; the first is the baseline")
    p.add_argument("--batch-size", type=count(1), default=128)
    p.add_argument("--num-classes", type=count(1), default=None)
    p.add_argument("--warmup", type=count(0), default=50, help="untimed forwards per model per round (default 50)")
    p.add_argument("--iters", type=count(1), default=200, help="timed forwards per model per round (default 200)")
    p.add_argument("--rounds", type=count(1), default=3, help="rounds, order alternating (default 3)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="fp32, or autocast to bf16/fp16")
    p.add_argument("--compile", action="store_true", help="torch.compile every model first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")


def run(args) -> int:
    import json
    from pathlib import Path

    from ..errors import ConfigError
    from ..spec import split_specs
    from .checks import output_file

    if args.json:
        output_file(args.json, "--json")  # checked now rather than after minutes of timing
    specs = split_specs(args.attn)
    if not specs:
        raise ConfigError("--attn names no variant; give comma-separated specs such as 'standard,ns'.")

    from ..bench import bench_variants, format_latency
    from ..train.run import resolve_device
    resolve_device(args.device)  # a device this machine lacks is a one-line error before any model is built
    result = bench_variants(args.model, specs, batch_size=args.batch_size, warmup=args.warmup, iters=args.iters,
                            rounds=args.rounds, device=args.device, dtype=args.dtype, compile=args.compile,
                            seed=args.seed, num_classes=args.num_classes)
    print(format_latency(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
