"""Instruments during training (probe_every) and after it (attnlab analyze, compare's report columns)."""

import json
import math

import pytest
import torch

import attnlab
from attnlab.analysis import first_images, head_output_spectra, jacobian_conditioning, training_probe
from attnlab.cli import main
from attnlab.data import build_dataset
from attnlab.train import RECIPES, load_run, train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    cfg = RECIPES["demo"].replace(epochs=1, probe_every=5, probe_images=32, runs_dir=str(runs),
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
    # the run's model on the first 160 digits test images, in batches of 32: the library's numbers again
    model, _ = load_run(run_dir)
    want = head_output_spectra(model, first_images(build_dataset("digits", False)), batch_size=32).summary()
    assert data["summary"]["p1"] == pytest.approx(want["p1"], rel=1e-6)
    assert data["summary"]["eff_rank"] == pytest.approx(want["eff_rank"], rel=1e-6)
    assert data["summary"]["max_logit"] == max(max(layer["max_logit"]) for layer in data["entropy"])
    assert (tmp_path / "spectra.png").stat().st_size > 1000
    assert main(["analyze", str(run_dir), "--what", "nope"]) == 2
    assert "choose from" in capsys.readouterr().err


def test_analyze_fresh_model_branches_and_jacobian(tmp_path, capsys):
    assert main(["analyze", "--model", "vit_digits", "--attn", "dna", "--what", "branches",
                 "--images", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "analysis.json").read_text())["vit_digits-dna"]
    hist = data["branches"]["intruders_hist"]  # counts of 0..k intruders, k = 10 directions per branch
    assert len(hist) == 11 and sum(hist) == 4 * 3 * 2  # 4 images x 3 heads x 2 blocks (vit_digits)
    assert data["summary"]["intruders_mean"] == pytest.approx(sum(i * n for i, n in enumerate(hist)) / sum(hist))
    assert main(["analyze", "--model", "vit_digits", "--what", "jacobian", "--images", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "analysis.json").read_text())["vit_digits-standard"]
    jac = data["jacobian"]
    # the fresh model is build_model under --seed (0), fed the first digits test image: block 0, head 0 again here
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", num_classes=10)
    image = build_dataset("digits", False)[0][0][None]
    kappa = jacobian_conditioning(model, image, blocks=[0], heads=[0]).kappa[0, 0, 0].item()
    assert jac["kappa"][0][0][0] == pytest.approx(kappa, rel=1e-9)
    per_block = [sum(math.log10(k[0]) for k in heads) / len(heads) for heads in jac["kappa"]]  # mean over heads
    assert jac["log10_kappa_per_block"] == pytest.approx(per_block, rel=1e-9) and len(per_block) == 2
    assert data["summary"]["log10_kappa"] == pytest.approx(sum(per_block) / 2, rel=1e-9)
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
    from attnlab.train.run import Run

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

    monkeypatch.setattr(Run, "load_model", spy)  # what load_run and analyze call
    assert main(["analyze", str(run_dir), "--device", "cuda:1"]) == 2
    assert asked == [torch.device("cuda:1")]
    assert main(["analyze", str(run_dir), "--device", "cuda:2"]) == 2
    assert "2 CUDA device(s); use cuda:0 to cuda:1" in capsys.readouterr().err
    assert asked == [torch.device("cuda:1")]
