"""The report's size ladder (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2309.14322, Figure 1: loss against rate per size, LR sensitivity against size) on run
directories written here, against sensitivities worked by hand."""

import json
import re

import pytest

from attnlab.report import write_report
from attnlab.report.ladder import ALL_PARAMS, NON_EMBEDDING, model_size

RATES = (1e-3, 1e-2, 1e-1)
INIT = 5.0
# (model, variant, z_loss) -> final val_loss at RATES; every run's loss at init is INIT
LOSSES = {
    ("ladder_d128", "standard", 0.0): (3.0, 2.5, 6.0), ("ladder_d192", "standard", 0.0): (2.8, 2.3, 7.0),
    ("ladder_d256", "standard", 0.0): (2.6, 2.2, 4.4),
    ("ladder_d128", "qknorm", 0.0): (3.1, 2.6, 2.9), ("ladder_d192", "qknorm", 0.0): (2.9, 2.4, 2.5),
    ("ladder_d256", "qknorm", 0.0): (2.7, 2.2, 2.3),
    ("ladder_d128", "standard", 1e-4): (3.0, 2.6, 4.0), ("ladder_d192", "standard", 1e-4): (2.8, 2.4, 3.0),
}
# Hand-worked: LRS = mean_i min(L_i, L0) - min_i L_i, L0 = 5.0
EXPECTED = {
    ("ladder_d128", "standard", 0.0): (3.0 + 2.5 + 5.0) / 3 - 2.5,   # 1.0: the 6.0 counts as 5.0
    ("ladder_d192", "standard", 0.0): (2.8 + 2.3 + 5.0) / 3 - 2.3,   # 1.066667
    ("ladder_d256", "standard", 0.0): (2.6 + 2.2 + 4.4) / 3 - 2.2,   # 0.866667
    ("ladder_d128", "qknorm", 0.0): (3.1 + 2.6 + 2.9) / 3 - 2.6,     # 0.266667
    ("ladder_d192", "qknorm", 0.0): (2.9 + 2.4 + 2.5) / 3 - 2.4,     # 0.2
    ("ladder_d256", "qknorm", 0.0): (2.7 + 2.2 + 2.3) / 3 - 2.2,     # 0.2
    ("ladder_d128", "standard", 1e-4): (3.0 + 2.6 + 4.0) / 3 - 2.6,  # 0.6
    ("ladder_d192", "standard", 1e-4): (2.8 + 2.4 + 3.0) / 3 - 2.4,  # 0.333333
}
# non-embedding parameters, docs/methods.md's ladder table
PARAMS = {"ladder_d128": 402_048, "ladder_d192": 1_328_448, "ladder_d256": 3_213_568}


def make_runs(root, probes=True):
    for (model, attn, z), finals in LOSSES.items():
        for lr, final in zip(RATES, finals):
            tag = f"lr_{lr:g}" + ("_z" if z else "")
            d = root / f"{model}-nanogpt-{tag}-{attn}-s0"
            d.mkdir(parents=True)
            # independent weight decay 1e-4 as the ladder grid sets it: weight_decay = 1e-4 / lr
            (d / "config.yaml").write_text(
                f"recipe: lm\nmodel: {model}\ndataset: nanogpt\ntag: {tag}\nattn: {attn}\nseed: 0\nlr: {lr}\n"
                f"min_lr: 1.0e-05\nweight_decay: {1e-4 / lr}\nz_loss: {z}\nwarmup_steps: 10\nmax_steps: 100\n")
            (d / "result.json").write_text(json.dumps(
                {"name": d.name, "task": "lm", "model": model, "dataset": "nanogpt", "tag": tag, "attn": attn,
                 "seed": 0, "metric": "val_loss", "val_loss": final, "params": 9_999_999, "steps": 100,
                 "init": {"val_loss": INIT}}))
            if probes and not z:  # the max logit grows with the rate and the size; qknorm keeps it flat
                grow = 1.0 if attn == "qknorm" else lr * 100 * PARAMS[model] / 1e6
                logged = [{"step": s, "max_logit/layer_0": 2.0 + grow * s / 10, "max_logit/layer_1": 1.0}
                          for s in (10, 20, 30)]
                (d / "metrics.jsonl").write_text(json.dumps(
                    {"epoch": 1, "step": 100, "train_loss": final, "val_loss": final, "perplexity": 1.0,
                     "accuracy": 0.1, "probes": logged}) + "\n")


def test_ladder_table_figure_and_json(tmp_path):
    make_runs(tmp_path / "runs")
    result = write_report(tmp_path / "runs", tmp_path / "out", costs=False)
    data = json.loads((tmp_path / "out" / "report.json").read_text())

    ladders = {ld["setting"]: ld for ld in data["lr_ladders"]}
    # z-loss on and off are two ladders; the weight decay that changes as 1e-4 / lr is one sweep, not three
    assert set(ladders) == {"z_loss=0, independent weight decay 0.0001",
                            "z_loss=0.0001, independent weight decay 0.0001"}
    off = ladders["z_loss=0, independent weight decay 0.0001"]
    assert [s["model"] for s in off["sizes"]] == ["ladder_d128", "ladder_d192", "ladder_d256"]
    assert [s["params"] for s in off["sizes"]] == [PARAMS[m] for m in ("ladder_d128", "ladder_d192", "ladder_d256")]
    assert {s["source"] for s in off["sizes"]} == {NON_EMBEDDING}
    for ladder, z in ((off, 0.0), (ladders["z_loss=0.0001, independent weight decay 0.0001"], 1e-4)):
        for method in ladder["methods"]:
            for entry in method["sizes"]:
                assert entry["lr_sensitivity"] == pytest.approx(EXPECTED[entry["model"], method["method"], z],
                                                                abs=1e-12)
    on = ladders["z_loss=0.0001, independent weight decay 0.0001"]
    assert [m["method"] for m in on["methods"]] == ["standard"]
    assert [e["model"] for e in on["methods"][0]["sizes"]] == ["ladder_d128", "ladder_d192"]

    # the max logit over training, at each size's largest rate (1e-1): the larger of the two layers
    std = {e["model"]: e["max_logit"] for e in next(m for m in off["methods"] if m["method"] == "standard")["sizes"]}
    assert std["ladder_d192"]["lr"] == 1e-1 and std["ladder_d192"]["steps"] == [10, 20, 30]
    grow = 0.1 * 100 * PARAMS["ladder_d192"] / 1e6
    assert std["ladder_d192"]["max"] == pytest.approx([2.0 + grow, 2.0 + 2 * grow, 2.0 + 3 * grow])
    assert on["methods"][0]["sizes"][0]["max_logit"] is None  # z-loss runs logged no probe

    md = result["markdown"]
    assert "## LR sensitivity across model sizes (Wortsman et al. 2023, Figure 1)" in md
    assert "| Model | Parameters | qknorm | standard |" in md
    assert "| ladder_d128 | 402k (non-embedding) | **0.2667** | 1.0000 |" in md
    assert "| ladder_d256 | 3.2M (non-embedding) | **0.2000** | 0.8667 |" in md
    assert "| ladder_d192 | 1.3M (non-embedding) | — | 0.3333 |" not in md  # z-loss on: one method, no qknorm column
    assert "| ladder_d192 | 1.3M (non-embedding) | 0.3333 |" in md
    figures = sorted(p.name for p in result["plots"] if p.name.startswith("report_sizes_"))
    assert figures == ["report_sizes_max_logit_nanogpt-z_loss-0-independent-weight-decay-0.0001.png",
                       "report_sizes_nanogpt-z_loss-0-independent-weight-decay-0.0001.png",
                       "report_sizes_nanogpt-z_loss-0.0001-independent-weight-decay-0.0001.png"]
    for p in result["plots"]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the per-model sweeps are still there, one per (model, z-loss), over all three rates
    assert len(data["lr_sweeps"]) == 5
    assert all(line["rates"] == list(RATES) for s in data["lr_sweeps"] for line in s["lines"])


def test_one_model_makes_no_ladder(tmp_path):
    make_runs(tmp_path / "runs", probes=False)
    for d in (tmp_path / "runs").iterdir():
        if not d.name.startswith("ladder_d128"):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
    result = write_report(tmp_path / "runs", tmp_path / "out", costs=False)
    assert "LR sensitivity across model sizes" not in result["markdown"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["lr_ladders"] == []


def test_coupled_weight_decay_that_differs_splits_the_sweep(tmp_path):
    """weight_decay neither one value nor one lr x weight_decay: separate sweeps, one per value."""
    make_runs(tmp_path / "runs", probes=False)
    for cfg in (tmp_path / "runs").glob("*/config.yaml"):
        cfg.write_text(re.sub(r"weight_decay: .*", "weight_decay: 0.1" if "lr_0.1" in cfg.parent.name else
                              "weight_decay: 0.01", cfg.read_text()))
    data = json.loads((write_report(tmp_path / "runs", tmp_path / "out", costs=False)["json"]).read_text())
    # 1e-3 and 1e-2 at weight_decay 0.01 are one sweep (coupled decay, one value); 1e-1 at 0.1 is alone: no sweep
    # (ladder_d256 ran without z-loss only: its own sweeps do not differ in z_loss, so its title does not say it)
    assert {s["title"] for s in data["lr_sweeps"]} == {
        *(f"{m} / nanogpt (z_loss={z}, weight_decay=0.01)" for m in ("ladder_d128", "ladder_d192")
          for z in ("0", "0.0001")), "ladder_d256 / nanogpt (weight_decay=0.01)"}
    assert all(line["rates"] == [1e-3, 1e-2] for s in data["lr_sweeps"] for line in s["lines"])
    ladders = {ld["setting"]: ld for ld in data["lr_ladders"]}
    assert set(ladders) == {"z_loss=0, weight_decay=0.01", "z_loss=0.0001, weight_decay=0.01"}
    # ... but the ladder reads its z_loss from its settings: it joins the z-loss-off ladder
    assert [s["model"] for s in ladders["z_loss=0, weight_decay=0.01"]["sizes"]] == [
        "ladder_d128", "ladder_d192", "ladder_d256"]


def test_model_size_sources():
    assert model_size("ladder_d1792", None) == (1_082_298_112, NON_EMBEDDING)
    assert model_size("gpt_tiny", 812_345) == (812_345, ALL_PARAMS)
    assert model_size("gpt_tiny", None) == (None, "unknown")
