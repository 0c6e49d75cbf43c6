"""``attnlab data prepare``: shards checked against an independent encoding of the documents (the tokenizer called
directly, the split and shard rules restated here), resumption after a real SIGKILL / SIGINT byte for byte, the
reader, and every bad input's one line and exit code 2."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from attnlab.data import prepare as prep
from tests.cli_runner import in_process

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the cat sat on a mat and dog ran far away while birds sing over green hills où ünïcode".split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) for _ in range(n)]


def train_tokenizer(path: Path, specials: list[str], template: str | None = None, vocab: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(make_docs(300, seed=1), trainer)
    if template:
        tok.post_processor = processors.TemplateProcessing(single=f"{template} $A",
                                                           special_tokens=[(template, tok.token_to_id(template))])
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def gpt2_like(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", ["<|endoftext|>"])


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def expected_shards(docs, tokenizer: Path, sep: str, shard_tokens: int, is_val) -> dict[str, list[bytes]]:
    """The layout restated: [sep] + ids per non-empty document, val by ``is_val(i)``, a shard closed at
    >= shard_tokens tokens, raw little-endian uint16."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    sep_id = tok.token_to_id(sep)
    shards = {"train": [[]], "val": [[]]}
    for i, text in enumerate(d for d in docs if d):
        current = shards["val" if is_val(i) else "train"]
        current[-1] += [sep_id] + tok.encode(text, add_special_tokens=False).ids
        if len(current[-1]) >= shard_tokens:
            current.append([])
    return {s: [np.asarray(ids, dtype="<u2").tobytes() for ids in parts if ids] for s, parts in shards.items()}


def shard_bytes(out: Path, split: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted(out.glob(f"{split}_*.bin"))]


def folder_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_are_the_documents_encoded_with_a_separator(tmp_path, gpt2_like, workers):
    docs = make_docs(400) + [""]  # an empty document is no document
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    r = in_process(["data", "prepare", src, "--tokenizer", gpt2_like, "--out", tmp_path / "out", "--val", "0.1",
                    "--shard-tokens", "700", "--workers", str(workers)])
    assert r.returncode == 0, r.stderr
    want = expected_shards(docs, gpt2_like, "<|endoftext|>", 700,
                           lambda i: math.floor((i + 1) * 0.1) > math.floor(i * 0.1))
    assert shard_bytes(tmp_path / "out", "train") == want["train"] and len(want["train"]) > 3
    assert shard_bytes(tmp_path / "out", "val") == want["val"]
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["splits"]["val"]["documents"] == 40 and m["splits"]["train"]["documents"] == 360
    assert m["splits"]["train"]["tokens"] == sum(len(b) // 2 for b in want["train"])
    assert [s["tokens"] for s in m["splits"]["train"]["shards"]] == [len(b) // 2 for b in want["train"]]
    assert [s["sha256"] for s in m["splits"]["val"]["shards"]] == [hashlib.sha256(b).hexdigest() for b in want["val"]]
    assert m["tokenizer"]["sha256"] == hashlib.sha256(gpt2_like.read_bytes()).hexdigest()
    assert (m["dtype"], m["vocab_size"], m["separator"]["token"]) == ("uint16", 300, "<|endoftext|>")
    assert m["attnlab_version"] and m["source"]["files"] == {"c.jsonl": m["source"]["files"]["c.jsonl"]}
    assert "train 1" in r.stdout.replace(",", "")  # the summary line


def test_val_count_takes_the_first_documents(tmp_path, gpt2_like):
    docs = make_docs(50)
    prep.prepare(prep.resolve_source(str(write_jsonl(tmp_path / "c.jsonl", docs))), gpt2_like, tmp_path / "out",
                 val=prep.parse_val("7"), shard_tokens=10**9)
    want = expected_shards(docs, gpt2_like, "<|endoftext|>", 10**9, lambda i: i < 7)
    assert shard_bytes(tmp_path / "out", "val") == want["val"]
    assert shard_bytes(tmp_path / "out", "train") == want["train"]


def test_text_files_folder_and_text_key(tmp_path, gpt2_like):
    (tmp_path / "in" / "b").mkdir(parents=True)
    docs = make_docs(6)
    for i, d in enumerate(docs):  # one document per file, sorted by relative path
        (tmp_path / "in" / ("b" if i % 2 else "") / f"{i}.txt").write_text(d, encoding="utf-8")
    order = sorted(((("b/" if i % 2 else "") + f"{i}.txt"), d) for i, d in enumerate(docs))
    prep.prepare(prep.resolve_source(str(tmp_path / "in")), gpt2_like, tmp_path / "out", val=prep.Val(count=1))
    want = expected_shards([d for _, d in order], gpt2_like, "<|endoftext|>", 10**8, lambda i: i < 1)
    assert shard_bytes(tmp_path / "out", "train") == want["train"]
    src = write_jsonl(tmp_path / "k.jsonl", docs, key="body")
    prep.prepare(prep.resolve_source(str(src)), gpt2_like, tmp_path / "out2", text_key="body", val=prep.Val(count=2))
    assert shard_bytes(tmp_path / "out2", "val") == expected_shards(docs, gpt2_like, "<|endoftext|>", 10**8,
                                                                   lambda i: i < 2)["val"]


def test_separator_is_the_tokenizers_own(tmp_path):
    from tokenizers import Tokenizer

    llama = train_tokenizer(tmp_path / "llama.json", ["<unk>", "<s>", "</s>"], template="<s>")
    tok = Tokenizer.from_file(str(llama))
    assert prep.find_separator(tok, None) == ("<s>", tok.token_to_id("<s>"))  # Llama's BOS, from its template
    assert prep.find_separator(tok, "</s>") == ("</s>", tok.token_to_id("</s>"))
    qwen = Tokenizer.from_file(str(train_tokenizer(tmp_path / "q.json", ["<|endoftext|>", "<|im_start|>",
                                                                         "<|im_end|>"])))
    assert prep.find_separator(qwen, None)[0] == "<|endoftext|>"
    docs = make_docs(20)
    prep.prepare(prep.resolve_source(str(write_jsonl(tmp_path / "c.jsonl", docs))), llama, tmp_path / "out",
                 val=prep.Val(count=2))
    # the BOS comes once, from the separator: the template's own is not added again
    want = expected_shards(docs, llama, "<s>", 10**8, lambda i: i < 2)
    assert shard_bytes(tmp_path / "out", "train") == want["train"]


def test_uint32_for_a_vocabulary_over_65536(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "big.json"))
    src = write_jsonl(tmp_path / "c.jsonl", ["w69999 w3", "w65536 w1 w2", "w70"])
    m = prep.prepare(prep.resolve_source(str(src)), tmp_path / "big.json", tmp_path / "out", val=prep.Val(count=1))
    assert m["dtype"] == "uint32" and m["vocab_size"] == 70_001
    assert np.fromfile(tmp_path / "out" / "val_000000.bin", dtype="<u4").tolist() == [70_000, 69_999, 3]
    assert np.fromfile(tmp_path / "out" / "train_000000.bin", dtype="<u4").tolist() == [70_000, 65_536, 1, 2,
                                                                                         70_000, 70]
    from attnlab.data import lm

    stream = lm.build_nanogpt(True, data_dir=str(tmp_path / "out"))  # dtype and vocabulary from the manifest
    assert stream.vocab_size == 70_001 and np.asarray(stream.tokens).tolist()[1] == 65_536


# ---- resumption ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop_at", [1, 4, 9])
def test_an_interrupted_run_continues_to_the_same_bytes(tmp_path, gpt2_like, monkeypatch, stop_at):
    """Interrupted after the stop_at-th shard write (before its state is saved, the worst moment), then resumed."""
    docs = make_docs(300)
    src = prep.resolve_source(str(write_jsonl(tmp_path / "c.jsonl", docs)))
    kwargs = dict(val=prep.Val(fraction=0.2), shard_tokens=400)
    prep.prepare(src, gpt2_like, tmp_path / "whole", **kwargs)
    real, calls = prep._Split.flush, []

    def flaky(self):
        real(self)
        calls.append(1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt

    monkeypatch.setattr(prep._Split, "flush", flaky)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(src, gpt2_like, tmp_path / "cut", **kwargs)
    assert not (tmp_path / "cut" / "manifest.json").exists()
    monkeypatch.setattr(prep._Split, "flush", real)
    seen = []
    prep.prepare(src, gpt2_like, tmp_path / "cut", log=seen.append, **kwargs)
    assert folder_bytes(tmp_path / "cut") == folder_bytes(tmp_path / "whole")
    assert stop_at == 1 or seen and "resuming" in seen[0]


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "attnlab", "data", "prepare", *map(str, args)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_killed_process_resumes_byte_for_byte(tmp_path, gpt2_like, sig):
    docs = make_docs(20_000, seed=3)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    args = [src, "--tokenizer", gpt2_like, "--val", "0.01", "--shard-tokens", "4000", "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(_cli(*args, "--out", tmp_path / "cut"), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    state = tmp_path / "cut" / prep.STATE
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if state.is_file() and len(json.loads(state.read_text() or "{}").get("splits", {}).get("train", {})
                                   .get("shards", [])) >= 3:
            break
        time.sleep(0.005)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (-9 if sig == signal.SIGKILL else 130), err
    if sig == signal.SIGINT:
        assert err.strip().splitlines()[-1] == "attnlab data: interrupted"
    assert not (tmp_path / "cut" / "manifest.json").exists(), "the run finished before it was killed"
    done = subprocess.run(_cli(*args, "--out", tmp_path / "cut"), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "resuming" in done.stderr
    whole = in_process(["data", "prepare", *args, "--out", tmp_path / "whole"])
    assert whole.returncode == 0, whole.stderr
    assert folder_bytes(tmp_path / "cut") == folder_bytes(tmp_path / "whole")
    assert not list((tmp_path / "cut").glob(".*"))  # no temporary file left


def test_a_finished_corpus_is_left_alone(tmp_path, gpt2_like):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(30))
    argv = ["data", "prepare", src, "--tokenizer", gpt2_like, "--out", tmp_path / "out", "--val", "3"]
    assert in_process(argv).returncode == 0
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    again = in_process(argv)
    assert again.returncode == 0 and "nothing to do" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == before


# ---- Parquet and Hugging Face datasets, through stand-ins for pyarrow and datasets (not installed here) -------------
class _FakeParquetFile:
    tables: dict = {}

    def __init__(self, path):
        self.columns = self.tables[path]
        self.schema_arrow = types.SimpleNamespace(names=list(self.columns))

    def iter_batches(self, columns):
        values = self.columns[columns[0]]
        for start in range(0, len(values), 4):
            chunk = values[start:start + 4]
            yield types.SimpleNamespace(column=lambda i, chunk=chunk: types.SimpleNamespace(to_pylist=lambda: chunk))


def test_parquet_through_pyarrow(tmp_path, gpt2_like, monkeypatch):
    docs = make_docs(23)
    path = tmp_path / "part-0.parquet"
    path.write_bytes(b"PAR1")
    _FakeParquetFile.tables = {str(path): {"text": docs[:10] + [None] + docs[10:], "n": list(range(24))}}
    fake = types.ModuleType("pyarrow.parquet")
    fake.ParquetFile = _FakeParquetFile
    monkeypatch.setitem(sys.modules, "pyarrow", types.ModuleType("pyarrow"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", fake)
    sys.modules["pyarrow"].parquet = fake
    prep.prepare(prep.resolve_source(str(path)), gpt2_like, tmp_path / "out", val=prep.Val(count=2))
    want = expected_shards(docs, gpt2_like, "<|endoftext|>", 10**8, lambda i: i < 2)  # the null row is skipped
    assert shard_bytes(tmp_path / "out", "train") == want["train"]
    r = in_process(["data", "prepare", path, "--tokenizer", gpt2_like, "--out", tmp_path / "o2", "--text-key", "body"])
    assert r.returncode == 2 and "no 'body' column (it has text, n)" in r.stderr


def test_a_real_parquet_file(tmp_path, gpt2_like):
    """The same through pyarrow itself (the test extra installs it): a file of two row groups, a null row skipped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(23)
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": docs[:10] + [None] + docs[10:], "n": list(range(24))}), path, row_group_size=7)
    prep.prepare(prep.resolve_source(str(path)), gpt2_like, tmp_path / "out", val=prep.Val(count=2))
    want = expected_shards(docs, gpt2_like, "<|endoftext|>", 10**8, lambda i: i < 2)
    assert shard_bytes(tmp_path / "out", "train") == want["train"]
    assert shard_bytes(tmp_path / "out", "val") == want["val"]


def test_parquet_without_pyarrow_names_the_extra(tmp_path, gpt2_like, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    r = in_process(["data", "prepare", tmp_path / "x.parquet", "--tokenizer", gpt2_like, "--out", tmp_path / "out"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "attnlab[data]" in r.stderr
    assert not (tmp_path / "out").exists()


def test_hugging_face_dataset_is_streamed(tmp_path, gpt2_like, monkeypatch):
    docs = make_docs(40)
    asked = []

    def load(name, config, split):
        asked.append((name, config, split))
        return iter([{"text": d, "url": f"u{i}"} for i, d in enumerate(docs)])

    monkeypatch.setattr(prep, "_load_hf", load)
    r = in_process(["data", "prepare", "allenai/c4", "--hf-config", "en", "--tokenizer", gpt2_like, "--out",
                    tmp_path / "out", "--val", "4", "--workers", "1"])
    assert r.returncode == 0, r.stderr
    assert asked == [("allenai/c4", "en", "train")]
    want = expected_shards(docs, gpt2_like, "<|endoftext|>", 10**8, lambda i: i < 4)
    assert shard_bytes(tmp_path / "out", "train") == want["train"]
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["source"] == {"huggingface": "allenai/c4", "config": "en", "split": "train"}


def test_hugging_face_without_datasets_names_the_extra(tmp_path, gpt2_like, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    r = in_process(["data", "prepare", "allenai/c4", "--tokenizer", gpt2_like, "--out", tmp_path / "out"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "pip install 'attnlab[data]'" in r.stderr
    assert not (tmp_path / "out").exists()


# ---- the reader ------------------------------------------------------------------------------------------------------
def test_lm_task_reads_the_shards_as_one_stream(tmp_path, gpt2_like):
    from attnlab.data import lm
    from attnlab.data.registry import data_fingerprint, dataset_info

    docs = make_docs(300)
    prep.prepare(prep.resolve_source(str(write_jsonl(tmp_path / "c.jsonl", docs))), gpt2_like, tmp_path / "out",
                 val=prep.Val(fraction=0.1), shard_tokens=500)
    whole = np.frombuffer(b"".join(shard_bytes(tmp_path / "out", "train")), dtype="<u2").astype(np.int64)
    stream = lm.build_nanogpt(True, data_dir=str(tmp_path / "out"))
    assert len(stream) == len(whole) and stream.vocab_size == 300
    x, y = stream.batch(3, batch_size=64, block_size=40, seed=1)
    starts = np.random.default_rng([1, 0, 0, 3]).integers(0, len(whole) - 40, size=64)  # TokenStream's own rule
    assert np.array_equal(x.numpy(), whole[starts[:, None] + np.arange(40)])
    assert np.array_equal(y.numpy(), whole[starts[:, None] + np.arange(1, 41)])
    val = lm.build_nanogpt(False, data_dir=str(tmp_path / "out"))
    assert np.array_equal(np.asarray(val.tokens), np.frombuffer(b"".join(shard_bytes(tmp_path / "out", "val")), "<u2"))
    assert dataset_info("nanogpt", data_dir=str(tmp_path / "out")).model_kwargs()["vocab_size"] == 300
    fp = data_fingerprint("nanogpt", data_dir=str(tmp_path / "out"))
    assert fp["tokenizer.json"] == hashlib.sha256(gpt2_like.read_bytes()).hexdigest()
    assert set(fp) == {"tokenizer.json", "train shards", "val shards"}
    (tmp_path / "out" / "train_000001.bin").write_bytes(b"\0\0")  # cut short
    with pytest.raises(Exception, match="not the .* its manifest records"):
        lm.build_nanogpt(True, data_dir=str(tmp_path / "out"))
    with pytest.raises(Exception, match="holds uint16 shards"):
        lm.nanogpt_vocab(str(tmp_path / "out"), 0, "uint32")


def test_sharded_tokens_index_as_their_concatenation():
    from attnlab.data.shards import ShardedTokens

    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1000, size=n).astype(np.uint16) for n in (5, 1, 17, 3)]
    whole, tokens = np.concatenate(parts), ShardedTokens(parts)
    assert len(tokens) == len(whole) == 26
    idx = rng.integers(0, 26, size=(7, 9))
    assert np.array_equal(tokens[idx], whole[idx])
    assert np.array_equal(tokens[3:20:2], whole[3:20:2]) and tokens[-1] == whole[-1] and tokens[5] == whole[5]
    with pytest.raises(IndexError):
        tokens[np.array([26])]


# ---- the error contract ----------------------------------------------------------------------------------------------
def _fails(argv, cwd=None) -> str:
    r = in_process(["data", "prepare", *argv], cwd=cwd)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    return r.stderr


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, gpt2_like):
    good = write_jsonl(tmp_path / "c.jsonl", make_docs(20))
    out = tmp_path / "out"
    tok = ["--tokenizer", gpt2_like, "--out", out]
    assert "does not exist" in _fails([tmp_path / "missing.jsonl", *tok])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"}\n\n{"text": oops}\n')
    assert "bad.jsonl line 4 is not valid JSON" in _fails([bad, *tok])
    assert "bad.jsonl line 4 is not valid JSON" in _fails([bad, *tok, "--workers", "2"])  # raised in the pool's feeder
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"text": "a"}\n{"body": "b"}\n')
    assert "line 2 has no 'text' field (it holds body)" in _fails([nokey, *tok])
    notstr = tmp_path / "n.jsonl"
    notstr.write_text('{"text": 3}\n')
    assert "is int, not text" in _fails([notstr, *tok])
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    assert "not UTF-8" in _fails([latin, *tok])
    assert "does not exist" in _fails([good, "--tokenizer", tmp_path / "no.json", "--out", out])
    (tmp_path / "broken.json").write_text("{not a tokenizer")
    assert "cannot be read as a Hugging Face tokenizer.json" in _fails([good, "--tokenizer", tmp_path / "broken.json",
                                                                       "--out", out])
    assert "none of the usual document separators" in _fails(
        [good, "--tokenizer", train_tokenizer(tmp_path / "plain.json", []), "--out", out])
    assert "has no token '<eos>'" in _fails([good, *tok, "--separator", "<eos>"])
    for val in ("0", "1.5", "-1", "abc", "2.5", "1.0"):
        assert "--val" in _fails([good, *tok, "--val", val])
    for flag in ("--workers", "--shard-tokens"):
        for value in ("0", "x", "-2"):
            assert flag in _fails([good, *tok, flag, value])
    assert "leaves the val split empty" in _fails([write_jsonl(tmp_path / "one.jsonl", ["x y"]), *tok, "--val",
                                                   "0.1"])
    assert "leaves the train split empty" in _fails([good, *tok, "--val", "20"])
    assert not out.exists()
    if os.geteuid() != 0:  # root reads any file
        locked = write_jsonl(tmp_path / "locked.jsonl", ["a"])
        locked.chmod(0)
        assert "cannot read" in _fails([locked, *tok])
        assert not out.exists()


def test_out_folder_of_another_corpus_is_refused(tmp_path, gpt2_like):
    good = write_jsonl(tmp_path / "c.jsonl", make_docs(20))
    out = tmp_path / "out"
    assert in_process(["data", "prepare", good, "--tokenizer", gpt2_like, "--out", out, "--val", "2"]).returncode == 0
    before = folder_bytes(out)
    assert "prepared with another --val" in _fails([good, "--tokenizer", gpt2_like, "--out", out, "--val", "3"])
    other = write_jsonl(tmp_path / "d.jsonl", make_docs(20, seed=5))
    assert "prepared with another input" in _fails([other, "--tokenizer", gpt2_like, "--out", out, "--val", "2"])
    assert folder_bytes(out) == before
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "train.bin").write_bytes(b"\0\0")
    assert "that no attnlab data prepare wrote" in _fails([good, "--tokenizer", gpt2_like, "--out",
                                                           tmp_path / "foreign"])
    assert "is a file" in _fails([good, "--tokenizer", gpt2_like, "--out", good])


def test_help_names_every_flag():
    r = in_process(["data", "prepare", "--help"])
    assert r.returncode == 0
    for flag in ("--tokenizer", "--out", "--text-key", "--val", "--shard-tokens", "--workers", "--separator",
                 "--hf-config", "--hf-split", "--no-progress", "manifest.json", "uint32", "attnlab[data]"):
        assert flag in r.stdout, flag
    assert in_process(["data", "--help"]).returncode == 0
    r = in_process(["data"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1


def test_out_inside_the_input_folder_is_not_input(tmp_path, gpt2_like):
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", make_docs(30))
    argv = ["data", "prepare", tmp_path / "corpus", "--tokenizer", gpt2_like, "--out", tmp_path / "corpus" / "tok",
            "--val", "3"]
    assert in_process(argv).returncode == 0
    before = folder_bytes(tmp_path / "corpus" / "tok")
    again = in_process(argv)  # its own shards are not a change of the input
    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr
    assert folder_bytes(tmp_path / "corpus" / "tok") == before
