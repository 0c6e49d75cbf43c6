"""A report compares the metric a run's result.json names (a video run's mean class accuracy), in its task's
direction, and shows the task's other metrics beside it; numbers worked by hand."""

from __future__ import annotations

import pytest

from attnlab.report.summary import accuracy_tables, summarize


def _run(attn, seed, mca, top1):
    return {"name": f"{attn}-{seed}", "model": "timesformer_base", "dataset": "video", "tag": "smarthome_cs",
            "setting": "", "attn": attn, "seed": seed, "task": "video", "metric": "mean_class_accuracy",
            "mean_class_accuracy": mca, "top1": top1, "top5": 99.0, "test_loss": 1.0}


def test_video_rows_compare_mean_class_accuracy():
    runs = [_run("standard", 0, 60.0, 80.0), _run("standard", 1, 62.0, 70.0),
            _run("dna", 0, 61.0, 75.0), _run("dna", 1, 65.0, 72.0)]
    base, dna = summarize(runs)
    assert base["mean"] == 61.0 and dna["mean"] == 63.0 and dna["gain_pp"] == pytest.approx(2.0)
    assert dna["wins"] == "2/2"  # by mean class accuracy; by top-1 it would be 1/2
    assert dna["columns"]["top1"]["mean"] == pytest.approx(73.5)
    [table] = accuracy_tables([base, dna])
    assert table.header[:2] == ["Variant", "Mean class accuracy (mean ± SD)"] and "Top-1 (mean ± SD)" in table.header
