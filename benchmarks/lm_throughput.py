"""Language-model throughput: tokens per second of attnlab's GPT presets against a straightforward causal GPT
written here in plain PyTorch (nanoGPT's model.py: the same shape, the same weights loaded, SDPA with
``is_causal=True``), training and inference, eager and compiled, in one run whose rounds alternate the order of
the arms; every variant's ratio to ``standard`` comes from the same run. Peak memory per arm (eager) is measured
after the timing, in one child process (glibc returns large blocks to the system there, so the resident set's
high-water mark, reset before each arm's step, follows the allocations); on CUDA by the allocator's peak.

Arms: ``plain`` (the reference below), ``timm`` (attnlab's GPT with timm's Attention left in place: the model
without the conversion) and each ``--variants`` spec (``standard`` first). For the Llama presets the reference is a
plain Llama in Hugging Face's layout (RMSNorm, SwiGLU, rotary cos / sin once per forward, SDPA with
``enable_gqa=True``), and there is no timm arm. Training step: zero_grad, forward,
cross-entropy of all next-token logits, backward, fused AdamW step. Inference: one forward of all logits under
``torch.inference_mode``.

    python benchmarks/lm_throughput.py                                   # gpt_tiny, batch 8 x 256 tokens, CPU
    python benchmarks/lm_throughput.py --variants standard,qknorm,sigma,dna --compile none
    python benchmarks/lm_throughput.py --model gpt_mini --batch-size 4 --json out.json
    python benchmarks/lm_throughput.py --threads 1 --clock cpu              # on a machine other jobs load
    python benchmarks/lm_throughput.py --model llama_mini --batch-size 4 --block-size 128   # issue target: >= 0.95

The size ladder (``--ladder``): training tokens/s of ladder presets (``attnlab.models.ladder``) alone, no reference,
under ``--amp`` (bf16 autocast by default on CUDA), eager and/or compiled, with the model FLOPs per token and the
model FLOPs utilisation (``attnlab.ops.model_flops``: 6 N + 12 L T d_attn per token, against the device's dense
bf16 peak; none on a CPU):

    python benchmarks/lm_throughput.py --ladder ladder_d512,ladder_d1024 --device cuda --vocab-size 32000 \
        --batch-size 16 --block-size 512 --compile only                                   # the GPU suite's rows
    python benchmarks/lm_throughput.py --ladder ladder_d128 --vocab-size 256 --batch-size 2 --block-size 64 \
        --compile none                                                                   # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.bench import resolve_device
from attnlab.models import build_model, convert, load_nanogpt
from attnlab.models.hf_decoder import to_attnlab
from attnlab.models.llama import LLAMA_PRESETS, Llama
from attnlab.spec import split_specs


# ---- the reference: nanoGPT's model.py, plainly -------------------------------------------------------------------
class PlainAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), PlainAttention(dim, heads), nn.LayerNorm(dim)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(dim, 4 * dim), c_proj=nn.Linear(4 * dim, dim)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, embed_dim: int, depth: int, num_heads: int):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, embed_dim), wpe=nn.Embedding(block_size, embed_dim),
            h=nn.ModuleList([PlainBlock(embed_dim, num_heads) for _ in range(depth)]), ln_f=nn.LayerNorm(embed_dim)))
        self.lm_head = nn.Linear(embed_dim, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ---- the Llama-shaped reference: Hugging Face's names and order, plainly -------------------------------------------
class PlainLlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (t * cos + torch.cat([-t[..., t.shape[-1] // 2:], t[..., :t.shape[-1] // 2]], -1) * sin for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class PlainLlamaLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, hidden: int, eps: float):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
        self.self_attn = PlainLlamaAttention(dim, heads, kv_heads, head_dim)
        self.mlp = nn.ModuleDict(dict(gate_proj=nn.Linear(dim, hidden, bias=False),
                                      up_proj=nn.Linear(dim, hidden, bias=False),
                                      down_proj=nn.Linear(hidden, dim, bias=False)))

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class PlainLlama(nn.Module):
    """Embedding, layers, RMSNorm and a tied head; the rotary cos / sin computed once per forward."""

    def __init__(self, vocab_size, embed_dim, depth, num_heads, num_kv_heads, head_dim, mlp_hidden, rope_theta,
                 norm_eps, **_):
        super().__init__()
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(vocab_size, embed_dim), norm=nn.RMSNorm(embed_dim, eps=norm_eps),
            layers=nn.ModuleList(PlainLlamaLayer(embed_dim, num_heads, num_kv_heads, head_dim, mlp_hidden, norm_eps)
                                 for _ in range(depth))))
        self.register_buffer("inv_freq", 1.0 / rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)

    def forward(self, idx):
        angles = torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32)[:, None] * self.inv_freq
        cos, sin = (torch.cat([f, f], -1) for f in (angles.cos(), angles.sin()))
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)


# ---- arms ---------------------------------------------------------------------------------------------------------
def geometry(name: str, vocab_size: int, block_size: int) -> dict:
    model = build_model(name, attn=None, vocab_size=vocab_size, block_size=block_size)
    if isinstance(model, Llama):
        return dict(model.geometry)
    return dict(vocab_size=vocab_size, block_size=block_size, embed_dim=model.embed_dim, depth=len(model.blocks),
                num_heads=model.blocks[0].attn.num_heads)


def build_arm(arm: str, args, device) -> nn.Module:
    """The arm's model with the reference's weights (seed 0), loaded before any conversion."""
    geo = geometry(args.model, args.vocab_size, args.block_size)
    torch.manual_seed(0)
    llama = "num_kv_heads" in geo
    if llama and not geo["tie_embeddings"]:
        raise SystemExit(f"{args.model}: the plain reference ties its head; give a preset with a tied head")
    plain = PlainLlama(**geo) if llama else PlainGPT(**geo)
    if arm == "plain":
        return plain.to(device)
    model = build_model(args.model, attn=None, vocab_size=args.vocab_size, block_size=args.block_size)
    if llama:
        model.load_state_dict(to_attnlab(plain.state_dict(), geo, "the plain reference"))
    else:
        model = load_nanogpt(model, plain.state_dict())
    return (model if arm == "timm" else convert(model, arm)).to(device)


def make_step(model: nn.Module, mode: str, tokens: torch.Tensor, compiled: bool):
    """A callable running one training step or one inference forward of ``model`` on ``tokens``."""
    forward = torch.compile(model, dynamic=False) if compiled else model
    x, y = tokens[:, :-1], tokens[:, 1:]
    if mode == "infer":
        model.eval()

        def infer():
            with torch.inference_mode():
                forward(x)
        return infer
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def train():
        opt.zero_grad(set_to_none=True)
        logits = forward(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()
        opt.step()
    return train


def tokens_for(args, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab_size, (args.batch_size, args.block_size + 1), generator=g).to(device)


def peak_memory_child(args) -> None:
    """Print {arm/mode: bytes} of each arm's step at its peak, eager (run with MALLOC_MMAP_THRESHOLD_ set)."""
    device = resolve_device(args.device)
    out = {}
    for mode in args.modes:
        for arm in args.arms:
            model = build_arm(arm, args, device)
            step = make_step(model, mode, tokens_for(args, device), compiled=False)
            step()  # first-call allocations (gradients, optimizer state, thread pools) are not the step's
            if device.type == "cuda":
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                out[f"{arm}/{mode}"] = torch.cuda.max_memory_allocated() - before
            else:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # Linux: reset the peak resident set (VmHWM) to the current one
                before = _rss()
                step()
                out[f"{arm}/{mode}"] = _hwm() - before
            del model, step
    print(json.dumps(out))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure(args, device) -> dict:
    """tokens/s (median over rounds) of every (mode, compiled, arm)."""
    tokens = tokens_for(args, device)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates: dict[tuple, list[float]] = {}
    for mode in args.modes:
        for compiled in args.compiled:
            arms = [a for a in args.arms if not compiled or a in ("plain", "timm", "standard")
                    or args.compile_variants]
            steps = {a: make_step(build_arm(a, args, device), mode, tokens, compiled) for a in arms}
            for a in arms:  # compile and settle outside the timing
                for _ in range(args.warmup):
                    steps[a]()
            for r in range(args.rounds):
                for a in (arms if r % 2 == 0 else arms[::-1]):
                    sync()
                    t0 = clock()
                    for _ in range(args.steps):
                        steps[a]()
                    sync()
                    rates.setdefault((mode, compiled, a), []).append(
                        args.steps * args.batch_size * args.block_size / (clock() - t0))
            print(f"# measured {mode}, {'compiled' if compiled else 'eager'}", file=sys.stderr, flush=True)
    return {k: statistics.median(v) for k, v in rates.items()}


def ladder(args, device) -> list[dict]:
    """tokens/s (median over rounds), FLOPs per token and MFU of each ``--ladder`` preset, training (one arm each:
    zero_grad, forward under autocast, cross-entropy in fp32, backward, fused AdamW)."""
    from attnlab.models.ladder import LADDER_PRESETS, count_parameters
    from attnlab.ops.model_flops import mfu, model_flops_per_token, peak_bf16

    peak = peak_bf16(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    amp = args.amp if args.amp != "auto" else "bf16" if device.type == "cuda" else "none"
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens = tokens_for(args, device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    rows = []
    names = split_specs(args.ladder)
    for name in names:
        if name not in LADDER_PRESETS:  # one line, exit code 2, before any model is built
            print(f"lm_throughput.py: --ladder: {name!r} is no ladder preset; choose from "
                  f"{', '.join(LADDER_PRESETS)}", file=sys.stderr)
            sys.exit(2)
    for name in names:
        for compiled in args.compiled:
            torch.manual_seed(0)
            model = build_model(name, attn=args.ladder_attn, vocab_size=args.vocab_size,
                                block_size=args.block_size).to(device)
            flops = model_flops_per_token(model, args.block_size)
            forward = torch.compile(model, dynamic=False) if compiled else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)

            def step():
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                    logits = forward(x)
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()
                opt.step()

            sync()
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                step()
            sync()
            settle = time.perf_counter() - t0
            rates = []
            for _ in range(args.rounds):
                sync()
                t0 = clock()
                for _ in range(args.steps):
                    step()
                sync()
                rates.append(args.steps * args.batch_size * args.block_size / (clock() - t0))
            rate = statistics.median(rates)
            util = mfu(rate, flops, peak)
            rows.append(dict(model=name, params_non_embedding=count_parameters(model.geometry["embed_dim"])[0],
                             params=sum(p.numel() for p in model.parameters()), compiled=compiled, amp=amp,
                             tokens_per_s=rate, flops_per_token=flops, tflops=rate * flops / 1e12, mfu=util,
                             warmup_s=settle))
            print(f"# measured {name}, {'compiled' if compiled else 'eager'}", file=sys.stderr, flush=True)
            del model, forward, opt
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_ladder(rows: list[dict], args, device) -> None:
    print(f"| model | params (non-emb) | compiled | amp | tokens/s ({args.clock}) | GFLOP/token | TFLOP/s | MFU | "
          f"warm-up s |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        mfu_text = "—" if r["mfu"] is None else f"{r['mfu']:.3f}"
        print(f"| {r['model']} | {r['params_non_embedding'] / 1e6:.1f}M | {'yes' if r['compiled'] else 'no'} | "
              f"{r['amp']} | {r['tokens_per_s']:.0f} | {r['flops_per_token'] / 1e9:.3f} | {r['tflops']:.3f} | "
              f"{mfu_text} | {r['warmup_s']:.1f} |",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt_tiny")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--variants", default="standard", help="comma-separated specs; ratios are against standard")
    p.add_argument("--modes", default="train,infer")
    p.add_argument("--compile", default="both", choices=["none", "both", "only"])
    p.add_argument("--compile-variants", action="store_true", help="also compile the variants other than standard")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: leave as is)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="cpu: this process's CPU time, steadier than wall time on a machine other jobs load (use "
                        "with --threads 1: idle threads that spin would count)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child process")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--ladder", metavar="PRESETS", help="comma-separated ladder presets (ladder_d512,...): tokens/s "
                   "and MFU of each, training, instead of the comparison with the plain reference")
    p.add_argument("--ladder-attn", default="standard", metavar="SPEC", help="the attention spec of --ladder's models")
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "none"],
                   help="--ladder: bf16 autocast ('auto': on CUDA, not on the CPU)")
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ladder:
        args.compiled = {"none": [False], "both": [False, True], "only": [True]}[args.compile]
        device = resolve_device(args.device)
        print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, {platform.machine()}, "
              f"{os.cpu_count()} CPUs, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}, device "
              f"{device}{' ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}, batch "
              f"{args.batch_size} x {args.block_size} tokens, vocab {args.vocab_size}, {args.clock} clock")
        rows = ladder(args, device)
        print(f"# load after: {os.getloadavg()[0]:.1f}")
        print_ladder(rows, args, device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ladder": rows, "batch_size": args.batch_size, "block_size": args.block_size,
                           "vocab_size": args.vocab_size, "device": str(device), "clock": args.clock}, f, indent=1)
        return
    specs = split_specs(args.variants)
    if "standard" not in specs:
        specs = ["standard", *specs]
    # a Llama preset is built with attnlab's attention from the start: no timm arm
    args.arms = ["plain", *(() if args.model in LLAMA_PRESETS else ("timm",)), *specs]
    args.modes = args.modes.split(",")
    args.compiled = {"none": [False], "both": [False, True], "only": [True]}[args.compile]
    if args.memory_child:
        return peak_memory_child(args)
    device = resolve_device(args.device)
    load = os.getloadavg()[0]
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, threads {torch.get_num_threads()}, load {load:.1f}, device {device}, "
          f"{args.model} batch {args.batch_size} x {args.block_size} tokens, vocab {args.vocab_size}, {args.clock} clock")
    rates = measure(args, device)
    memory = {}
    if not args.no_memory:
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--memory-child"], capture_output=True, text=True,
                               env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        if child.returncode == 0:
            memory = json.loads(child.stdout.strip().splitlines()[-1])
        else:
            print(f"# peak memory not measured: {child.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    print(f"# load after: {os.getloadavg()[0]:.1f}")
    print(f"| mode | compiled | arm | tokens/s ({args.clock}) | / plain | / standard | peak MiB (eager) |")
    print("|---|---|---|---:|---:|---:|---:|")
    rows = []
    for (mode, compiled, arm), rate in rates.items():
        plain = rates.get((mode, compiled, "plain"), math.nan)
        std = rates.get((mode, compiled, "standard"), math.nan)
        mib = memory.get(f"{arm}/{mode}")
        rows.append(dict(mode=mode, compiled=compiled, arm=arm, tokens_per_s=rate, vs_plain=rate / plain,
                         vs_standard=rate / std, peak_mib=None if mib is None else mib / 2**20))
        print(f"| {mode} | {'yes' if compiled else 'no'} | {arm} | {rate:.0f} | {rate / plain:.3f} | "
              f"{rate / std:.3f} | {'' if mib is None else f'{mib / 2**20:.1f}'} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "batch_size": args.batch_size, "block_size": args.block_size,
                       "device": str(device), "threads": torch.get_num_threads(), "clock": args.clock, "load": load,
                       "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
