"""Where the time goes in a language-model run: tokens per second over all ranks, the model FLOP/s they take
(PaLM's count, 6N + 12 L T d_attn) and the MFU against the device's peak, in the epoch record and result.json."""

from __future__ import annotations

import types

import pytest
import torch

from attnlab.train.config import make_config
from attnlab.train.run import Run


def _task(**overrides):
    run = Run(make_config("lm_demo_llama", **overrides))
    model = run.task.build_model()
    return run, model


def test_the_record_has_tokens_per_second_and_model_flops():
    run, model = _task()
    cfg = model.blocks[0].attn
    T, L, d = 64, len(model.blocks), model.embed_dim
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = 0 if any(m is getattr(model, "lm_head", None) for m in model.modules()) else model.wte.weight.numel()
    flops = 6 * (linears + head) + 12 * L * T * cfg.num_heads * cfg.head_dim
    stats = run.task.train_stats({"loss": 40.0, "seen": 2048.0}, 2.0)
    assert stats["tokens_per_s"] == 1024.0
    assert stats["model_tflops"] == pytest.approx(1024.0 * flops / 1e12, rel=1e-12)
    assert "mfu" not in stats  # no peak for the CPU
    assert d > 0


def test_mfu_on_a_device_whose_peak_is_known(monkeypatch):
    run, _ = _task()
    monkeypatch.setattr(run, "device", torch.device("cuda", 0), raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(run, "ranks", types.SimpleNamespace(world_size=2, rank=0, is_main=True), raising=False)
    stats = run.task.train_stats({"loss": 1.0, "seen": 1e6}, 1.0)
    # the tokens of both ranks against twice one H100 SXM's 989.4 dense bf16 TFLOP/s
    assert stats["mfu"] == pytest.approx(1e6 * run.task.flops_per_token / (2 * 989.4e12), rel=1e-12)
    assert run.task.result({"val_loss": 1.0, **stats})["mfu"] == stats["mfu"]
