"""LRA byte-level text classification (Tay et al., "Long Range Arena", arXiv:2011.04006, Sec. 3.3), from the IMDb
reviews a user brings (Maas et al. 2011, the files TensorFlow Datasets' ``imdb_reviews`` is built from).

Layout read: ``<data_dir>/aclImdb/{train,test}/{neg,pos}/*.txt`` (the extracted ``aclImdb_v1.tar.gz``); other
folders and files there (``unsup``, ``urls_*.txt``, ``*.feat``) are ignored. Label 0 is negative, 1 positive
(``imdb_reviews``' order). A review is its UTF-8 bytes, one token per byte, cut to ``max_length`` (LRA: 1,000 to
4,000; the Nyströmformer authors use 4,000) and padded: id = byte + 1, 0 is padding. Files are read in sorted order.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from attnlab.data.listops import TokenDataset
from attnlab.data.registry import DatasetInfo
from attnlab.errors import DatasetError

VOCAB_SIZE = 257  # 256 bytes + padding
CLASSES = ("neg", "pos")


def encode(text: bytes, max_length: int) -> np.ndarray:
    """Ids (uint8 would not hold 256: int16) of one review's bytes, cut to max_length, not padded."""
    return np.frombuffer(text[:max_length], dtype=np.uint8).astype(np.int16) + 1


@lru_cache(maxsize=2)
def _read(folder: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    files = [(label, path) for label, name in enumerate(CLASSES) for path in sorted((Path(folder) / name).glob("*.txt"))]
    tokens = np.zeros((len(files), max_length), dtype=np.int16)
    for i, (_, path) in enumerate(files):
        ids = encode(path.read_bytes(), max_length)
        tokens[i, : len(ids)] = ids
    return torch.from_numpy(tokens), torch.tensor([label for label, _ in files])


def load_lra_text(data_dir, split: str, *, max_length: int = 4000) -> TokenDataset:
    """The ``train`` or ``test`` split as a :class:`TokenDataset` of byte ids."""
    folder = Path(data_dir) / "aclImdb" / split
    missing = [name for name in CLASSES if not any((folder / name).glob("*.txt"))]
    if missing:
        raise DatasetError(f"{folder} has no reviews in {', '.join(missing)}/; extract aclImdb_v1.tar.gz into "
                           f"{data_dir} so that aclImdb/{split}/neg and aclImdb/{split}/pos hold the .txt files.")
    return TokenDataset(*_read(str(folder), max_length))


__all__ = ["CLASSES", "VOCAB_SIZE", "encode", "load_lra_text"]


# ---- the dataset table's entry (attnlab.data.registry)
def info(data_dir, *, max_length: int) -> DatasetInfo:
    return DatasetInfo("lra_text", len(CLASSES), max_length, VOCAB_SIZE, (), (), task="sequence",
                       model_args=(("num_classes", len(CLASSES)), ("vocab_size", VOCAB_SIZE),
                                   ("max_length", max_length)))


def build(train: bool, *, data_dir, download: bool, augment: str, max_length: int) -> TokenDataset:
    return load_lra_text(data_dir, "train" if train else "test", max_length=max_length)
