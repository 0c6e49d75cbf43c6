"""TimeSformer throughput: divided against joint space-time attention, and each attention variant against standard,
measured in one run (rounds alternate the order; the median round is reported), plus how the cost grows with T.

Per attention (divided, joint) and variant: inference clips/s (forward, eval mode, the NS-Attn paper's latency
protocol), training clips/s (forward, cross-entropy, backward, AdamW step on one fixed batch), activation memory
(the bytes autograd saves for the backward of one training forward, counted by a saved-tensors hook: the same on
every device and load) and, on CUDA, the peak allocated memory of a training step. Ratios: variant / standard within
an attention, divided / joint within a variant.

Scaling in T at fixed N: multiply-adds of one clip counted by FlopCounterMode on the meta device (exact, no compute;
SDPA as its math kernel), in total and in the attention products alone (batched matmuls), for T = 2 .. 32, with the
exponent a of cost ~ T^a fitted by least squares on the log-log points; and the measured forward time per clip over
the same T. Divided attention costs N T^2 (temporal) + T N^2 (spatial) products, linear in T while T < N; joint
attention (TN)^2, quadratic.

    python benchmarks/video_throughput.py                                  # timesformer_tiny on the CPU
    python benchmarks/video_throughput.py --options img_size=32 --batch-size 4        # N = 64 patches per frame
    python benchmarks/video_throughput.py --model timesformer_base --flops-only       # ViT-B's counts, seconds on a CPU
    python benchmarks/video_throughput.py --model timesformer_base --device cuda --batch-size 8 --amp bf16
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from attnlab.bench import DTYPES, matched_models, measure_latency, measure_train_throughput, resolve_device
from attnlab.models import build_model
from attnlab.spec import split_specs

ATTENTION_OPS = ("bmm", "baddbmm", "_scaled_dot_product")  # q k^T and (weights) v; linears are mm / addmm


def clip_shape(model, frames: int) -> tuple[int, ...]:
    return (model.in_chans, frames, *model.patch_embed.img_size)


def activation_bytes(model, clips, targets) -> int:
    """Bytes of the tensors autograd saves in one training forward (each storage counted once)."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(clips).float(), targets)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def peak_train_memory(model, clips, targets) -> float | None:
    if clips.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(clips.device)
    F.cross_entropy(model(clips).float(), targets).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(clips.device) / 2**20


def macs(name: str, attention: str, frames: int, options: dict) -> tuple[int, int]:
    """(total, attention-product) multiply-adds of one clip, counted on the meta device."""
    with torch.device("meta"):
        model = build_model(name, attn="standard", attention=attention, num_frames=frames, **options).eval()
        x = torch.empty(1, *clip_shape(model, frames))
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(x)
    ops = counter.get_flop_counts()["Global"]
    attention_flops = sum(n for op, n in ops.items() if any(str(op).split(".")[-1].startswith(a)
                                                            for a in ATTENTION_OPS))
    return counter.get_total_flops() // 2, attention_flops // 2


def exponent(xs, ys) -> float:
    """Least-squares slope of log y on log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def options(text: str) -> dict:
    """``key=value,...`` model options, numbers converted."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def scaling(args, specs, attentions, device, opts, g) -> None:
    scan = [int(t) for t in args.scan.split(",")]
    timed = not args.flops_only
    print(f"\nScaling in T at fixed N ({args.model} {args.options}, one clip; GMACs by FlopCounterMode"
          + (f", ms per clip by the latency protocol at batch {args.batch_size}" if timed else "")
          + ", standard attention):\n")
    print("| attention | " + " | ".join(f"T={t}" for t in scan) + " | exponent (total) | exponent (attention) |"
          + (" exponent (time) |" if timed else ""))
    print("|---|" + "---:|" * (len(scan) + 2 + timed))
    for attention in attentions:
        counts = [macs(args.model, attention, t, opts) for t in scan]
        times = []
        for t in scan if timed else ():
            model = matched_models(args.model, specs[:1], device=device, dtype=args.amp, attention=attention,
                                   num_frames=t, **opts)[specs[0]]
            inner = getattr(model, "model", model)
            x = torch.randn(args.batch_size, *clip_shape(inner, t), generator=g).to(device)
            times.append(measure_latency({"m": model}, x, warmup=1, iters=args.iters, rounds=1,
                                         progress=False)["models"]["m"]["mean_ms"] / args.batch_size)
        cells = [f"{c / 1e9:.3g} G" + (f", {times[i]:.2f} ms" if timed else "") for i, (c, _) in enumerate(counts)]
        print(f"| {attention} | {' | '.join(cells)} | {exponent(scan, [c for c, _ in counts]):.2f} | "
              f"{exponent(scan, [a for _, a in counts]):.2f} |" + (f" {exponent(scan, times):.2f} |" if timed else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="timesformer_tiny")
    p.add_argument("--attn", default="standard,dna,diff", help="variants; the first is the baseline")
    p.add_argument("--attentions", default="divided,joint")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--scan", default="2,4,8,16,32", help="clip lengths T of the scaling fit")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="fp32", choices=list(DTYPES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed training steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--options", default="", help="model options key=value,... (e.g. img_size=32)")
    p.add_argument("--flops-only", action="store_true", help="only the operation counts of the T scan (meta device)")
    args = p.parse_args()
    opts = options(args.options)

    device = resolve_device(args.device)
    specs = split_specs(args.attn)
    attentions = args.attentions.split(",")
    amp = None if args.amp == "fp32" else DTYPES[args.amp]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {datetime.date.today()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, threads {torch.get_num_threads()}, load {load:.1f}, device {device}, "
          f"{args.model} {args.options}, T={args.frames}, batch {args.batch_size}, {args.amp}")
    g = torch.Generator().manual_seed(0)
    if args.flops_only:
        return scaling(args, specs, attentions, device, opts, g)

    models = {}
    for attention in attentions:
        group = matched_models(args.model, specs, device=device, dtype=args.amp, attention=attention,
                               num_frames=args.frames, **opts)
        models.update({(attention, spec): m for spec, m in group.items()})
    first = next(iter(models.values()))
    inner = getattr(first, "model", first)
    clips = torch.randn(args.batch_size, *clip_shape(inner, args.frames), generator=g).to(device)
    targets = torch.randint(0, inner.num_classes, (args.batch_size,), generator=g).to(device)
    names = {f"{a}/{s}": m for (a, s), m in models.items()}
    latency = measure_latency(names, clips, warmup=args.warmup, iters=args.iters, rounds=args.rounds, progress=False)
    train = {key: [] for key in names}
    for r in range(args.rounds):
        for key in (list(names) if r % 2 == 0 else list(names)[::-1]):
            train[key].append(measure_train_throughput(names[key], (clips, targets), steps=args.steps,
                                                       warmup=args.warmup if r == 0 else 0, amp_dtype=amp))
    rows = {}
    for key, model in names.items():
        net = getattr(model, "model", model)
        rows[key] = dict(infer=1000 * args.batch_size / latency["models"][key]["mean_ms"],
                         train=statistics.median(train[key]),
                         act=activation_bytes(net, clips, targets) / 2**20,
                         peak=peak_train_memory(net, clips, targets))
    print("\n| attention | variant | inference clips/s | training clips/s | activations MiB | peak MiB | "
          "infer / standard | train / standard | infer divided / joint | train divided / joint |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for attention in attentions:
        for spec in specs:
            row, base = rows[f"{attention}/{spec}"], rows[f"{attention}/{specs[0]}"]
            joint = rows.get(f"joint/{spec}") if attention == "divided" else None
            vs = (f"{row['infer'] / joint['infer']:.2f} | {row['train'] / joint['train']:.2f}" if joint
                  else "| ")
            peak = f"{row['peak']:.0f}" if row["peak"] is not None else "-"
            print(f"| {attention} | {spec} | {row['infer']:.1f} | {row['train']:.1f} | {row['act']:.1f} | {peak} | "
                  f"{row['infer'] / base['infer']:.3f} | {row['train'] / base['train']:.3f} | {vs} |")

    scaling(args, specs, attentions, device, opts, g)


if __name__ == "__main__":
    main()
