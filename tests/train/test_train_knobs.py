"""Recipe knobs usable with any variant: post-LN blocks, LARS, no warm-up / no weight decay, grid variations."""

import pytest
import torch

import attnlab
from attnlab.models.blocks import PostNormBlock
from attnlab.train import RECIPES, train
from attnlab.train.grid import grid_runs, load_grid
from attnlab.train.optim import build_optimizer


def test_post_ln_block_is_post_norm():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", norm="post", attn="ns").eval()
    block = model.blocks[0]
    assert isinstance(block, PostNormBlock)
    x = torch.randn(2, 16, block.attn.dim)
    with torch.no_grad():
        h = block.norm1(x + block.attn(x))  # written out: LN after each residual addition
        expected = block.norm2(h + block.mlp(h))
        torch.testing.assert_close(block(x), expected)
    pre = attnlab.build_model("vit_digits", attn="ns")
    pre.load_state_dict(model.state_dict())  # same parameter names
    with pytest.raises(attnlab.AttnlabError, match="ViT-family"):
        attnlab.build_model("swin_cifar", norm="post")


def test_lars_step_follows_the_trust_ratio():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits")
    opt = build_optimizer(model, lr=0.5, weight_decay=0.0, name="lars", momentum=0.9)
    w, b = model.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.bias
    w0, b0 = w.detach().clone(), b.detach().clone()
    model(torch.randn(4, 1, 8, 8)).square().mean().backward()
    gw, gb = w.grad.clone(), b.grad.clone()
    opt.step()
    # first step: momentum buffer = gradient; matrices scaled by trust ratio 0.001 ||w|| / ||g||, biases plain SGD
    torch.testing.assert_close(w.detach(), w0 - 0.5 * 0.001 * w0.norm() / gw.norm() * gw)
    torch.testing.assert_close(b.detach(), b0 - 0.5 * gb)


def test_knobs_train_end_to_end(tmp_path):
    cfg = RECIPES["demo"].replace(epochs=1, optimizer="lars", lr=0.5, warmup_epochs=0,
                                  weight_decay=0.0, norm="post", runs_dir=str(tmp_path), progress=False)
    result = train(cfg)
    saved = attnlab.train.load_config(tmp_path / result["name"] / "config.yaml")
    assert (saved.optim.optimizer, saved.norm, saved.sched.warmup_epochs, saved.optim.weight_decay) == \
        ("lars", "post", 0, 0.0)
    model, _ = attnlab.train.load_run(tmp_path / result["name"])
    assert isinstance(model.blocks[0], PostNormBlock)


def test_variations_make_separate_tagged_runs(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text("variants: [standard, ns]\nseeds: [0, 1]\nbase: {recipe: demo}\n"
                    "variations:\n  paper: {}\n  no_warmup: {warmup_epochs: 0}\n")
    grid = load_grid(path)
    configs = grid_runs(grid["base"], grid["variants"], grid["seeds"], None, None, tmp_path, grid["variations"])
    assert len(configs) == 2 * 2 * 2
    assert {c.tag for c in configs} == {"paper", "no_warmup"}
    assert all(c.sched.warmup_epochs == 0 for c in configs if c.tag == "no_warmup")
    assert all(c.sched.warmup_epochs == RECIPES["demo"].sched.warmup_epochs for c in configs if c.tag == "paper")
    names = {attnlab.train.run_name(c) for c in configs}
    assert len(names) == 8 and "vit_digits-digits-no_warmup-ns-s1" in names
