"""QK-clip's cost: training steps per second of ``qkclip`` (recording hook + clip after every optimizer step)
against ``standard`` on the same weights and batch, measured in one run. Rounds alternate the order; the ratio
reported is the median over rounds of (qkclip img/s) / (standard img/s) in that round. Also times QK-clip's
pieces alone, which a loaded machine measures more steadily than whole steps: the per-forward record of one
attention module (screened: the bound only, the usual case; exact: the q k^T maximum a head over the bound needs)
and one ``clip_`` of the whole model, and turns them into a step-time ratio: 1 + (layers * record + clip) / step.

    python benchmarks/qkclip_overhead.py                       # vit_cifar, CPU, batch 128, fp32
    python benchmarks/qkclip_overhead.py --device cuda --amp bf16 --models vit_cifar,swin_cifar
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import timm
import torch

from attnlab.bench import input_shape, measure_train_throughput, resolve_device
from attnlab.models import attention_modules, build_model
from attnlab.ops import logits as logit_ops
from attnlab.reparam import qkclip


def _optimizer_factory(model):
    def make(params):
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05)
        qkclip.attach_optimizer_hooks(model, opt)  # no-op for the standard model
        return opt
    return make


def _time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit_cifar")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", default="none", choices=["bf16", "none"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    amp = torch.bfloat16 if args.amp == "bf16" else None
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cpu = platform.processor() or platform.machine()
    print(f"# {datetime.date.today()}, torch {torch.__version__}, timm {timm.__version__}, {cpu}, "
          f"threads {torch.get_num_threads()}, device {device}, batch {args.batch_size}, amp {amp}, "
          f"{args.rounds} rounds x {args.steps} steps")
    print("| model | standard img/s | qkclip img/s | qkclip/standard rate (median of rounds) | rounds' ratios "
          "| record ms/layer (screened / exact) | clip ms | step-time ratio from parts (typical / every head exact) |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for name in args.models.split(","):
        models = {}
        for spec in ("standard", "qkclip"):
            torch.manual_seed(0)
            models[spec] = build_model(name, num_classes=100, attn=spec).to(device)
        g = torch.Generator().manual_seed(0)
        batch = (torch.randn(args.batch_size, *input_shape(models["standard"]), generator=g).to(device),
                 torch.randint(0, 100, (args.batch_size,), generator=g).to(device))
        rates = {s: [] for s in models}
        for r in range(args.rounds):
            for spec in (("standard", "qkclip") if r % 2 == 0 else ("qkclip", "standard")):
                m = models[spec]
                rates[spec].append(measure_train_throughput(
                    m, batch, steps=args.steps, warmup=args.warmup, amp_dtype=amp,
                    optimizer_factory=_optimizer_factory(m)))
        ratios = [c / s for s, c in zip(rates["standard"], rates["qkclip"])]

        # the pieces alone: the record of the first attention module's q, k, and one clip of the whole model
        module = attention_modules(models["qkclip"])[0][1]
        seen = []
        h = module.register_forward_pre_hook(lambda mod, a: seen.append(a[0].detach()))
        with torch.no_grad():
            models["qkclip"].eval()(batch[0][:1])
        h.remove()
        x = seen[0].repeat(args.batch_size, 1, 1)  # one image's tokens (or windows) times the batch size
        with torch.no_grad():
            out = module.qkv(x)
            H, D = module.num_heads, module.head_dim
            q, k = out[..., : 2 * H * D].unflatten(-1, (2, H, D)).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D)
            tau = module.qk_clip.tau
            screened_ms = _time(lambda: logit_ops.screened_max_logits(q, k, module.scale, tau), 10, sync)
            exact_ms = _time(lambda: logit_ops.max_scaled_logits(q, k, module.scale), 10, sync)
        clip_ms = _time(lambda: qkclip.clip_(models["qkclip"]), 10, sync)
        n_layers = len(attention_modules(models["qkclip"]))
        step_ms = 1e3 * args.batch_size / statistics.median(rates["standard"])
        estimate = 1 + (n_layers * screened_ms + clip_ms) / step_ms
        worst = 1 + (n_layers * (screened_ms + exact_ms) + clip_ms) / step_ms
        print(f"| {name} | {statistics.median(rates['standard']):.1f} | {statistics.median(rates['qkclip']):.1f} | "
              f"{statistics.median(ratios):.3f} | {', '.join(f'{r:.3f}' for r in ratios)} | "
              f"{screened_ms:.2f} / {exact_ms:.2f} | {clip_ms:.2f} | {estimate:.3f} / {worst:.3f} |", flush=True)


if __name__ == "__main__":
    main()
