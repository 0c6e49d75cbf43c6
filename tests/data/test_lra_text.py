"""The LRA byte-level text loader (attnlab.data.lra_text) on review files written here in aclImdb's layout."""

from __future__ import annotations

import pytest

from attnlab.data import build_dataset, dataset_info
from attnlab.errors import DatasetError


def write_reviews(root, split, reviews):
    for label, name, text in reviews:
        folder = root / "aclImdb" / split / label
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(text.encode("utf-8"))


def test_reviews_become_byte_ids_with_labels(tmp_path):
    write_reviews(tmp_path, "train", [("pos", "1_9.txt", "Great film<br />é"), ("neg", "0_2.txt", "Dull."),
                                       ("neg", "3_1.txt", "x" * 50)])
    (tmp_path / "aclImdb/train/unsup").mkdir()
    (tmp_path / "aclImdb/train/unsup/5_0.txt").write_text("ignored")
    (tmp_path / "aclImdb/train/urls_pos.txt").write_text("ignored")
    ds = build_dataset("lra_text", True, data_dir=tmp_path, max_length=20)
    assert len(ds) == 3
    items = [ds[i] for i in range(3)]
    # sorted: neg/0_2.txt, neg/3_1.txt, pos/1_9.txt; labels 0 = negative, 1 = positive
    assert [label for _, label in items] == [0, 0, 1]
    assert items[0][0].tolist() == [b + 1 for b in b"Dull."] + [0] * 15
    assert items[1][0].tolist() == [ord("x") + 1] * 20  # cut to max_length
    assert items[2][0].tolist() == [b + 1 for b in "Great film<br />é".encode()] + [0] * 2
    assert items[2][0].tolist()[16:18] == [0xC3 + 1, 0xA9 + 1]  # the UTF-8 bytes of é, not its code point
    info = dataset_info("lra_text", max_length=20)
    assert (info.num_classes, info.image_size, info.in_chans) == (2, 20, 257)


def test_missing_files_are_named(tmp_path):
    write_reviews(tmp_path, "test", [("pos", "1_9.txt", "ok")])
    with pytest.raises(DatasetError, match=r"no reviews in neg/; extract aclImdb_v1.tar.gz"):
        build_dataset("lra_text", False, data_dir=tmp_path)
    with pytest.raises(DatasetError, match="no reviews in neg, pos/"):
        build_dataset("lra_text", True, data_dir=tmp_path)
