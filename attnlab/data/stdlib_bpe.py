"""``stdlib_bpe``: the standard library's source as a prepared BPE corpus, made on this machine with no download.

    documents: the ``stdlib`` dataset's ``.py`` files (:func:`attnlab.data.lm.stdlib_files`), sorted by path, one
               document each, empty files left out (as ``attnlab data prepare`` leaves them out)
    split:     document i to validation when floor((i+1) f) > floor(i f), f = ``VAL`` (prepare's ``--val 0.05``)
    tokenizer: a byte-level BPE (GPT-2's pre-tokenizer and byte alphabet, no prefix space) of ``VOCAB`` ids
               trained by Hugging Face ``tokenizers`` on the train documents alone, in that order, with
               ``<|endoftext|>`` as id 0 (the document separator prepare puts before each document)
    corpus:    :func:`attnlab.data.prepare.prepare` of those documents with that tokenizer

written once under ``<data_dir>/stdlib_bpe/``: ``tokenizer.json`` (written atomically) and ``corpus/`` (prepare's
shards and ``manifest.json``, atomic and resumable). A file lock on ``<data_dir>/stdlib_bpe/.lock`` makes a second
process (a grid's parallel runs, DDP ranks) wait for the first and then find the corpus made; the grid itself makes
it once while it checks its runs, before any of them starts. Runs read the corpus through the ``nanogpt`` reader
(:mod:`attnlab.data.shards`) and record its manifest as their data fingerprint. Training the tokenizer twice gives
the same bytes (tested), so machines with the same Python and ``tokenizers`` versions make the same corpus; the
manifest's tokenizer sha256 says which one a run read.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from attnlab.data.registry import DatasetInfo
from attnlab.errors import ConfigError, DatasetError

NAME = "stdlib_bpe"
VOCAB = 2048  # ids: small enough that the embeddings do not dwarf the ladder's smallest rungs
VAL = 0.05
SEPARATOR = "<|endoftext|>"
SHARD_TOKENS = 1 << 20


def require_tokenizers() -> None:
    """ConfigError (one line) when the ``tokenizers`` package is missing."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ConfigError(f"dataset {NAME} trains its BPE tokenizer with the tokenizers package, which is not "
                          f"installed; pip install 'attnlab[lm]'.") from None


def folder(data_dir) -> Path:
    return Path(data_dir) / NAME


def source():
    """The standard library's ``.py`` files as a :class:`attnlab.data.prepare.Source` (sorted relative paths)."""
    from attnlab.data.lm import stdlib_files
    from attnlab.data.prepare import Source

    root, files = stdlib_files()
    return Source(str(root), files=tuple(root / f for f in files))


def train_documents(src) -> list[str]:
    """The texts prepare will number (non-empty documents) that its split puts in train."""
    from attnlab.data.prepare import Val

    val = Val(VAL)
    docs = [text for text, _ in src.documents("text") if text]
    return [text for i, text in enumerate(docs) if not val.is_val(i)]


def train_tokenizer(src, vocab: int = VOCAB) -> str:
    """The BPE tokenizer of the module docstring trained on ``src``'s train documents, as tokenizer.json text."""
    require_tokenizers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[SEPARATOR], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = train_documents(src)
    tok.train_from_iterator(docs, trainer, length=len(docs))
    return tok.to_str()


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive ``flock`` on ``path`` held for the block (none where the OS or file system has none)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        fcntl = None
    try:
        f = open(path, "a+")
    except OSError:  # a read-only data folder: a finished corpus is only read there, so no lock is needed
        yield
        return
    with f:
        held = False
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX)
                held = True
            except OSError:  # a file system that cannot lock: go on without
                pass
        try:
            yield
        finally:
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)


def ensure(data_dir, log=lambda line: None) -> Path:
    """The prepared corpus folder ``<data_dir>/stdlib_bpe/corpus``, made first if it is not there (module
    docstring); a finished one is only checked (prepare's manifest against this machine's files and tokenizer)."""
    from attnlab.data.prepare import Val, prepare

    require_tokenizers()
    root = folder(data_dir)
    corpus = root / "corpus"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DatasetError(f"cannot make {root} for dataset {NAME} ({err.strerror or err}); give --data-dir a "
                           f"writable folder.") from None
    with _locked(root / ".lock"):
        src = source()
        tokenizer = root / "tokenizer.json"
        if not tokenizer.is_file():
            log(f"training the {VOCAB}-id BPE tokenizer of {NAME} on the standard library")
            tmp = tokenizer.with_name(f".tokenizer.json.{os.getpid()}.tmp")
            try:
                tmp.write_text(train_tokenizer(src), encoding="utf-8")
                os.replace(tmp, tokenizer)
            except OSError as err:
                tmp.unlink(missing_ok=True)
                raise DatasetError(f"cannot write {tokenizer} ({err.strerror or err}); give --data-dir a writable "
                                   f"folder.") from None
        if not (corpus / "manifest.json").is_file():
            log(f"preparing {corpus}")
        prepare(src, tokenizer, corpus, val=Val(VAL), shard_tokens=SHARD_TOKENS, separator=SEPARATOR,
                progress=False, log=log)
    return corpus


def stdlib_bpe_info(data_dir="data") -> DatasetInfo:
    from attnlab.data.lm import lm_info
    from attnlab.data.shards import read_manifest

    return lm_info(NAME, read_manifest(ensure(data_dir))["vocab_size"])


def build_stdlib_bpe(train: bool, *, data_dir="data", download: bool = False, augment: str = "none"):
    """The train or val split of the prepared corpus (made first if needed), read as a ``nanogpt`` corpus."""
    from attnlab.data.lm import build_nanogpt, no_augment

    no_augment(NAME, augment)
    return build_nanogpt(train, data_dir=ensure(data_dir))


def stdlib_bpe_fingerprint(data_dir="data") -> dict[str, str]:
    """The prepared corpus's manifest (its shards' hashes, the tokenizer's sha256), as ``nanogpt`` records it."""
    from attnlab.data.lm import nanogpt_fingerprint

    return nanogpt_fingerprint(ensure(data_dir))


def codec(data_dir="data"):
    """(encode, decode) of the corpus's tokenizer, for ``attnlab sample``."""
    from attnlab.data.lm import load_tokenizer

    tok = load_tokenizer(folder(data_dir) / "tokenizer.json")
    return (lambda text: tok.encode(text, add_special_tokens=False).ids,
            lambda ids: tok.decode([int(i) for i in ids]))


__all__ = ["NAME", "VAL", "VOCAB", "build_stdlib_bpe", "ensure", "source", "stdlib_bpe_fingerprint",
           "stdlib_bpe_info", "train_tokenizer"]
