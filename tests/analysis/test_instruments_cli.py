"""Instruments during training (probe_every) and after it (attnlab analyze, compare's report columns)."""

import dataclasses
import json
import math

import pytest

from attnlab.analysis import training_probe
from attnlab.cli import main
from attnlab.train import RECIPES, train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    cfg = dataclasses.replace(RECIPES["demo"], epochs=1, probe_every=5, probe_images=32, runs_dir=str(runs),
                              progress=False)
    result = train(cfg, probe=training_probe)
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


def test_load_run_returns_the_model_on_the_requested_device(run_dir):
    import torch

    from attnlab.train import load_run

    on_cpu, cfg = load_run(run_dir)
    on_meta, _ = load_run(run_dir, map_location="meta")  # a device other than the CPU that this machine has
    tensors = dict(on_meta.named_parameters()) | dict(on_meta.named_buffers())
    assert tensors and {t.device.type for t in tensors.values()} == {"meta"}
    assert not on_meta.training and cfg.attn == "standard"
    reference = dict(on_cpu.named_parameters()) | dict(on_cpu.named_buffers())
    assert {name: t.shape for name, t in tensors.items()} == {name: t.shape for name, t in reference.items()}
    again, _ = load_run(run_dir, map_location=torch.device("cpu"))
    for name, t in (dict(again.named_parameters()) | dict(again.named_buffers())).items():
        assert torch.equal(t, reference[name]), name


def test_analyze_device_flag(run_dir, monkeypatch, capsys):
    import torch

    import attnlab.train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["analyze", str(run_dir), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0] and "--device cpu" in err[0]

    # with CUDA present, the run is loaded onto the device asked for (the spy stops the analysis there)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    asked = []

    def spy(run, map_location="cpu"):
        asked.append(torch.device(map_location))
        raise attnlab.AttnlabError("stop here")

    monkeypatch.setattr(attnlab.train, "load_run", spy)
    assert main(["analyze", str(run_dir), "--device", "cuda:1"]) == 2
    assert asked == [torch.device("cuda:1")]
    assert main(["analyze", str(run_dir), "--device", "cuda:2"]) == 2
    assert "2 CUDA device(s); use cuda:0 to cuda:1" in capsys.readouterr().err
    assert asked == [torch.device("cuda:1")]
