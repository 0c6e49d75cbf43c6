"""The AdamW decay / no-decay split and the warm-up + cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from attnlab.train.optim import build_optimizer, build_scheduler, param_groups


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, 4))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 4))
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.attn = nn.Module()
        self.attn.relative_position_bias_table = nn.Parameter(torch.zeros(49, 3))  # 2-D, still no decay
        self.alpha = nn.Parameter(torch.zeros(3))                                  # per-head scalars
        self.gamma = nn.Parameter(torch.tensor(1.0))                               # 0-D
        self.conv = nn.Conv2d(1, 4, 2)
        self.frozen = nn.Parameter(torch.zeros(4, 4), requires_grad=False)


def test_decay_split_by_hand():
    model = Toy()
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["conv.weight", "proj.weight"]
    assert sorted(names[id(p)] for p in no_decay["params"]) == sorted([
        "pos_embed", "cls_token", "proj.bias", "norm.weight", "norm.bias", "attn.relative_position_bias_table",
        "alpha", "gamma", "conv.bias"])
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0


def test_decay_split_on_vit_digits():
    import attnlab

    model = attnlab.build_model("vit_digits", num_classes=10)
    opt = build_optimizer(model, 1e-3, 0.05)
    decayed = {n for n, p in model.named_parameters() if any(p is q for q in opt.param_groups[0]["params"])}
    # per block qkv, proj, fc1, fc2 weights; plus the patch-embedding conv and the head
    expected = {f"blocks.{i}.{w}.weight" for i in range(len(model.blocks))
                for w in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    expected |= {"patch_embed.proj.weight", "head.weight"}
    assert decayed == expected
    n_all = sum(1 for _ in model.parameters())
    assert len(opt.param_groups[1]["params"]) == n_all - len(expected)


def test_submodules_no_weight_decay_lists_are_honoured():
    """timm declares some exclusions on submodules (XCiT's XCA: its per-head temperature, 3-D) and as globs."""
    import attnlab

    model = attnlab.build_model("xcit_nano_12_p16_224", attn="qknorm", img_size=32, depth=2, cls_attn_layers=1,
                                num_classes=5)
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert {"blocks.0.attn.temperature", "blocks.1.attn.temperature"} <= {names[id(p)] for p in no_decay["params"]}
    assert not any("temperature" in n or n.startswith("pos_embed.") for n in decayed)
    assert "blocks.0.attn.qkv.weight" in decayed


@pytest.mark.parametrize("warmup_epochs", [2, 0])
def test_schedule_is_linear_warmup_then_cosine(warmup_epochs):
    lr, warmup_lr, min_lr, epochs, steps = 1e-3, 1e-6, 1e-5, 5, 4
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_scheduler(opt, total_steps=epochs * steps, warmup_steps=warmup_epochs * steps,
                            warmup_lr=warmup_lr, min_lr=min_lr)
    w, total = warmup_epochs * steps, epochs * steps
    seen = [opt.param_groups[0]["lr"]]
    for t in range(1, total + 1):
        sched.step_update(t)
        seen.append(opt.param_groups[0]["lr"])
    for t, got in enumerate(seen):
        if t < w:
            want = warmup_lr + t * (lr - warmup_lr) / w
        else:
            want = min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * (t - w) / (total - w)))
        assert got == pytest.approx(want, rel=1e-12), t
    assert seen[w] == pytest.approx(lr) and seen[-1] == pytest.approx(min_lr)
