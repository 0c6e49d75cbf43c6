"""One process of the packing measurement (what ``attnlab compare --jobs N`` does on one GPU): build the model,
warm up, wait until all N processes are warm (a file barrier), then time training steps of the model step alone
on one synthetic batch and print one row ``| model | processes | rank | img/s |``.

    python benchmarks/pack.py RANK N --work DIR [--model swin_cifar] [--steps 100] [--batch-size 128] [--device cuda]

If the N processes are not all ready within ``--barrier-timeout`` seconds (one failed, or never started), it exits
with status 3 and one line saying how many were, instead of waiting for ever.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import model_options

from attnlab.bench import input_shape, measure_train_throughput
from attnlab.models import build_model


def barrier(work: Path, rank: int, n: int, timeout: float, poll: float = 0.005) -> int:
    """Mark ``rank`` ready under ``work`` and wait for all ``n``; returns how many were ready (n unless timed out)."""
    folder = work / f"pack_{n}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ready_{rank}").touch()
    deadline = time.monotonic() + timeout
    while True:
        ready = sum((folder / f"ready_{i}").exists() for i in range(n))
        if ready == n or time.monotonic() > deadline:
            return ready
        time.sleep(poll)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rank", type=int)
    p.add_argument("n", type=int)
    p.add_argument("--work", type=Path, required=True, help="folder of the barrier's files")
    p.add_argument("--model", default="swin_cifar")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--amp", default="bf16", choices=["bf16", "none"])
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--model-options", default=None, help="YAML mapping for build_model, e.g. '{depth: 1}'")
    p.add_argument("--barrier-timeout", type=float, default=120.0)
    args = p.parse_args()
    device = torch.device(args.device)
    amp = torch.bfloat16 if args.amp == "bf16" else None
    torch.manual_seed(args.rank)
    model = build_model(args.model, num_classes=args.num_classes, **model_options(args.model_options)).to(device)
    batch = (torch.randn(args.batch_size, *input_shape(model), device=device),
             torch.randint(0, args.num_classes, (args.batch_size,), device=device))
    measure_train_throughput(model, batch, steps=max(1, args.steps // 10), warmup=0, amp_dtype=amp)
    ready = barrier(args.work, args.rank, args.n, args.barrier_timeout)
    if ready < args.n:
        print(f"pack.py {args.rank}/{args.n}: only {ready} of {args.n} processes were ready after "
              f"{args.barrier_timeout:g} s; not timing", file=sys.stderr, flush=True)
        sys.exit(3)
    rate = measure_train_throughput(model, batch, steps=args.steps, warmup=0, amp_dtype=amp)
    print(f"| model | processes | rank | img/s |\n|---|---:|---:|---:|\n| {args.model} | {args.n} | {args.rank} | "
          f"{rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
