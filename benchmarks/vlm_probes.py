"""Training-step time of DnA probes over standard probes (VisCoP's visual probes, the DnA paper's video LLM, Sec.
4.2), both on the same frozen encoder and the same clips, measured in one run (ratios hold, times do not).

Two rows per encoder:
  step     clips -> frozen encoder (no gradient, eval) -> probes at every layer -> a linear head on the mean probe,
           cross-entropy, backward, AdamW on the probes and the head (the LLM's part of VisCoP's step left out:
           it is the same for both arms)
  probes   the same on the encoder's hidden states computed once: the probes' own cost
Ratio = DnA step time / standard step time (1.0 = as fast; above 1, slower), the median over rounds of each
round's ratio; rounds alternate the order (attnlab.bench.measure_train_throughput: warm-up, timed steps, one fixed
batch). Both arms start from the same seed (the same encoder, probes and head; DnA's extra Q-, V- and alpha drawn
after).

Encoders: ``tiny`` (SigLIP-NaViT, 192 wide, 6 blocks, patch 14; a CPU size) and ``videollama3`` (VideoLLaMA3's
SigLIP-NaViT geometry, 1152 wide, 27 blocks, 16 heads, random weights; a GPU size). 16 probes at every layer, the
authors' DnA script's setting.

    python benchmarks/vlm_probes.py                                                   # tiny, CPU, fp32
    python benchmarks/vlm_probes.py --encoder videollama3 --device cuda --amp bf16 --frames 16 --size 224 \
        --batch-size 2 --steps 10 --warmup 3 --rounds 3                                # the GPU row
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics

import torch
from torch import nn

from attnlab.bench import measure_train_throughput, resolve_device
from attnlab.models.siglip_navit import SigLIPNaViT
from attnlab.models.viscop import VisCoPEncoder

ENCODERS = {"tiny": dict(embed_dim=192, depth=6, num_heads=3, mlp_hidden=768, patch_size=14),
            "videollama3": dict(embed_dim=1152, depth=27, num_heads=16, mlp_hidden=4304, patch_size=14),
            "dry": dict(embed_dim=32, depth=2, num_heads=2, mlp_hidden=64, patch_size=14)}
CLASSES = 8


class ProbeStep(nn.Module):
    """clips -> VisCoPEncoder -> mean probe -> logits: the step's loss reaches the probes only."""

    def __init__(self, vision: VisCoPEncoder) -> None:
        super().__init__()
        self.vision, self.head = vision, nn.Linear(vision.embed_dim, CLASSES)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        return self.head(self.vision(clips)[2].mean(dim=1))


class ProbesOnly(nn.Module):
    """The probes and head on given hidden states (B, layers, M, dim): the probes' own cost."""

    def __init__(self, step: ProbeStep) -> None:
        super().__init__()
        self.probes, self.head = step.vision.probes, step.head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.probes(list(hidden.unbind(1))).mean(dim=1))


def build(encoder: str, attns: list[str], device, num_probes: int, layers: str) -> dict[str, ProbeStep]:
    models = {}
    for attn in attns:
        torch.manual_seed(0)
        enc = SigLIPNaViT(**ENCODERS[encoder])
        torch.manual_seed(1)
        models[attn] = ProbeStep(VisCoPEncoder(enc, num_probes=num_probes, layers=layers, attn=attn)).to(device)
    return models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoder", default="tiny", choices=sorted(ENCODERS))
    p.add_argument("--attn", default="standard,dna", help="comma-separated probe terms; the first is the baseline")
    p.add_argument("--probes", type=int, default=16)
    p.add_argument("--layers", default="all")
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--size", type=int, default=112, help="frame side in pixels (a multiple of the patch size)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", default="none", choices=["bf16", "none"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    amp = torch.bfloat16 if args.amp == "bf16" else None
    attns = [a.strip() for a in args.attn.split(",") if a.strip()]
    if len(attns) < 2:
        raise SystemExit(f"--attn needs a baseline and at least one other term, e.g. 'standard,dna'; got {args.attn!r}")
    geometry = ENCODERS[args.encoder]
    tokens = (args.size // geometry["patch_size"]) ** 2
    print(f"# {datetime.date.today()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"threads {torch.get_num_threads()}, device {device}, amp {amp}, encoder {args.encoder} "
          f"({geometry['embed_dim']} wide, {geometry['depth']} blocks), batch {args.batch_size} x {args.frames} "
          f"frames of {args.size}px ({args.frames * tokens} keys), {args.probes} probes at layers {args.layers}, "
          f"{args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up)")
    models = build(args.encoder, attns, device, args.probes, args.layers)
    g = torch.Generator().manual_seed(0)
    clips = torch.randn(args.batch_size, args.frames, 3, args.size, args.size, generator=g).to(device)
    targets = torch.randint(0, CLASSES, (args.batch_size,), generator=g).to(device)
    with torch.no_grad():
        enc = models[attns[0]].vision.encoder
        hidden, _ = enc.encode(clips.flatten(0, 1))
        hidden = torch.stack([h.reshape(args.batch_size, -1, h.shape[-1]) for h in hidden], dim=1)
    arms = {"step": ({a: m for a, m in models.items()}, clips),
            "probes": ({a: ProbesOnly(m) for a, m in models.items()}, hidden)}
    base = attns[0]
    cols = [a for a in attns[1:]]
    print("| encoder | row | " + " | ".join(f"{a} steps/s" for a in attns) + " | "
          + " | ".join(f"{a} / {base} time (median of rounds) | {a} rounds' ratios" for a in cols) + " |")
    print("|---|---|" + "---:|" * len(attns) + "---:|---|" * len(cols))
    for row, (arm, inputs) in arms.items():
        rates = {a: [] for a in attns}
        for r in range(args.rounds):
            for a in (attns if r % 2 == 0 else list(reversed(attns))):
                rates[a].append(measure_train_throughput(arm[a], (inputs, targets), steps=args.steps,
                                                         warmup=args.warmup, amp_dtype=amp) / args.batch_size)
        cells = [f"{statistics.median(rates[a]):.2f}" for a in attns]
        for a in cols:
            ratios = [s / d for s, d in zip(rates[base], rates[a])]
            cells += [f"{statistics.median(ratios):.3f}", ", ".join(f"{x:.3f}" for x in ratios)]
        print(f"| {args.encoder} | {row} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
