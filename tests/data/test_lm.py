"""Token streams (attnlab.data.lm): bytes of a file or folder, a tokenizer.json built here offline, nanoGPT's
uint16 .bin files written here, the standard library's own source; blocks that are contiguous slices and a
function of (seed, split, rank, step) alone; the error contract."""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from attnlab.data import lm
from attnlab.errors import ConfigError, DatasetError


def write_bins(folder: Path, n_train=5000, n_val=700, meta=None) -> None:
    """nanoGPT's prepare.py output: ids as uint16 in train.bin / val.bin (here token i = i, so blocks are ranges)."""
    folder.mkdir(parents=True, exist_ok=True)
    np.arange(n_train, dtype=np.uint16).tofile(folder / "train.bin")
    (np.arange(n_val, dtype=np.uint16) + 7).tofile(folder / "val.bin")
    if meta is not None:
        with (folder / "meta.pkl").open("wb") as f:
            pickle.dump(meta, f)


def test_blocks_are_contiguous_next_token_pairs(tmp_path):
    write_bins(tmp_path)
    stream = lm.build_nanogpt(True, data_dir=tmp_path, vocab_size=6000)
    x, y = stream.batch(3, batch_size=8, block_size=32, seed=1)
    assert x.shape == y.shape == (8, 32) and str(x.dtype) == "torch.int64"
    starts = x[:, 0].numpy()
    assert (x.numpy() == starts[:, None] + np.arange(32)).all()  # a contiguous slice of train.bin
    assert (y.numpy() == x.numpy() + 1).all()  # the next tokens
    assert (starts >= 0).all() and (starts + 33 <= 5000).all()


def test_blocks_depend_on_seed_split_rank_step_alone(tmp_path):
    write_bins(tmp_path)
    a = lm.build_nanogpt(True, data_dir=tmp_path, vocab_size=6000)
    b = lm.build_nanogpt(True, data_dir=tmp_path, vocab_size=6000)
    first = a.batch(5, 4, 16, seed=2, rank=1)[0]
    a.batch(0, 4, 16)  # what was drawn before does not matter
    assert (b.batch(5, 4, 16, seed=2, rank=1)[0] == first).all()
    for other in (dict(seed=3, rank=1), dict(seed=2, rank=0)):
        assert not (b.batch(5, 4, 16, **other)[0] == first).all()
    assert not (b.batch(6, 4, 16, seed=2, rank=1)[0] == first).all()
    val = lm.build_nanogpt(False, data_dir=tmp_path, vocab_size=6000)
    assert (val.batch(0, 4, 16)[0][:, 0] >= 7).all()  # val.bin, memory-mapped as written
    evals = [list(val.eval_batches(4, 16, iters=3, seed=1)) for _ in range(2)]
    assert all((a[0] == b[0]).all() for a, b in zip(*evals)) and len(evals[0]) == 3


def test_nanogpt_meta_and_errors(tmp_path):
    write_bins(tmp_path / "char", n_train=60, n_val=40, meta=None)
    (np.arange(60, dtype=np.uint16) % 3).tofile(tmp_path / "char" / "train.bin")
    (np.arange(40, dtype=np.uint16) % 3).tofile(tmp_path / "char" / "val.bin")
    itos = {0: "a", 1: "é", 2: "\n"}
    with (tmp_path / "char" / "meta.pkl").open("wb") as f:
        pickle.dump({"vocab_size": 3, "itos": itos, "stoi": {v: k for k, v in itos.items()}}, f)
    char = lm.build_nanogpt(False, data_dir=tmp_path / "char")
    assert char.vocab_size == 3 and lm.nanogpt_info(tmp_path / "char").num_classes == 3
    ids = np.arange(40) % 3  # bytes per validation token: 1, 2, 1 repeating
    assert char.bytes_per_token == pytest.approx(np.array([1, 2, 1])[ids].mean())

    write_bins(tmp_path / "gpt2")
    assert lm.nanogpt_info(tmp_path / "gpt2").num_classes == 50257  # GPT-2's BPE without meta.pkl
    with pytest.raises(DatasetError, match="token id .* outside its vocabulary of 100"):
        lm.build_nanogpt(True, data_dir=tmp_path / "gpt2", vocab_size=100).batch(0, 64, 64)
    os.remove(tmp_path / "gpt2" / "val.bin")
    with pytest.raises(DatasetError, match=r"val.bin does not exist; give --data-dir the folder"):
        lm.build_nanogpt(True, data_dir=tmp_path / "gpt2")
    (tmp_path / "gpt2" / "val.bin").write_bytes(b"abc")
    with pytest.raises(DatasetError, match="not a uint16 token file"):
        lm.nanogpt_info(tmp_path / "gpt2")


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_hostile_meta_pkl_is_refused_without_running(tmp_path):
    write_bins(tmp_path)
    marker = tmp_path / "marker"
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 5, "itos": Payload(marker)}))
    with pytest.raises(DatasetError, match="not nanoGPT's plain meta.pkl"):
        lm.nanogpt_info(tmp_path)
    assert not marker.exists()


def test_text_file_and_folder_are_bytes_in_sorted_order(tmp_path):
    (tmp_path / "one.txt").write_bytes(b"hello world\n" * 50)
    stream = lm.build_text(True, data_dir=tmp_path / "one.txt")
    val = lm.build_text(False, data_dir=tmp_path / "one.txt")
    raw = np.frombuffer(b"hello world\n" * 50, dtype=np.uint8)
    assert (np.concatenate([stream.tokens, val.tokens]) == raw).all()
    assert len(val) == 60 and stream.vocab_size == 256 and stream.bytes_per_token == 1.0
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "2.txt").write_bytes(b"BBBB" * 10)
    (folder / "a.txt").write_bytes(b"AAAA" * 10)
    (folder / ".hidden").write_bytes(b"zzzz")
    (folder / ".git").mkdir()
    (folder / ".git" / "x").write_bytes(b"yyyy")
    files = lm.text_files(folder)
    assert [p.relative_to(folder).as_posix() for p in files] == ["a.txt", "b/2.txt"]
    both = lm.build_text(True, data_dir=folder, val_fraction=0.5)
    assert bytes(both.tokens) == b"AAAA" * 10
    with pytest.raises(DatasetError, match="does not exist"):
        lm.build_text(True, data_dir=tmp_path / "nope")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DatasetError, match="is empty"):
        lm.build_text(True, data_dir=tmp_path / "empty.txt")
    with pytest.raises(DatasetError, match="too few for blocks of 600"):
        stream.batch(0, 2, 600)
    with pytest.raises(DatasetError, match="takes no augmentation"):
        lm.build_text(True, data_dir=tmp_path / "one.txt", augment="recipe")


def write_tokenizer(path: Path, words: list[str]) -> None:
    """A word-level tokenizer.json (Hugging Face tokenizers, offline): ids in the order of ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    words = ["[UNK]", "the", "cat", "sat", "on", "mat"]
    write_tokenizer(tmp_path / "tokenizer.json", words)
    text = "the cat sat on the mat " * 20 + "the dog"
    (tmp_path / "c.txt").write_text(text)
    info = lm.text_info(tmp_path / "c.txt", tokenizer=str(tmp_path / "tokenizer.json"))
    assert info.num_classes == 6
    train = lm.build_text(True, data_dir=tmp_path / "c.txt", tokenizer=str(tmp_path / "tokenizer.json"))
    val = lm.build_text(False, data_dir=tmp_path / "c.txt", tokenizer=str(tmp_path / "tokenizer.json"))
    expect = [words.index(w) if w in words else 0 for w in text.split()]
    assert np.concatenate([train.tokens, val.tokens]).tolist() == expect
    assert train.bytes_per_token == pytest.approx(len(text.encode()) / len(expect))
    with pytest.raises(ConfigError, match="vocabulary of 6 tokens, more than the model's 4"):
        lm.check_vocab(info.num_classes, 4, "the tokenizer tokenizer.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DatasetError, match="cannot be read as a Hugging Face tokenizer.json"):
        lm.build_text(True, data_dir=tmp_path / "c.txt", tokenizer=str(tmp_path / "bad.json"))
    with pytest.raises(DatasetError, match="does not exist"):
        lm.text_info(tmp_path / "c.txt", tokenizer=str(tmp_path / "missing.json"))


def test_stdlib_corpus_is_the_sorted_standard_library():
    root, files = lm.stdlib_files()
    assert root == Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files) and "os.py" in files and "json/decoder.py" in files
    assert not any(part in ("test", "tests", "site-packages", "__pycache__") for f in files for part in f.split("/"))
    manifest = lm.stdlib_manifest()
    digest = hashlib.sha256()
    for rel in files:  # the manifest's hash, recomputed here from its definition
        data = (root / rel).read_bytes()
        digest.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    assert manifest == {"python": sys.version.split()[0], "files": len(files),
                        "bytes": sum((root / f).stat().st_size for f in files), "sha256": digest.hexdigest()}
    train, val = lm.build_stdlib(True), lm.build_stdlib(False)
    assert len(train) + len(val) == manifest["bytes"] and len(val) == round(0.1 * manifest["bytes"])
    assert bytes(train.tokens[:len((root / files[0]).read_bytes())]) == (root / files[0]).read_bytes()
    assert train.manifest == manifest and lm.stdlib_info().num_classes == 256
    lm.check_manifest(manifest)
    other = dict(manifest, python="3.99.0", sha256="0" * 64)
    with pytest.raises(DatasetError, match=r"this machine's Python .* the run's Python 3.99.0"):
        lm.check_manifest(other)


def test_table_entries_parse_their_options(tmp_path):
    from attnlab.data import build_dataset, dataset_info
    from attnlab.data.registry import resolve_options

    assert resolve_options("text", {}) == {"tokenizer": "", "val_fraction": 0.1}
    assert resolve_options("text", {"val_fraction": "0.2"})["val_fraction"] == 0.2
    with pytest.raises(ConfigError, match="unknown option tokeniser for dataset text"):
        resolve_options("text", {"tokeniser": "x"})
    with pytest.raises(ConfigError, match="must lie between 0.001 and 0.5"):
        resolve_options("stdlib", {"val_fraction": 0.9})
    with pytest.raises(ConfigError, match="is not an integer"):
        resolve_options("nanogpt", {"vocab_size": 3.5})
    info = dataset_info("stdlib")
    assert (info.task, info.model_kwargs()) == ("lm", {"vocab_size": 256})
    assert dataset_info("mqar", seq_len=128, num_kv_pairs=4).model_kwargs() == {"vocab_size": 8192, "block_size": 128}
    write_bins(tmp_path)
    assert len(build_dataset("nanogpt", False, data_dir=tmp_path, vocab_size=6000)) == 700
    with pytest.raises(DatasetError, match="takes no augmentation"):
        build_dataset("stdlib", True, augment="recipe")
