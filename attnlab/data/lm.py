"""Token streams for language modelling, and random contiguous blocks of them (nanoGPT's ``get_batch``).

Sources, each split (``train`` / ``val``) one 1-D array of token ids (docs/methods.md, "Data"): ``text`` (a file or
folder as bytes, or through a ``tokenizer.json``), ``stdlib`` (the standard library's ``.py`` files as bytes, its
:func:`stdlib_manifest` recorded by a run and compared by :func:`check_manifest`), ``nanogpt`` (prepared ``.bin``
memory maps, ``meta.pkl`` read as plain data).

A block at training step ``s`` is a function of (seed, split, rank, s) alone: B start offsets drawn uniformly from
``numpy.random.default_rng([seed, split, rank, s])``, x = ids[i : i + T], y = ids[i + 1 : i + T + 1], so a resumed
run draws the blocks the uninterrupted one would; evaluation batch j is ``batch(j)``, the same at every evaluation.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from attnlab.data.registry import DatasetInfo
from attnlab.errors import ConfigError, DatasetError

BYTE_VOCAB = 256
SPLITS = ("train", "val")
GPT2_VOCAB = 50257  # nanoGPT's openwebtext / shakespeare prepare.py encode with GPT-2's BPE
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass
class TokenStream:
    """One split of a corpus: ``tokens`` a 1-D integer array (in memory or a memory map) of ids < ``vocab_size``."""

    name: str
    split: str
    tokens: np.ndarray
    vocab_size: int
    bytes_per_token: float | None = None
    manifest: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def check_block_size(self, block_size: int) -> None:
        if block_size < 1 or block_size + 1 > len(self.tokens):
            raise DatasetError(f"the {self.split} split of {self.name} holds {len(self.tokens)} tokens, too few for "
                               f"blocks of {block_size} (x and its next-token targets need {block_size + 1}); give a "
                               f"block size below {len(self.tokens)} or a larger corpus.")

    def batch(self, step: int, batch_size: int, block_size: int, *, seed: int = 0, rank: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each int64 (batch_size, block_size): random contiguous blocks and their next tokens, a function
        of (seed, split, rank, step) alone (module docstring)."""
        self.check_block_size(block_size)
        rng = np.random.default_rng([seed, SPLITS.index(self.split), rank, step])
        starts = rng.integers(0, len(self.tokens) - block_size, size=batch_size)
        chunk = np.asarray(self.tokens[starts[:, None] + np.arange(block_size + 1)], dtype=np.int64)
        if chunk.size and int(chunk.max()) >= self.vocab_size:
            raise DatasetError(f"the {self.split} split of {self.name} holds token id {int(chunk.max())}, outside its "
                               f"vocabulary of {self.vocab_size}; give the vocab_size the corpus was encoded with.")
        chunk = torch.from_numpy(chunk)
        return chunk[:, :-1], chunk[:, 1:]

    def eval_batches(self, batch_size: int, block_size: int, iters: int, *, seed: int = 0):
        """``batch(j)`` for j < ``iters``: the same blocks at every evaluation (nanoGPT's eval_iters)."""
        for j in range(iters):
            yield self.batch(j, batch_size, block_size, seed=seed)


def no_augment(dataset: str, augment: str) -> None:
    """DatasetError for an augmentation asked of token data."""
    if augment != "none":
        raise DatasetError(f"dataset {dataset} holds token streams and takes no augmentation; use augment='none'.")


def check_vocab(data_vocab: int, model_vocab: int, source: str) -> None:
    """ConfigError when the corpus has more token ids than the model has embeddings."""
    if data_vocab > model_vocab:
        raise ConfigError(f"{source} has a vocabulary of {data_vocab} tokens, more than the model's {model_vocab}; "
                          f"build the model with vocab_size={data_vocab} (or more).")


def _split(name: str, tokens: np.ndarray, train: bool, val_fraction: float) -> np.ndarray:
    """The first 1 - val_fraction of ``tokens`` (train) or the rest (val)."""
    cut = len(tokens) - max(1, int(round(len(tokens) * val_fraction)))
    if cut < 2:
        raise DatasetError(f"{name} holds only {len(tokens)} tokens, too few to split into train and validation; "
                           f"give a larger corpus.")
    return tokens[:cut] if train else tokens[cut:]


# ---- text: bytes or a tokenizer the user brings -----------------------------------------------------------------
def files_under(folder: Path) -> list[Path]:
    """Every non-hidden file under ``folder`` (hidden folders skipped), in sorted relative-path order."""
    files = []
    for parent, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(parent) / n for n in names if not n.startswith(".")]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def text_files(path: Path) -> list[Path]:
    """``path`` itself, or every non-hidden file under the folder ``path`` in sorted relative-path order."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DatasetError(f"text corpus {path} does not exist; give a text file or a folder of them (--data-dir).")
    files = files_under(path)
    if not files:
        raise DatasetError(f"text corpus folder {path} holds no files; give a text file or a folder of them.")
    return files


def _read_bytes(files: list[Path]) -> bytes:
    try:
        return b"".join(p.read_bytes() for p in files)
    except OSError as err:
        raise DatasetError(f"cannot read {err.filename}: {err.strerror}; give readable text files.") from None


def load_tokenizer(path: str | Path):
    """A Hugging Face ``tokenizers.Tokenizer`` from a ``tokenizer.json`` (read offline)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("a tokenizer.json needs the tokenizers package; pip install attnlab[lm].") from None
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"tokenizer file {path} does not exist; give a Hugging Face tokenizer.json.")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        why = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
        raise DatasetError(f"tokenizer file {path} cannot be read as a Hugging Face tokenizer.json ({why}).") from None


@lru_cache(maxsize=4)
def _encoded(files: tuple[Path, ...], tokenizer: str, stamp: tuple) -> tuple[np.ndarray, int, float]:
    """(ids, vocabulary, bytes per token) of the files' bytes, or of their text through ``tokenizer``."""
    data = _read_bytes(list(files))
    if not data:
        raise DatasetError(f"text corpus {files[0] if len(files) == 1 else files[0].parent} is empty; give a file "
                           f"with text in it.")
    if not tokenizer:
        return np.frombuffer(data, dtype=np.uint8), BYTE_VOCAB, 1.0
    tok = load_tokenizer(tokenizer)
    # one document per file keeps the encoding of a file independent of its neighbours
    docs = []
    for p in files:
        try:
            docs.append(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as err:  # decoded with replacement it would train on U+FFFD
            raise DatasetError(f"text corpus file {p} is not UTF-8 (byte {err.object[err.start]:#04x} at offset "
                               f"{err.start}), and the tokenizer reads text; convert it to UTF-8 (e.g. iconv -f "
                               f"latin1 -t utf-8) or train on its bytes (no tokenizer option).") from None
    ids = [i for enc in tok.encode_batch(docs) for i in enc.ids]
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if not ids:
        raise DatasetError(f"the tokenizer {tokenizer} encodes the text corpus to no tokens; give text it can read.")
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    return np.asarray(ids, dtype=dtype), vocab, len(data) / len(ids)


def _stamp(files: list[Path], tokenizer: str) -> tuple:
    """What invalidates the cache: every file's size and modification time (and the tokenizer's)."""
    paths = files + ([Path(tokenizer)] if tokenizer else [])
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths if p.exists())


def lm_info(name: str, vocab_size: int, block_size: int | None = None) -> DatasetInfo:
    """The table's info of a token corpus: its vocabulary (``num_classes``, and the model's ``vocab_size``), the
    block size the data fixes (MQAR; else 0 and no ``block_size`` for the model)."""
    args = (("vocab_size", vocab_size),) + ((("block_size", block_size),) if block_size else ())
    return DatasetInfo(name, vocab_size, block_size or 0, 0, (), (), task="lm", model_args=args)


def text_info(data_dir="data", *, tokenizer: str = "", val_fraction: float = 0.1) -> DatasetInfo:
    """Vocabulary (256 bytes, or the tokenizer's, read from its file alone) of the text corpus at ``data_dir``,
    which is not read (bytes need none: a byte-level run samples without its corpus)."""
    return lm_info("text", load_tokenizer(tokenizer).get_vocab_size(with_added_tokens=True) if tokenizer
                   else BYTE_VOCAB)


def build_text(train: bool, *, data_dir="data", download: bool = False, augment: str = "none",
               tokenizer: str = "", val_fraction: float = 0.1) -> TokenStream:
    """The train or val split of the text file or folder ``data_dir`` (bytes, or ``tokenizer``'s ids)."""
    no_augment("text", augment)
    files = text_files(Path(data_dir))
    ids, vocab, per_token = _encoded(tuple(files), tokenizer, _stamp(files, tokenizer))
    name = f"text corpus {data_dir}"
    return TokenStream(name, "train" if train else "val", _split(name, ids, train, val_fraction), vocab, per_token)


# ---- the standard library's own source ----------------------------------------------------------------------
def stdlib_files() -> tuple[Path, list[str]]:
    """(root, sorted relative paths) of the standard library's ``.py`` files, tests and installed packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = Path(folder).relative_to(root)
        found += [(rel / n).as_posix() for n in names if n.endswith(".py")]
    if not found:
        raise DatasetError(f"the standard library at {root} holds no .py files (a build without sources?); use "
                           f"--dataset text with a corpus of your own.")
    return root, sorted(found)


@lru_cache(maxsize=1)
def _stdlib() -> tuple[np.ndarray, dict]:
    root, files = stdlib_files()
    digest, parts = hashlib.sha256(), []
    for rel in files:
        data = (root / rel).read_bytes()
        digest.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        parts.append(data)
    ids = np.frombuffer(b"".join(parts), dtype=np.uint8)
    manifest = {"python": sys.version.split()[0], "files": len(files), "bytes": int(ids.size),
                "sha256": digest.hexdigest()}
    return ids, manifest


def stdlib_manifest() -> dict:
    """What identifies this machine's stdlib corpus: Python version, file count, bytes, sha256 of paths and contents."""
    return dict(_stdlib()[1])


def check_manifest(recorded: dict, current: dict | None = None) -> None:
    """DatasetError when the stdlib corpus ``recorded`` by a run differs from this machine's (``current``)."""
    current = stdlib_manifest() if current is None else current
    if recorded.get("sha256") != current["sha256"]:
        raise DatasetError(
            f"the stdlib corpus differs from the one the run recorded: this machine's Python {current['python']} gives "
            f"{current['files']} files, sha256 {current['sha256'][:12]}, the run's Python {recorded.get('python')} "
            f"gave {recorded.get('files')} files, sha256 {str(recorded.get('sha256'))[:12]}; use that Python version "
            f"to continue or compare the run, or start a new one.")


def stdlib_info(data_dir="data", *, val_fraction: float = 0.1) -> DatasetInfo:
    return lm_info("stdlib", BYTE_VOCAB)


def build_stdlib(train: bool, *, data_dir="data", download: bool = False, augment: str = "none",
                 val_fraction: float = 0.1) -> TokenStream:
    """The train or val split of the standard library's bytes (no files needed beyond Python's own)."""
    no_augment("stdlib", augment)
    ids, manifest = _stdlib()
    name = f"the Python {manifest['python']} standard library"
    return TokenStream(name, "train" if train else "val", _split(name, ids, train, val_fraction), BYTE_VOCAB, 1.0,
                       dict(manifest))


# ---- nanoGPT's prepared .bin files ------------------------------------------------------------------------------
class _PlainData(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numbers only: any class or function reference is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def read_meta(folder: Path) -> dict:
    """nanoGPT's ``meta.pkl`` (vocab_size, itos, stoi) as plain data, or {} when there is none."""
    path = folder / "meta.pkl"
    if not path.is_file():
        return {}
    try:
        with path.open("rb") as f:
            meta = _PlainData(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise DatasetError(f"{path} is not nanoGPT's plain meta.pkl ({str(err)[:100]}); remove it and give "
                           f"vocab_size.") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int):
        raise DatasetError(f"{path} holds no vocab_size; remove it and give the vocab_size option.")
    return meta


def _bin(folder: Path, split: str, dtype: str = "uint16") -> np.ndarray:
    path = folder / f"{split}.bin"
    if not path.is_file():
        raise DatasetError(f"{path} does not exist; give --data-dir the folder where nanoGPT's prepare.py wrote "
                           f"train.bin and val.bin.")
    width = np.dtype(dtype).itemsize
    if path.stat().st_size < 2 * width or path.stat().st_size % width:
        raise DatasetError(f"{path} is not a {dtype} token file (its size {path.stat().st_size} bytes is not a "
                           f"multiple of {width} holding at least 2 tokens); give the file nanoGPT's prepare.py "
                           f"wrote, or the dtype option it was written with.")
    return np.memmap(path, dtype=dtype, mode="r")


CHUNK = 1 << 24  # tokens per step of the id check: 32 MiB of uint16 at a time
REMEMBERED = 1 << 26  # token files from this size on: a passed check is remembered (OpenWebText's 9B tokens take ~1 min)


def _passed_key(path: Path, vocab: int, dtype: str) -> str:
    """What a passed id check of ``path`` is remembered by: the file's path, size and modification time (a file
    rewritten since is checked again), the vocabulary and dtype."""
    st = path.stat()
    return f"{path.resolve()} {st.st_size} {st.st_mtime_ns} {vocab} {dtype}"


def _passed_file() -> Path:
    from attnlab.ops.ckernel import cache_dir

    return cache_dir() / "checked-token-files.json"


def _passed() -> set[str]:
    try:
        found = json.loads(_passed_file().read_text())
    except (OSError, ValueError):
        return set()
    return set(found) if isinstance(found, list) else set()


def check_token_ids(tokens: np.ndarray, vocab: int, path: Path, dtype: str) -> None:
    """Every id of a token file below ``vocab``, and a uint16 file that is not a uint32 file read as uint16 (whose
    odd halves would all be 0), checked in one vectorised pass of ``CHUNK`` tokens at a time (a progress bar for
    files past 2**28 tokens); DatasetError naming the file otherwise. nanoGPT finds a bad id only when a batch
    draws it, thousands of steps in. A file of ``REMEMBERED`` tokens or more that passed is remembered in attnlab's
    cache, so a run's resume, evaluation and the next run on it do not read it again."""
    from tqdm.auto import tqdm

    key = _passed_key(path, vocab, dtype) if len(tokens) >= REMEMBERED else None
    if key is not None and key in _passed():
        return

    top, odd_top, even_top = 0, 0, 0
    for start in tqdm(range(0, len(tokens), CHUNK), desc=f"checking {path.name}", unit="chunk", leave=False,
                      disable=len(tokens) < 1 << 28):
        chunk = np.asarray(tokens[start:start + CHUNK])
        top = max(top, int(chunk.max()))
        odd_top = max(odd_top, int(chunk[1::2].max(initial=0)))  # CHUNK is even: chunks start at even offsets
        even_top = max(even_top, int(chunk[0::2].max(initial=0)))
    if dtype == "uint16" and len(tokens) >= 64 and odd_top == 0 and even_top > 0:
        raise DatasetError(f"{path} reads as uint16 ids whose every second one is 0: it looks like a uint32 file "
                           f"(4 bytes per token); give the data option dtype: uint32.")
    if top >= vocab:
        raise DatasetError(f"{path} holds token id {top}, outside its vocabulary of {vocab} (0 to {vocab - 1}); give "
                           f"the vocab_size the corpus was encoded with (or its meta.pkl).")
    if key is not None:  # best effort: a cache that cannot be written only means checking again next time
        try:
            file = _passed_file()
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(sorted(_passed() | {key})[-1000:]))
            os.replace(tmp, file)
        except OSError:
            pass


def nanogpt_vocab(data_dir, vocab_size: int = 0, dtype: str = "uint16") -> tuple[int, dict]:
    """(vocabulary, meta.pkl) of nanoGPT's .bin corpus at ``data_dir`` (both files checked to exist)."""
    folder = Path(data_dir)
    prepared = _prepared(folder, dtype)
    if prepared is not None:  # attnlab data prepare's shards: vocabulary and dtype from its manifest
        return vocab_size or prepared["vocab_size"], {}
    for split in SPLITS:
        _bin(folder, split, dtype)
    meta = read_meta(folder)
    vocab = vocab_size or meta.get("vocab_size") or GPT2_VOCAB
    if vocab > np.iinfo(dtype).max + 1:
        raise DatasetError(f"the nanoGPT corpus at {folder} has a vocabulary of {vocab}, more ids than {dtype} "
                           f"holds; give the data option dtype: uint32 if its files hold 4 bytes per token.")
    return vocab, meta


def nanogpt_info(data_dir="data", *, vocab_size: int = 0, dtype: str = "uint16") -> DatasetInfo:
    return lm_info("nanogpt", nanogpt_vocab(data_dir, vocab_size, dtype)[0])


def _bytes_per_token(meta: dict, val: np.ndarray) -> float | None:
    """UTF-8 bytes per validation token for a character-level meta.pkl (``itos``); None for other encodings."""
    itos = meta.get("itos")
    if not isinstance(itos, dict) or not itos or not all(isinstance(v, str) for v in itos.values()):
        return None
    lengths = np.zeros(max(max(itos) + 1, int(val.max()) + 1), dtype=np.float64)
    for i, s in itos.items():
        lengths[i] = len(s.encode("utf-8"))
    return float(lengths[np.asarray(val)].mean())


def build_nanogpt(train: bool, *, data_dir="data", download: bool = False, augment: str = "none",
                  vocab_size: int = 0, dtype: str = "uint16") -> TokenStream:
    """nanoGPT's ``train.bin`` or ``val.bin`` in ``data_dir``, memory-mapped as they are, every id checked."""
    no_augment("nanogpt", augment)
    vocab, meta = nanogpt_vocab(data_dir, vocab_size, dtype)
    split = "train" if train else "val"
    prepared = _prepared(Path(data_dir), dtype)
    if prepared is not None:
        return _build_prepared(Path(data_dir), prepared, split, vocab)
    tokens = _bin(Path(data_dir), split, dtype)
    check_token_ids(tokens, vocab, Path(data_dir) / f"{split}.bin", dtype)
    return TokenStream(f"nanoGPT corpus {data_dir}", split, tokens, vocab,
                       _bytes_per_token(meta, _bin(Path(data_dir), "val", dtype)))


def _prepared(folder: Path, dtype: str) -> dict | None:
    """The manifest of a corpus ``attnlab data prepare`` wrote in ``folder`` (None: nanoGPT's train.bin / val.bin);
    its dtype wins over the option's default, a different one given is refused."""
    from attnlab.data.shards import read_manifest

    manifest = read_manifest(folder)
    if manifest is not None and dtype not in ("uint16", manifest["dtype"]):
        raise DatasetError(f"{folder} holds {manifest['dtype']} shards (its manifest.json), not {dtype}; leave the "
                           f"dtype option out.")
    return manifest


def _build_prepared(folder: Path, manifest: dict, split: str, vocab: int) -> TokenStream:
    """One split of a prepared corpus: its shards as one memory-mapped array, every shard's ids checked."""
    from attnlab.data.shards import split_files, split_tokens

    for path in split_files(folder, manifest, split):
        check_token_ids(np.memmap(path, dtype=manifest["dtype"], mode="r"), vocab, path, manifest["dtype"])
    return TokenStream(f"prepared corpus {folder}", split, split_tokens(folder, manifest, split), vocab, None)


def _utf8(text: str) -> str:
    """``text`` unchanged, or ConfigError when it holds a byte that is not valid UTF-8 (a lone surrogate, as Python
    reads such a byte from the command line): a tokenizer or a character table encodes text, not bytes."""
    bad = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:
        byte = text[bad].encode("utf-8", errors="surrogateescape")
        raise ConfigError(f"the prompt holds the byte {byte!r} at position {bad}, which is not valid UTF-8; this run "
                          f"encodes text, so give the prompt as UTF-8 text (or its token ids with --prompt-ids).")
    return text


# ---- what a run records of its corpus (registry.data_fingerprint) -------------------------------------------------
MAX_LISTED = 100  # files a fingerprint lists one by one; a larger corpus is one digest of every file's stamp


def text_fingerprint(data_dir="data", *, tokenizer: str = "", val_fraction: float = 0.1) -> dict[str, str]:
    """The corpus's content: a single file as "text corpus", a folder's files by relative path (one digest past
    ``MAX_LISTED`` files), each by size and sha256 of its whole content (the corpus is read whole to be encoded
    anyway), and the tokenizer's content hash."""
    from attnlab.data.registry import file_sha256

    root = Path(data_dir)
    files = text_files(root)
    if root.is_file():  # named by what it is, not by its file name: a copy given with --data-dir is the same corpus
        stamps = {"text corpus": f"{root.stat().st_size} bytes, {file_sha256(root)}"}
    else:
        stamps = {p.relative_to(root).as_posix(): f"{p.stat().st_size} bytes, {file_sha256(p)}" for p in files}
    out = stamps if len(stamps) <= MAX_LISTED else {
        "corpus files": f"{len(stamps)} files, content sha256 "
                        f"{hashlib.sha256(repr(sorted(stamps.items())).encode()).hexdigest()[:16]}"}
    if tokenizer:
        out["tokenizer.json"] = file_sha256(tokenizer)
    return out


def stdlib_fingerprint(data_dir="data", *, val_fraction: float = 0.1) -> dict[str, str]:
    """The standard library corpus's manifest (Python version, files, sha256 of paths and contents)."""
    m = stdlib_manifest()
    return {"stdlib corpus": f"Python {m['python']}, {m['files']} files, sha256 {m['sha256'][:16]}"}


def nanogpt_fingerprint(data_dir="data", *, vocab_size: int = 0, dtype: str = "uint16") -> dict[str, str]:
    """train.bin's and val.bin's size and content hash (sampled past 64 MiB: registry.content_stamp), meta.pkl's
    content hash."""
    from attnlab.data.registry import content_stamp, file_sha256

    folder = Path(data_dir)
    prepared = _prepared(folder, dtype)
    if prepared is not None:
        from attnlab.data.shards import fingerprint

        return fingerprint(prepared)
    out = {f"{split}.bin": content_stamp(folder / f"{split}.bin") for split in SPLITS}
    if (folder / "meta.pkl").is_file():
        out["meta.pkl"] = file_sha256(folder / "meta.pkl")
    return out


def text_codec(dataset: str, data_dir="data", options: dict | None = None):
    """(encode: str -> ids, decode: ids -> str) of a corpus's tokens, or None when its ids are not text (MQAR,
    nanoGPT's BPE ids without a meta.pkl): bytes as UTF-8, a tokenizer.json's own, meta.pkl's characters."""
    options = options or {}
    if dataset == "stdlib" or (dataset == "text" and not options.get("tokenizer")):
        # a byte that is not UTF-8 reaches Python's argv as a lone surrogate; surrogateescape gives the byte back
        return (lambda text: list(text.encode("utf-8", errors="surrogateescape")),
                lambda ids: bytes(int(i) for i in ids).decode("utf-8", errors="replace"))
    if dataset == "text":
        tok = load_tokenizer(options["tokenizer"])
        return (lambda text: tok.encode(_utf8(text)).ids, lambda ids: tok.decode([int(i) for i in ids]))
    if dataset == "stdlib_bpe":
        from attnlab.data.stdlib_bpe import codec

        return codec(data_dir)
    if dataset == "nanogpt":
        meta = read_meta(Path(data_dir))
        stoi, itos = meta.get("stoi"), meta.get("itos")
        if isinstance(stoi, dict) and isinstance(itos, dict):
            def encode(text):
                text = _utf8(text)
                missing = next((c for c in text if c not in stoi), None)
                if missing is not None:
                    raise ConfigError(f"the prompt holds {missing!r}, which the corpus's meta.pkl has no token for; "
                                      f"use its characters only.")
                return [stoi[c] for c in text]
            return encode, lambda ids: "".join(itos.get(int(i), "?") for i in ids)
    return None


__all__ = ["BYTE_VOCAB", "TokenStream", "build_nanogpt", "build_stdlib", "build_text", "check_manifest",
           "check_token_ids", "nanogpt_fingerprint", "stdlib_fingerprint", "text_fingerprint",
           "check_vocab", "lm_info", "load_tokenizer", "nanogpt_info", "nanogpt_vocab", "no_augment", "read_meta",
           "stdlib_files", "stdlib_info", "stdlib_manifest", "text_codec", "text_files", "text_info"]
