"""What the benchmark scripts share: model options from the command line, torch.compile as the trainer sets it
up (or through another backend, for the CPU dry run), and a failed row's one-line error."""

from __future__ import annotations

import sys
import traceback

import yaml


def model_options(text: str | None) -> dict:
    """A YAML mapping of build_model keyword arguments (``{depth: 1}``), for tiny models in the dry run."""
    value = yaml.safe_load(text) if text else {}
    if not isinstance(value, dict):
        raise SystemExit(f"--model-options {text!r} is not a mapping; write it as '{{depth: 1}}'")
    return value


def compiler(backend: str, device, compiled: bool = True):
    """(compile function, CUDA graphs?): ``torch.compile`` as ``attnlab train --compile`` calls it (mode ``auto``,
    static shapes) for inductor; another backend (``aot_eager``: Dynamo and AOT autograd, no code generation) for
    checking the compiled code paths on a CPU, where inductor takes minutes per model."""
    import torch

    from attnlab.train.run import compile_mode

    if not compiled:
        return (lambda m: m), False
    if backend == "inductor":
        mode = compile_mode("auto", device)
        return (lambda m: torch.compile(m, mode=mode, dynamic=False)), \
            mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"
    return (lambda m: torch.compile(m, backend=backend, dynamic=False)), False


def failure(err: BaseException) -> str:
    """A failed row's status cell: the exception's type and first line (its traceback goes to stderr)."""
    traceback.print_exc(file=sys.stderr)
    first = (str(err).strip().splitlines() or [""])[0]
    return f"failed: {type(err).__name__}: {first}".replace("|", "/")[:200]
