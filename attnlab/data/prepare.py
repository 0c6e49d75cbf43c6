"""``attnlab data prepare``: a text dataset -> tokenized shards in nanoGPT's raw ``.bin`` layout, plus a manifest.

    documents (JSONL / Parquet / text files / a Hugging Face dataset, in a fixed order)
      -> doc i goes to val when floor((i+1) f) > floor(i f) (fraction f), or when i < n (count n); else to train
      -> ids = [separator] + tokenizer.encode(text, no special tokens)           (llm.c's fineweb.py layout)
      -> <split>_000000.bin, <split>_000001.bin, ...: raw little-endian uint16 (vocab <= 65536) or uint32 ids,
         no header, as nanoGPT's prepare.py writes train.bin; a shard holds whole documents and is closed once it
         reaches --shard-tokens tokens
      -> manifest.json: source, tokenizer sha256, vocab, dtype, token and document counts per split and per shard

Shards are written atomically (a temporary name, then ``os.replace``), and after each one ``prepare.state.json``
records the shards written, the next document, and the ids the other split has gathered since its last shard (set
aside in a hidden file named by that document); an interrupted run (SIGKILL, Ctrl-C, a full disk) started again
with the same arguments skips the documents before that one unread by the tokenizer, and writes the same bytes an
uninterrupted run would. The manifest is written last: its presence marks a finished corpus.
attnlab's ``nanogpt`` dataset reads the shards through :mod:`attnlab.data.shards`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from attnlab.errors import ConfigError, DatasetError

FORMAT = "attnlab-tokens/1"
MANIFEST = "manifest.json"
STATE = "prepare.state.json"
SPLITS = ("train", "val")
BATCH_DOCS = 64  # documents per task sent to a worker: large enough to amortise the pipe, small enough to stream
#: special tokens that separate documents, in the order they are looked for: GPT-2, Qwen and Llama 3's base
#: tokenizers end a document with <|endoftext|> / <|end_of_text|>; SentencePiece Llamas begin one with <s>
SEPARATORS = ("<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<s>", "</s>", "<|im_end|>", "[SEP]", "<eos>",
              "<bos>")
TEXT_SUFFIXES = (".txt", ".md", ".text")
_HF_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# ---- arguments ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Val:
    """The validation split: ``fraction`` of the documents spread evenly, or the first ``count`` documents."""

    fraction: float = 0.0
    count: int = 0

    def is_val(self, i: int) -> bool:
        if self.count:
            return i < self.count
        return math.floor((i + 1) * self.fraction) > math.floor(i * self.fraction)

    def __str__(self) -> str:
        return str(self.count) if self.count else repr(self.fraction)


def parse_val(text) -> Val:
    """``--val``: a fraction in (0, 1) of the documents, or a whole count of documents (>= 1)."""
    try:
        number = float(text)
    except (TypeError, ValueError):
        number = math.nan
    if 0 < number < 1:
        return Val(fraction=number)
    if number >= 1 and number.is_integer() and re.fullmatch(r"\s*\d+\s*", str(text)):
        return Val(count=int(number))
    raise ConfigError(f"--val {text!r} is neither a fraction between 0 and 1 (e.g. 0.005) nor a whole number of "
                      f"documents (e.g. 1000).")


# ---- inputs: every source is an ordered iterator of documents (text, where) ------------------------------------------
def _read_error(path: Path, err: OSError):
    return DatasetError(f"cannot read {path}: {err.strerror or err}; give a readable file.")


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _kind(path: Path) -> str:
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _jsonl_docs(path: Path, key: str) -> Iterator[tuple[str, str]]:
    try:
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as err:
                    raise DatasetError(f"{path} line {n} is not valid JSON ({str(err).split(':')[0]}); give one JSON "
                                       f"object per line.") from None
                if not isinstance(row, dict) or key not in row:
                    found = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
                    raise DatasetError(f"{path} line {n} has no {key!r} field (it holds {found or 'nothing'}); give "
                                       f"--text-key the field that holds the text.")
                if not isinstance(row[key], str):
                    raise DatasetError(f"{path} line {n}: the {key!r} field is {type(row[key]).__name__}, not text; "
                                       f"give --text-key a field that holds strings.")
                yield row[key], f"{path} line {n}"
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x}); convert it to UTF-8.") \
            from None
    except (OSError, EOFError) as err:
        if isinstance(err, OSError) and err.errno is not None:
            raise _read_error(path, err) from None
        raise DatasetError(f"{path} is not a readable gzip file ({err}); give the file whole.") from None


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading Parquet needs pyarrow, which the datasets package brings; pip install "
                          "'attnlab[data]'.") from None
    return pq


def _parquet_docs(path: Path, key: str) -> Iterator[tuple[str, str]]:
    pq = _pyarrow_parquet()
    try:
        file = pq.ParquetFile(str(path))
        names = list(file.schema_arrow.names)
        if key not in names:
            raise DatasetError(f"{path} has no {key!r} column (it has {', '.join(names)}); give --text-key the "
                               f"column that holds the text.")
        row = 0
        for batch in file.iter_batches(columns=[key]):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DatasetError(f"{path} row {row}: the {key!r} column holds {type(text).__name__}, not text; "
                                       f"give --text-key a string column.")
                yield text, f"{path} row {row}"
    except DatasetError:
        raise
    except OSError as err:
        raise _read_error(path, err) from None
    except Exception as err:  # pyarrow.lib.ArrowInvalid and kin for a file that is not Parquet
        raise DatasetError(f"{path} cannot be read as Parquet ({str(err).splitlines()[0][:120]}).") from None


def _text_doc(path: Path) -> Iterator[tuple[str, str]]:
    try:
        with _open_text(path) as f:
            yield f.read(), str(path)
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                           f"convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8).") from None
    except (OSError, EOFError) as err:
        if isinstance(err, OSError) and err.errno is not None:
            raise _read_error(path, err) from None
        raise DatasetError(f"{path} is not a readable gzip file ({err}); give the file whole.") from None


def local_files(path: Path) -> list[Path]:
    """``path``, or every non-hidden file under the folder ``path`` in sorted relative-path order."""
    if path.is_file():
        return [path]
    from attnlab.data.lm import files_under

    files = files_under(path)
    if not files:
        raise DatasetError(f"input folder {path} holds no files; give JSONL, Parquet or text files.")
    return files


def _load_hf(name: str, config: str | None, split: str):
    """``datasets.load_dataset(name, config, split=split, streaming=True)``: rows streamed from the Hub (or cache)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{name!r} is not a local file or folder, and reading it as a Hugging Face dataset needs "
                          f"the datasets package; pip install 'attnlab[data]' (or check the path).") from None
    try:
        return datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as err:  # the Hub's errors have many classes; the user needs the sentence
        raise DatasetError(f"the Hugging Face dataset {name!r} (config {config}, split {split}) cannot be loaded "
                           f"({str(err).splitlines()[0][:160] if str(err) else type(err).__name__}).") from None


def _hf_docs(name: str, config: str | None, split: str, key: str) -> Iterator[tuple[str, str]]:
    for n, row in enumerate(_load_hf(name, config, split)):
        if key not in row:
            raise DatasetError(f"the Hugging Face dataset {name!r} has no {key!r} field (it has "
                               f"{', '.join(map(str, row))}); give --text-key the field that holds the text.")
        if not isinstance(row[key], str):
            raise DatasetError(f"the Hugging Face dataset {name!r} row {n}: the {key!r} field is "
                               f"{type(row[key]).__name__}, not text; give --text-key a string field.")
        yield row[key], f"{name} row {n}"


@dataclass(frozen=True)
class Source:
    """Where the documents come from: local ``files`` or a Hugging Face dataset ``hf`` (name, config, split)."""

    text: str
    files: tuple[Path, ...] = ()
    hf: tuple[str, str | None, str] | None = None

    def describe(self) -> dict:
        """What identifies the input: each file's size and modification time, or the dataset's name."""
        if self.hf:
            return {"huggingface": self.hf[0], "config": self.hf[1], "split": self.hf[2]}
        root = Path(self.text)
        stamps = {}
        for p in self.files:
            st = p.stat()
            name = p.relative_to(root).as_posix() if p != root else p.name
            stamps[name] = f"{st.st_size} bytes, mtime {st.st_mtime_ns}"
        return {"path": str(root.resolve()), "files": stamps}

    def documents(self, key: str) -> Iterator[tuple[str, str]]:
        if self.hf:
            yield from _hf_docs(*self.hf, key)
            return
        for p in self.files:
            kind = _kind(p)
            yield from (_jsonl_docs(p, key) if kind == "jsonl" else _parquet_docs(p, key) if kind == "parquet"
                        else _text_doc(p))


def resolve_source(text: str, hf_config: str | None = None, hf_split: str = "train") -> Source:
    """A local file or folder when ``text`` exists (or looks like a path), else a Hugging Face dataset name."""
    path = Path(text)
    if path.exists():
        if not os.access(path, os.R_OK):
            raise DatasetError(f"cannot read {path}: permission denied; give a readable file or folder.")
        files = tuple(local_files(path))
        if any(_kind(p) == "parquet" for p in files):
            _pyarrow_parquet()
        return Source(text, files=files)
    looks_local = (text.startswith((".", "/", "~")) or text.count("/") > 1 or os.sep in text.replace("/", "")
                   or Path(text).suffix.lower() in (".jsonl", ".json", ".parquet", ".txt", ".gz", ".ndjson", ".md"))
    if looks_local or not _HF_NAME.match(text):
        raise DatasetError(f"input {text} does not exist; give a JSONL, Parquet or text file, a folder of them, or a "
                           f"Hugging Face dataset name (e.g. allenai/c4).")
    return Source(text, hf=(text, hf_config, hf_split))


# ---- the tokenizer and its separator -------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def find_separator(tok, given: str | None) -> tuple[str, int]:
    """(token, id) of the document separator: ``given``, or the tokenizer's BOS (the token its post-processor puts
    before a sequence: Llama), or the first of :data:`SEPARATORS` it defines."""
    if given:
        ident = tok.token_to_id(given)
        if ident is None:
            raise ConfigError(f"the tokenizer has no token {given!r}; give --separator one of its special tokens "
                              f"({', '.join(_specials(tok)[:8]) or 'none defined'}).")
        return given, ident
    bos = _template_bos(tok)
    if bos is not None:
        return bos, tok.token_to_id(bos)
    for name in SEPARATORS:
        ident = tok.token_to_id(name)
        if ident is not None:
            return name, ident
    raise ConfigError(f"the tokenizer defines none of the usual document separators ({', '.join(SEPARATORS[:4])} "
                      f"...); give --separator one of its tokens ({', '.join(_specials(tok)[:8]) or 'none special'}).")


def _specials(tok) -> list[str]:
    return [t.content for t in tok.get_added_tokens_decoder().values() if t.special]


def _template_bos(tok) -> str | None:
    """The special token a TemplateProcessing post-processor puts first (Llama's <s> / <|begin_of_text|>)."""
    try:
        post = json.loads(tok.to_str()).get("post_processor") or {}
    except ValueError:
        return None
    steps = post.get("processors", [post]) if isinstance(post, dict) else []
    for step in steps:
        single = step.get("single") if isinstance(step, dict) and step.get("type") == "TemplateProcessing" else None
        if single and "SpecialToken" in single[0]:
            name = single[0]["SpecialToken"]["id"]
            if tok.token_to_id(name) is not None:
                return name
    return None


# ---- workers -------------------------------------------------------------------------------------------------------
_TOKENIZER = None


def _init_worker(tokenizer_path: str) -> None:
    import signal

    from attnlab.data.lm import load_tokenizer

    global _TOKENIZER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # pool.terminate() ends a worker quietly (the CLI's handler raises)
    _TOKENIZER = load_tokenizer(tokenizer_path)


def _pool(workers: int, tokenizer: str):
    """A process pool whose workers start with SIGTERM's default action (forked children inherit the CLI's handler,
    which would print a traceback when ``pool.terminate()`` ends them)."""
    import multiprocessing
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return multiprocessing.Pool(workers, _init_worker, (tokenizer,))
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return multiprocessing.Pool(workers, _init_worker, (tokenizer,))
    finally:
        signal.signal(signal.SIGTERM, previous)


def _encode(texts: list[str]) -> list[list[int]]:
    return [e.ids for e in _TOKENIZER.encode_batch(texts, add_special_tokens=False)]


# ---- the run -------------------------------------------------------------------------------------------------------
def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, value: dict) -> None:
    _atomic_write(path, (json.dumps(value, indent=1) + "\n").encode())


def _batches(docs: Iterable[tuple[int, str]], size: int) -> Iterator[list[tuple[int, str]]]:
    batch = []
    for item in docs:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class _Split:
    """One split's shards: those written, and the documents and ids gathered for the next (``pending``)."""

    def __init__(self, name: str, out: Path, done: dict | None, dtype) -> None:
        done = done or {"shards": [], "pending": None}
        self.name, self.out, self.dtype = name, out, dtype
        self.shards: list[dict] = list(done["shards"])
        self.parts: list[np.ndarray] = []
        self.tokens = self.docs = 0
        self.saved: dict | None = done.get("pending")  # the pending ids as the last state recorded them
        if self.saved:
            path = out / self.saved["file"]
            data = path.read_bytes() if path.is_file() else b""
            if hashlib.sha256(data).hexdigest() != self.saved["sha256"]:
                raise DatasetError(f"{path}, which {out / STATE} records, is missing or changed; remove {out} to "
                                   f"start over.")
            self.parts = [np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype)]
            self.tokens, self.docs = self.saved["tokens"], self.saved["documents"]

    def add(self, ids: list[int], sep: int) -> None:
        self.parts.append(np.asarray([sep, *ids], dtype=self.dtype))
        self.tokens += len(ids) + 1
        self.docs += 1

    def _bytes(self) -> bytes:
        return np.concatenate(self.parts).astype(self.dtype.newbyteorder("<"), copy=False).tobytes()

    def flush(self) -> None:
        """The pending documents as the next shard."""
        if not self.docs:
            return
        data = self._bytes()
        name = shard_name(self.name, len(self.shards))
        _atomic_write(self.out / name, data)
        self.shards.append({"file": name, "tokens": self.tokens, "documents": self.docs,
                            "sha256": hashlib.sha256(data).hexdigest()})
        self.parts, self.tokens, self.docs, self.saved = [], 0, 0, None

    def keep_pending(self, next_doc: int) -> None:
        """The pending ids written aside (named by the restart point), so that a restart need not read them again."""
        if not self.docs:
            self.saved = None
            return
        if self.saved and self.saved["documents"] == self.docs:
            return  # unchanged since the last save
        data = self._bytes()
        self.parts = [np.frombuffer(data, dtype=self.dtype.newbyteorder("<")).astype(self.dtype)]
        name = f".{self.name}.pending.{next_doc}.bin"
        _atomic_write(self.out / name, data)
        self.saved = {"file": name, "tokens": self.tokens, "documents": self.docs,
                      "sha256": hashlib.sha256(data).hexdigest()}

    def state(self) -> dict:
        return {"shards": self.shards, "pending": self.saved}


def prepare(source: Source, tokenizer: str | Path, out: str | Path, *, text_key: str = "text", val: Val = Val(0.005),
            shard_tokens: int = 100_000_000, workers: int = 1, separator: str | None = None,
            progress: bool | None = None, log: Callable[[str], None] = lambda line: None) -> dict:
    """Tokenize ``source`` into shards under ``out`` (module docstring) and return the manifest. A run interrupted
    earlier with the same arguments continues after its last complete shard; a finished one is returned as is."""
    from tqdm.auto import tqdm

    from attnlab import __version__
    from attnlab.data.lm import load_tokenizer

    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, not {workers}.")
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be at least 1, not {shard_tokens}.")
    out = Path(out)
    if source.files:  # an --out inside the input folder: its own shards are not input
        inside = out.resolve()
        source = replace(source, files=tuple(p for p in source.files if inside not in p.resolve().parents))
        if not source.files:
            raise DatasetError(f"input {source.text} holds no files outside --out {out}; give the corpus's folder.")
    tokenizer = Path(tokenizer)
    tok = load_tokenizer(tokenizer)
    sep_token, sep = find_separator(tok, separator)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    job = {"format": FORMAT, "source": source.describe(), "text_key": text_key,
           "tokenizer": {"sha256": file_sha256(tokenizer), "vocab_size": vocab},
           "separator": {"token": sep_token, "id": sep, "placement": "before each document"},
           "dtype": dtype.name, "val": str(val), "shard_tokens": shard_tokens}

    out = Path(out)
    created = not out.exists()
    state = _resume(out, job)
    if state is not None and state.get("complete"):
        log(f"{out} already holds this corpus (manifest.json); nothing to do.")
        return state["manifest"]
    out.mkdir(parents=True, exist_ok=True)
    splits = {s: _Split(s, out, (state or {}).get("splits", {}).get(s), dtype) for s in SPLITS}
    start = (state or {}).get("next_doc", 0)
    if start:
        log(f"resuming {out}: {sum(len(sp.shards) for sp in splits.values())} shards written, continuing from "
            f"document {start}")

    def save(next_doc: int) -> None:
        for sp in splits.values():
            sp.keep_pending(next_doc)
        _write_json(out / STATE, {**job, "next_doc": next_doc, "splits": {s: sp.state() for s, sp in splits.items()}})
        keep = {sp.saved["file"] for sp in splits.values() if sp.saved}
        for p in out.glob(".*.pending.*.bin"):  # earlier restart points' pending ids
            if p.name not in keep:
                p.unlink(missing_ok=True)

    def numbered() -> Iterator[tuple[int, str]]:
        for i, (text, _) in enumerate(d for d in source.documents(text_key) if d[0]):
            if i >= start:
                yield i, text

    pool = None
    try:
        save(start)  # from here on the folder is this job's: a shard written before the next save is found again
        if workers > 1:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism
            pool = _pool(workers, str(tokenizer))
            encoded = pool.imap(_encode_batch, _batches(numbered(), BATCH_DOCS), chunksize=1)
        else:
            encoded = (([i for i, _ in batch], [e.ids for e in tok.encode_batch([t for _, t in batch],
                                                                                 add_special_tokens=False)])
                       for batch in _batches(numbered(), BATCH_DOCS))
        bar = tqdm(desc=f"tokenizing into {out}", unit="doc", initial=start,
                   disable=None if progress is None else not progress, dynamic_ncols=True)
        for indices, ids in encoded:
            for i, doc_ids in zip(indices, ids):
                sp = splits["val" if val.is_val(i) else "train"]
                sp.add(doc_ids, sep)
                if sp.tokens >= shard_tokens:
                    sp.flush()
                    save(i + 1)
            bar.update(len(indices))
            bar.set_postfix(tokens=sum(sp.tokens + sum(s["tokens"] for s in sp.shards) for sp in splits.values()),
                            refresh=False)
        bar.close()
    except BaseException:
        if pool is not None:
            pool.terminate()
        if created and not any(sp.shards for sp in splits.values()):
            _remove_ours(out)  # nothing of value was written: leave no half-made folder behind
        raise
    if pool is not None:
        pool.close()
        pool.join()
    for sp in splits.values():
        sp.flush()
    totals = {s: {"tokens": sum(x["tokens"] for x in sp.shards), "documents": sum(x["documents"] for x in sp.shards),
                  "shards": sp.shards} for s, sp in splits.items()}
    if not totals["train"]["tokens"] or not totals["val"]["tokens"]:
        empty = "train" if not totals["train"]["tokens"] else "val"
        n = totals["train"]["documents"] + totals["val"]["documents"]
        for s in totals.values():
            for shard in s["shards"]:
                (out / shard["file"]).unlink(missing_ok=True)
        (out / STATE).unlink(missing_ok=True)
        if created:
            _remove_ours(out)
        raise DatasetError(f"the input holds {n} non-empty document{'s' * (n != 1)}, which leaves the {empty} split "
                           f"empty with --val {val}; give more documents or another --val.")
    manifest = {**job, "tokenizer": {**job["tokenizer"], "file": str(tokenizer.resolve())},
                "attnlab_version": __version__, "vocab_size": vocab, "splits": totals}
    _write_json(out / MANIFEST, manifest)
    (out / STATE).unlink(missing_ok=True)
    for p in [*out.glob(".*.pending.*.bin"), *out.glob(".*.tmp")]:  # ids set aside; a write cut short by a crash
        p.unlink(missing_ok=True)
    return manifest


def _encode_batch(batch: list[tuple[int, str]]) -> tuple[list[int], list[list[int]]]:
    return [i for i, _ in batch], _encode([t for _, t in batch])


def _remove_ours(out: Path) -> None:
    for p in out.iterdir():
        if p.name in (STATE, MANIFEST) or re.fullmatch(r"\.{0,2}((train|val)_\d{6}|(train|val)\.pending\.\d+)\.bin"
                                                       r"(\.tmp)?|\.(manifest|prepare\.state)\.json\.tmp", p.name):
            p.unlink(missing_ok=True)
    try:
        out.rmdir()
    except OSError:
        pass


def _resume(out: Path, job: dict) -> dict | None:
    """The state of an earlier run of the same job in ``out`` ({"complete", "manifest"} when it finished), None
    for a new or empty folder; DatasetError for a folder that holds anything else."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise DatasetError(f"--out {out} is a file; give a new or empty folder.")
    for name in (MANIFEST, STATE):
        path = out / name
        if not path.is_file():
            continue
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            raise DatasetError(f"{path} is not a readable prepare manifest; give another --out folder, or remove "
                               f"{out} to start over.") from None
        found_job = {**found, "tokenizer": {k: v for k, v in (found.get("tokenizer") or {}).items() if k != "file"}}
        if any(found_job.get(k) != job[k] for k in job):
            what = next(k for k in job if found_job.get(k) != job[k])
            what = {"source": "input", "text_key": "--text-key", "val": "--val", "shard_tokens": "--shard-tokens",
                    "separator": "--separator", "tokenizer": "tokenizer"}.get(what, what)
            raise DatasetError(f"--out {out} holds a corpus prepared with another {what} (from "
                               f"{'a finished' if name == MANIFEST else 'an interrupted'} run); give another --out "
                               f"folder, or remove {out} to start over.")
        if name == MANIFEST:
            return {"complete": True, "manifest": found}
        return found
    others = [p.name for p in out.iterdir() if not p.name.startswith(".")]
    if others:
        raise DatasetError(f"--out {out} already holds files ({', '.join(sorted(others)[:3])}) that no attnlab data "
                           f"prepare wrote; give a new or empty folder.")
    return None


__all__ = ["FORMAT", "MANIFEST", "STATE", "Source", "Val", "find_separator", "parse_val", "prepare",
           "resolve_source", "shard_name"]
