"""write_report reads only the run files written here and reproduces report.md / report.json."""

import json

import pytest

from attnlab.report import write_report


def make_runs(root):
    # swin_cifar / cifar100: standard 77.30 77.40 77.50 (mean 77.40, SD 0.10); ns 78.10 78.20 78.60
    # (mean 78.30, deviations -.2 -.1 .3, SD = sqrt(0.14 / 2) = 0.2646); gain +0.90; wins 3/3.
    values = {"standard": [77.30, 77.40, 77.50], "ns": [78.10, 78.20, 78.60]}
    for attn, tops in values.items():
        for seed, top1 in zip([0, 1, 3], tops):
            d = root / f"swin_cifar-cifar100-{attn}-s{seed}"
            d.mkdir(parents=True)
            (d / "config.yaml").write_text(f"model: swin_cifar\ndataset: cifar100\nattn: {attn}\nseed: {seed}\n")
            (d / "metrics.jsonl").write_text("".join(json.dumps(
                {"epoch": e, "train_loss": 4.0 - e, "test_loss": 3.5 - e, "top1": top1 - 2 + e}) + "\n" for e in (0, 1, 2)))
            (d / "result.json").write_text(json.dumps({
                "name": d.name, "model": "swin_cifar", "dataset": "cifar100", "attn": attn, "seed": seed,
                "epochs": 100, "top1": top1, "top5": 95.0, "test_loss": 1.0, "params": 7_000_000,
                "seconds": 3600.0, "extra": {"p1": 0.6 if attn == "ns" else 0.8}}))
    # A run still training: listed as unfinished, not summarised.
    d = root / "swin_cifar-cifar100-ns-s7"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "train_loss": 4.0, "test_loss": 4.0, "top1": 10.0}) + "\n")


def test_write_report_from_files(tmp_path):
    runs = tmp_path / "runs"
    make_runs(runs)
    out = tmp_path / "out"
    result = write_report(runs, out)

    md = (out / "report.md").read_text()
    assert md == result["markdown"]
    assert "### swin_cifar / cifar100" in md
    assert "| standard (baseline) | 77.40 ± 0.10 | — | — | 3 | 0.80 |" in md
    assert "| ns | 78.30 ± 0.26 | +0.90 | 3/3 | 3 | 0.60 |" in md
    assert "swin_cifar-cifar100-ns-s7" in md  # unfinished run is named

    assert result["json"] == out / "report.json"
    data = json.loads((out / "report.json").read_text())
    assert data["baseline"] == "standard"
    assert data["unfinished"] == ["swin_cifar-cifar100-ns-s7"]
    rows = {r["variant"]: r for r in data["rows"]}
    assert rows["ns"]["mean"] == pytest.approx(78.30, abs=1e-9)
    assert rows["ns"]["sd"] == pytest.approx((0.14 / 2) ** 0.5, abs=1e-9)
    assert rows["ns"]["gain_pp"] == pytest.approx(0.90, abs=1e-9)
    assert rows["ns"]["seeds"] == [0, 1, 3]
    assert rows["ns"]["wins"] == "3/3"

    assert [p.name for p in result["plots"]] == ["report_swin_cifar_cifar100.png",
                                                 "report_curves_swin_cifar_cifar100.png"]
    for path in result["plots"]:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({path.name})" in md  # linked relative to report.md
    assert result["html_path"] == out / "report.html" and result["html_path"].read_text() == result["html"]

    # Same files in, same report out (no dates or absolute paths), also when written next to the runs.
    again = write_report(runs, tmp_path / "out2")
    for name in ("report.md", "report.json", "report.html"):
        assert (tmp_path / "out2" / name).read_text() == (out / name).read_text()
    no_plots = write_report(runs, tmp_path / "out3", plots=False)
    assert no_plots["plots"] == [] and "## Figures" not in no_plots["markdown"]
    in_place = write_report(runs, plots=False)
    assert in_place["json"] == runs / "report.json"
    assert (runs / "report.md").read_text() == no_plots["markdown"]


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"name": "x"}', ""])
def test_a_corrupt_run_is_listed_and_the_others_reported(tmp_path, damage):
    runs = tmp_path / "runs"
    make_runs(runs)
    clean = write_report(runs, tmp_path / "clean", plots=False)
    bad = runs / "swin_cifar-cifar100-ns-s9"
    bad.mkdir()
    (bad / "result.json").write_text(damage)

    result = write_report(runs, tmp_path / "out", plots=False)
    assert result["rows"] == clean["rows"]  # the six good runs, as without the bad one
    md = result["markdown"]
    after = "## Accuracy"  # the header above counts the unreadable run; the sections of the good runs are as before
    assert md[md.index(after):].startswith(clean["markdown"][clean["markdown"].index(after):])
    assert "1 unreadable, not included" in md[:md.index(after)]
    assert "Unreadable runs, not included:" in md and "- swin_cifar-cifar100-ns-s9: result.json " in md
    assert str(tmp_path) not in md  # relative names only, as everywhere in the report
    data = json.loads(result["json"].read_text())
    assert [u["run_dir"] for u in data["unreadable"]] == ["swin_cifar-cifar100-ns-s9"]

    from attnlab.cli import main  # the command prints the report, exit code 0

    assert main(["report", str(runs), "--no-plots", "--out", str(tmp_path / "cli")]) == 0


def test_only_corrupt_runs_is_one_clear_error(tmp_path):
    from attnlab.errors import AttnlabError

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "result.json").write_text("{not json")
    with pytest.raises(AttnlabError, match="no run under .* has a readable result.json"):
        write_report(tmp_path, plots=False)
