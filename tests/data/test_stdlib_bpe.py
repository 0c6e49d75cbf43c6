"""``stdlib_bpe``: the standard library's source through a BPE tokenizer trained on it, prepared once by
``attnlab data prepare``. Checked against an independent encoding (the tokenizer called directly, prepare's split
and separator rules restated here) and against ``prepare`` itself; a second use reuses the folder; without the
tokenizers package the dataset is refused in one line. A slice of the standard library keeps the tests fast."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from attnlab.data import lm, stdlib_bpe
from attnlab.data.registry import build_dataset, data_fingerprint, dataset_info
from attnlab.errors import ConfigError
from tests.cli_runner import in_process

FILES = 60  # the first files of the standard library in sorted order: some hundred kB of source


@pytest.fixture
def small_stdlib(monkeypatch):
    root, files = lm.stdlib_files()
    monkeypatch.setattr(lm, "stdlib_files", lambda: (root, files[:FILES]))
    return root, files[:FILES]


def independent_splits(root, files, tok) -> dict[str, np.ndarray]:
    """The corpus as prepare's docstring defines it, restated: non-empty files in order, document i to val when
    floor(0.05 (i+1)) > floor(0.05 i), each document's ids after the separator <|endoftext|>."""
    docs = [t for t in ((root / f).read_text(encoding="utf-8") for f in files) if t]
    sep = tok.token_to_id("<|endoftext|>")
    out = {"train": [], "val": []}
    for i, text in enumerate(docs):
        split = "val" if math.floor(0.05 * (i + 1)) > math.floor(0.05 * i) else "train"
        out[split] += [sep, *tok.encode(text, add_special_tokens=False).ids]
    return {k: np.asarray(v) for k, v in out.items()}


def test_the_tokenizer_is_deterministic_lossless_and_of_the_stated_size(small_stdlib):
    from tokenizers import Tokenizer

    first = stdlib_bpe.train_tokenizer(stdlib_bpe.source())
    assert stdlib_bpe.train_tokenizer(stdlib_bpe.source()) == first  # same bytes twice
    tok = Tokenizer.from_str(first)
    assert tok.get_vocab_size() == stdlib_bpe.VOCAB == 2048
    assert tok.token_to_id("<|endoftext|>") == 0
    root, files = small_stdlib
    text = (root / files[-1]).read_text(encoding="utf-8")
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text  # byte-level: nothing lost
    # trained on the train documents alone: prepare's split of the non-empty files, restated
    docs = [t for t in ((root / f).read_text(encoding="utf-8") for f in files) if t]
    train = [t for i, t in enumerate(docs) if math.floor(0.05 * (i + 1)) == math.floor(0.05 * i)]
    assert stdlib_bpe.train_documents(stdlib_bpe.source()) == train and len(train) < len(docs)


def test_the_corpus_is_prepare_of_the_stdlib_through_its_tokenizer(small_stdlib, tmp_path):
    from tokenizers import Tokenizer

    from attnlab.data.prepare import Val, prepare
    from attnlab.data.shards import read_manifest, split_tokens

    root, files = small_stdlib
    corpus = stdlib_bpe.ensure(tmp_path)
    assert corpus == tmp_path / "stdlib_bpe" / "corpus"
    tok_file = tmp_path / "stdlib_bpe" / "tokenizer.json"
    assert tok_file.read_text(encoding="utf-8") == stdlib_bpe.train_tokenizer(stdlib_bpe.source())
    manifest = read_manifest(corpus)
    want = independent_splits(root, files, Tokenizer.from_file(str(tok_file)))
    for split in ("train", "val"):
        got = np.asarray(split_tokens(corpus, manifest, split))
        assert got.dtype == np.uint16 and np.array_equal(got, want[split]), split
        stream = build_dataset("stdlib_bpe", split == "train", data_dir=tmp_path)
        assert stream.vocab_size == 2048 and np.array_equal(np.asarray(stream.tokens[:]), want[split])
    # exactly what attnlab data prepare writes for that text and that tokenizer
    again = prepare(stdlib_bpe.source(), tok_file, tmp_path / "by_hand", val=Val(0.05), separator="<|endoftext|>",
                    shard_tokens=stdlib_bpe.SHARD_TOKENS, progress=False)
    assert again["splits"] == manifest["splits"]
    assert dataset_info("stdlib_bpe", data_dir=tmp_path).model_kwargs() == {"vocab_size": 2048}
    assert data_fingerprint("stdlib_bpe", data_dir=tmp_path)["tokenizer.json"] == manifest["tokenizer"]["sha256"]


def test_a_second_use_reuses_the_prepared_folder(small_stdlib, tmp_path, monkeypatch):
    corpus = stdlib_bpe.ensure(tmp_path)
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "stdlib_bpe").rglob("*") if p.is_file()}

    def no_training(*_):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(stdlib_bpe, "train_tokenizer", no_training)
    lines = []
    assert stdlib_bpe.ensure(tmp_path, log=lines.append) == corpus
    assert any("already holds this corpus" in line for line in lines), lines
    build_dataset("stdlib_bpe", True, data_dir=tmp_path)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "stdlib_bpe").rglob("*") if p.is_file()} == stamps


def test_without_tokenizers_the_dataset_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'attnlab\[lm\]'"):
        dataset_info("stdlib_bpe", data_dir=tmp_path)
    assert not (tmp_path / "stdlib_bpe").exists()
    r = in_process(["train", "--recipe", "lm_ladder_demo", "--data-dir", tmp_path, "--runs-dir", tmp_path / "runs",
                    "--no-progress"])
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "pip install 'attnlab[lm]'" in r.stderr, r.stderr
    assert not (tmp_path / "stdlib_bpe").exists() and not (tmp_path / "runs").exists()


def test_the_ladder_demo_preset_expands_to_three_sizes_two_variants_three_rates(small_stdlib, tmp_path):
    """`attnlab compare --preset lm_ladder_demo` planned without training: 18 runs, and the corpus made once in
    the planning process, before any worker starts."""
    from attnlab.train.config import flat_dict
    from attnlab.train.grid import load_grid, plan_grid

    grid = load_grid(preset="lm_ladder_demo", runs_dir=str(tmp_path / "runs"), data_dir=str(tmp_path))
    assert grid["jobs"] == 2 and grid["seeds"] == [0]
    plans = plan_grid(grid["base"], grid["variants"], grid["seeds"], grid["datasets"], grid["models"],
                      grid["runs_dir"], grid["variations"])
    cells = {(p["cfg"].model, p["cfg"].attn, p["cfg"].optim.lr) for p in plans}
    assert cells == {(f"ladder_d{w}", a, lr) for w in (128, 192, 256) for a in ("standard", "qknorm")
                     for lr in (1e-3, 1e-2, 1e-1)}
    assert len(plans) == 18 and all(p["action"] == "train" for p in plans)
    flat = flat_dict(plans[0]["cfg"])
    assert (flat["dataset"], flat["max_steps"], flat["threads"], flat["probe_every"]) == ("stdlib_bpe", 100, 1, 20)
    assert (tmp_path / "stdlib_bpe" / "corpus" / "manifest.json").is_file()


def test_two_processes_preparing_at_once_make_the_corpus_once(small_stdlib, tmp_path, monkeypatch):
    """The lock: two concurrent callers (threads here; flock excludes two open files in one process as it does two
    processes) train the tokenizer once and prepare once; the second finds the first's corpus."""
    import threading

    calls, train = [], stdlib_bpe.train_tokenizer
    monkeypatch.setattr(stdlib_bpe, "train_tokenizer", lambda src: calls.append(1) or train(src))
    results, errors, logs = [], [], [[], []]

    def make(i):
        try:
            results.append(stdlib_bpe.ensure(tmp_path, log=logs[i].append))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and len(set(results)) == 1
    assert len(calls) == 1
    assert sorted(any("already holds this corpus" in line for line in log) for log in logs) == [False, True]


def test_a_data_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    r = in_process(["train", "--recipe", "lm_ladder_demo", "--data-dir", tmp_path / "file", "--runs-dir",
                    tmp_path / "runs", "--no-progress"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "give --data-dir a writable folder" in r.stderr and not (tmp_path / "runs").exists(), r.stderr
