"""A report compares only runs trained alike (issue 26 item 1), writes its files as checkpoints are written (issue 27
item 9), says what was trained, and draws each variant in one colour on honest axes (issue 26, report.html)."""

import json
import os

import pytest
import yaml

from attnlab.report import write_report


def add_run(root, attn, seed, top1, *, recipe="ns_cifar", name=None, **config):
    """A finished run as the trainer leaves it: a full config.yaml (every key, as train writes it), result.json."""
    from attnlab.train import make_config
    from attnlab.train.config import config_to_dict

    cfg = make_config(recipe, model="vit_cifar", dataset="cifar10", attn=attn, seed=seed, **config)
    d = root / (name or f"{cfg.recipe}-e{cfg.epochs}-{attn}-s{seed}")
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    (d / "result.json").write_text(json.dumps({"name": d.name, "model": "vit_cifar", "dataset": "cifar10",
                                               "tag": "", "attn": attn, "seed": seed, "epochs": cfg.epochs,
                                               "top1": top1}))
    return d


def rows_of(result):
    return [(r["variant"], r["setting"], r["gain_pp"], r["wins"]) for r in result["rows"]]


def test_runs_of_different_length_or_recipe_are_never_compared(tmp_path):
    """The issue's case: a 12-epoch standard run and a 2-epoch ns run printed "gain -53.06 pp"."""
    runs = tmp_path / "runs"
    add_run(runs, "standard", 0, 81.06, epochs=12)
    add_run(runs, "ns", 0, 28.00, epochs=2, warmup_epochs=1)
    result = write_report(runs, tmp_path / "out", plots=False, costs=False)
    assert all(r["gain_pp"] is None and r["wins"] is None for r in result["rows"])  # no gain across them
    settings = {r["variant"]: r["setting"] for r in result["rows"]}
    assert settings == {"standard": "epochs=12, warmup_epochs=10", "ns": "epochs=2, warmup_epochs=1"}
    md = result["markdown"]
    assert "### vit_cifar / cifar10 (epochs=12, warmup_epochs=10)" in md
    assert "### vit_cifar / cifar10 (epochs=2, warmup_epochs=1)" in md
    assert "-53.06" not in md
    assert ("vit_cifar / cifar10: these runs differ in more than variant and seed (epochs, warmup_epochs), so they "
            "form 2 separate comparisons") in md
    data = json.loads(result["json"].read_text())
    assert data["mismatched"] == [{"group": "vit_cifar / cifar10", "keys": ["epochs", "warmup_epochs"],
                                   "settings": ["epochs=12, warmup_epochs=10", "epochs=2, warmup_epochs=1"]}]

    # a different recipe is named first, with every key it changes; the matched pair in each setting is compared
    add_run(runs, "standard", 0, 90.0, recipe="demo", model_options={"depth": 2}, name="demo-std")
    add_run(runs, "ns", 0, 91.5, recipe="demo", model_options={"depth": 2}, name="demo-ns")
    result = write_report(runs, tmp_path / "out2", plots=False, costs=False)
    demo = [r for r in result["rows"] if r["setting"].startswith("recipe=demo")]
    assert [(r["variant"], round(r["gain_pp"] or 0, 6), r["wins"]) for r in demo] == [("standard", 0, None),
                                                                                    ("ns", 1.5, "1/1")]
    assert demo[0]["setting"].startswith("recipe=demo, epochs=20, ") and "model_options={\"depth\": 2}" in \
        demo[0]["setting"]
    [mismatch] = json.loads(result["json"].read_text())["mismatched"]
    assert mismatch["keys"][:2] == ["recipe", "epochs"] and "lr" in mismatch["keys"] and len(mismatch["settings"]) == 3


def test_runs_differing_only_in_runtime_keys_are_compared(tmp_path):
    """device, paths, workers, compile...: how a run ran, not what it computes (RUNTIME_KEYS)."""
    runs = tmp_path / "runs"
    add_run(runs, "standard", 0, 80.0, device="cuda:1", runs_dir="elsewhere", num_workers=8)
    add_run(runs, "ns", 0, 81.0, device="cpu", compile=True, data_dir="/data")
    result = write_report(runs, tmp_path / "out", plots=False, costs=False)
    assert [(v, s, round(g or 0, 6), w) for v, s, g, w in rows_of(result)] == [("standard", "", 0, None),
                                                                              ("ns", "", 1.0, "1/1")]
    assert json.loads(result["json"].read_text())["mismatched"] == []


def test_a_config_naming_few_keys_means_the_recipe_defaults(tmp_path):
    """A config.yaml written by hand with a few keys matches a full one with the recipe's values."""
    runs = tmp_path / "runs"
    add_run(runs, "standard", 0, 80.0)
    short = runs / "short-ns"
    short.mkdir()
    (short / "config.yaml").write_text("model: vit_cifar\ndataset: cifar10\nattn: ns\nseed: 0\nepochs: '100'\n")
    (short / "result.json").write_text(json.dumps({"name": "short-ns", "model": "vit_cifar", "dataset": "cifar10",
                                                   "attn": "ns", "seed": 0, "top1": 80.5}))
    result = write_report(runs, tmp_path / "out", plots=False, costs=False)
    assert [r["gain_pp"] for r in result["rows"]] == [None, pytest.approx(0.5)]


def test_report_files_replace_symlinks_and_never_write_through_them(tmp_path):
    """report.md/.json/.html and the PNGs are written to a temporary file beside them and renamed: a symlink in the
    way is replaced, its target (outside the runs directory) is left as it was."""
    runs = tmp_path / "runs"
    add_run(runs, "standard", 0, 80.0)
    add_run(runs, "ns", 0, 81.0)
    outside = tmp_path / "outside"
    outside.mkdir()
    names = ["report.md", "report.json", "report.html", "report_vit_cifar_cifar10.png"]
    for name in names:
        (outside / name).write_text(f"precious {name}\n")
        os.symlink(outside / name, runs / name)
    result = write_report(runs, plots=True, costs=False)
    for name in names:
        assert (outside / name).read_text() == f"precious {name}\n"
        assert not (runs / name).is_symlink() and (runs / name).stat().st_size > 0
    assert json.loads((runs / "report.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert not [p for p in runs.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind


def test_provenance_header(tmp_path):
    runs = tmp_path / "runs"
    add_run(runs, "standard", 0, 80.0, epochs=12)
    add_run(runs, "ns", 1, 81.0, epochs=12)
    d = add_run(runs, "ns", 2, 81.5, epochs=12)
    result_json = json.loads((d / "result.json").read_text())
    result_json.update(finished="2025-03-04T10:00:00+00:00", machine="cuda:0 (NVIDIA H200)", attnlab_version="0.1.0")
    (d / "result.json").write_text(json.dumps(result_json))
    (runs / "unfinished").mkdir()
    (runs / "unfinished" / "config.yaml").write_text("model: vit_cifar\n")
    md = write_report(runs, tmp_path / "out", plots=False, costs=False)["markdown"]
    header = md[md.index("## What was trained"):md.index("## Accuracy")]
    assert "- **Runs**: 3 finished (1 unfinished, not included); 2 variants; seeds 0, 1, 2; 1 comparison" in header
    assert "- **Models and datasets**: vit_cifar on cifar10" in header
    assert "- **Recipe**: ns_cifar, 12 epochs" in header
    assert "- **Finished**: " in header and "2025-03-04 to " in header  # the recorded date, then the files' times
    assert "- **Machine**: cuda:0 (NVIDIA H200) (2 runs recorded none)" in header
    assert "- **attnlab**: runs trained with 0.1.0 (2 runs recorded none); report by " in header


def rows(*variants, baseline="standard"):
    """summarize-like rows of one comparison: (variant, mean, sd)."""
    base = next(m for v, m, _ in variants if v == baseline)
    return [{"variant": v, "mean": m, "sd": sd, "baseline": v == baseline,
             "gain_pp": None if v == baseline else m - base} for v, m, sd in variants]


def test_top1_figure_starts_at_zero_and_keeps_each_variant_colour():
    from matplotlib.colors import to_hex

    from attnlab.analysis.figures import BASELINE_COLOR, variant_colors
    from attnlab.report.write import group_figure

    group = rows(("standard", 93.5, 0.1), ("ns", 93.9, 0.2), ("speccond", 93.6, None))
    colors = variant_colors(["standard", "ns", "speccond", "dna"])
    fig = group_figure(group, "vit_cifar / cifar10", colors)
    bars_ax, gain_ax = fig.axes
    assert bars_ax.get_ylim()[0] == 0  # bars read as ratios: from 0, not zoomed onto their tops
    faces = [to_hex(p.get_facecolor()) for p in bars_ax.patches]
    assert faces == [BASELINE_COLOR, colors["ns"], colors["speccond"]]
    gains = gain_ax.collections[-1]
    assert [to_hex(c) for c in gains.get_facecolors()] == [colors["ns"], colors["speccond"]]
    assert [round(y, 6) for _, y in gains.get_offsets()] == [0.4, 0.1]  # the gains, where 0.1 pp shows


def test_variant_colours():
    from attnlab.analysis.figures import BASELINE_COLOR, PALETTE, variant_colors

    names = ["standard", "ns", "dna", "speccond", "sigma", "qknorm", "qkclip", "diff", "cog", "ns( steps=2 )"]
    colors = variant_colors(names)
    assert colors["standard"] == BASELINE_COLOR
    others = [c for v, c in colors.items() if v != "standard"]
    assert len(set(others)) == len(others) == 9 and "ns(steps=2)" in colors  # whitespace is not the variant's
    grey = {"#7f7f7f", "#c7c7c7", BASELINE_COLOR}
    assert not grey & set(PALETTE)
    assert variant_colors(reversed(names)) == colors  # by the set, not by the order of appearance
    assert variant_colors(["ns", "dna"], baseline="ns")["ns"] == BASELINE_COLOR


def test_summarize_without_settings_is_one_group():
    """summarize on plain dicts (no settings): one group, as before."""
    from attnlab.report import summarize

    out = summarize([{"model": "m", "dataset": "d", "attn": a, "seed": 0, "top1": t}
                     for a, t in (("standard", 1.0), ("ns", 2.0))])
    assert [(r["variant"], r["setting"], r["gain_pp"]) for r in out] == [("standard", "", None), ("ns", "", 1.0)]
