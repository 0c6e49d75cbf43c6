"""A corpus that ``attnlab data prepare`` wrote (:mod:`attnlab.data.prepare`): its manifest, and each split's shards
read as one token array.

A split is the concatenation of its shards in order (``train_000000.bin``, ``train_000001.bin``, ...), each a raw
memory map of the manifest's dtype; :class:`ShardedTokens` indexes them as one 1-D array without copying them, so
nanoGPT's random contiguous blocks (:meth:`attnlab.data.lm.TokenStream.batch`) may span a shard boundary, as they
would in one ``train.bin``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from attnlab.errors import DatasetError

FORMAT = "attnlab-tokens/1"  # attnlab.data.prepare.FORMAT, repeated to keep this reader free of the writer


def read_manifest(folder) -> dict | None:
    """The prepare manifest in ``folder``, None when there is none (nanoGPT's own train.bin / val.bin)."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DatasetError(f"{path} cannot be read as JSON ({err}); prepare the corpus again with attnlab data "
                           f"prepare.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None  # another tool's manifest: the folder is read as nanoGPT's
    for key in ("dtype", "vocab_size", "splits"):
        if key not in manifest:
            raise DatasetError(f"{path} holds no {key}; prepare the corpus again with attnlab data prepare.")
    return manifest


class ShardedTokens:
    """Shards (1-D arrays, in order) indexed as one array: ``len``, integer and integer-array indexing, slices."""

    def __init__(self, shards: list[np.ndarray]) -> None:
        self.shards = shards
        self.starts = np.cumsum([0] + [len(s) for s in shards])
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return self[np.arange(start, stop, step)]
        index = np.asarray(index)
        if not np.issubdtype(index.dtype, np.integer):
            raise TypeError("ShardedTokens takes integer indices and slices")
        flat = index.reshape(-1)
        flat = np.where(flat < 0, flat + len(self), flat)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} tokens")
        which = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for k in np.unique(which):
            hit = which == k
            out[hit] = self.shards[k][flat[hit] - self.starts[k]]
        return out.reshape(index.shape) if index.ndim else out[0]

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([np.asarray(s) for s in self.shards])
        return whole if dtype is None else whole.astype(dtype)


def split_files(folder, manifest: dict, split: str) -> list[Path]:
    """The shard files of ``split`` the manifest lists, each checked to exist with the size it records."""
    folder = Path(folder)
    entry = manifest["splits"].get(split) or {}
    shards = entry.get("shards") or []
    if not shards:
        raise DatasetError(f"{folder}/manifest.json lists no {split} shards; prepare the corpus again with attnlab "
                           f"data prepare.")
    width = np.dtype(manifest["dtype"]).itemsize
    files = []
    for shard in shards:
        path = folder / shard["file"]
        if not path.is_file():
            raise DatasetError(f"{path}, a {split} shard that {folder}/manifest.json lists, does not exist; copy the "
                               f"whole folder or prepare the corpus again.")
        if path.stat().st_size != shard["tokens"] * width:
            raise DatasetError(f"{path} holds {path.stat().st_size} bytes, not the {shard['tokens'] * width} its "
                               f"manifest records ({shard['tokens']} {manifest['dtype']} tokens); it was changed or "
                               f"cut short: prepare the corpus again.")
        files.append(path)
    return files


def split_tokens(folder, manifest: dict, split: str):
    """A split's shards as one token array: the memory map itself for one shard, else :class:`ShardedTokens`."""
    maps = [np.memmap(p, dtype=manifest["dtype"], mode="r") for p in split_files(folder, manifest, split)]
    return maps[0] if len(maps) == 1 else ShardedTokens(maps)


def fingerprint(manifest: dict) -> dict[str, str]:
    """What a run records of a prepared corpus: its tokenizer's sha256 and each split's tokens and shard hashes."""
    import hashlib

    out = {"tokenizer.json": manifest["tokenizer"]["sha256"]}
    for split, entry in manifest["splits"].items():
        digest = hashlib.sha256("".join(s["sha256"] for s in entry["shards"]).encode()).hexdigest()[:16]
        out[f"{split} shards"] = f"{entry['tokens']} tokens in {len(entry['shards'])} shards, sha256 {digest}"
    return out


__all__ = ["ShardedTokens", "fingerprint", "read_manifest", "split_files", "split_tokens"]
