"""--data-on-device (issue 11 item 2's wiring): where it is on by default, that training consumes the device
pipeline's batches, and that a resumed run sees the same images as an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
import yaml
from train_helpers import tiny, weights

from attnlab.data import build_device_pipeline
from attnlab.errors import ConfigError
from attnlab.train import train
from attnlab.train.run import Run

# the full recipe's randomness on digits: shift (its crop), Mixup/CutMix, repeated augmentation
RECIPE = dict(augment="recipe", mixup=0.8, cutmix=1.0, mixup_prob=0.5, label_smoothing=0.1, repeated_aug=3,
              data_on_device=True)


def data_on_device(cfg, device):
    run = Run(cfg)
    run.device = device  # as torchrun's rank device would be: no CUDA needed to ask the task
    return run.task.on_device()


def test_default_on_cuda_for_tensor_datasets_only():
    cfg = tiny("runs")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for name in ("cifar10", "cifar100", "digits", "synthetic"):
        assert data_on_device(cfg.replace(dataset=name), cuda)
        assert not data_on_device(cfg.replace(dataset=name), cpu)
    assert not data_on_device(cfg.replace(dataset="imagefolder"), cuda)
    assert data_on_device(cfg.replace(data_on_device=True), cpu)
    assert not data_on_device(cfg.replace(data_on_device=False), cuda)
    with pytest.raises(ConfigError, match="device pipeline holds cifar10, cifar100, digits, synthetic, not imagefolder"):
        data_on_device(cfg.replace(dataset="imagefolder", data_on_device=True), cpu)


def test_training_consumes_the_pipeline_batches(tmp_path, monkeypatch):
    import attnlab.models as models

    seen = []
    original = models.build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)
        model.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()) if m.training else None)
        return model
    monkeypatch.setattr(models, "build_model", build)
    cfg = tiny(tmp_path, epochs=1, **RECIPE)
    train(cfg)
    pipe = build_device_pipeline("digits", device="cpu", batch_size=cfg.batch_size, seed=cfg.seed,
                                 augment="recipe", repeated_aug=3, mixup=0.8, cutmix=1.0, mix_prob=0.5,
                                 switch_prob=0.5, label_smoothing=0.1)
    expected = [batch.images for batch in pipe.epoch(1)]
    assert len(seen) == len(expected) == len(pipe)
    assert all(torch.equal(a, b) for a, b in zip(seen, expected))


class Interrupt(Exception):
    pass


def test_resume_sees_the_same_images(tmp_path, on_train_forward):
    full = train(tiny(tmp_path / "full", **RECIPE))
    steps = len(build_device_pipeline("digits", device="cpu", batch_size=64, seed=0, augment="recipe",
                                      repeated_aug=3))
    on_train_forward(lambda count, out: (_ for _ in ()).throw(Interrupt) if count == steps + 5 else None)
    with pytest.raises(Interrupt):
        train(tiny(tmp_path / "cut", **RECIPE))
    resumed = train(tiny(tmp_path / "cut", resume=True, **RECIPE))
    a = weights(tmp_path / "full" / full["name"] / "checkpoint.safetensors")
    b = weights(tmp_path / "cut" / full["name"] / "checkpoint.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["test_loss"] == full["test_loss"]


def test_command_line_flags(tmp_path):
    from attnlab.cli import main

    code = main(["train", "--recipe", "demo", "--epochs", "1", "--no-progress", "--data-on-device",
                 "--runs-dir", str(tmp_path), "--name", "on"])
    assert code == 0
    assert yaml.safe_load((tmp_path / "on" / "config.yaml").read_text())["image"]["data_on_device"] is True
    code = main(["train", "--recipe", "demo", "--epochs", "1", "--no-progress", "--no-data-on-device",
                 "--runs-dir", str(tmp_path), "--name", "off"])
    assert code == 0
    assert yaml.safe_load((tmp_path / "off" / "config.yaml").read_text())["image"]["data_on_device"] is False
