"""EMA of the weights (issue 11 item 5): off by default; on, ema.safetensors holds, after every epoch, the average
e_1 = w_1, e_t = d e_{t-1} + (1 - d) w_t of the parameters after each optimizer step t (timm's ModelEmaV3 without
warm-up), with the buffers (sigma's power-iteration u) of the live model; it is evaluated each epoch and resumes
exactly."""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import tiny, weights

from attnlab.train import train
from attnlab.train import loop as train_loop


def _record_steps(monkeypatch):
    """The float64 parameters and the buffers after every optimizer step of the runs started afterwards."""
    steps: list[tuple[dict, dict]] = []
    original = train_loop.build_optimizer

    def build(model, *args, **kwargs):
        optimizer = original(model, *args, **kwargs)

        def record(opt, args, kwargs):
            steps.append(({k: p.detach().double().clone() for k, p in model.named_parameters()},
                          {k: b.detach().clone() for k, b in model.named_buffers()}))
        optimizer.register_step_post_hook(record)
        return optimizer
    monkeypatch.setattr(train_loop, "build_optimizer", build)
    return steps


def test_ema_is_the_average_of_the_steps_weights(tmp_path, monkeypatch):
    steps = _record_steps(monkeypatch)
    decay = 0.9
    result = train(tiny(tmp_path, epochs=1, attn="sigma", ema=True, ema_decay=decay))
    run = tmp_path / result["name"]
    ema = weights(run / "ema.safetensors")
    params, buffers = steps[0]
    average = dict(params)
    for params, buffers in steps[1:]:
        average = {k: decay * average[k] + (1 - decay) * params[k] for k in average}
    for k, v in average.items():
        torch.testing.assert_close(ema[k].double(), v, rtol=1e-5, atol=1e-6, msg=k)
    assert any(".u" in k for k in buffers)  # sigma's power-iteration vectors: copied, not averaged
    for k, v in buffers.items():
        assert torch.equal(ema[k], v), k
    assert not all(torch.equal(ema[k].double(), params[k]) for k in params)  # not the raw weights
    raw = weights(run / "checkpoint.safetensors")
    assert raw.keys() == ema.keys()
    # evaluated each epoch beside the raw weights, and named in the result
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert {"ema_top1", "ema_top5", "ema_test_loss"} <= set(line)
    assert result["extra"] == {"ema_top1": line["ema_top1"], "ema_top5": line["ema_top5"],
                               "ema_test_loss": line["ema_test_loss"]}


def test_ema_is_off_by_default(tmp_path):
    result = train(tiny(tmp_path, epochs=1))
    run = tmp_path / result["name"]
    assert not (run / "ema.safetensors").exists() and result["extra"] == {}
    assert not any(k.startswith("ema_") for k in json.loads((run / "metrics.jsonl").read_text()))


class Interrupt(Exception):
    pass


def test_ema_resumes_exactly(tmp_path, on_train_forward):
    full = train(tiny(tmp_path / "full", ema=True, ema_decay=0.95))
    on_train_forward(lambda count, out: (_ for _ in ()).throw(Interrupt) if count == 22 + 4 else None)
    with pytest.raises(Interrupt):
        train(tiny(tmp_path / "cut", ema=True, ema_decay=0.95))
    resumed = train(tiny(tmp_path / "cut", ema=True, ema_decay=0.95, resume=True))
    a = weights(tmp_path / "full" / full["name"] / "ema.safetensors")
    b = weights(tmp_path / "cut" / full["name"] / "ema.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["extra"] == full["extra"]
