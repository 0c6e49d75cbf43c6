"""The command line on a detection run: eval prints its COCO AP, analyze draws its predictions and measures its
backbone, and flags that only classification takes are one line."""

from __future__ import annotations

import json

import pytest
from cli_runner import in_process

pytest.importorskip("pycocotools")

SMALL = {"train_images": 8, "val_images": 3, "image_size": 64, "min_size": 8, "max_size": 24}


def _cli(*args):
    return in_process(list(args))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from attnlab.train import make_config
    from attnlab.train.loop import train

    root = tmp_path_factory.mktemp("detect")
    result = train(make_config("detect_demo", data_dir=str(root / "data"), runs_dir=str(root / "runs"), epochs=1,
                               batch_size=4, warmup_steps=1, progress=False, data_options=SMALL))
    return root / "runs" / result["name"], result


@pytest.mark.slow
def test_eval_prints_the_runs_coco_ap(run_dir):
    path, result = run_dir
    out = _cli("eval", path)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout.strip().splitlines()[-1])
    assert printed["task"] == "detect"
    assert {k: printed[k] for k in ("box_AP", "mask_AP", "box_APl")} == \
           {k: result[k] for k in ("box_AP", "mask_AP", "box_APl")}
    bad = _cli("eval", path, "--noise", "0.5")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--noise" in bad.stderr


@pytest.mark.slow
def test_analyze_draws_predictions_and_measures_the_backbone(run_dir, tmp_path):
    path, _ = run_dir
    out = _cli("analyze", path, "--what", "predictions,spectra,relevance", "--images", "2", "--out", tmp_path)
    assert out.returncode == 0, out.stderr
    panels = sorted(p.name for p in tmp_path.glob("predictions_*.png"))
    assert panels == ["predictions_000001.png", "predictions_000002.png", "predictions_000003.png"]
    analysis = json.loads((tmp_path / "analysis.json").read_text())
    [(label, entry)] = analysis.items()
    assert "p1" in entry["summary"] and len(entry["spectra"]["blocks"]) == 4  # the detector's four blocks
    assert "relevance does not apply" in out.stderr  # it explains a classifier's logits


@pytest.mark.slow
@pytest.mark.parametrize("flags, words", [
    (["--model", "vit_cifar"], "timm ViT/DeiT or Swin"),
    (["--data-options", '{min_size: 80, image_size: 64}'], "min_size"),
    (["--model-options", "{heads: big}"], "heads"),
])
def test_train_refuses_what_detection_cannot_take_in_one_line(tmp_path, flags, words):
    out = _cli("train", "--recipe", "detect_demo", "--data-dir", tmp_path / "data", "--runs-dir", tmp_path / "runs",
               "--no-progress", *flags)
    assert out.returncode == 2 and words in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()
