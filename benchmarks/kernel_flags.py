"""Build time and speed of the fused CPU kernels under two optimisation levels, in one run.

Each level builds the ns and dna kernels into a fresh cache in a fresh process (what a user's first DnA or NS-Attn
forward on a CPU pays), then times them on one thread; the levels alternate over ``--rounds``. Prints the build
seconds and the forward milliseconds per level, and each level's ratio to the first.

    python benchmarks/kernel_flags.py                 # -O3 (attnlab's) against -O2
    python benchmarks/kernel_flags.py --levels=-O3,-O2 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch
from attnlab.ops import ckernel
ckernel._FLAGS = (sys.argv[1], *ckernel._FLAGS[1:])
from attnlab.ops import dna_cpu, ns_cpu, ns_transform
from attnlab.ops.dna_cpu import dna_attention
torch.set_num_threads(1)
t = time.perf_counter()
assert dna_cpu.unavailable() is None and ns_cpu.unavailable() is None
build = time.perf_counter() - t

def best(f, n=20):
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter(); f(); times.append(time.perf_counter() - t)
    return 1e3 * min(times)

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 6, 65, 32, generator=g)           # vit_cifar's heads: 65 tokens x 32 features
q = torch.randn(5, 8, 6, 65, 64, generator=g).unbind(0)
alpha = torch.linspace(-0.5, 0.5, 6)
with torch.no_grad():
    out = {"build_s": build, "ns_ms": best(lambda: ns_transform(x, impl="kernel")),
           "dna_ms": best(lambda: dna_attention(*q, alpha, scale_pos=0.125, scale_neg=0.125))}
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="-O3,-O2",
                        help="comma-separated optimisation flags, attnlab's first (default: -O3,-O2)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per level (default: 1)")
    args = parser.parse_args()
    levels = args.levels.split(",")
    found: dict[str, list[dict]] = {level: [] for level in levels}
    for r in range(args.rounds):
        for level in levels if r % 2 == 0 else levels[::-1]:
            with tempfile.TemporaryDirectory() as cache:
                proc = subprocess.run([sys.executable, "-c", CHILD, level], capture_output=True, text=True,
                                      env=dict(os.environ, ATTNLAB_CACHE=cache), check=True)
            found[level].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {level}: {found[level][-1]}", file=sys.stderr)
    best = {level: {k: min(row[k] for row in rows) for k in rows[0]} for level, rows in found.items()}
    first = best[levels[0]]
    print("| flags | build s | ns ms | dna ms | build x | ns x | dna x |")
    print("|---|---|---|---|---|---|---|")
    for level, row in best.items():
        print(f"| {level} | {row['build_s']:.1f} | {row['ns_ms']:.2f} | {row['dna_ms']:.2f} | "
              f"{row['build_s'] / first['build_s']:.2f} | {row['ns_ms'] / first['ns_ms']:.2f} | "
              f"{row['dna_ms'] / first['dna_ms']:.2f} |")


if __name__ == "__main__":
    main()
