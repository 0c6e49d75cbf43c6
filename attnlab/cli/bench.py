"""Forward latency of attention variants with the NS-Attn paper's protocol (Section 3.5): all variants load
identical parameters, inputs resident on the device, `--rounds` rounds of `--warmup` untimed and `--iters` timed
forwards with the order alternating between rounds; CUDA events on GPU, a monotonic clock on CPU. Prints ms/batch as
mean and sample SD across round means and the overhead against the first variant.

Example: attnlab bench --model vit_cifar --attn standard,ns --batch-size 128"""

from __future__ import annotations

import argparse
import gc
import json
import re
from pathlib import Path

from ..errors import ConfigError
from .checks import count, output_file


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


def _out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's refusal (both RuntimeErrors)."""
    import torch

    text = str(err)
    return isinstance(err, torch.OutOfMemoryError) or any(
        s in text for s in ("out of memory", "can't allocate memory", "not enough memory"))


def _what_failed(text: str) -> str:
    """The allocation an out-of-memory message reports, in a few words."""
    cpu = re.search(r"allocate (\d+) bytes", text)
    cuda = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    if cpu:
        return f"an allocation of {int(cpu[1]):,} bytes failed"
    if cuda:
        return f"an allocation of {cuda[1]} failed"
    return " ".join(text.split())[:120]


def _memory_budget(device) -> int:
    """Bytes a probe forward may take: on CUDA the device's free memory; on the CPU half of what the system has
    available (MemAvailable) and of what this process may still map (RLIMIT_AS), so that no probe can bring in
    the kernel's OOM killer, which would end the process (and maybe another) without a word."""
    import resource  # POSIX only: imported where it is used

    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])
    limits = []
    try:
        with open("/proc/meminfo") as f:
            limits += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                limits.append(soft - int(f.read().split()[0]) * resource.getpagesize())
    except (OSError, ValueError, IndexError):
        pass
    return max(min(limits), 0) // 2 if limits else 1 << 30


def _bytes_per_image(models: dict, shape, device) -> int:
    """An upper bound of the memory a forward takes per image: the bytes of every tensor that one image's forward
    through each model makes, summed over all ops (more than the peak, since most are freed as they go)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Tally(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Tally.total += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                               if isinstance(t, torch.Tensor))
            return out

    x = torch.zeros(1, *shape, device=device)
    with torch.inference_mode(), Tally():
        for net in models.values():
            net(x)
    return max(Tally.total, 1)


def largest_fitting_batch(args, specs: list[str], device) -> int | None:
    """The largest of batch/2, batch/4, ... for which one forward of every variant in ``specs`` runs on ``device``
    (probes beyond the memory budget are not tried), or None when not even batch 1 does."""
    import torch

    from ..bench import input_shape, matched_models
    from ..models import build_model

    models = matched_models(args.model, specs, num_classes=args.num_classes, seed=args.seed, device=device,
                            dtype=args.dtype)
    shape = input_shape(build_model(args.model, num_classes=args.num_classes, attn=None))
    per_image, budget = _bytes_per_image(models, shape, device), _memory_budget(device)
    batch = args.batch_size // 2
    while batch >= 1:
        if batch * per_image <= budget:
            try:
                x = torch.zeros(batch, *shape, device=device)
                with torch.inference_mode():
                    for net in models.values():
                        net(x)
                return batch
            except RuntimeError as err:
                if not _out_of_memory(err):
                    raise
            x = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        batch //= 2
    return None


def run(args) -> int:
    from ..spec import split_specs

    if args.json:
        output_file(args.json, "--json")  # checked now rather than after minutes of timing
    specs = split_specs(args.attn)
    if not specs:
        raise ConfigError("--attn names no variant; give comma-separated specs such as 'standard,ns'.")

    from ..bench import bench_variants, format_latency
    from ..train.checkpoint import atomic_write_text
    from ..train.run import resolve_device
    device = resolve_device(args.device)  # a device this machine lacks is a one-line error before any model is built
    failure = None
    try:
        result = bench_variants(args.model, specs, batch_size=args.batch_size, warmup=args.warmup, iters=args.iters,
                                rounds=args.rounds, device=args.device, dtype=args.dtype, compile=args.compile,
                                seed=args.seed, num_classes=args.num_classes)
    except RuntimeError as err:
        if not _out_of_memory(err):
            raise
        failure = _what_failed(str(err))
    if failure is not None:  # out of the except block, so that the failed attempt's tensors are freed
        gc.collect()
        fits = largest_fitting_batch(args, specs, device)
        if fits is None:
            raise ConfigError(f"{args.model} does not fit in memory on {device} even at batch 1 "
                              f"({failure}); try a smaller model, --dtype bf16 or another device.")
        raise ConfigError(f"batch {args.batch_size} does not fit in memory on {device} ({failure}); batch {fits} "
                          f"does (one forward of every variant): pass --batch-size {fits}.")
    print(format_latency(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(result, indent=2))
    return 0
