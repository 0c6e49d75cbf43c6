"""What the weight-side methods cost: training-step time of each spec over ``standard`` on the same weights and
batch, and folded inference over standard, all measured in one run.

Rounds alternate the order of the specs. Two ratios are printed: of the minimum times over rounds (on a shared
machine the least-disturbed sample is the best estimate of the undisturbed time) and the median over rounds of
(spec time) / (standard time) in that round. A third, low-noise estimate times the parametrisations alone (every
effective weight computed and back-propagated once) and adds that to the standard step. Specs are a
comma-separated list, so other weight-side methods (``qkclip``: its optimizer hook is attached here, a no-op for
the others) take a row of the same table.
``sigma-naive`` is the straightforward parametrisation (power iteration in the forward, gamma * W / sigma through
autograd), kept here as the yardstick for :mod:`attnlab.reparam.sigma`.

    python benchmarks/reparam_overhead.py                                  # vit_cifar, CPU, batch 128, fp32
    python benchmarks/reparam_overhead.py --specs standard,sigma,qkclip --rounds 8
    python benchmarks/reparam_overhead.py --device cuda --amp bf16
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import time

import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import attnlab
from attnlab.bench import input_shape, measure_train_throughput, resolve_device
from attnlab.reparam import qkclip

DEFAULT_SPECS = "standard,sigma,sigma-naive,speccond,speccond(lam=auto)"


class NaiveSigma(nn.Module):
    """The straightforward sigma-Reparam parametrisation: W_hat = gamma * W / (v^T W u) through autograd."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.detach().reshape(weight.shape[0], -1)
        u = torch.linalg.svd(w.T.double(), full_matrices=False).U[:, 0].float()
        self.register_buffer("u", u)
        self.gamma = nn.Parameter(torch.linalg.vector_norm(w @ u).reshape(()))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        w = weight.reshape(weight.shape[0], -1)
        with torch.no_grad():
            v = F.normalize(torch.mv(w, self.u), dim=0)
            u = F.normalize(torch.mv(w.t(), v), dim=0)
            if self.training:
                self.u.copy_(u)
            else:
                u = self.u
        sigma = torch.dot(v, torch.mv(w, u))
        return self.gamma * weight / sigma


def build(name: str, spec: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if spec == "sigma-naive":
        model = attnlab.build_model(name, attn="standard")
        for m in list(model.modules()):
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                parametrize.register_parametrization(m, "weight", NaiveSigma(m.weight), unsafe=True)
        return model
    return attnlab.build_model(name, attn=spec)


def optimizer_factory(model: nn.Module):
    def make(params):
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05)
        qkclip.attach_optimizer_hooks(model, opt)  # no-op for models without qkclip
        return opt
    return make


def inference_ms(model: nn.Module, x: torch.Tensor, iters: int, sync) -> float:
    with torch.no_grad():
        model(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            model(x)
        sync()
    return (time.perf_counter() - t0) / iters * 1e3


def reparam_ms(model: nn.Module, iters: int, sync) -> float:
    """The parametrisations alone: every effective weight computed (training mode) and back-propagated once."""
    layers = [m for m in model.modules() if parametrize.is_parametrized(m, "weight")]
    if not layers:
        return 0.0
    model.train()
    cotangents = [torch.randn_like(m.weight) for m in layers]

    def once():
        torch.autograd.backward([m.weight for m in layers], cotangents)

    once()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    sync()
    model.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_cifar")
    p.add_argument("--specs", default=DEFAULT_SPECS, help="comma-separated specs; 'standard' is always included")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", default="none", choices=["bf16", "none"])
    p.add_argument("--steps", type=int, default=2, help="timed training steps per spec per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--infer-iters", type=int, default=3)
    p.add_argument("--no-infer", action="store_true", help="skip the folded-inference rows")
    p.add_argument("--flush-denormal", action="store_true", help="torch.set_flush_denormal(True) (CPU)")
    args = p.parse_args()
    # specs may contain commas inside parentheses: split on commas at depth 0 only
    specs, depth, cur = [], 0, ""
    for ch in args.specs:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            specs.append(cur)
            cur = ""
        else:
            cur += ch
    specs.append(cur)
    specs = ["standard"] + [s for s in specs if s and s != "standard"]
    if args.flush_denormal:
        torch.set_flush_denormal(True)

    device = resolve_device(args.device)
    amp = torch.bfloat16 if args.amp == "bf16" else None
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    print(f"# {datetime.date.today()}, torch {torch.__version__}, timm {timm.__version__}, "
          f"{platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, device {device}, "
          f"model {args.model}, batch {args.batch_size}, amp {amp}, flush_denormal {args.flush_denormal}, "
          f"{args.rounds} rounds x {args.steps} steps")

    models = {s: build(args.model, s, seed=0).to(device) for s in specs}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, *input_shape(models["standard"]), generator=g).to(device)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)

    step_s: dict[str, list[float]] = {s: [] for s in specs}
    for r in range(args.rounds):
        for s in (specs if r % 2 == 0 else specs[::-1]):
            rate = measure_train_throughput(models[s], (x, y), steps=args.steps, warmup=args.warmup,
                                            optimizer_factory=optimizer_factory(models[s]), amp_dtype=amp)
            step_s[s].append(args.batch_size / rate)
    # the parametrisations' own forward + backward per step, a low-noise measure of the overhead itself
    alone = {s: statistics.median(reparam_ms(models[s], 20, sync) for _ in range(3)) for s in specs}
    base = min(step_s["standard"]) * 1e3
    print("\n| spec | training step (s, min) | ratio of minima | ratio over standard (median of per-round ratios) "
          "| parametrisations alone (ms/step) | 1 + alone / standard step |")
    print("|---|---|---|---|---|---|")
    for s in specs:
        ratios = [a / b for a, b in zip(step_s[s], step_s["standard"])]
        print(f"| {s} | {min(step_s[s]):.3f} | {min(step_s[s]) / min(step_s['standard']):.3f} "
              f"| {statistics.median(ratios):.3f} | {alone[s]:.1f} | {1 + alone[s] / base:.3f} |")

    if args.no_infer:
        return
    # inference: unfolded eval, folded, standard; rounds alternate again
    infer = {"standard": models["standard"].eval()}
    for s in specs[1:]:
        if s == "sigma-naive":
            continue
        infer[f"{s} (unfolded)"] = models[s].eval()
        infer[f"{s} (folded)"] = attnlab.fold(copy.deepcopy(models[s])).eval()
    ms: dict[str, list[float]] = {k: [] for k in infer}
    names = list(infer)
    for r in range(args.rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            ms[k].append(inference_ms(infer[k], x, args.infer_iters, sync))
    print("\n| model (eval, no_grad) | forward (ms, min) | ratio of minima | ratio over standard (median of per-round "
          "ratios) |")
    print("|---|---|---|---|")
    for k in names:
        ratios = [a / b for a, b in zip(ms[k], ms["standard"])]
        print(f"| {k} | {min(ms[k]):.1f} | {min(ms[k]) / min(ms['standard']):.3f} | {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
