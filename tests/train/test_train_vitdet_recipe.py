"""The vitdet recipe's optimizer and schedule: ViTDet's layer-wise learning-rate decay and its step schedule,
checked against the rules written out by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.errors import ConfigError
from attnlab.train import RECIPES, make_config
from attnlab.train.optim import build_optimizer, build_scheduler, layer_ids


def test_layer_ids_follow_vitdets_rule():
    # ViTDet's get_vit_lr_decay_rate: embeddings 0, block i -> i + 1, everything else L + 1
    names = ["backbone.trunk.pos_embed", "backbone.trunk.patch_embed.proj.weight",
             "backbone.trunk.blocks.0.attn.qkv.weight", "backbone.trunk.blocks.11.mlp.fc2.bias",
             "backbone.pyramid.stages.0.0.weight", "roi_heads.box_head.0.0.weight", "cls_token", "norm.weight"]
    ids, layers = layer_ids(names + [f"backbone.trunk.blocks.{i}.norm1.weight" for i in range(12)])
    assert layers == 12
    assert [ids.get(n, layers + 1) for n in names] == [0, 0, 1, 12, 13, 13, 0, 13]


def test_swin_blocks_count_across_stages():
    names = [f"layers.{s}.blocks.{b}.attn.qkv.weight" for s, depth in enumerate((2, 2, 6, 2)) for b in range(depth)]
    ids, layers = layer_ids(names + ["layers.1.downsample.reduction.weight", "patch_embed.proj.weight"])
    assert layers == 12
    assert [ids[n] for n in names] == list(range(1, 13))
    assert ids["layers.1.downsample.reduction.weight"] == 3  # with stage 1's first block
    assert ids["patch_embed.proj.weight"] == 0


class _TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)


def test_layer_decay_scales_each_group_and_the_scheduler_applies_it():
    model = _TwoBlocks()
    opt = build_optimizer(model, 1e-3, 0.1, layer_decay=0.5)
    scale = {id(p): g["lr_scale"] for g in opt.param_groups for p in g["params"]}
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    # L = 2: head 1, block 1 -> 0.5, block 0 -> 0.25, embedding 0.125; biases never decay
    assert scale[id(model.head.weight)] == 1.0 and scale[id(model.blocks[1].weight)] == 0.5
    assert scale[id(model.blocks[0].bias)] == 0.25 and scale[id(model.patch_embed.weight)] == 0.125
    assert decay[id(model.blocks[0].weight)] == 0.1 and decay[id(model.blocks[0].bias)] == 0.0
    assert opt.param_groups[0]["lr_scale"] == 1.0  # the logged lr is the heads' own
    sched = build_scheduler(opt, total_steps=10, warmup_steps=0, warmup_lr=0.0, min_lr=0.0, schedule="step")
    sched.step_update(1)
    lrs = {g["lr_scale"]: g["lr"] for g in opt.param_groups if g["params"]}
    assert lrs == pytest.approx({1.0: 1e-3, 0.5: 5e-4, 0.25: 2.5e-4, 0.125: 1.25e-4})
    plain = build_optimizer(model, 1e-3, 0.1)
    assert len(plain.param_groups) == 2 and "lr_scale" not in plain.param_groups[0]


def test_step_schedule_by_hand():
    model = nn.Linear(2, 2)
    opt = build_optimizer(model, 1e-4, 0.1)
    total = 270
    sched = build_scheduler(opt, total_steps=total, warmup_steps=10, warmup_lr=1e-7, min_lr=0.0, schedule="step")
    seen = []
    for t in range(total):
        sched.step_update(t)
        seen.append(opt.param_groups[0]["lr"])
    assert seen[0] == pytest.approx(1e-7) and seen[5] == pytest.approx(1e-7 + 5 * (1e-4 - 1e-7) / 10)
    # peak until 8/9 of training (240 steps), a tenth until 26/27 (260), a hundredth after
    assert seen[100] == pytest.approx(1e-4) and seen[235] == pytest.approx(1e-4)
    assert seen[245] == pytest.approx(1e-5) and seen[255] == pytest.approx(1e-5)
    assert seen[265] == pytest.approx(1e-6)


def test_the_vitdet_recipe_is_the_papers():
    cfg = RECIPES["vitdet"]
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.layer_decay, cfg.drop_path, cfg.sched.lr_schedule) == \
        (1e-4, 0.1, 0.7, 0.1, "step")
    assert (cfg.epochs, cfg.batch_size, cfg.model, cfg.dataset) == (50, 32, "vitdet_base_224", "coco")
    assert cfg.detect.augment == "recipe"  # large-scale jitter; a detection run has no mixing or smoothing keys
    with pytest.raises(ConfigError, match="belongs to the image family"):
        make_config("vitdet", mixup_prob=0.5)
    with pytest.raises(ConfigError, match="layer_decay"):
        make_config("vitdet", layer_decay=1.5)
    with pytest.raises(ConfigError, match="lr_schedule"):
        make_config("vitdet", lr_schedule="linear")


def test_the_papers_detection_configs():
    from pathlib import Path

    from attnlab.train.grid import load_grid

    configs = Path(__file__).parents[2] / "configs"
    table9 = load_grid(configs / "dna_vitdet_coco.yaml")
    base = table9["base"]
    assert (base.model, base.dataset, base.epochs, base.batch_size, base.data_options) == \
           ("vitdet_base_224", "coco", 50, 32, {"image_size": 224})  # Table 9: 224x224, 50 epochs; Table 5: 32
    assert table9["variants"][0] == "standard" and "dna" in table9["variants"] and base.pretrained
    swin = load_grid(configs / "speccond_swin_coco.yaml")
    assert swin["models"] == ["swin_small_maskrcnn", "swin_base_maskrcnn"]
    assert swin["variants"] == ["standard", "speccond"] and swin["base"].optim.layer_decay is None
