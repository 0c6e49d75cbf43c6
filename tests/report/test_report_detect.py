"""The report's detection table: box AP as the headline (mean, sample SD, gain, matched-seed wins), mask AP, AP50
and AP75 beside it, in Markdown, JSON and HTML, from result.json files written by hand."""

from __future__ import annotations

import json
import statistics

import pytest

from attnlab.report.summary import format_markdown, summarize
from attnlab.report.write import write_report

# box AP, mask AP, box AP50 per (variant, seed): the DnA paper's Table 9 numbers, perturbed per seed
RUNS = {("standard", 0): (26.2, 22.7, 42.4), ("standard", 1): (26.0, 22.5, 42.0),
        ("dna", 0): (26.5, 22.8, 43.0), ("dna", 1): (25.9, 22.9, 42.6)}


def _write(root):
    for (attn, seed), (box, mask, box50) in RUNS.items():
        run = root / f"vitdet_base_224-coco-{attn}-s{seed}"
        run.mkdir(parents=True)
        result = {"name": run.name, "task": "detect", "model": "vitdet_base_224", "dataset": "coco", "tag": "",
                  "attn": attn, "seed": seed, "epochs": 50, "box_AP": box, "box_AP50": box50, "box_AP75": 27.0,
                  "box_APs": 10.0, "box_APm": 30.0, "box_APl": None, "mask_AP": mask, "mask_AP50": 39.0,
                  "mask_AP75": 22.9, "metric": "box_AP", "params": 110_806_709, "seconds": 1.0, "extra": {}}
        (run / "result.json").write_text(json.dumps(result))


def test_detection_rows_by_hand(tmp_path):
    from attnlab.report.summary import scan_runs

    _write(tmp_path)
    runs, unreadable = scan_runs(tmp_path)
    assert not unreadable
    rows = {r["variant"]: r for r in summarize(runs)}
    std, dna = rows["standard"], rows["dna"]
    assert std["metric"] == "box_AP" and std["baseline"]
    assert std["mean"] == pytest.approx(26.1) and std["sd"] == pytest.approx(statistics.stdev([26.2, 26.0]))
    assert dna["gain_pp"] == pytest.approx(26.2 - 26.1)
    assert dna["wins"] == "1/2"  # seed 0: 26.5 > 26.2; seed 1: 25.9 < 26.0
    assert dna["columns"]["mask_AP"]["mean"] == pytest.approx(22.85)
    assert dna["columns"]["mask_AP"]["gain_pp"] == pytest.approx(22.85 - 22.6)
    assert dna["columns"]["box_AP50"]["sd"] == pytest.approx(statistics.stdev([43.0, 42.6]))
    assert std["columns"]["mask_AP"]["gain_pp"] is None
    md = format_markdown(list(rows.values()))
    header = next(line for line in md.splitlines() if line.startswith("| Variant"))
    assert header.startswith("| Variant | box AP (mean ± SD) | Gain (pp) | Wins | n | mask AP (mean ± SD) |")
    assert "| dna | 26.20 ± 0.42 | +0.10 | 1/2 | 2 | 22.85 ± 0.07 | +0.25 |" in md


def test_markdown_json_and_html(tmp_path):
    _write(tmp_path / "runs")
    result = write_report(tmp_path / "runs", tmp_path / "out")
    assert "| standard (baseline) | 26.10 ± 0.14 |" in result["markdown"]
    assert "Final-epoch box AP (%)" in result["markdown"]
    data = json.loads(result["json"].read_text())
    row = next(r for r in data["rows"] if r["variant"] == "dna")
    assert row["metric"] == "box_AP" and row["columns"]["mask_AP"]["mean"] == pytest.approx(22.85)
    html = result["html"].read_text() if hasattr(result["html"], "read_text") else result["html"]
    assert "box AP (mean ± SD)" in html and "26.20 ± 0.42" in html
