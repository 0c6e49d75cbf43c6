"""The detect task through the one trainer: COCO AP in metrics and result.json, exact resume after a kill, DDP, the
error contract, and a short run on the synthetic shapes set that learns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import forked
import pytest
import torch
from train_helpers import arm_kill, weights

pytest.importorskip("pycocotools")

from attnlab.errors import ConfigError, DatasetError, UnsupportedModelError  # noqa: E402
from attnlab.train import make_config  # noqa: E402
from attnlab.train.loop import check_run, train  # noqa: E402

SMALL = {"train_images": 16, "val_images": 4, "image_size": 64, "min_size": 8, "max_size": 24}


def _cfg(tmp_path, **overrides):
    base = dict(data_dir=str(tmp_path / "data"), runs_dir=str(tmp_path / "runs"), epochs=2, batch_size=4,
                progress=False, data_options=dict(SMALL), warmup_steps=2)
    base.update(overrides)
    return make_config("detect_demo", **base)


@pytest.mark.slow
def test_a_run_writes_coco_ap_to_metrics_and_result(tmp_path):
    result = train(_cfg(tmp_path, epochs=1))
    assert result["task"] == "detect" and result["metric"] == "box_AP"
    keys = list(result)
    assert keys.index("box_AP") < keys.index("mask_AP")
    for key in ("box_AP", "box_AP50", "box_AP75", "mask_AP", "mask_AP50", "mask_AP75", "box_APs"):
        assert 0.0 <= result[key] <= 100.0
    assert result["box_APl"] is None  # no large object on 64-pixel images: pycocotools' -1, written as null
    [line] = [json.loads(x) for x in (tmp_path / "runs" / result["name"] / "metrics.jsonl").read_text().splitlines()]
    assert line["box_AP"] == result["box_AP"] and line["train_loss_mask"] > 0 and line["img_per_s"] > 0


@pytest.mark.slow
def test_boxes_only_trains_faster_rcnn(tmp_path):
    result = train(_cfg(tmp_path, epochs=1, data_options={**SMALL, "masks": False, "train_images": 8}))
    assert "box_AP" in result and "mask_AP" not in result


@pytest.mark.parametrize("overrides, error, words", [
    (dict(model="vit_cifar"), UnsupportedModelError, "timm ViT/DeiT or Swin"),
    (dict(model="xcit_nano_12_p16_224"), UnsupportedModelError, "detect task takes"),
    (dict(batch_size=32), ConfigError, "batch_size 32"),
    (dict(model_options={"masks": True}, data_options={**SMALL, "masks": False}), ConfigError, "masks"),
    (dict(data_options={**SMALL, "min_size": 80}), DatasetError, "min_size"),
])
def test_what_the_task_cannot_take_is_one_line_before_training(tmp_path, overrides, error, words):
    with pytest.raises(error) as err:
        check_run(_cfg(tmp_path, **overrides))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "runs").exists()


def test_coco_files_are_checked_before_training(tmp_path):
    from attnlab.data.shapes import ShapesOptions, generate_shapes

    root = generate_shapes(tmp_path / "coco", ShapesOptions(train_images=8, val_images=2, image_size=64, min_size=8,
                                                            max_size=24))
    for split in ("train", "val"):  # COCO 2017's layout
        (root / split).rename(root / f"{split}2017")
        (root / "annotations" / f"instances_{split}.json").rename(root / "annotations" / f"instances_{split}2017.json")
    cfg = _cfg(tmp_path, dataset="coco", data_dir=str(root), data_options={"image_size": 64})
    assert check_run(cfg)["action"] == "train"
    (root / "val2017" / "000001.png").unlink()
    with pytest.raises(DatasetError, match="missing from"):
        check_run(cfg)
    with pytest.raises(DatasetError, match="missing from"):
        train(cfg)
    assert not (tmp_path / "runs").exists()


# ---- exact resume after SIGKILL --------------------------------------------------------------------------------
# argv: data_dir, runs_dir, kill_at (training forward count at which the process SIGKILLs itself; 0: never). Two
# DataLoader workers run the large-scale jitter; drop-path and torchvision's samplers draw from torch's RNG.
SCRIPT = arm_kill("build_detector") + textwrap.dedent("""
    data_dir, runs_dir = sys.argv[1], sys.argv[2]
    cfg = make_config("detect_demo", data_dir=data_dir, runs_dir=runs_dir, epochs=2, batch_size=4, warmup_steps=2,
                      drop_path=0.1, num_workers=2, progress=False, resume=True,
                      data_options={"train_images": 16, "val_images": 4, "image_size": 64, "min_size": 8,
                                    "max_size": 24})
    print(json.dumps(train(cfg)))
""")


def _run(data_dir, runs_dir, kill_at: int) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-c", SCRIPT, str(data_dir), str(runs_dir), str(kill_at)],
                      capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_gives_identical_weights(tmp_path):
    data = tmp_path / "data"
    whole = _run(data, tmp_path / "whole", 0)
    assert whole.returncode == 0, whole.stderr
    result = json.loads(whole.stdout.strip().splitlines()[-1])
    name = result["name"]

    killed = _run(data, tmp_path / "cut", 4 + 2)  # epoch 2 (4 steps an epoch), step 2
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = tmp_path / "cut" / name
    assert not (run / "result.json").exists()
    assert torch.load(run / "trainer_state.pt", weights_only=True)["epoch"] == 1

    resumed = _run(data, tmp_path / "cut", 0)
    assert resumed.returncode == 0, resumed.stderr
    again = json.loads(resumed.stdout.strip().splitlines()[-1])
    w_whole, w_cut = weights(tmp_path / "whole" / name / "checkpoint.safetensors"), weights(run / "checkpoint.safetensors")
    assert w_whole.keys() == w_cut.keys()
    assert all(torch.equal(w_whole[k], w_cut[k]) for k in w_whole)
    assert {k: again[k] for k in ("box_AP", "mask_AP")} == {k: result[k] for k in ("box_AP", "mask_AP")}
    lines = lambda d: [json.loads(x) for x in (d / name / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    drop = ("epoch_seconds", "img_per_s")
    assert [{k: v for k, v in m.items() if k not in drop} for m in lines(tmp_path / "cut")] == \
           [{k: v for k, v in m.items() if k not in drop} for m in lines(tmp_path / "whole")]


# ---- DDP -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_train_a_detector(tmp_path):
    from test_train_ddp import _torchrun

    args = ["train", "--recipe", "detect_demo", "--epochs", "1", "--batch-size", "4", "--warmup-steps", "1",
            "--no-progress", "--threads", "1", "--data-dir", str(tmp_path / "data"), "--runs-dir",
            str(tmp_path / "runs"), "--data-options", json.dumps(SMALL)]
    two = _torchrun(args)
    assert two.returncode == 0, two.stderr
    [run] = (tmp_path / "runs").iterdir()
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2 and result["box_AP"] is not None
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


# ---- it learns -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_short_run_on_shapes_learns(tmp_path):
    from attnlab.data import build_dataset
    from attnlab.data.coco_eval import evaluate_detector
    from attnlab.models import build_detector

    # 100 steps of 4 images at 96 px, shapes of 16 to 40 px (three at most): box AP50 about 25 against 0 untrained
    options = {"train_images": 100, "val_images": 16, "seed": 1, "image_size": 96, "min_size": 16, "max_size": 40,
               "max_objects": 3}
    cfg = _cfg(tmp_path, epochs=4, batch_size=4, lr=1e-3, warmup_steps=10, data_options=options)
    torch.manual_seed(cfg.seed)
    untrained = evaluate_detector(build_detector("vitdet_tiny", img_size=96), build_dataset(
        "shapes", False, data_dir=cfg.run.data_dir, **options))["box_AP50"]
    result = train(cfg)
    assert result["box_AP50"] > untrained + 10, (untrained, result["box_AP50"])
