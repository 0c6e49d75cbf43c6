"""Write a trained run's weights with every reparametrisation (sigma, specnorm, speccond) folded into plain
weights, as safetensors: the result loads into a model built with the spec minus its weight terms and costs exactly
a standard model at inference. The file's metadata names that spec (attnlab_spec) and the original one.

The file is written atomically (a temporary file beside it, then a rename), with the permissions your umask gives.
An --out inside RUN_DIR may name a new file or an earlier export, never one of the run's own files.

With --hf DIR, a Llama- or Qwen-shaped run (standard or qknorm attention; weight terms folded, qkclip's clipped
weights as they are) is written as a Hugging Face checkpoint directory instead (config.json + model.safetensors:
LlamaForCausalLM, Qwen2ForCausalLM with q/k/v biases alone, Qwen3ForCausalLM with QK-norm), which transformers'
from_pretrained loads; DIR must not exist yet.

Example: attnlab export runs/sigma_vs_qk/vit_cifar-cifar100-paper-sigma-s0 --out vit_sigma_folded.safetensors
         attnlab export runs/lm_demo_llama/<run> --hf llama_hf/"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import ConfigError
from .checks import output_file, run_dir

DEFAULT_NAME = "folded.safetensors"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory (config.yaml + checkpoint)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, help=f"output file (default: RUN_DIR/{DEFAULT_NAME})")
    where.add_argument("--hf", default=None, metavar="DIR",
                       help="write a Llama/Qwen-shaped run as a Hugging Face checkpoint directory (config.json + "
                            "model.safetensors) that transformers loads; DIR must not exist")


def _is_export(path: Path) -> bool:
    """Whether ``path`` is a safetensors file an export wrote (its header metadata names attnlab_folded_from); only
    the header is read."""
    from ..models.pretrained import SafetensorError, open_safetensors

    try:
        with open_safetensors(path) as f:
            return "attnlab_folded_from" in (f.metadata() or {})
    except (OSError, ValueError, SafetensorError):
        return False


def check_out(out: Path, run_dir: Path, own_names: frozenset[str]) -> None:
    """ConfigError if ``out`` (symlinks and '..' resolved) lies in ``run_dir`` and would replace a file of the
    run: an existing file that no export wrote, or one of the names the run writes (``own_names``)."""
    target, root = out.resolve(), run_dir.resolve()
    if not target.is_relative_to(root):
        return
    ours = target.parent == root and target.name in own_names
    if ours or (target.exists() and not _is_export(target)):
        raise ConfigError(f"--out {out} would replace the run's own {target.relative_to(root).as_posix()}; give a "
                          f"path outside {run_dir}, or a new file in it such as {run_dir / DEFAULT_NAME}.")


def run(args) -> int:
    run_dir(args.run_dir)
    if args.hf is not None:
        return _run_hf(args)
    out = output_file(args.out or Path(args.run_dir) / DEFAULT_NAME, "--out")

    from ..reparam.fold import folded_safetensors
    from ..spec import Spec, parse_spec
    from ..train import load_run
    from ..train.checkpoint import PREV_STATE, PREV_WEIGHTS, STATE, WEIGHTS, atomic_write_bytes
    from ..train.files import CONFIG, METRICS, RESULT

    check_out(out, Path(args.run_dir), frozenset({CONFIG, METRICS, RESULT, WEIGHTS, STATE, PREV_WEIGHTS, PREV_STATE}))
    model, cfg = load_run(args.run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, folded_safetensors(model))
    plain = Spec(tuple(t for t in parse_spec(cfg.attn).terms if t.kind != "weight"))
    print(f"wrote {out}; load it into attnlab.build_model({cfg.model!r}, attn={str(plain)!r}, ...)")
    return 0


def _run_hf(args) -> int:
    """--hf: the run's model with its weight terms folded, in the Hugging Face layout of its attention."""
    out = Path(args.hf)
    if out.exists():
        raise ConfigError(f"--hf {out} exists; give a new directory for the Hugging Face checkpoint.")
    output_file(out, "--hf")

    from ..models.hf_decoder import export_hf
    from ..reparam.fold import fold
    from ..train import load_run
    from ..train.checkpoint import PREV_STATE, PREV_WEIGHTS, STATE, WEIGHTS
    from ..train.files import CONFIG, METRICS, RESULT

    check_out(out, Path(args.run_dir), frozenset({CONFIG, METRICS, RESULT, WEIGHTS, STATE, PREV_WEIGHTS, PREV_STATE}))
    model, cfg = load_run(args.run_dir)
    export_hf(fold(model), out)
    kind = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"wrote {out} ({kind}); load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
