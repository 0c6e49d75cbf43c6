"""LRA ListOps generated locally (attnlab.data.listops): labels against an independent evaluator, the limits, the
files in LRA's format, and a run of the sequence model on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from attnlab.data import build_dataset, dataset_info
from attnlab.data.listops import VOCAB, generate
from attnlab.errors import ConfigError, DatasetError
from tests.reference_lowrank import listops_evaluate

SMALL = dict(max_length=60, min_length=10, max_depth=5, max_args=4, num_train=200, num_val=10, num_test=40, seed=3)


@pytest.mark.parametrize("limits", [dict(max_length=60, min_length=10, max_depth=5, max_args=4),
                                    dict(max_length=2000, min_length=500, max_depth=10, max_args=10)])
def test_labels_equal_an_independent_evaluator_and_limits_hold(limits):
    rows = generate(300 if limits["max_length"] < 100 else 25, seed=1, **limits)
    assert len({source for source, _ in rows}) == len(rows)  # distinct
    seen_ops, labels = set(), set()
    for source, label in rows:
        tokens = source.split()
        value, depth, widest = listops_evaluate(tokens)
        assert label == value, source
        length = sum(t not in ("(", ")") for t in tokens)
        assert limits["min_length"] < length < limits["max_length"]  # LRA keeps both bounds out
        assert depth <= limits["max_depth"] and 2 <= widest <= limits["max_args"]
        seen_ops |= {t for t in tokens if t.startswith("[")}
        labels.add(label)
    assert seen_ops == {"[MAX", "[MIN", "[MED", "[SM"}
    assert len(labels) >= 5


def test_lra_parentheses_layout():
    # LRA writes [MAX 2 9 ] as the nested pairs ((([MAX, 2), 9), ])
    rows = generate(50, seed=0, max_length=5, min_length=3, max_depth=2, max_args=2)  # length exactly 4
    for source, label in rows:
        op, a, b = source.split()[3], source.split()[4], source.split()[6]
        assert source == f"( ( ( {op} {a} ) {b} ) ] )"


def test_files_written_once_in_lra_format_and_read_back(tmp_path):
    train = build_dataset("listops", True, data_dir=tmp_path, **SMALL)
    test = build_dataset("listops", False, data_dir=tmp_path, **SMALL)
    folder = tmp_path / "listops"
    assert sorted(p.name for p in folder.iterdir()) == ["basic_test.tsv", "basic_train.tsv", "basic_val.tsv",
                                                        "generator.json"]
    lines = (folder / "basic_train.tsv").read_text().splitlines()
    assert lines[0] == "Source\tTarget" and len(lines) == 201 and len(train) == 200 and len(test) == 40
    for i in (0, 57, 199):
        source, target = lines[i + 1].split("\t")
        ids, label = train[i]
        assert ids.dtype == torch.int64 and ids.shape == (60,) and label == int(target)
        expected = [t for t in source.split() if t not in ("(", ")")]
        assert [VOCAB[j] for j in ids.tolist() if j] == expected
    mtime = os.stat(folder / "basic_train.tsv").st_mtime_ns
    again = build_dataset("listops", True, data_dir=tmp_path, **SMALL)
    assert os.stat(folder / "basic_train.tsv").st_mtime_ns == mtime and torch.equal(again.tokens, train.tokens)
    with pytest.raises(DatasetError, match="generated with other options"):
        build_dataset("listops", True, data_dir=tmp_path, **{**SMALL, "seed": 4})
    info = dataset_info("listops", max_length=60)
    assert (info.num_classes, info.image_size, info.in_chans) == (10, 60, len(VOCAB))


def test_same_seed_same_files(tmp_path):
    build_dataset("listops", True, data_dir=tmp_path / "a", **SMALL)
    build_dataset("listops", True, data_dir=tmp_path / "b", **SMALL)
    for name in ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv"):
        assert (tmp_path / "a/listops" / name).read_text() == (tmp_path / "b/listops" / name).read_text()
    splits = [set((tmp_path / "a/listops" / n).read_text().splitlines()[1:]) for n in
              ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv")]
    assert not (splits[0] & splits[1] or splits[0] & splits[2] or splits[1] & splits[2])


def _user_files(root: Path, body: str) -> None:
    (root / "listops").mkdir(parents=True)
    for name in ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv"):
        (root / "listops" / name).write_text("Source\tTarget\n" + body)


def test_user_files_are_read_and_bad_ones_named(tmp_path):
    _user_files(tmp_path / "ok", "( ( ( [SM 2 ) 9 ) ] )\t1\n")
    ds = build_dataset("listops", True, data_dir=tmp_path / "ok", max_length=8)
    assert ds[0][0].tolist() == [14, 3, 10, 15, 0, 0, 0, 0] and ds[0][1] == 1
    _user_files(tmp_path / "bad", "( ( [FIRST 2 ) ] )\t2\n")
    with pytest.raises(DatasetError, match=r"line 2 .*unknown ListOps token '\[FIRST'"):
        build_dataset("listops", True, data_dir=tmp_path / "bad", max_length=8)
    with pytest.raises(DatasetError, match="more than max_length 3"):
        build_dataset("listops", True, data_dir=tmp_path / "ok", max_length=3)
    with pytest.raises(DatasetError, match="takes no augmentation"):
        build_dataset("listops", True, data_dir=tmp_path / "ok", max_length=8, augment="recipe")
    with pytest.raises(ConfigError, match="max_args"):
        build_dataset("listops", True, data_dir=tmp_path / "x", max_args=1)


def test_lra_listops_trains_with_nystrom_speccond_and_no_layernorm(tmp_path):
    from attnlab.train import train
    from attnlab.train.config import RECIPES, validate

    cfg = RECIPES["lra_listops"].replace(
        epochs=1, batch_size=16, lr=1e-3, progress=False, device="cpu", threads=1,
        data_dir=str(tmp_path / "data"), runs_dir=str(tmp_path / "runs"), attn="nystrom(landmarks=8)+speccond",
        norm="none", data_options={**SMALL, "max_length": 40, "num_train": 64, "num_test": 16},
        model_options={"embed_dim": 16, "depth": 1})
    result = train(cfg)
    assert result["model"] == "lra" and 0.0 <= result["top1"] <= 100.0
    assert (Path(cfg.run.runs_dir) / result["name"] / "config.yaml").read_text().count("norm: none") == 1
    with pytest.raises(ConfigError, match="config key 'mixup' .* belongs to the image family; lra_listops trains a "
                                          "sequence classifier"):
        validate(cfg.replace(mixup=0.8, mixup_prob=0.5))


def test_seq_listops_preset():
    from torch import nn

    from attnlab.models import attention_modules, build_model

    model = build_model("seq_listops", attn="performer(features=8)", max_length=12)
    assert len(attention_modules(model)) == 2 and any(isinstance(m, nn.LayerNorm) for m in model.modules())
    bare = build_model("seq_listops", norm="none", max_length=12, pool="token")
    assert not any(isinstance(m, nn.LayerNorm) for m in bare.modules())
    tokens = torch.randint(0, 16, (3, 12))
    assert model(tokens).shape == bare(tokens).shape == (3, 10)
    with pytest.raises(ConfigError, match="longer than the model's max_length 12"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ConfigError, match="norm must be 'pre', 'post' or 'none'"):
        build_model("seq_listops", norm="bogus")


def test_lengths_follow_lras_strict_rule():
    # LRA keeps a tree only if min_length < length < max_length: neither bound is ever produced
    lengths = set()
    for source, _ in generate(400, seed=5, max_length=8, min_length=3, max_depth=3, max_args=3):
        lengths.add(sum(t not in ("(", ")") for t in source.split()))
    assert lengths == {4, 5, 7}  # 2 + 2 or 3 children of lengths 1, 4, 5: 3 and 8 would be the bounds
    with pytest.raises(DatasetError, match="strictly between"):
        generate(5, seed=0, max_length=6, min_length=5)


@pytest.mark.parametrize("spec", ["standard", "dna", "performer(features=16)"])
def test_the_recipes_model_masks_padding_and_the_ablation_does_not(spec):
    """The lra_listops recipe's model gives the same logits however far a batch is padded (LRA and every peer mask
    the padding); seq_listops, the named unmasked ablation, attends the padding, so its logits move."""
    from attnlab.models import build_model
    from attnlab.train.config import RECIPES

    tokens = torch.randint(1, 16, (2, 100), generator=torch.Generator().manual_seed(0))
    tokens[1, 60:] = 0  # a shorter sequence in the batch
    padded = {n: torch.nn.functional.pad(tokens, (0, n - 100)) for n in (128, 256)}
    for name, masked in ((RECIPES["lra_listops"].model, True), ("seq_listops", False)):
        torch.manual_seed(0)
        model = build_model(name, attn=spec, max_length=256, drop_rate=0.0, attn_drop_rate=0.0).double().eval()
        with torch.no_grad():
            short, long = model(padded[128]), model(padded[256])
        if masked:
            torch.testing.assert_close(short, long, rtol=1e-10, atol=1e-10)
        else:
            assert (short - long).abs().max() > 1e-3 * short.abs().max()
