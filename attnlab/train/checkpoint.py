"""Atomic files, checkpoints and RNG state of a run directory. The last two completed epochs are kept as pairs of
weights and trainer state, matched by a save id and checked by their sha256 (:func:`content_sha256`); every file is
replaced atomically; readers of the weights (:func:`find_weights`) never read the trainer state. Layout and
guarantees: docs/training.md, "Run directory"; one writer at a time: :mod:`attnlab.train.lock`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from attnlab.errors import AttnlabError, ConfigError

from .files import PREV_STATE, PREV_WEIGHTS, RESULT, STATE, WEIGHTS
from .lock import RunLock, temp_name

# what resuming reads from a trainer state (with cfg.ema also "ema"): a state without one of them is unusable
RESUME_KEYS = ("epoch", "num_updates", "optimizer", "scheduler", "rng", "history")


class CheckpointError(AttnlabError):
    """A run directory holds checkpoint files but no intact pair of weights and trainer state."""


class NoIntactCheckpoint(CheckpointError):
    """Checkpoint files, none of them usable; ``why`` names each file and its fault."""

    why = ""


def _no_intact(run_dir: Path, skipped: dict[str, str], what: str) -> NoIntactCheckpoint:
    why = "; ".join(f"{name}: {reason}" for name, reason in skipped.items()) or "trainer state without weights"
    if (Path(run_dir) / RESULT).exists():  # --resume of a finished run without intact weights trains it again
        how = f"the run had finished, so run `attnlab train --resume {run_dir}`, which trains it again from the start"
    else:
        how = f"train the run again with `attnlab train --resume {run_dir}`, which starts it afresh"
    err = NoIntactCheckpoint(f"{run_dir} holds no intact {what} ({why}); {how}.")
    err.why = why  # kept when the error is pickled (to another rank or process), unlike arguments of __init__
    return err


def _fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write(file)`` on a same-directory temporary file, fsync, then ``os.replace``; if
    ``write`` or the rename raises, the temporary file is removed and ``path`` is left as it was. The file is opened
    with mode 0666 so that the umask decides its permissions (``tempfile.mkstemp`` would make it 0600). An OSError
    names ``path`` (a full disk's ENOSPC names no file of its own)."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def create_dir_with(path: str | Path, files: dict[str, bytes], lock: RunLock | None = None) -> None:
    """Create directory ``path`` holding ``files`` (name -> bytes) in one rename, so that it never exists without
    them, locked by ``lock`` (a :class:`~attnlab.train.lock.RunLock`; without one, one is taken for the call) before
    it appears; an existing ``path`` gets the files written into it, each atomically, once the lock is held
    (RunLockedError if another process holds it). A run's own ``lock``, not yet held, that finds ``path`` existing
    is a ConfigError: another process made it after the run began and decided to train afresh."""
    path = Path(path)
    own = lock is None
    lock = RunLock(path) if own else lock
    try:
        if not path.is_dir() and not lock.held:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = temp_name(path)
            os.mkdir(tmp)
            try:
                lock.acquire(tmp)  # held before the directory appears under its name
                for name, data in files.items():
                    atomic_write_bytes(tmp / name, data)
                os.rename(tmp, path)  # fails if another process made a non-empty ``path`` meanwhile
                lock.moved()
                _fsync_dir(path.parent)
                return
            except OSError:
                lock.release()
                if not path.is_dir():
                    raise
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp)
        if not lock.held:  # an existing directory: its own lock would have been taken when the run began
            lock.acquire()  # RunLockedError while another process holds it
            if not own:
                raise ConfigError(f"run directory {path} was made by another process while this run set up; run the "
                                  f"command again (with --resume to continue that run).")
        for name, data in files.items():
            atomic_write_bytes(path / name, data)
    finally:
        if own:
            lock.release()


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


def content_sha256(obj: Any) -> str:
    """sha256 of the values of a nested structure of tensors (dtype, shape and bytes), dicts (items sorted by key),
    lists, tuples and scalars (their repr): what a file holds, independent of how it is laid out on disk."""
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(x, dict):
            h.update(f"D{len(x)};".encode())
            for k, v in sorted(x.items(), key=lambda kv: (type(kv[0]).__name__, str(kv[0]))):
                feed(k)
                feed(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)};".encode())
            for v in x:
                feed(v)
        else:
            h.update(f"{type(x).__name__}:{x!r};".encode())

    feed(obj)
    return h.hexdigest()


def _weights_digest(meta: Mapping[str, str], weights: Mapping[str, torch.Tensor]) -> str:
    return content_sha256([{k: meta.get(k) for k in ("epoch", "save_id")}, dict(weights)])


def new_save_id(epoch: int) -> str:
    """The id that ties a checkpoint's files together: the epoch and 16 random hex digits."""
    return f"{epoch}-{secrets.token_hex(8)}"


def save_checkpoint(run_dir: str | Path, model: nn.Module, state: dict[str, Any],
                    previous: tuple[str, str] | None = (WEIGHTS, STATE), *, save_id: str | None = None,
                    weights: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write the checkpoint of epoch ``state["epoch"]`` as the latest pair, keeping ``previous`` as the previous pair:
    the files (weights, state) of the intact pair to keep (default: the latest pair; missing files are skipped;
    ``None`` keeps none), renamed before the new files are written (why that order: docs/training.md). ``save_id``:
    one already written elsewhere (a sharded run's optimizer directory); ``weights``: the model's, gathered (a
    sharded model's own state dict holds its shards)."""
    run_dir = Path(run_dir)
    epoch = int(state["epoch"])
    save_id = save_id or new_save_id(epoch)
    weights = weights_of(model) if weights is None else \
        {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}
    meta = {"epoch": str(epoch), "save_id": save_id}
    data = safetensors_bytes(weights, metadata={**meta, "sha256": _weights_digest(meta, weights)})
    state = {**state, "save_id": save_id}
    state["sha256"] = content_sha256(state)
    buf = io.BytesIO()
    torch.save(state, buf)
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
    """The newest intact checkpoint of a run directory (see :func:`find_checkpoint`; from :func:`find_weights`,
    ``state`` is empty and ``files`` names the weights alone)."""

    epoch: int
    files: tuple[str, ...]                    # (weights, state) file names it was read from
    weights: dict[str, torch.Tensor]
    state: dict[str, Any]
    skipped: dict[str, str] = field(default_factory=dict)   # file name -> why it was not used

    @property
    def note(self) -> str | None:
        """One line for the user when a newer checkpoint file could not be used, else None (training's words)."""
        return self.fallback("continuing from")

    def fallback(self, verb: str) -> str | None:
        """``note`` with its own verb ("continuing from" when training, "using" when reading a run)."""
        if self.files[0] == WEIGHTS or not self.skipped:
            return None
        why = "; ".join(f"{name}: {reason}" for name, reason in self.skipped.items())
        return f"the latest checkpoint is unusable ({why}); {verb} epoch {self.epoch}, the previous intact one."


class _Unusable(Exception):
    """A checkpoint file that reads but fails a check; the message says which."""


def _reason(err: Exception) -> str:
    return str(err) if isinstance(err, _Unusable) else f"unreadable ({type(err).__name__})"


def _open_weights(path: Path):
    from attnlab.models.pretrained import open_safetensors

    return open_safetensors(path)


def _weights_meta(path: Path) -> tuple[int, str]:
    """(epoch, save id) from a weights file's header."""
    with _open_weights(path) as f:
        meta = f.metadata() or {}
    epoch = int(meta["epoch"])
    return epoch, meta.get("save_id", f"epoch {epoch}")


def _heads(run_dir: Path, skipped: dict[str, str]) -> list[tuple[int, str, str]]:
    """(epoch, save id, file) of each weights file whose header reads; why the others do not into ``skipped``."""
    heads = []
    for name in (WEIGHTS, PREV_WEIGHTS):
        if (run_dir / name).exists():
            try:
                heads.append((*_weights_meta(run_dir / name), name))
            except Exception as err:  # noqa: BLE001 -- a damaged file fails in its reader's own way
                skipped[name] = _reason(err)
    return heads


def _read_weights(path: Path, map_location, model: nn.Module | None) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, its names and shapes checked against ``model``'s from the header first, then
    its content against the sha256 in its metadata (files without one are older and unchecked)."""
    from attnlab.models.pretrained import mismatch, safetensors_header, shapes

    with _open_weights(path) as f:
        meta = f.metadata() or {}
        if model is not None:
            why = mismatch(shapes(model.state_dict()), {k: s for k, (_, s) in safetensors_header(f).items()},
                           "the model")
            if why:
                raise _Unusable(f"parses but {why}")
        weights = {k: f.get_tensor(k).to(map_location) for k in f.keys()}
    if "sha256" in meta and meta["sha256"] != _weights_digest(meta, weights):
        raise _Unusable("damaged (its content does not match its sha256)")
    return weights


def _read_state(path: Path, map_location, state_keys: tuple[str, ...], model: nn.Module | None) -> dict[str, Any]:
    """A trainer state, checked against the sha256 it records, for the keys ``state_keys``, and (with ``model``
    and "ema" among them) for EMA weights of the model's shapes."""
    from attnlab.models.pretrained import mismatch, shapes

    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict):
        raise _Unusable(f"holds a {type(state).__name__}, not a trainer state")
    digest = state.pop("sha256", None)
    if digest is not None and digest != content_sha256(state):
        raise _Unusable("damaged (its content does not match its sha256)")
    missing = next((k for k in state_keys if k not in state), None)
    if missing is not None:
        raise _Unusable(f"parses but lacks {missing!r}")
    if model is not None and "ema" in state_keys:
        why = mismatch(shapes(model.state_dict()), shapes(state["ema"]), "the model")
        if why:
            raise _Unusable(f"parses but its EMA state dict {why}")
    return state


def find_checkpoint(run_dir: str | Path, map_location: str | torch.device = "cpu", *, model: nn.Module | None = None,
                    state_keys: tuple[str, ...] = ()) -> Checkpoint | None:
    """The newest intact (weights, trainer state) pair among the run directory's checkpoint files, or None if it
    holds none. A pair is intact when both files read, match their sha256 (files of older versions have none) and
    record the same save id (older files without one match by epoch); with ``model``, when the weights have its
    names and shapes; with ``state_keys``, when the state holds those keys. Raises NoIntactCheckpoint (a
    CheckpointError) if there are checkpoint files but no intact pair."""
    run_dir = Path(run_dir)
    skipped: dict[str, str] = {}
    heads = _heads(run_dir, skipped)
    states: dict[str, tuple[str, dict[str, Any]]] = {}  # save id -> (state file, state)
    for name in (STATE, PREV_STATE):
        if not (run_dir / name).exists():
            continue
        try:
            state = _read_state(run_dir / name, map_location, state_keys, model)
            states[state.get("save_id", f"epoch {int(state['epoch'])}")] = (name, state)
        except Exception as err:  # noqa: BLE001
            skipped[name] = _reason(err)
    for epoch, save_id, weights_name in sorted(heads, reverse=True):
        if save_id not in states:
            skipped[weights_name] = f"epoch {epoch} without its trainer state"
            continue
        state_name, state = states[save_id]
        try:
            weights = _read_weights(run_dir / weights_name, map_location, model)
        except Exception as err:  # noqa: BLE001
            skipped[weights_name] = _reason(err)
            continue
        return Checkpoint(epoch, (weights_name, state_name), weights, state, skipped)
    if heads or states or skipped:
        raise _no_intact(run_dir, skipped, "checkpoint")
    return None


def resume_point(run_dir: str | Path, model: nn.Module | None = None, state_keys: tuple[str, ...] = ()
                 ) -> tuple[Checkpoint | None, str | None]:
    """(checkpoint to continue from, one line for the user) for training a run directory: the newest intact pair
    (:func:`find_checkpoint`, on the CPU) and its fallback note; with checkpoint files but no intact pair (a kill
    inside the first save, damage), None and the note that the run starts afresh."""
    try:
        found = find_checkpoint(run_dir, "cpu", model=model, state_keys=state_keys)
    except NoIntactCheckpoint as err:
        return None, f"no intact checkpoint ({err.why}); starting the run afresh, replacing its checkpoint files."
    return found, found.note if found is not None else None


def find_weights(run_dir: str | Path, map_location: str | torch.device = "cpu", *, model: nn.Module | None = None
                 ) -> Checkpoint | None:
    """The newest intact weights file of a run directory (checked as in :func:`find_checkpoint`), without reading
    any trainer state: what reading a run (eval, export, analyze) needs. None without checkpoint files;
    NoIntactCheckpoint when none of its weights files is intact."""
    run_dir = Path(run_dir)
    skipped: dict[str, str] = {}
    heads = _heads(run_dir, skipped)
    for epoch, name in sorted(((epoch, name) for epoch, _, name in heads), reverse=True):
        try:
            return Checkpoint(epoch, (name,), _read_weights(run_dir / name, map_location, model), {}, skipped)
        except Exception as err:  # noqa: BLE001
            skipped[name] = _reason(err)
    if heads or skipped or has_checkpoint(run_dir):
        raise _no_intact(run_dir, skipped, "weights")
    return None


def load_checkpoint(run_dir: str | Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(weights, trainer state) of the run directory's newest intact checkpoint; raises CheckpointError if none."""
    found = find_checkpoint(run_dir, map_location)
    if found is None:
        raise CheckpointError(f"{run_dir} holds no checkpoint ({WEIGHTS}, {STATE}); train the run first.")
    return found.weights, found.state
