"""Training curves: aggregation against the reference, one line per variant, untrusted metrics.jsonl."""

import json

import pytest

from attnlab.analysis import plot_training_curves, read_metrics, training_curves
from attnlab.cli import main
from attnlab.errors import ConfigError
from tests import reference_instruments as ref


def _run(root, attn, seed, rows):
    run = root / f"vit_digits-digits-{attn}-s{seed}"
    run.mkdir()
    (run / "config.yaml").write_text(f"model: vit_digits\ndataset: digits\nattn: {attn}\nseed: {seed}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _rows(offset, epochs=3):
    return [{"epoch": e, "train_loss": 2.0 - 0.3 * e + offset, "test_loss": 2.1 - 0.2 * e + offset,
             "top1": 30.0 + 10 * e - offset, "lr": 0.001} for e in range(1, epochs + 1)]


def test_mean_and_band_over_seeds(tmp_path):
    runs = [_run(tmp_path, "standard", s, _rows(0.1 * s)) for s in range(3)]
    runs += [_run(tmp_path, "ns", 0, _rows(0.5)), _run(tmp_path, "ns", 1, _rows(0.2, epochs=2))]
    curves = training_curves(runs)
    assert set(curves) == {"standard", "ns"} and curves["ns"]["runs"] == 2
    for variant, seeds in (("standard", (0, 1, 2)), ("ns", None)):
        histories = [read_metrics(r / "metrics.jsonl") for r in runs if f"-{variant}-" in r.name]
        for metric in ("train_loss", "test_loss", "top1"):
            epochs, want = ref.curves(histories, metric)
            got = curves[variant][metric]
            assert curves[variant]["epochs"] == epochs
            for k, (mean, low, high) in enumerate(want):
                assert got["mean"][k] == pytest.approx(mean) and got["low"][k] == pytest.approx(low)
                assert got["high"][k] == pytest.approx(high)
    assert curves["ns"]["top1"]["n"] == [2, 2, 1]  # epoch 3 only in the longer run: no band there
    assert curves["ns"]["top1"]["low"][2] == curves["ns"]["top1"]["high"][2]


def test_figure_is_small_multiples_beside_the_baseline(tmp_path):
    """One row per variant (train loss, test loss, top-1), each panel the variant's mean line beside the
    baseline's in grey; one colour per variant, none of them grey; whole epochs on the x axis."""
    from matplotlib.colors import to_hex

    runs = [_run(tmp_path, a, s, _rows(0.1 * s)) for a in ("standard", "ns", "dna") for s in range(2)]
    fig = plot_training_curves(training_curves(runs), tmp_path / "curves.png")
    assert len(fig.axes) == 6  # rows ns and dna (sorted as found), 3 panels each
    rows = [fig.axes[:3], fig.axes[3:]]
    assert [r[0].get_ylabel() for r in rows] == ["ns", "dna"]
    seen = {}
    for row, variant in zip(rows, ("ns", "dna")):
        for ax in row:
            baseline, line = ax.get_lines()  # one mean line each (bands are filled areas)
            assert to_hex(baseline.get_color()) == "#808080" and baseline.get_linestyle() == "--"
            seen.setdefault(variant, set()).add(to_hex(line.get_color()))
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert all(len(c) == 1 for c in seen.values()) and seen["ns"] != seen["dna"]
    assert "#808080" not in seen["ns"] | seen["dna"]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("text", ["not json\n", "[1, 2]\n", '{"epoch": 1, "train_loss": "x", "test_loss": 1, '
                                  '"top1": 2}\n', '{"epoch": true, "train_loss": 1, "test_loss": 1, "top1": 2}\n',
                                  "[" * 100000 + "\n"])
def test_malformed_metrics_is_one_line_naming_the_file(tmp_path, text, capsys):
    run = _run(tmp_path, "standard", 0, _rows(0))
    (run / "metrics.jsonl").write_text(json.dumps(_rows(0)[0]) + "\n" + text)
    with pytest.raises(ConfigError, match="metrics.jsonl line 2"):
        training_curves([run])
    assert main(["analyze", str(run), "--what", "curves", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run / "metrics.jsonl") in err[0]
