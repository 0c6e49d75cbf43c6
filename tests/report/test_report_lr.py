"""The report's learning-rate sweep (loss against peak rate, Wortsman et al. 2023's LR sensitivity) on run
directories written here, against numbers worked by hand."""

import json

import pytest

from attnlab.report import write_report

# (variant, warm-up steps, lr, seed) -> (final val_loss, loss at init or None)
RUNS = {
    ("standard", 0, 1e-3, 0): (2.0, 5.5), ("standard", 0, 1e-2, 0): (1.5, 5.5), ("standard", 0, 3e-2, 0): (6.0, 5.5),
    ("qknorm", 0, 1e-3, 0): (2.2, 5.6), ("qknorm", 0, 1e-2, 0): (1.7, 5.6), ("qknorm", 0, 1e-2, 1): (1.9, 5.6),
    ("qknorm", 0, 3e-2, 0): (1.9, 5.6),
    ("standard", 10, 1e-3, 0): (2.1, 5.5), ("standard", 10, 1e-2, 0): (1.6, 5.5),  # 3e-2 did not finish
    ("qknorm", 10, 1e-3, 0): (2.3, 5.6), ("qknorm", 10, 1e-2, 0): (1.9, 5.6), ("qknorm", 10, 3e-2, 0): (2.0, 5.6),
    ("qknorm", 20, 3e-2, 0): (1.9, 5.6),  # a warm-up run at one rate only: no line
    ("sigma", 0, 1e-3, 0): (2.5, None), ("sigma", 0, 1e-2, 0): (2.4, None),  # trained before init was recorded
}
# Hand-worked: LRS = mean_i min(L_i, L0) - min_i L_i
#   standard, no warm-up: (2.0 + 1.5 + min(6.0, 5.5)) / 3 - 1.5 = 9.0 / 3 - 1.5 = 1.5
#   qknorm: L(1e-2) = mean(1.7, 1.9) = 1.8, so (2.2 + 1.8 + 1.9) / 3 - 1.8 = 5.9 / 3 - 1.8 = 0.166667
#   standard, 10 warm-up steps: (2.1 + 1.6) / 2 - 1.6 = 0.25, over 2 of the 3 rates run with that warm-up
#   qknorm, 10 warm-up steps: (2.3 + 1.9 + 2.0) / 3 - 1.9 = 6.2 / 3 - 1.9 = 0.166667


def make_runs(root):
    for (attn, warmup, lr, seed), (final, init) in RUNS.items():
        tag = f"lr_{lr:g}" + (f"_warm{warmup}" if warmup else "")
        d = root / f"gpt_tiny-stdlib-{tag}-{attn}-s{seed}"
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(
            f"recipe: lm_demo\nmodel: gpt_tiny\ndataset: stdlib\ntag: {tag}\nattn: {attn}\nseed: {seed}\n"
            f"lr: {lr}\nmin_lr: {lr / 10}\nwarmup_steps: {warmup}\n")
        result = {"name": d.name, "task": "lm", "model": "gpt_tiny", "dataset": "stdlib", "tag": tag, "attn": attn,
                  "seed": seed, "metric": "val_loss", "val_loss": final, "perplexity": 2.0 ** final, "steps": 150}
        if init is not None:
            result["init"] = {"val_loss": init, "perplexity": 2.0 ** init}
        (d / "result.json").write_text(json.dumps(result))
    # a classification run with its own learning rate is no sweep (top-1 is not a loss)
    d = root / "vit_digits-digits-standard-s0"
    d.mkdir()
    (d / "config.yaml").write_text("recipe: demo\nmodel: vit_digits\ndataset: digits\nattn: standard\nseed: 0\n")
    (d / "result.json").write_text(json.dumps({"name": d.name, "model": "vit_digits", "dataset": "digits",
                                               "attn": "standard", "seed": 0, "top1": 90.0}))


def test_lr_sensitivity_table_and_figure(tmp_path):
    make_runs(tmp_path / "runs")
    result = write_report(tmp_path / "runs", tmp_path / "out", costs=False)
    data = json.loads((tmp_path / "out" / "report.json").read_text())

    [sweep] = data["lr_sweeps"]
    assert sweep["title"] == "gpt_tiny / stdlib"
    lines = {(line["variant"], line["warmup"]): line for line in sweep["lines"]}
    assert all(line["rates"] == [1e-3, 1e-2, 3e-2] for line in lines.values())
    assert set(lines) == {("standard", "none"), ("standard", "10 steps"), ("qknorm", "none"), ("qknorm", "10 steps"),
                          ("sigma", "none")}  # not qknorm with 20 steps, run at one rate
    assert lines[("qknorm", "10 steps")]["lr_sensitivity"] == pytest.approx(6.2 / 3 - 1.9, abs=1e-12)
    assert lines[("standard", "none")]["lr_sensitivity"] == pytest.approx(1.5, abs=1e-12)
    assert lines[("qknorm", "none")]["lr_sensitivity"] == pytest.approx(5.9 / 3 - 1.8, abs=1e-12)
    assert lines[("standard", "10 steps")]["lr_sensitivity"] == pytest.approx(0.25, abs=1e-12)
    assert lines[("sigma", "none")]["lr_sensitivity"] is None
    qk = {p["lr"]: p for p in lines[("qknorm", "none")]["points"]}
    assert qk[1e-2]["final"] == pytest.approx(1.8) and qk[1e-2]["n"] == 2

    md = result["markdown"]
    assert "Validation loss as mean ± sample SD over seeds; gains (differences of means) against" in md  # no "%"
    assert "## Learning-rate sensitivity (Wortsman et al. 2023)" in md
    assert "| standard | none | 3 of 3 | 1.5000 | 1e-2 | 5.5000 | 1.5000 |" in md
    assert "| qknorm | none | 3 of 3 | 1.8000 | 1e-2 | 5.6000 | 0.1667 |" in md
    assert "| standard | 10 steps | 2 of 3 (no finished run at 3e-2) | 1.6000 | 1e-2 | 5.5000 | 0.2500 |" in md
    assert ("| sigma | none | 2 of 3 (no finished run at 3e-2) | 2.4000 | 1e-2 | — | — (no loss at init recorded) |"
            in md)

    [figure] = [p for p in result["plots"] if p.name.startswith("report_lr_")]
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"against the peak learning rate, gpt_tiny / stdlib (dashed: no warm-up)]({figure.name})" in md


def test_runs_at_one_rate_make_no_sweep(tmp_path):
    make_runs(tmp_path / "runs")
    for d in (tmp_path / "runs").iterdir():
        if "lr_0.01" in d.name or "lr_0.03" in d.name:
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
    result = write_report(tmp_path / "runs", tmp_path / "out", costs=False)
    assert "Learning-rate sensitivity" not in result["markdown"]
    assert not any(p.name.startswith("report_lr_") for p in result["plots"])


def test_per_layer_max_logit_over_training(tmp_path):
    """metrics.jsonl's probes (probe_every) -> per variant, per layer, the mean over seeds at each step, and a
    figure in the report."""
    from attnlab.analysis.curves import layer_max_logits

    probes = {("standard", 0): [{"step": 10, "max_logit/layer_0": 2.0, "max_logit/layer_1": 3.0},
                                {"step": 20, "max_logit/layer_0": 4.0, "max_logit/layer_1": 9.0}],
              ("standard", 1): [{"step": 10, "max_logit/layer_0": 4.0, "max_logit/layer_1": 5.0},
                                {"step": 20, "max_logit/layer_0": 6.0, "max_logit/layer_1": 11.0}],
              ("qknorm", 0): [{"step": 10, "max_logit/layer_0": 1.0, "max_logit/max": 1.0, "entropy/layer_0": 2.0}]}
    dirs = []
    for (attn, seed), logged in probes.items():
        d = tmp_path / "runs" / f"gpt_tiny-stdlib-{attn}-s{seed}"
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(f"recipe: lm_demo\nmodel: gpt_tiny\ndataset: stdlib\nattn: {attn}\n"
                                       f"seed: {seed}\n")
        (d / "metrics.jsonl").write_text(json.dumps(
            {"epoch": 1, "step": 20, "train_loss": 3.0, "val_loss": 3.0, "perplexity": 20.0, "accuracy": 0.2,
             "probes": logged}) + "\n")
        (d / "result.json").write_text(json.dumps(
            {"name": d.name, "task": "lm", "model": "gpt_tiny", "dataset": "stdlib", "attn": attn, "seed": seed,
             "metric": "val_loss", "val_loss": 3.0}))
        dirs.append(d)

    found = layer_max_logits(dirs)
    assert found["standard"] == {"runs": 2, "steps": [10, 20], "layers": {0: [3.0, 5.0], 1: [4.0, 10.0]}}
    assert found["qknorm"] == {"runs": 1, "steps": [10], "layers": {0: [1.0]}}

    result = write_report(tmp_path / "runs", tmp_path / "out", costs=False)
    [figure] = [p for p in result["plots"] if p.name.startswith("report_max_logit_")]
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Max attention logit per layer (Wortsman et al. 2023)" in result["markdown"].replace("###", "##")

    # the numbers beside the figure (issue 45): each layer at the last probed step, mean over seeds, in report.md,
    # report.html and report.json; with and without the figures
    for plots in (True, False):
        result = write_report(tmp_path / "runs", tmp_path / f"out{plots}", costs=False, plots=plots)
        data = json.loads(result["json"].read_text())
        assert data["max_logits"] == [
            {"group": "gpt_tiny / stdlib", "variant": "qknorm", "step": 10, "runs": 1, "layers": [1.0, None],
             "max": 1.0},
            {"group": "gpt_tiny / stdlib", "variant": "standard", "step": 20, "runs": 2, "layers": [5.0, 10.0],
             "max": 10.0}]
        [table] = data["tables"]["Max attention logit per layer (Wortsman et al. 2023)"]
        assert table["header"] == ["Variant", "step", "layer 0", "layer 1", "max", "runs"]
        assert table["rows"] == [["qknorm", "10", "1.00", "—", "1.00", "1"], ["standard", "20", "5.00", "10.00",
                                                                               "10.00", "2"]]
        assert "| standard | 20 | 5.00 | 10.00 | 10.00 | 2 |" in result["markdown"]
        assert ('<td class="l">standard</td><td class="r">20</td><td class="r">5.00</td><td class="r">10.00</td>'
                in result["html"])


def test_max_logits_read_as_a_table():
    from attnlab.report.write import _logit

    assert [_logit(v) for v in (1124.66, 954.53, 88.96, 5.0, 0.08123, float("nan"))] == \
        ["1,124.7", "954.5", "88.96", "5.00", "0.0812", "—"]
