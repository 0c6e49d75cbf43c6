"""Multi-query associative recall (MQAR), generated locally by seed (Arora, Eyuboglu et al., "Zoology: Measuring and
Improving Recall in Efficient Language Models", arXiv 2312.04927, Sec. 3 and its synthetic-data appendix).

A sequence of ``seq_len`` tokens starts with ``num_kv_pairs`` key-value pairs, then asks for every key once more; the
model must answer each query with the value that followed that key in the context:

    position   0  1  2  3 ...  2K-2 2K-1 | 2K ...                       seq_len - 1
    input      k1 v1 k2 v2 ... kK   vK   | filler, and each key once at an even offset 2g from 2K
    target     ignored                   | v(key) at each query's position, ignored elsewhere (-100)

as Zoology's generator draws it: keys are distinct ids from [1, vocab_size / 2), values distinct ids from
[vocab_size / 2, vocab_size); query slots g are distinct, drawn from the (seq_len - 2K) / 2 slots with
probabilities proportional to g^(power_a - 1) (g = 1, 2, ...: a power law, short gaps likely, as repeated bigrams are
in text); filler tokens are uniform over the whole vocabulary (``random_non_queries``; else 0). The loss and the
accuracy are taken at the query positions only (targets -100 elsewhere, ``ignore_index``).

The train set (``num_train`` examples, Zoology's 100,000) and the test set (``num_test``, Zoology's 3,000) are fixed by
the options without being stored (:class:`MQAR`), and a training step's batch by (seed, rank, step) as well.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from attnlab.data.registry import DatasetInfo
from attnlab.data.lm import lm_info, no_augment
from attnlab.data.lm_metrics import IGNORE  # the target of every position that is not a query
from attnlab.errors import ConfigError
SPLITS = ("train", "test")

def check(vocab_size: int, seq_len: int, num_kv_pairs: int) -> None:
    """ConfigError for a geometry Zoology's generator cannot fill."""
    if seq_len % 2:
        raise ConfigError(f"mqar seq_len must be even (queries sit at even offsets), not {seq_len}.")
    if 4 * num_kv_pairs > seq_len:
        raise ConfigError(f"mqar needs seq_len >= 4 x num_kv_pairs (the pairs and their queries): {num_kv_pairs} "
                          f"pairs need seq_len >= {4 * num_kv_pairs}, not {seq_len}.")
    if vocab_size <= seq_len:  # Zoology's condition; with 4 K <= seq_len it leaves room for K distinct keys
        raise ConfigError(f"mqar vocab_size must exceed seq_len (Zoology's condition), not {vocab_size} <= {seq_len}.")


def gap_probabilities(slots: int, power_a: float) -> np.ndarray:
    """P(query slot g), g = 0 .. slots - 1: proportional to (g + 1)^(power_a - 1)."""
    p = np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def _distinct(rng: np.random.Generator, rows: int, k: int, low: int, high: int) -> np.ndarray:
    """(rows, k) ids from [low, high), distinct within a row, uniformly (each row a uniform k-subset, shuffled)."""
    n = high - low
    if 4 * k > n:  # a dense draw: a random permutation per row
        return rng.random((rows, n)).argsort(axis=1)[:, :k] + low
    out = rng.integers(low, high, size=(rows, k))
    while True:  # redraw the rows that repeat an id (rare when k << n)
        s = np.sort(out, axis=1)
        bad = np.nonzero((s[:, 1:] == s[:, :-1]).any(axis=1))[0]
        if not bad.size:
            return out
        out[bad] = rng.integers(low, high, size=(bad.size, k))


def generate(rng: np.random.Generator, rows: int, vocab_size: int, seq_len: int, num_kv_pairs: int,
             power_a: float = 0.01, random_non_queries: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` examples (inputs, targets), each int64 (rows, seq_len) (module docstring).

    The query slots are a weighted draw without replacement, done as the top ``num_kv_pairs`` of log p + Gumbel
    noise per row, which has the distribution of drawing them one after another with probabilities proportional
    to the remaining p (Zoology's ``np.random.choice(..., replace=False, p=p)``).
    """
    K, half = num_kv_pairs, vocab_size // 2
    keys = _distinct(rng, rows, K, 1, half)
    values = _distinct(rng, rows, K, half, vocab_size)
    slots = (seq_len - 2 * K) // 2
    scores = np.log(gap_probabilities(slots, power_a)) + rng.gumbel(size=(rows, slots))
    gaps = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    inputs = np.zeros((rows, seq_len), dtype=np.int64)
    inputs[:, 0:2 * K:2], inputs[:, 1:2 * K:2] = keys, values
    where = 2 * K + 2 * gaps
    r = np.arange(rows)[:, None]
    inputs[r, where] = keys
    targets = np.full((rows, seq_len), IGNORE, dtype=np.int64)
    targets[r, where] = values
    if random_non_queries:
        filler = rng.integers(0, vocab_size, size=(rows, seq_len))
        inputs = np.where(inputs == 0, filler, inputs)
    return inputs, targets


#: int32 elements of one generated chunk (inputs and targets of rows x seq_len): 0.5 MB
_CHUNK_ELEMENTS = 1 << 16


class MQAR:
    """One split of MQAR: ``len`` examples, generated on demand in chunks of consecutive indices, chunk c from
    ``numpy.random.default_rng([seed, split, c])`` (the examples depend on the seed and the options alone).

    ``[i]`` is example i as int64 tensors (inputs, targets); :meth:`batch` draws a training batch of a step.
    """

    def __init__(self, split: str = "train", *, vocab_size: int = 8192, seq_len: int = 64, num_kv_pairs: int = 8,
                 power_a: float = 0.01, random_non_queries: bool = True, num_train: int = 100_000,
                 num_test: int = 3_000, seed: int = 0) -> None:
        if split not in SPLITS:
            raise ConfigError(f"mqar split must be one of {', '.join(SPLITS)}, not {split!r}.")
        check(vocab_size, seq_len, num_kv_pairs)
        self.split, self.seed = split, seed
        self.vocab_size, self.seq_len, self.num_kv_pairs = vocab_size, seq_len, num_kv_pairs
        self.power_a, self.random_non_queries = power_a, random_non_queries
        self.length = num_train if split == "train" else num_test
        self.rows = max(1, _CHUNK_ELEMENTS // seq_len)
        self.name = f"mqar {split}"
        self.bytes_per_token = None  # not text: no bits per byte
        self._chunk = lru_cache(maxsize=256)(self._generate_chunk)

    def __len__(self) -> int:
        return self.length

    def _generate_chunk(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), c])
        x, y = generate(rng, self.rows, self.vocab_size, self.seq_len, self.num_kv_pairs, self.power_a,
                        self.random_non_queries)
        return x.astype(np.int32), y.astype(np.int32)

    def examples(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 (len(indices), seq_len)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.length):
            raise IndexError(f"mqar {self.split} has {self.length} examples")
        x = np.empty((idx.size, self.seq_len), dtype=np.int64)
        y = np.empty_like(x)
        for c in np.unique(idx // self.rows):
            rows = np.nonzero(idx // self.rows == c)[0]
            cx, cy = self._chunk(int(c))
            x[rows], y[rows] = cx[idx[rows] % self.rows], cy[idx[rows] % self.rows]
        return torch.from_numpy(x), torch.from_numpy(y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.examples([index])
        return x[0], y[0]

    def check_block_size(self, block_size: int) -> None:
        if block_size != self.seq_len:
            raise ConfigError(f"mqar examples are {self.seq_len} tokens long; use block size {self.seq_len} (or set "
                              f"the dataset option seq_len={block_size}).")

    def batch(self, step: int, batch_size: int, block_size: int | None = None, *, seed: int = 0, rank: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of ``batch_size`` examples drawn uniformly from the split, a function of (seed, rank, step):
        the training stream (the test split is evaluated in order with :meth:`examples`)."""
        if block_size is not None:
            self.check_block_size(block_size)
        rng = np.random.default_rng([seed, 1 << 20, rank, step])  # a stream apart from the examples' own
        return self.examples(rng.integers(0, self.length, size=batch_size))

    def eval_batches(self, batch_size: int, block_size: int | None = None, iters: int | None = None, *,
                     seed: int = 0):
        """The split's examples in order, ``batch_size`` at a time: all of them, or the first ``iters`` batches."""
        if block_size is not None:
            self.check_block_size(block_size)
        stop = self.length if iters is None else min(self.length, iters * batch_size)
        for start in range(0, stop, batch_size):
            yield self.examples(range(start, min(start + batch_size, stop)))


def mqar_info(data_dir="data", *, vocab_size: int = 8192, seq_len: int = 64, num_kv_pairs: int = 8,
              **options) -> DatasetInfo:
    """Vocabulary and the (fixed) block size of MQAR with these options (Zoology's defaults)."""
    check(vocab_size, seq_len, num_kv_pairs)
    return lm_info("mqar", vocab_size, seq_len)


def build_mqar(train: bool, *, data_dir="data", download: bool = False, augment: str = "none", **options) -> MQAR:
    """The train or test split of MQAR (nothing is read or written)."""
    no_augment("mqar", augment)
    return MQAR("train" if train else "test", **options)


__all__ = ["IGNORE", "MQAR", "build_mqar", "check", "gap_probabilities", "generate", "mqar_info"]
