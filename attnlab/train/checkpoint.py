"""Atomic files, checkpoints and RNG state of a run directory.

A run directory holds ``checkpoint.safetensors`` (model weights, the epoch in its metadata) and
``trainer_state.pt`` (optimizer, scheduler, sampler and RNG states, epoch, metrics history). Both are plain
tensors and containers, so ``torch.load(..., weights_only=True)`` reads the state. Every file is written to a
temporary file in the same directory, flushed and fsynced, then moved over the old one with ``os.replace``:
a crash at any moment leaves either the old or the new file, never a torn one.
"""

from __future__ import annotations

import io
import json
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from attnlab.errors import AttnlabError

WEIGHTS = "checkpoint.safetensors"
STATE = "trainer_state.pt"


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(file)`` on a same-directory temporary file, fsync, then ``os.replace``.

    If ``write`` or the rename raises, the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------- RNG state
def get_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states as tensors and plain containers."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss_next": py_gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (Mixup draws from it) and torch (CPU and all CUDA devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------- checkpoints
def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as standalone contiguous CPU tensors (safetensors refuses shared storage)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


def save_checkpoint(run_dir: str | Path, model: nn.Module, state: dict[str, Any]) -> None:
    """Write the weights, then the trainer state, each atomically. ``state["epoch"]`` is stored in both."""
    run_dir = Path(run_dir)
    epoch = int(state["epoch"])
    data = safetensors_bytes(weights_of(model), metadata={"epoch": str(epoch)})
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(run_dir / WEIGHTS, data)
    atomic_write_bytes(run_dir / STATE, buf.getvalue())


def has_checkpoint(run_dir: str | Path) -> bool:
    run_dir = Path(run_dir)
    return (run_dir / WEIGHTS).exists() and (run_dir / STATE).exists()


def load_checkpoint(run_dir: str | Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights, trainer state) of a run directory; raises AttnlabError if they belong to different epochs."""
    run_dir = Path(run_dir)
    from safetensors import safe_open

    with safe_open(run_dir / WEIGHTS, framework="pt") as f:
        weights_epoch = int((f.metadata() or {}).get("epoch", -1))
    weights = load_file(run_dir / WEIGHTS, device=str(map_location))
    state = torch.load(run_dir / STATE, map_location=map_location, weights_only=True)
    if weights_epoch != int(state["epoch"]):
        raise AttnlabError(f"{run_dir} holds weights of epoch {weights_epoch} but trainer state of epoch "
                           f"{state['epoch']} (the run stopped between the two writes); start the run afresh.")
    return weights, state
