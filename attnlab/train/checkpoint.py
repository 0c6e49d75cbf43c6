"""Atomic files, checkpoints and RNG state of a run directory.

A run directory keeps the checkpoints of its last two completed epochs, each a pair of files:
``checkpoint.safetensors`` (model weights) + ``trainer_state.pt`` (optimizer, scheduler, sampler and RNG states,
epoch, metrics history) for the latest epoch, ``checkpoint.prev.safetensors`` + ``trainer_state.prev.pt`` for the
one before. Both files of a pair record the epoch and a random save id (the weights in their metadata); a pair is
intact when both files read and their ids match, so weights and state of different saves are never mixed.
Resuming takes the newest intact pair wherever its two files lie (a kill in the middle of the rotation leaves
one of them renamed), so an unreadable latest checkpoint falls back to the previous one.

Every file is written to a temporary file in the same directory, flushed and fsynced, then moved over the old
one with ``os.replace``: a crash at any moment leaves either the old or the new file, never a torn one. Files
are created with mode 0666 and directories with 0777, both less the user's umask, like any other program's.
"""

from __future__ import annotations

import io
import json
import os
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from attnlab.errors import AttnlabError

from .files import PREV_STATE, PREV_WEIGHTS, STATE, WEIGHTS


class CheckpointError(AttnlabError):
    """A run directory holds checkpoint files but no intact pair of weights and trainer state."""


def _fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        dir_fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _temp_name(path: Path) -> Path:
    return path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(file)`` on a same-directory temporary file, fsync, then ``os.replace``.

    If ``write`` or the rename raises, the temporary file is removed and ``path`` is left as it was. The file is
    opened with mode 0666 so that the umask decides its permissions (``tempfile.mkstemp`` would make it 0600).
    """
    path = Path(path)
    tmp = _temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
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
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def create_dir_with(path: str | Path, files: dict[str, bytes]) -> None:
    """Create directory ``path`` holding ``files`` (name -> bytes) in one rename, so that it never exists without
    them; if ``path`` already exists the files are written into it, each atomically."""
    path = Path(path)
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_name(path)
        os.mkdir(tmp)
        try:
            for name, data in files.items():
                atomic_write_bytes(tmp / name, data)
            os.rename(tmp, path)  # fails if another process made a non-empty ``path`` meanwhile
            _fsync_dir(path.parent)
            return
        except OSError:
            if not path.is_dir():
                raise
        finally:
            if tmp.exists():
                for child in tmp.iterdir():
                    child.unlink()
                tmp.rmdir()
    for name, data in files.items():
        atomic_write_bytes(path / name, data)


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


def save_checkpoint(run_dir: str | Path, model: nn.Module, state: dict[str, Any],
                    previous: tuple[str, str] | None = (WEIGHTS, STATE)) -> None:
    """Write the checkpoint of epoch ``state["epoch"]`` as the latest pair, keeping ``previous`` as the previous pair.

    ``previous`` names the files (weights, state) of the intact pair to keep, by default the current latest pair
    (files that do not exist are skipped); they are renamed to the previous pair's names, then the new weights and
    state are written, each atomically. ``None`` keeps no previous pair. The epoch and a fresh save id go into
    both files, so that a kill between any two of these steps leaves an intact pair for
    :func:`find_checkpoint` and never a mixed one.
    """
    run_dir = Path(run_dir)
    epoch = int(state["epoch"])
    save_id = f"{epoch}-{secrets.token_hex(8)}"
    data = safetensors_bytes(weights_of(model), metadata={"epoch": str(epoch), "save_id": save_id})
    buf = io.BytesIO()
    torch.save({**state, "save_id": save_id}, buf)
    if previous is None:
        for name in (PREV_WEIGHTS, PREV_STATE):
            (run_dir / name).unlink(missing_ok=True)
    else:
        for src, dst in zip(previous, (PREV_WEIGHTS, PREV_STATE)):
            if src != dst and (run_dir / src).exists():
                os.replace(run_dir / src, run_dir / dst)
        _fsync_dir(run_dir)
    atomic_write_bytes(run_dir / WEIGHTS, data)
    atomic_write_bytes(run_dir / STATE, buf.getvalue())


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds any checkpoint file (intact or not)."""
    run_dir = Path(run_dir)
    return any((run_dir / name).exists() for name in (WEIGHTS, STATE, PREV_WEIGHTS, PREV_STATE))


@dataclass
class Checkpoint:
    """The newest intact checkpoint of a run directory (see :func:`find_checkpoint`)."""

    epoch: int
    files: tuple[str, str]                    # (weights, state) file names it was read from
    weights: dict[str, torch.Tensor]
    state: dict[str, Any]
    skipped: dict[str, str] = field(default_factory=dict)   # file name -> why it was not used

    @property
    def note(self) -> str | None:
        """One line for the user when a newer checkpoint file could not be used, else None (training's words)."""
        return self.fallback("continuing from")

    def fallback(self, verb: str) -> str | None:
        """``note`` with its own verb ("continuing from" when training, "using" when reading a run)."""
        if self.files == (WEIGHTS, STATE) or not self.skipped:
            return None
        why = "; ".join(f"{name}: {reason}" for name, reason in self.skipped.items())
        return f"the latest checkpoint is unusable ({why}); {verb} epoch {self.epoch}, the previous intact one."


def _reason(err: Exception) -> str:
    return f"unreadable ({type(err).__name__})"


def find_checkpoint(run_dir: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint | None:
    """The newest intact (weights, trainer state) pair among the run directory's checkpoint files, or None if it
    holds none. A pair is intact when both files read and record the same save id (files of older versions,
    without one, match by epoch). Raises CheckpointError if there are checkpoint files but no intact pair."""
    run_dir = Path(run_dir)
    skipped: dict[str, str] = {}
    heads: list[tuple[int, str, str]] = []  # (epoch, save id, weights file)
    for name in (WEIGHTS, PREV_WEIGHTS):
        if not (run_dir / name).exists():
            continue
        try:
            with safe_open(run_dir / name, framework="pt") as f:
                meta = f.metadata() or {}
            epoch = int(meta["epoch"])
            heads.append((epoch, meta.get("save_id", f"epoch {epoch}"), name))
        except Exception as err:  # noqa: BLE001 -- a damaged file fails in its reader's own way
            skipped[name] = _reason(err)
    states: dict[str, tuple[str, dict[str, Any]]] = {}  # save id -> (state file, state)
    for name in (STATE, PREV_STATE):
        if not (run_dir / name).exists():
            continue
        try:
            state = torch.load(run_dir / name, map_location=map_location, weights_only=True)
            states[state.get("save_id", f"epoch {int(state['epoch'])}")] = (name, state)
        except Exception as err:  # noqa: BLE001
            skipped[name] = _reason(err)
    for epoch, save_id, weights_name in sorted(heads, reverse=True):
        if save_id not in states:
            skipped[weights_name] = f"epoch {epoch} without its trainer state"
            continue
        state_name, state = states[save_id]
        try:
            weights = load_file(run_dir / weights_name, device=str(map_location))
        except Exception as err:  # noqa: BLE001
            skipped[weights_name] = _reason(err)
            continue
        return Checkpoint(epoch, (weights_name, state_name), weights, state, skipped)
    if heads or states or skipped:
        why = "; ".join(f"{name}: {reason}" for name, reason in skipped.items()) or "trainer state without weights"
        raise CheckpointError(f"{run_dir} holds no intact checkpoint ({why}); delete its checkpoint files to start "
                              "the run afresh.")
    return None


def load_checkpoint(run_dir: str | Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights, trainer state) of the run directory's newest intact checkpoint; raises CheckpointError if none."""
    found = find_checkpoint(run_dir, map_location)
    if found is None:
        raise CheckpointError(f"{run_dir} holds no checkpoint ({WEIGHTS}, {STATE}); train the run first.")
    return found.weights, found.state
