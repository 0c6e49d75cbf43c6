"""Write a trained run's weights with every reparametrisation (sigma, specnorm, speccond) folded into plain
weights, as safetensors: the result loads into a model built with the spec minus its weight terms and costs exactly
a standard model at inference. The file's metadata names that spec (attnlab_spec) and the original one.

Example: attnlab export runs/sigma_vs_qk/vit_cifar-cifar100-paper-sigma-s0 --out vit_sigma_folded.safetensors"""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory (config.yaml + checkpoint)")
    p.add_argument("--out", default=None, help="output file (default: RUN_DIR/folded.safetensors)")


def run(args) -> int:
    from pathlib import Path

    from .checks import output_file, run_dir

    run_dir(args.run_dir)
    out = output_file(args.out or Path(args.run_dir) / "folded.safetensors", "--out")

    from ..reparam import export_folded
    from ..spec import Spec, parse_spec
    from ..train import load_run
    model, cfg = load_run(args.run_dir)
    path = export_folded(model, out)
    plain = Spec(tuple(t for t in parse_spec(cfg.attn).terms if t.kind != "weight"))
    print(f"wrote {path}; load it into attnlab.build_model({cfg.model!r}, attn={str(plain)!r}, ...)")
    return 0
