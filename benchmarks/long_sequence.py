"""Long sequences: forward time and peak memory of ``standard``, ``nystrom`` and ``performer`` in the sequence model
(``seq_listops``: dim 64, 2 blocks, 2 heads of 32) at lengths 1k to 8k, in one run, as ratios to ``standard``, with
the growth exponent b of time ~ N^b and memory ~ N^b fitted by least squares over the lengths (log-log).

Time: inference forwards (no gradient), the fastest of several rounds whose order of variants rotates (on a shared
machine, load only ever adds time, so the minimum is the least disturbed). Peak memory: each (variant, length) forward runs once more in a fresh process,
which reports the growth of its peak resident set (VmHWM, reset before the forward) over its resident set before
the forward (CPU, Linux; glibc's mmap threshold is pinned at 64 KiB there, so every freed tensor leaves the
resident set and a warm-up forward cannot lend its memory to the measured one), or
``torch.cuda.max_memory_allocated`` over the allocation before it (CUDA).

    python benchmarks/long_sequence.py                                # 2 CPU threads, batch 1
    python benchmarks/long_sequence.py --lengths 1024,2048,4096,8192 --variants "standard,nystrom(landmarks=64)"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

from attnlab.bench import resolve_device
from attnlab.models import build_model

VARIANTS = "standard,nystrom(landmarks=64),performer(features=256)"


def _model(spec: str, length: int, device):
    torch.manual_seed(0)
    return build_model("seq_listops", attn=spec, max_length=length, drop_rate=0.0, attn_drop_rate=0.0).to(device).eval()


def _tokens(batch: int, length: int, device):
    return torch.randint(1, 16, (batch, length), generator=torch.Generator().manual_seed(1)).to(device)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def peak_memory(spec: str, length: int, batch: int, device) -> int:
    """Bytes the forward adds at its peak (run in a fresh process: --one)."""
    model, tokens = _model(spec, length, device), _tokens(batch, length, device)
    with torch.no_grad():
        if device.type == "cuda":
            model(tokens)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model(tokens)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
        model(tokens)  # first-call allocations (thread pools, kernels) are not the forward's
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the peak resident set (VmHWM) to the current one
        before = _rss_bytes()
        model(tokens)
        return _status_kib("VmHWM") * 1024 - before


def exponent(lengths, values) -> float:
    """Least-squares slope of log(value) against log(length)."""
    xs, ys = [math.log(n) for n in lengths], [math.log(max(v, 1e-12)) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=VARIANTS, help="comma-separated specs; the first is the baseline")
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads on the CPU (0: leave as is)")
    p.add_argument("--one", nargs=2, metavar=("SPEC", "LENGTH"), help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.one:
        print(peak_memory(args.one[0], int(args.one[1]), args.batch_size, device))
        return

    specs = _split(args.variants)
    lengths = [int(n) for n in args.lengths.split(",")]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[tuple[str, int], list[float]] = {}
    for n in lengths:
        models = {s: _model(s, n, device) for s in specs}
        tokens = _tokens(args.batch_size, n, device)
        with torch.no_grad():
            for s in specs:  # warm-up
                models[s](tokens)
            for r in range(args.rounds):
                for s in specs[r % len(specs):] + specs[: r % len(specs)]:
                    sync()
                    t0 = time.perf_counter()
                    models[s](tokens)
                    sync()
                    times.setdefault((s, n), []).append(time.perf_counter() - t0)
    memory = {}
    for s in specs:
        for n in lengths:
            out = subprocess.run([sys.executable, __file__, "--one", s, str(n), "--batch-size", str(args.batch_size),
                                  "--device", args.device, "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
            memory[(s, n)] = int(out.stdout.strip().splitlines()[-1])

    base = specs[0]
    result = {"device": str(device), "threads": torch.get_num_threads(), "batch_size": args.batch_size,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(), "lengths": lengths,
              "variants": {}}
    print(f"{'variant':34s} {'N':>6s} {'ms':>9s} {'x faster':>9s} {'MiB':>8s} {'x less mem':>10s}")
    for s in specs:
        ms = [min(times[(s, n)]) * 1e3 for n in lengths]
        mib = [memory[(s, n)] / 2**20 for n in lengths]
        entry = {"ms": ms, "peak_mib": mib,
                 "speedup": [min(times[(base, n)]) * 1e3 / m for n, m in zip(lengths, ms)],
                 "memory_ratio": [memory[(base, n)] / max(memory[(s, n)], 1) for n in lengths],
                 "time_exponent": exponent(lengths, ms), "memory_exponent": exponent(lengths, mib)}
        result["variants"][s] = entry
        for i, n in enumerate(lengths):
            print(f"{s:34s} {n:6d} {ms[i]:9.1f} {entry['speedup'][i]:9.2f} {mib[i]:8.1f} {entry['memory_ratio'][i]:10.2f}")
        print(f"{s:34s} growth exponent: time {entry['time_exponent']:.2f}, memory {entry['memory_exponent']:.2f}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def _split(text: str) -> list[str]:
    """Comma-separated specs; commas inside parentheses (options) stay with their spec."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur] if cur else out


if __name__ == "__main__":
    main()
