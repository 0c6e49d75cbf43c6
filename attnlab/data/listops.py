"""LRA ListOps, generated locally (Nangia and Bowman, "ListOps: A Diagnostic Dataset for Latent Tree Learning",
2018; the Long Range Arena setting of Tay et al., "Long Range Arena", arXiv:2011.04006).

An example is a tree of operators over digits; its label is the tree's value (10 classes):

    [MAX 2 9 [MIN 4 7 ] 0 ]  ->  9

Operators (LRA's four): MAX, MIN, MED (median; for an even count the floor of the mean of the two middle values,
as LRA's ``int(np.median(...))``), SM (sum modulo 10). The generator follows LRA's: a node below ``max_depth`` is an
operator with probability 0.25 (else a digit), an operator takes 2 to ``max_args`` arguments, a tree is kept when
its length (tokens without parentheses) lies strictly between min_length and max_length (LRA's rule), duplicates
are dropped. The files (``<data_dir>/listops/basic_{train,val,test}.tsv`` in LRA's format, generated once by seed),
their ``generator.json`` and the token ids: docs/training.md, "Long Range Arena".
"""

from __future__ import annotations

import json
import os
import random
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.registry import DatasetInfo
from attnlab.errors import DatasetError

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VOCAB = ("<pad>",) + tuple(str(d) for d in range(10)) + OPERATORS + (END,)
VALUE_P = 0.25  # LRA's: probability that a node shallower than max_depth is an operator
SPLITS = {"train": "basic_train.tsv", "val": "basic_val.tsv", "test": "basic_test.tsv"}
GENERATOR_FILE = "generator.json"


def _evaluate(op: str, values: list[int]) -> int:
    if op == "[MAX":
        return max(values)
    if op == "[MIN":
        return min(values)
    if op == "[MED":
        s = sorted(values)
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2  # int(np.median(values)) for digits
    return sum(values) % 10


class _TooLong(Exception):
    """A tree grew past max_length: LRA would reject it once complete, so stop drawing it now."""


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int, budget: list[int]) -> tuple[str, int]:
    """(source text with LRA's parentheses, value) of a random subtree; ``budget[0]`` counts down the tokens left
    (parentheses excluded) and raises _TooLong below zero."""
    if depth >= max_depth or rng.random() > VALUE_P:
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooLong
        value = int(rng.random() * 10)  # randrange costs 4x more per draw
        return str(value), value
    budget[0] -= 2  # the operator and its ]
    op = OPERATORS[int(rng.random() * len(OPERATORS))]
    children = [_tree(rng, depth + 1, max_depth, max_args, budget) for _ in range(2 + int(rng.random() * (max_args - 1)))]
    text = "( " * (len(children) + 1) + op + "".join(f" {c[0]} )" for c in children) + f" {END} )"
    return text, _evaluate(op, [c[1] for c in children])


def generate(num: int, *, seed: int = 0, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
             max_args: int = 10) -> list[tuple[str, int]]:
    """``num`` distinct (source, label) examples whose lengths lie strictly between min_length and max_length."""
    if min_length + 1 >= max_length:
        raise DatasetError(f"listops keeps lengths strictly between min_length and max_length (LRA's rule), and "
                           f"none lies between {min_length} and {max_length}; give a min_length at most "
                           f"max_length - 2.")
    rng = random.Random(seed)  # Python's generator, as LRA's; much faster per draw than numpy's here
    seen: dict[str, int] = {}
    tries = 0
    while len(seen) < num:
        tries += 1
        if tries > 1000 * (num + 100):
            raise DatasetError(f"listops found only {len(seen)} of {num} distinct trees with lengths {min_length} to "
                               f"{max_length} (max_depth {max_depth}, max_args {max_args}); widen those limits.")
        budget = [max_length]
        try:
            text, value = _tree(rng, 1, max_depth, max_args, budget)
        except _TooLong:
            continue
        if min_length < max_length - budget[0] < max_length:  # LRA's rule: both bounds excluded
            seen.setdefault(text, value)
    return list(seen.items())


def _write(path: Path, rows: list[tuple[str, int]]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("Source\tTarget\n" + "".join(f"{s}\t{t}\n" for s, t in rows))
    tmp.replace(path)  # atomic: a reader never sees half a file


def ensure_files(data_dir, *, num_train: int, num_val: int, num_test: int, seed: int, min_length: int,
                 max_length: int, max_depth: int, max_args: int) -> Path:
    """``<data_dir>/listops`` with the three split files, generated on first use; returns the folder."""
    folder = Path(data_dir) / "listops"
    options = dict(num_train=num_train, num_val=num_val, num_test=num_test, seed=seed, min_length=min_length,
                   max_length=max_length, max_depth=max_depth, max_args=max_args, lengths="strict")
    record = folder / GENERATOR_FILE
    if all((folder / f).exists() for f in SPLITS.values()):
        if record.exists() and json.loads(record.read_text()) != options:
            raise DatasetError(f"{folder} holds ListOps generated with other options "
                               f"({record.read_text().strip()}); use another --data-dir or delete that folder.")
        return folder
    rows = generate(num_train + num_val + num_test, seed=seed, min_length=min_length, max_length=max_length,
                    max_depth=max_depth, max_args=max_args)
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / SPLITS["train"], rows[:num_train])
    _write(folder / SPLITS["val"], rows[num_train:num_train + num_val])
    _write(folder / SPLITS["test"], rows[num_train + num_val:])
    record.write_text(json.dumps(options))
    return folder


# one character per token, so that a file is encoded by str.translate and a byte lookup
_CODES = {op: chr(ord("a") + i) for i, op in enumerate(OPERATORS)} | {END: "e"}
_LOOKUP = np.full(256, 255, dtype=np.uint8)
for _i, _tok in enumerate(VOCAB[1:], start=1):
    _LOOKUP[ord(_CODES.get(_tok, _tok))] = _i


def encode(source: str) -> np.ndarray:
    """Token ids (uint8) of one source text; parentheses dropped. Raises DatasetError on an unknown token."""
    tokens = [t for t in source.split() if t not in ("(", ")")]
    text = "".join(_CODES.get(t, t) for t in tokens)
    ids = _LOOKUP[np.frombuffer(text.encode("latin-1", "replace"), dtype=np.uint8)]
    if len(ids) != len(tokens) or (ids == 255).any():
        bad = next(t for t in tokens if t not in VOCAB)
        raise DatasetError(f"unknown ListOps token {bad!r}; tokens are digits 0-9, {', '.join(OPERATORS)}, ] "
                           f"and parentheses.")
    return ids


@lru_cache(maxsize=4)
def _read(path: str, mtime: float, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    lines = Path(path).read_text().splitlines()
    if not lines or lines[0].split("\t") != ["Source", "Target"]:
        raise DatasetError(f"{path} is not a ListOps file: its first line must be the header 'Source<TAB>Target'.")
    tokens = np.zeros((len(lines) - 1, max_length), dtype=np.uint8)
    labels = np.zeros(len(lines) - 1, dtype=np.int64)
    for i, line in enumerate(lines[1:]):
        source, sep, target = line.rpartition("\t")
        try:
            if not sep:
                raise ValueError
            labels[i] = int(target)
            ids = encode(source)
        except (ValueError, DatasetError) as err:
            why = str(err) if isinstance(err, DatasetError) else "it is not 'source<TAB>label'"
            raise DatasetError(f"{path} line {i + 2} cannot be read: {why.rstrip('.')}.") from None
        if len(ids) > max_length:
            raise DatasetError(f"{path} line {i + 2} has {len(ids)} tokens, more than max_length {max_length}; "
                               f"give a larger max_length (dataset option).")
        tokens[i, : len(ids)] = ids
    return torch.from_numpy(tokens), torch.from_numpy(labels)


class TokenDataset(Dataset):
    """Token ids (n, L) uint8 (0 padding) and labels; items are (ids as int64 (L,), label int)."""

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor):
        self.tokens, self.labels = tokens, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.tokens[index].long(), int(self.labels[index])


def load_listops(data_dir, split: str, *, max_length: int = 2000, **generator) -> TokenDataset:
    """One split (``train``, ``val`` or ``test``), generating the files first if ``<data_dir>/listops`` lacks them."""
    folder = ensure_files(data_dir, max_length=max_length, **generator)
    path = folder / SPLITS[split]
    return TokenDataset(*_read(str(path), path.stat().st_mtime, max_length))


__all__ = ["OPERATORS", "VOCAB", "TokenDataset", "encode", "ensure_files", "generate", "load_listops"]


# ---- the dataset table's entry (attnlab.data.registry)
def info(data_dir, *, max_length: int, **_generator) -> DatasetInfo:
    """10 classes; a sequence model is sized by the vocabulary and the padded length."""
    return DatasetInfo("listops", 10, max_length, len(VOCAB), (), (), task="sequence",
                       model_args=(("num_classes", 10), ("vocab_size", len(VOCAB)), ("max_length", max_length)))


def build(train: bool, *, data_dir, download: bool, augment: str, **options) -> TokenDataset:
    """The train split, or the test split; generated into ``<data_dir>/listops`` on first use."""
    return load_listops(data_dir, "train" if train else "test", **options)
