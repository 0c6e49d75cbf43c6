"""The training loop on digits: it learns, it is deterministic, it logs, it resumes, it stops at NaN."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from train_helpers import STEPS_PER_EPOCH_64, tiny, weights

from attnlab.errors import ConfigError, NonFiniteLossError
from attnlab.train import RECIPES, load_config, train


def test_demo_recipe_learns_digits(tmp_path):
    # the demo run itself (about 95%; a model that does not learn sits at 10%)
    cfg = RECIPES["demo"].replace(runs_dir=str(tmp_path), progress=False)
    result = train(cfg)
    assert result["top1"] >= 90.0
    run = tmp_path / result["name"]
    assert result["name"] == "vit_digits-digits-standard-s0"
    assert json.loads((run / "result.json").read_text()) == result
    assert set(result) == {"name", "model", "dataset", "tag", "attn", "seed", "epochs", "top1", "top5", "test_loss",
                           "params", "seconds", "extra", "world_size", "task", "metric", "finished", "machine",
                           "attnlab_version"}
    assert result["task"] == "image" and result["metric"] == "top1"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == list(range(1, cfg.epochs + 1))
    for key in ("train_loss", "test_loss", "top1", "top5", "lr", "epoch_seconds", "img_per_s"):
        assert all(isinstance(m[key], float) for m in lines), key
    assert lines[-1]["top1"] == result["top1"] and lines[-1]["top5"] >= lines[-1]["top1"]
    assert lines[-1]["train_loss"] < lines[0]["train_loss"]
    # config.yaml reruns the same thing, its data directory stored absolute (docs/training.md)
    again = load_config(run / "config.yaml")
    assert again == cfg.replace(name=result["name"], data_dir=str(Path(cfg.run.data_dir).resolve()))
    state = torch.load(run / "trainer_state.pt", weights_only=True)
    assert state["epoch"] == cfg.epochs


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    a = train(tiny(tmp_path / "a", epochs=1))
    b = train(tiny(tmp_path / "b", epochs=1))
    c = train(tiny(tmp_path / "c", epochs=1, seed=1))
    wa, wb, wc = (weights(tmp_path / d / r["name"] / "checkpoint.safetensors")
                  for d, r in (("a", a), ("b", b), ("c", c)))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


class Interrupt(Exception):
    pass


def test_resume_after_interrupt_equals_uninterrupted(tmp_path, on_train_forward):
    # the full recipe's randomness: augmentation, Mixup/CutMix (numpy), repeated augmentation, drop-path
    extra = dict(augment="recipe", mixup=0.8, cutmix=1.0, mixup_prob=0.5, label_smoothing=0.1, repeated_aug=3,
                 drop_path=0.1)
    full = train(tiny(tmp_path / "full", **extra))
    # timm's RepeatAugSampler keeps 1437 // 256 * 256 = 1280 images per epoch: 20 batches of 64
    stop_at = 20 + 5  # epoch 2, step 5

    def interrupt(count, output):
        if count == stop_at:
            raise Interrupt
    on_train_forward(interrupt)
    with pytest.raises(Interrupt):
        train(tiny(tmp_path / "cut", **extra))
    run = tmp_path / "cut" / full["name"]
    assert torch.load(run / "trainer_state.pt", weights_only=True)["epoch"] == 1
    with pytest.raises(ConfigError, match="--resume"):
        train(tiny(tmp_path / "cut", **extra))
    resumed = train(tiny(tmp_path / "cut", resume=True, **extra))
    w_full = weights(tmp_path / "full" / full["name"] / "checkpoint.safetensors")
    w_cut = weights(run / "checkpoint.safetensors")
    assert all(torch.equal(w_full[k], w_cut[k]) for k in w_full)
    assert resumed["top1"] == full["top1"] and resumed["test_loss"] == full["test_loss"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    # a finished run resumed again returns its result without training
    assert train(tiny(tmp_path / "cut", resume=True, **extra)) == resumed
    with pytest.raises(ConfigError, match="differs in epochs"):
        train(tiny(tmp_path / "cut", resume=True, epochs=3, **extra))


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, on_train_forward, capsys):
    bad = STEPS_PER_EPOCH_64 + 3  # epoch 2, step 3
    on_train_forward(lambda count, out: out * float("nan") if count == bad else None)
    cfg = tiny(tmp_path)
    with pytest.raises(NonFiniteLossError) as info:
        train(cfg)
    msg = str(info.value)
    assert "epoch 2 step 3" in msg and "nan" in msg
    run = tmp_path / "vit_digits-digits-standard-s0"
    state = torch.load(run / "trainer_state.pt", weights_only=True)
    assert state["epoch"] == 1 and not (run / "result.json").exists()
    w = weights(run / "checkpoint.safetensors")
    assert all(torch.isfinite(t).all() for t in w.values())
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1

    # the command line: one stderr line, non-zero exit
    from attnlab.cli import main

    on_train_forward(lambda count, out: out * float("inf") if count == 3 else None)
    code = main(["train", "--recipe", "demo", "--epochs", "1", "--batch-size", "64", "--no-progress",
                 "--runs-dir", str(tmp_path / "cli")])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1 and "epoch 1 step 3" in err


def test_config_yaml_holds_everything(tmp_path):
    cfg = tiny(tmp_path, epochs=1, attn=" standard ")
    result = train(cfg)
    saved = yaml.safe_load((tmp_path / result["name"] / "config.yaml").read_text())
    assert saved["attn"] == "standard" and saved["run"]["resume"] is False
    sections = {"optim", "sched", "run", "image"}  # the common sections and the run's family's, nothing else
    assert set(saved) == {f.name for f in dataclasses.fields(cfg)} - {"families"} | {"image"}
    nested = {k for k, v in saved.items() if isinstance(v, dict) and k not in ("model_options", "data_options")}
    assert nested == sections
