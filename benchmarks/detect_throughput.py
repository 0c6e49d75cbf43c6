"""Mask R-CNN throughput with attnlab's detection backbones: a training step and an inference pass of the detector
whose transformer carries each spec, against the same detector around the unconverted timm backbone ("timm"), in
one run.

Every arm starts from the same weights and sees the same fixed batch (images with boxes and masks). A training
step is the trainer's: zero_grad, forward (the attention dispatcher takes attnlab's CPU path for short
sequences in training), the summed torchvision losses, backward, AdamW. An inference pass keeps every detection (score
threshold 0), so each arm runs its heads on exactly ``detections_per_img`` boxes whatever its backbone outputs.
Rounds rotate the order of the arms; an arm's rate is the fastest of its rounds (on a shared machine load only
ever adds time, so the fastest is the least disturbed), and the ratios are against ``standard`` and ``timm``.
Peak memory: each arm's training step runs once more in a fresh process, which reports the growth of its peak
resident set (VmHWM, reset before the step) over the resident set before it (CPU, Linux), or
``torch.cuda.max_memory_allocated`` over the allocation before it (CUDA).

    python benchmarks/detect_throughput.py                                   # vitdet_tiny, batch 2, 1 thread
    python benchmarks/detect_throughput.py --preset vitdet_base_224 --batch-size 1 --attn standard,dna
    python benchmarks/detect_throughput.py --device cuda --amp bf16 --preset vitdet_base_224 --batch-size 8
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import torch

from attnlab.bench import resolve_device
from attnlab.models import build_detector
from attnlab.spec import split_specs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_sequence import _rss_bytes, _status_kib  # noqa: E402  the peak-resident-set readers, shared

BASE = "timm"


def make_batch(n: int, size: int, num_classes: int, device) -> tuple[list, list]:
    """``n`` random images of ``size`` with three boxes each (masks filling the boxes), seeded."""
    g = torch.Generator().manual_seed(0)
    images, targets = [], []
    for _ in range(n):
        images.append(torch.rand(3, size, size, generator=g).to(device))
        xy = torch.rand(3, 2, generator=g) * size * 0.6
        wh = size * (0.1 + 0.3 * torch.rand(3, 2, generator=g))
        boxes = torch.cat([xy, (xy + wh).clamp(max=size)], 1).round()
        masks = torch.zeros(3, size, size, dtype=torch.uint8)
        for m, (x0, y0, x1, y1) in zip(masks, boxes.int().tolist()):
            m[y0:y1, x0:x1] = 1
        labels = torch.randint(1, num_classes + 1, (3,), generator=g)
        targets.append({"boxes": boxes.to(device), "labels": labels.to(device), "masks": masks.to(device)})
    return images, targets


def build_arms(preset: str, specs: list[str], device) -> dict:
    torch.manual_seed(0)
    plain = build_detector(preset, attn=None)
    arms = {BASE: plain}
    for spec in specs:
        torch.manual_seed(0)
        arms[spec] = build_detector(preset, attn=spec)
        if spec == "standard":  # the same weights as the timm arm, not merely the same seed
            arms[spec].load_state_dict(plain.state_dict())
    for model in arms.values():
        model.roi_heads.score_thresh = 0.0
    return {k: m.to(device) for k, m in arms.items()}


def _autocast(device, amp):
    return torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext()


def train_step(model, optimizer, images, targets, device, amp) -> None:
    model.train()
    optimizer.zero_grad(set_to_none=True)
    with _autocast(device, amp):
        loss = sum(model(images, targets).values())
    loss.backward()
    optimizer.step()


@torch.no_grad()
def infer(model, images, device, amp) -> None:
    model.eval()
    with _autocast(device, amp):
        model(images)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(arm: str, args, device, amp) -> int:
    """Bytes a training step adds at its peak (run in a fresh process: --one)."""
    model = build_arms(args.preset, [] if arm == BASE else [arm], device)[arm]
    images, targets = make_batch(args.batch_size, model.detector_config.img_size, model.detector_config.num_classes,
                                 device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, optimizer, images, targets, device, amp)  # first-call allocations and optimizer state
    if device.type == "cuda":
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(model, optimizer, images, targets, device, amp)
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset the peak resident set (VmHWM) to the current one
    before = _rss_bytes()
    train_step(model, optimizer, images, targets, device, amp)
    return _status_kib("VmHWM") * 1024 - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="vitdet_tiny", help="a detector preset (attnlab.models.DETECTOR_PRESETS)")
    p.add_argument("--attn", default="standard,dna,ns,speccond", help="comma-separated specs (standard first)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps (and inference passes) per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="none", choices=["none", "bf16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (0: leave as is)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--one", metavar="ARM", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    amp = torch.bfloat16 if args.amp == "bf16" else None
    if args.one:
        print(peak_memory(args.one, args, device, amp))
        return

    specs = split_specs(args.attn)
    arms = build_arms(args.preset, specs, device)
    cfg = arms[BASE].detector_config
    images, targets = make_batch(args.batch_size, cfg.img_size, cfg.num_classes, device)
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in arms.items()}
    names = list(arms)
    for name in names:  # warm-up: first-call allocations, optimizer state
        train_step(arms[name], optimizers[name], images, targets, device, amp)
        infer(arms[name], images, device, amp)
    train_s = {k: [] for k in names}
    infer_s = {k: [] for k in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                train_step(arms[name], optimizers[name], images, targets, device, amp)
            _sync(device)
            t1 = time.perf_counter()
            for _ in range(args.steps):
                infer(arms[name], images, device, amp)
            _sync(device)
            train_s[name].append(t1 - t0)
            infer_s[name].append(time.perf_counter() - t1)
    n = args.steps * args.batch_size
    memory = {}
    if not args.no_memory:
        for name in names:
            out = subprocess.run([sys.executable, __file__, "--one", name, "--preset", args.preset,
                                  "--batch-size", str(args.batch_size), "--device", args.device, "--amp", args.amp,
                                  "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
            memory[name] = int(out.stdout.strip().splitlines()[-1])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# {datetime.date.today()}, {args.preset}, batch {args.batch_size}, device {device}, amp {args.amp}, "
          f"threads {torch.get_num_threads()}, torch {torch.__version__}, {platform.machine()}, load {load:.1f}")
    print("| backbone | train img/s | infer img/s | train / timm | infer / timm | train / standard | "
          "infer / standard | peak train MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rate = {k: (n / min(train_s[k]), n / min(infer_s[k])) for k in names}
    ref = "standard" if "standard" in rate else BASE
    result = {"preset": args.preset, "batch_size": args.batch_size, "device": str(device), "amp": args.amp,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "load": load, "arms": {}}
    for k in names:
        (tr, inf), (btr, binf), (str_, sinf) = rate[k], rate[BASE], rate[ref]
        mib = memory.get(k, float("nan")) / 2**20
        print(f"| {k} | {tr:.3g} | {inf:.3g} | {tr / btr:.3f} | {inf / binf:.3f} | {tr / str_:.3f} | "
              f"{inf / sinf:.3f} | {mib:.0f} |", flush=True)
        result["arms"][k] = {"train_img_s": tr, "infer_img_s": inf, "train_vs_timm": tr / btr,
                             "infer_vs_timm": inf / binf, "train_vs_standard": tr / str_,
                             "infer_vs_standard": inf / sinf, "peak_train_mib": mib}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
