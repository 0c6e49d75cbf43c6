"""Can attnlab run here? The GPU suite's first step: versions, every torch/timm/torchvision name the code uses, and
one training step of each model and variant the suite measures, before minutes of compilation are spent.

    python benchmarks/check_env.py                  # on the CUDA device if there is one
    python benchmarks/check_env.py --device cpu

Prints a Markdown table of versions (stdout) and exits 0; or prints ONE line ``environment: ...`` on stderr naming
what is missing or broken, and exits 3. Checks, in order:
1. versions: torch, torchvision, timm at least ``MINIMUM`` (torch 2.11 / torchvision 0.26 / Triton 3.6 are the GPU
   machine's; this checkout's own pins are torch 2.14.1 / torchvision 0.29.1), Triton present on CUDA;
2. every attnlab module imports (the timm classes attnlab subclasses are imported at module level);
3. every dotted torch/timm/torchvision name the package and the benchmark scripts reference (``from X import Y``
   and ``torch.a.b`` chains, found by reading their source) exists; ``REQUIRED`` lists the ones younger than
   torch 2.0 or private, with the release that brought them, so that a failure says what to look for;
4. the suite's models (vit_cifar, swin_cifar, ViT-B/16 with one block) with the suite's variants build, and one
   training step of each (batch 2, bf16 autocast) runs on the device.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import os
import pkgutil
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MINIMUM = {"torch": (2, 11), "torchvision": (0, 26), "timm": (1, 0, 16)}  # timm 1.0.15 lacks timm.layers.Attention
SCANNED = ("attnlab", "benchmarks")  # what runs on the GPU machine
# Names younger than torch 2.0, or private, that attnlab relies on, with the release that brought each ("2.1+":
# by 2.1-2.3; the scan finds every name the code uses, this list says where a failure comes from). The timm entries
# were checked with this script against timm 1.0.15, 1.0.16, 1.0.17, 1.0.20 and 1.0.29.
REQUIRED = {
    "torch.library.custom_op": "torch 2.4",
    "torch._library.custom_ops.CustomOpDef.register_fake": "torch 2.4 (the method of custom_op's result)",
    "torch.compiler.cudagraph_mark_step_begin": "torch 2.1", "torch.compiler.is_compiling": "torch 2.3",
    "torch.compiler.assume_constant_result": "torch 2.1+", "torch.compiler.reset": "torch 2.1",
    "torch.nn.attention.sdpa_kernel": "torch 2.3", "torch.nn.attention.SDPBackend": "torch 2.2+",
    "torch.utils.flop_counter.register_flop_formula": "torch 2.1+", "torch.utils.flop_counter.FlopCounterMode":
    "torch 2.1+", "torch.utils.flop_counter.sdpa_flop_count": "torch 2.2+", "torch.amp.GradScaler": "torch 2.3",
    "torch.amp.is_autocast_available": "torch 2.4",
    "torch.func.jacrev": "torch 2.0",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": "torch 2.2+, private",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": "torch 2.2+, private",
    "timm.layers.Attention": "timm 1.0.16 (absent in 1.0.15)", "timm.layers.RmsNorm": "timm <= 1.0.15",
    "timm.models.swin_transformer.get_relative_position_index": "timm <= 1.0.15",
    "timm.models.davit.ChannelAttentionV2": "timm <= 1.0.15", "timm.utils.ModelEmaV3": "timm <= 1.0.15",
    "timm.optim.Lars": "timm <= 1.0.15", "timm.data.distributed_sampler.RepeatAugSampler": "timm <= 1.0.15",
    "torchvision.transforms.functional._get_inverse_affine_matrix": "torchvision 0.8 (private)",
    "torchvision.transforms.v2.functional.equalize": "torchvision 0.16",
}
ROOTS = ("torch", "timm", "torchvision")
OWN = "torch.ops.attnlab."  # attnlab's own custom ops, registered when attnlab.ops imports
SUITE_MODELS = {"vit_cifar": "standard,ns,dna,sigma,speccond", "swin_cifar": "standard,ns",
                "vit_base_patch16_224": "standard,dna"}


class Missing(Exception):
    """What the environment lacks, in one line."""


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit()) if p[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def referenced_names(paths: tuple = ()) -> dict[str, str]:
    """{dotted name: first file using it} for every ``from torch|timm|torchvision... import X`` and every attribute
    chain on a name bound to one of those modules (``torch.cuda.is_available``, ``F.pad`` as torch.nn.functional)."""
    files = paths or [f for d in SCANNED for f in sorted((ROOT / d).rglob("*.py"))]
    found: dict[str, str] = {}
    for path in files:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
        where = str(Path(path).relative_to(ROOT)) if Path(path).is_relative_to(ROOT) else str(path)
        alias: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in ROOTS:
                        alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                        found.setdefault(a.name, where)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] in ROOTS:
                for a in node.names:
                    found.setdefault(f"{node.module}.{a.name}", where)
                    alias[a.asname or a.name] = f"{node.module}.{a.name}"
        Chains(alias, found, where).visit(tree)
    return found


class Chains(ast.NodeVisitor):
    """Records each whole attribute chain rooted at a module alias (``torch.cuda.is_available``, not its parts)."""

    def __init__(self, alias: dict[str, str], found: dict[str, str], where: str):
        self.alias, self.found, self.where = alias, found, where

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in self.alias:
            name = ".".join([self.alias[base.id], *reversed(chain)])
            if not name.startswith(OWN):
                self.found.setdefault(name, self.where)
        else:
            self.visit(base)


def resolve(name: str):
    """The object a dotted name names, importing submodules on the way; AttributeError/ImportError if absent."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i + 1]))
    return obj


def check_versions() -> list[tuple[str, str, str]]:
    rows = [("python", platform.python_version(), ">= 3.10")]
    if sys.version_info < (3, 10):
        raise Missing(f"python {platform.python_version()} is older than 3.10")
    for pkg, minimum in MINIMUM.items():
        try:
            mod = importlib.import_module(pkg)
        except Exception as err:  # noqa: BLE001 - any failure to import is the finding
            raise Missing(f"cannot import {pkg} ({type(err).__name__}: {err})") from None
        have = mod.__version__
        if version_tuple(have) < minimum:
            raise Missing(f"{pkg} {have} is older than the {'.'.join(map(str, minimum))} the suite supports")
        rows.append((pkg, have, ">= " + ".".join(map(str, minimum))))
    return rows


def check_imports() -> None:
    import attnlab

    for info in pkgutil.walk_packages(attnlab.__path__, "attnlab."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as err:  # noqa: BLE001
            raise Missing(f"importing {info.name} failed: {type(err).__name__}: {str(err).splitlines()[0]}") \
                from None


def check_names(names: dict[str, str] | None = None) -> int:
    names = dict(referenced_names()) if names is None else names
    missing = []
    for name in sorted(set(names) | set(REQUIRED)):
        try:
            resolve(name)
        except (AttributeError, ImportError):
            since = f", since {REQUIRED[name]}" if name in REQUIRED else ""
            missing.append(f"{name} (used by {names.get(name, 'attnlab')}{since})")
    if missing:
        raise Missing(f"missing: {'; '.join(missing[:6])}" + (f"; and {len(missing) - 6} more" if len(missing) > 6
                                                              else ""))
    return len(names)


def check_steps(device) -> int:
    """One bf16-autocast training step (batch 2) of each suite model and variant; returns how many ran."""
    import torch
    import torch.nn.functional as F

    from attnlab.bench import input_shape
    from attnlab.models import build_model

    ran = 0
    for model_name, specs in SUITE_MODELS.items():
        for spec in specs.split(","):
            try:
                torch.manual_seed(0)
                # ViT-B/16 with one block (its 86M parameters take seconds to initialise), the same classes
                small = {"depth": 1, **({"img_size": 64} if device.type == "cpu" else {})} if "224" in model_name \
                    else {}
                model = build_model(model_name, num_classes=100, attn=spec, **small).to(device)
                x = torch.randn(2, *input_shape(model), device=device)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).float(), torch.tensor([0, 1], device=device))
                loss.backward()
                if not torch.isfinite(loss):
                    raise RuntimeError(f"loss is {float(loss)}")
            except Exception as err:  # noqa: BLE001
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                raise Missing(f"a training step of {model_name} {spec} on {device} failed: "
                              f"{type(err).__name__}: {first}") from None
            ran += 1
    return ran


def gpu_rows(device) -> list[tuple[str, str, str]]:
    import torch

    rows = [("cuda", str(torch.version.cuda), ""), ("cudnn", str(torch.backends.cudnn.version()), "")]
    p = torch.cuda.get_device_properties(device)
    rows.append(("gpu", f"{p.name}, {p.total_memory / 2 ** 30:.0f} GiB, sm_{p.major}{p.minor}, "
                        f"{p.multi_processor_count} SMs", ""))
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        rows.append(("driver", out or "?", ""))
    except (OSError, subprocess.SubprocessError):
        rows.append(("driver", "nvidia-smi not found", ""))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--no-steps", action="store_true", help="skip check 4 (the training steps)")
    args = p.parse_args(argv)
    rows: list[tuple[str, str, str]] = []
    try:
        rows += check_versions()
        import torch

        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              "cpu" if args.device == "auto" else args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise Missing(f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
        try:
            import triton

            rows.append(("triton", triton.__version__, "needed on CUDA (inductor, dna[triton])"))
        except ImportError:
            if device.type == "cuda":
                raise Missing("triton is not installed; torch.compile's inductor needs it on CUDA") from None
            rows.append(("triton", "not installed", "needed on CUDA only"))
        import numpy

        import attnlab

        rows += [("numpy", numpy.__version__, ""), ("attnlab", f"{attnlab.__version__} ({attnlab.__file__})", "")]
        if device.type == "cuda":
            rows += gpu_rows(device)
        rows.append(("cpu cores", str(os.cpu_count()), ""))
        check_imports()
        n = check_names()
        rows.append(("names checked", str(n), "every torch/timm/torchvision name in attnlab/ and benchmarks/"))
        if not args.no_steps:
            rows.append(("training steps", f"{check_steps(device)} on {device}",
                         "; ".join(f"{m}: {s}" for m, s in SUITE_MODELS.items())))
    except Missing as err:
        have = ", ".join(f"{name} {version}" for name, version, _ in rows[1:4])
        print(f"environment: {err}" + (f" ({have})" if have else ""), file=sys.stderr, flush=True)
        return 3
    print("| what | version | supported |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
