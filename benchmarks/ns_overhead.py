"""NS-Attn forward overhead over standard attention, measured in one run (ratios hold; absolute times do not).

Every configuration loads identical parameters; the protocol is the NS-Attn paper's (Section 3.5): rounds of
warm-up and timed forwards with the order alternating between rounds. Rows:
  ns                 attnlab's default (backend=auto): the fused C kernel on CPU forwards without gradient
                     (ns_kernel.c), the Gram-space torch formulation elsewhere (GPU, autograd, torch.compile)
  ns(backend=fast)      the Gram-space torch formulation on every device
  ns(backend=reference) Algorithm 1 written literally, batched over samples and heads

CPU (issue targets, 2 cores, batch 64, fp32 eager): ns/standard <= 1.10 for vit_cifar, <= 1.15 for swin_cifar.
GPU (batch 128, fp32 and bf16, eager and compiled): <= 1.05 for both.

    python benchmarks/ns_overhead.py                       # CPU defaults
    python benchmarks/ns_overhead.py --device cuda --batch-size 128 --dtypes fp32,bf16 --compile both
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from common import failure, model_options

from attnlab.bench import bench_variants
from attnlab.spec import split_specs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit_cifar,swin_cifar")
    p.add_argument("--attn", default="standard,ns,ns(backend=fast),ns(backend=reference)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="fp32", help="comma-separated: fp32, bf16")
    p.add_argument("--compile", default="no", choices=["no", "yes", "both"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile-backend", default="inductor", help="aot_eager: the compiled path, checked on a CPU")
    p.add_argument("--num-classes", type=int, default=None, help="default: the preset's")
    p.add_argument("--model-options", default=None, help="YAML mapping for build_model, e.g. '{depth: 1}'")
    p.add_argument("--config", default=None, help="YAML with the same keys (e.g. configs/ns_attn_latency.yaml); "
                   "flags given explicitly on the command line still win")
    args = p.parse_args()
    if args.config:
        import yaml

        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}
        for key, value in (yaml.safe_load(open(args.config)) or {}).items():
            if key not in given and hasattr(args, key):
                setattr(args, key, ",".join(map(str, value)) if isinstance(value, list) else value)

    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"threads {torch.get_num_threads()}, device {args.device}, batch {args.batch_size}", flush=True)
    compiles = {"no": [False], "yes": [True], "both": [False, True]}[args.compile]
    specs = split_specs(args.attn)
    print("| model | dtype | mode | " + " | ".join(f"{s} ms" for s in specs) + " | " +
          " | ".join(f"{s} / {specs[0]}" for s in specs[1:]) + " | status |")
    print("|---" * (3 + 2 * len(specs)) + "|", flush=True)
    failed = 0
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for compiled in compiles:
                cells = [model, dtype, "compiled" if compiled else "eager"]
                try:  # a failing row is recorded and the next one runs
                    r = bench_variants(model, specs, batch_size=args.batch_size, warmup=args.warmup,
                                       iters=args.iters, rounds=args.rounds, device=args.device, dtype=dtype,
                                       compile=compiled, compile_backend=args.compile_backend,
                                       num_classes=args.num_classes, model_options=model_options(args.model_options),
                                       progress=False)
                    ms = [r["models"][name]["mean_ms"] for name in r["models"]]
                    cells += [f"{m:.2f}" for m in ms] + [f"{m / ms[0]:.3f}" for m in ms[1:]] + ["ok"]
                except Exception as err:  # noqa: BLE001
                    failed += 1
                    cells += ["-"] * (2 * len(specs) - 1) + [failure(err)]
                print("| " + " | ".join(cells) + " |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
