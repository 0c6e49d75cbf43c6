"""Instruments during training (probe_every) and after it (attnlab analyze, compare's report columns)."""

import dataclasses
import json
import math

import pytest

from attnlab.cli import main
from attnlab.train import RECIPES, train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    cfg = dataclasses.replace(RECIPES["demo"], epochs=1, probe_every=5, probe_images=32, runs_dir=str(runs),
                              progress=False)
    result = train(cfg)
    return runs / result["name"]


def test_probe_logs_entropy_every_n_steps(run_dir):
    line = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    steps = [p["step"] for p in line["probes"]]
    assert steps == list(range(5, 22 + 1, 5))  # 1437 // 64 = 22 steps in the epoch
    for probe in line["probes"]:
        # 16 tokens per image: entropy lies between 0 (one-hot) and log 16 (uniform)
        assert 0 < probe["entropy/min_head"] <= probe["entropy/mean"] <= math.log(16) + 1e-9
        assert probe["max_logit/max"] >= probe["max_logit/mean"] > 0 and probe["qk_spectral_norm/max"] > 0


def test_analyze_cli_writes_json_and_plot(run_dir, tmp_path, capsys):
    assert main(["analyze", str(run_dir), "--what", "spectra,entropy,qk", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "analysis.json").read_text())[run_dir.name]
    assert data["attn"] == "standard"
    assert set(data["summary"]) >= {"p1", "eff_rank", "entropy", "max_logit", "qk_norm_max"}
    assert 1 / 16 <= data["summary"]["p1"] <= 1 and 1 <= data["summary"]["eff_rank"] <= 16
    assert (tmp_path / "spectra.png").stat().st_size > 1000
    assert main(["analyze", str(run_dir), "--what", "nope"]) == 2
    assert "choose from" in capsys.readouterr().err


def test_analyze_fresh_model_branches_and_jacobian(tmp_path, capsys):
    assert main(["analyze", "--model", "vit_digits", "--attn", "dna", "--what", "branches",
                 "--images", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "analysis.json").read_text())["vit_digits-dna"]
    assert 0 <= data["summary"]["intruders_mean"] <= 10  # k = 10 directions per branch
    assert main(["analyze", "--model", "vit_digits", "--what", "jacobian", "--images", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "analysis.json").read_text())["vit_digits-standard"]
    assert data["summary"]["log10_kappa"] >= 0  # a condition number is at least 1
    assert len(data["jacobian"]["log10_kappa_per_block"]) == 2
    # the Jacobian instrument is defined for softmax kernels: a DnA model is refused in one line
    assert main(["analyze", "--model", "vit_digits", "--attn", "dna", "--what", "jacobian", "--images", "1",
                 "--out", str(tmp_path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
