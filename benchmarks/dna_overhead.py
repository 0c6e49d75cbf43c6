"""DnA forward throughput over standard attention, every variant measured in one run (ratios hold, times do not).

Throughput ratio = standard latency / variant latency (1.0 = as fast as standard). Every model starts from the same
seed, so the shared weights are identical. Protocol: attnlab.bench.measure_latency (the NS-Attn paper's: rounds
of warm-up and timed forwards, model order alternating between rounds), eval mode, inference mode.

On the CPU, attnlab's dna runs both branches in one fused C kernel for forwards without gradient (the rows below
are such forwards); training and other devices use two SDPA calls. Rows besides the registered variants, to
compare implementations of Q±V±:
  dna[sdpa]             attnlab's dna with the kernel off: its own projection, two SDPA calls, alpha mul + add
  dna[straightforward]  separate Q-/V- Linears next to the 3*dim qkv, -Q- fed to a second SDPA, alpha mul + add
  dna[one-sdpa]         both branches as ONE SDPA call, stacked along the head axis (K copied, -Q- as query)
  dna[triton]           attnlab's dna with its opt-in Triton kernel (ATTNLAB_DNA_TRITON=1): CUDA, or Triton's CPU
                        interpreter with TRITON_INTERPRET=1 (a check of the path, not a speed)

Each dna[...] row is compared with the dna row on the same input (max |difference| / max |dna|) and flagged
"wrong" beyond a tolerance for the dtype (fp32: 1e-4 on the CPU, 1e-2 on CUDA, where cuDNN's convolution and
Triton's tl.dot run in TF32; bf16 / fp16: 0.1, a loose bound that only a wrong result exceeds): the difference is
recorded beside the row and timing continues.

Targets for dna (qv), 2 CPU cores, fp32 eval: vit_cifar batch 64 >= 0.70; vit_base_patch16_224 batch 4 >= 0.85.
On a CUDA GPU, bf16, ViT-B/16 at batch 128: >= 0.85.

    python benchmarks/dna_overhead.py                                  # both CPU targets
    python benchmarks/dna_overhead.py --models vit_cifar --batch-sizes 64 --iters 20
    python benchmarks/dna_overhead.py --device cuda --dtype bf16 --models vit_base_patch16_224 --batch-sizes 128 \
        --warmup 10 --iters 50 --attn "standard,dna,dna[triton],dna[straightforward]"   # the GPU target (bf16 autocast)
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import subprocess

import torch
import torch.nn.functional as F
from torch import nn

from common import model_options

import attnlab
from attnlab.attention.dna import DnAAttention
from attnlab.bench import DTYPES, Autocast, input_shape, measure_latency, resolve_device
from attnlab.models.convert import attention_modules
from attnlab.spec import split_specs


class Straightforward(DnAAttention):
    """Q±V± written the obvious way: qkv (Q+, K, V+) plus separate q_neg / v_neg Linears, two SDPA calls."""

    def setup(self):
        A = self.attn_dim
        w, b = self.qkv.weight.detach(), self.qkv.bias.detach() if self.qkv.bias is not None else None
        rows = lambda i: slice(i * A, (i + 1) * A)  # noqa: E731  (layout Q+, Q-, K, V+, V-)
        self.qkv_std = nn.Linear(self.dim, 3 * A, bias=b is not None)
        self.q_neg = nn.Linear(self.dim, A, bias=b is not None)
        self.v_neg = nn.Linear(self.dim, A, bias=b is not None)
        with torch.no_grad():
            self.qkv_std.weight.copy_(torch.cat([w[rows(0)], w[rows(2)], w[rows(3)]]))
            self.q_neg.weight.copy_(w[rows(1)])
            self.v_neg.weight.copy_(w[rows(4)])
            if b is not None:
                self.qkv_std.bias.copy_(torch.cat([b[rows(0)], b[rows(2)], b[rows(3)]]))
                self.q_neg.bias.copy_(b[rows(1)])
                self.v_neg.bias.copy_(b[rows(4)])

    def forward(self, x, attn_mask=None, is_causal=False, mask=None):
        B, N, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q, k, v = self.qkv_std(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        qn = self.q_neg(x).reshape(B, N, H, D).transpose(1, 2)
        vn = self.v_neg(x).reshape(B, N, H, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v) + self.alpha.view(-1, 1, 1) * \
            F.scaled_dot_product_attention(-qn, k, vn)
        return self.finish(o, None, x)


class TritonKernel(DnAAttention):
    """attnlab's dna with the opt-in Triton kernel switched on for this module's forwards."""

    def forward(self, x, attn_mask=None, is_causal=False, mask=None):
        before = os.environ.get("ATTNLAB_DNA_TRITON")
        os.environ["ATTNLAB_DNA_TRITON"] = "1"
        try:
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal, mask=mask)
        finally:
            if before is None:
                del os.environ["ATTNLAB_DNA_TRITON"]
            else:
                os.environ["ATTNLAB_DNA_TRITON"] = before


class OneSDPA(DnAAttention):
    """Q±V± as one SDPA call over 2H heads: queries [Q+, -Q-], keys [K, K] (a copy), values [V+, V-]."""

    def forward(self, x, attn_mask=None, is_causal=False, mask=None):
        B, N, _ = x.shape
        H, D = self.num_heads, self.head_dim
        y = self.qkv(x).view(B, N, 5, H, D)
        sign = torch.tensor([1.0, -1.0], dtype=y.dtype, device=y.device).view(1, 1, 2, 1, 1)
        q = (y[:, :, 0:2] * sign).reshape(B, N, 2 * H, D).transpose(1, 2)
        k = y[:, :, 2:3].expand(B, N, 2, H, D).reshape(B, N, 2 * H, D).transpose(1, 2)
        v = y[:, :, 3:5].reshape(B, N, 2 * H, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.finish(torch.addcmul(o[:, :H], self.alpha.view(-1, 1, 1), o[:, H:]), None, x)


def build(model_name: str, specs: list[str], seed: int = 0, **options) -> dict[str, nn.Module]:
    torch.manual_seed(seed)
    base = attnlab.build_model(model_name, attn=None, **options)
    models = {}
    for spec in specs:
        kind, _, impl = spec.partition("[")
        torch.manual_seed(seed + 1)  # new parameters (Q-, V-, alpha) drawn identically for every layout
        m = attnlab.convert(copy.deepcopy(base), kind)
        if impl == "sdpa]":  # attnlab's dna as it runs where the fused CPU kernel does not
            for _, attn in attention_modules(m):
                attn.backend = "sdpa"
        elif impl:
            cls = {"straightforward]": Straightforward, "one-sdpa]": OneSDPA, "triton]": TritonKernel}[impl]
            for _, attn in attention_modules(m):
                attn.__class__ = cls
                if cls is Straightforward:
                    attn.setup()
                if cls is TritonKernel:  # pinned, so that the interpreter's CPU run takes it too
                    attn.backend = "triton"
        models[spec] = m.eval()
    return models


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - best effort
        return platform.processor() or platform.machine()


def tolerance(dtype: str, device: torch.device) -> float:
    """How far a dna[...] row may differ from dna (relative to dna's largest output) before it is flagged."""
    if dtype != "fp32":
        return 0.1
    return 1e-2 if device.type == "cuda" else 1e-4


def differences(models: dict[str, nn.Module], x: torch.Tensor, tol: float) -> dict[str, str]:
    """{row: "diff | check"} for each dna[...] row against dna on ``x``; a row that raises is recorded as such."""
    out = {name: "- | -" for name in models}
    if "dna" not in models:
        return out
    with torch.inference_mode():
        ref = models["dna"](x).float()
        scale = ref.abs().max().clamp_min(1e-12)
        out["dna"] = "0 | reference"
        for name, m in models.items():
            if name.startswith("dna["):
                try:
                    diff = float((m(x).float() - ref).abs().max() / scale)
                    out[name] = f"{diff:.2e} | {'ok' if diff <= tol else 'WRONG'}"
                except Exception as err:  # noqa: BLE001 - its timing will fail too, and say why
                    out[name] = f"- | failed: {type(err).__name__}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit_cifar,vit_base_patch16_224")
    p.add_argument("--batch-sizes", default="64,4", help="one per model")
    p.add_argument("--attn", default="standard,dna,dna[sdpa],dna[straightforward],dna[one-sdpa],dna(variant=q),"
                   "dna(variant=v),dna(variant=shared),dna(variant=sum)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                   help="fp32, or autocast to bf16 / fp16 (weights stay fp32, as in training)")
    p.add_argument("--model-options", default=None, help="YAML mapping for build_model, e.g. '{depth: 1}'")
    args = p.parse_args()
    import timm

    device = resolve_device(args.device)
    if "dna[triton]" in split_specs(args.attn) and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("dna[triton] runs on CUDA (or under Triton's interpreter, TRITON_INTERPRET=1); pass --device cuda")
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_name()}, threads {torch.get_num_threads()}"
    print(f"# {where}, torch {torch.__version__}, timm {timm.__version__}, {args.dtype} eval, "
          "forward throughput ratio = standard ms / variant ms")
    specs = split_specs(args.attn)
    tol = tolerance(args.dtype, device)
    for model_name, bs in zip(args.models.split(","), map(int, args.batch_sizes.split(","))):
        models = build(model_name, specs, **model_options(args.model_options))
        shape = input_shape(models[specs[0]])
        x = torch.randn(bs, *shape, generator=torch.Generator().manual_seed(0)).to(device)
        for name, m in models.items():
            m = m.to(device)
            models[name] = m if args.dtype == "fp32" else Autocast(m, DTYPES[args.dtype])
        checks = differences(models, x, tol)  # the layouts compute the same function
        r = measure_latency(models, x, warmup=args.warmup, iters=args.iters, rounds=args.rounds, progress=False)
        print(f"\n## {model_name}, batch {bs}: {r['rounds']} rounds x ({r['warmup']} warm-up + {r['iters']} timed)\n")
        print(f"| attention | ms/batch (mean ± SD over rounds) | throughput vs standard | max diff / max dna "
              f"(tolerance {tol:g}) | check |")
        print("|---|---:|---:|---:|---|")
        for name, s in r["models"].items():
            print(f"| {name} | {s['mean_ms']:.1f} ± {s['sd_ms'] or 0:.1f} | {1 / s['ratio']:.3f} | {checks[name]} |",
                  flush=True)


if __name__ == "__main__":
    main()
