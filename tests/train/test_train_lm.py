"""The lm task through the one trainer: a run killed with SIGKILL mid-run and resumed ends bit-identical to the
uninterrupted one (weights, every metrics line), with gradient accumulation and z-loss on; the recipe's checks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import forked
import pytest
import torch
from train_helpers import ARM_KILL, weights

from attnlab.errors import ConfigError

SCRIPT = ARM_KILL + textwrap.dedent("""
    runs_dir = sys.argv[1]
    cfg = RECIPES["lm"].replace(
        max_steps=6, eval_every=2, eval_iters=1, warmup_steps=2, batch_size=4, block_size=32,
        grad_accum=2, z_loss=1e-4, model_options={"embed_dim": 32, "depth": 1, "num_heads": 2}, threads=1,
        runs_dir=runs_dir, progress=False, resume=True)
    print(json.dumps(train(cfg)))
""")


def _run(runs_dir, kill_at: int) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-c", SCRIPT, str(runs_dir), str(kill_at)], capture_output=True,
                      text=True, timeout=600)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path):
    whole = _run(tmp_path / "whole", 0)
    assert whole.returncode == 0, whole.stderr
    result = json.loads(whole.stdout.strip().splitlines()[-1])
    name = result["name"]
    assert result["task"] == "lm" and result["metric"] == "val_loss" and result["steps"] == 6

    killed = _run(tmp_path / "cut", 2 * 2 * 2 + 3)  # third "epoch" (steps 5-6), its second micro-batch
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = tmp_path / "cut" / name
    assert not (run / "result.json").exists()
    resumed = _run(tmp_path / "cut", 0)
    assert resumed.returncode == 0, resumed.stderr
    again = json.loads(resumed.stdout.strip().splitlines()[-1])

    w_whole, w_cut = weights(tmp_path / "whole" / name / "checkpoint.safetensors"), weights(run / "checkpoint.safetensors")
    assert w_whole.keys() == w_cut.keys() and all(torch.equal(w_whole[k], w_cut[k]) for k in w_whole)
    for key in ("val_loss", "perplexity", "accuracy", "bits_per_byte"):
        assert again[key] == result[key]
    assert again["init"] == result["init"]  # the loss at initialisation survives the kill (it is in the checkpoint)
    lines = lambda d: [json.loads(x) for x in (d / name / "metrics.jsonl").read_text().splitlines()]
    drop = ("epoch_seconds", "tokens_per_s", "train_seconds", "seconds")
    assert [{k: v for k, v in m.items() if k not in drop} for m in lines(tmp_path / "cut")] == \
           [{k: v for k, v in m.items() if k not in drop} for m in lines(tmp_path / "whole")]


def test_recipe_values_and_checks():
    from attnlab.train import RECIPES
    from attnlab.train.config import validate

    lm = RECIPES["lm"]
    assert (lm.optim.beta2, lm.optim.weight_decay, lm.optim.clip_grad, lm.sched.min_lr / lm.optim.lr) == \
        (0.95, 0.1, 1.0, 0.1)
    for bad, match in ((dict(block_size=0), "block_size"), (dict(eval_iters=0), "eval_iters"),
                       (dict(z_loss=-1.0), "z_loss"), (dict(beta2=1.0), "beta2")):
        with pytest.raises(ConfigError, match=match):
            validate(lm.replace(**bad))


def test_loss_at_initialisation_is_the_untrained_models(tmp_path):
    """result.json's ``init``: the evaluation before the first step. With lr 0 nothing moves, so it is the final
    evaluation; it does not depend on the rate, and training at a real rate moves the final loss away from it."""
    from attnlab.train import RECIPES, train

    def run(lr):
        return train(RECIPES["lm"].replace(
            max_steps=2, eval_every=2, eval_iters=1, warmup_steps=0, batch_size=2, block_size=16,
            lr=lr, min_lr=lr / 10, weight_decay=0.0, model_options={"embed_dim": 16, "depth": 1, "num_heads": 2},
            threads=1, runs_dir=str(tmp_path / f"lr{lr}"), progress=False))

    frozen, moving = run(0.0), run(1e-2)
    assert frozen["init"]["val_loss"] == frozen["val_loss"] and frozen["init"]["perplexity"] == frozen["perplexity"]
    assert moving["init"] == frozen["init"]
    assert moving["val_loss"] != moving["init"]["val_loss"]


def _lm_run(runs_dir, **overrides):
    from attnlab.train import RECIPES, train

    return train(RECIPES["lm"].replace(
        max_steps=4, eval_every=4, eval_iters=1, warmup_steps=1, batch_size=2, block_size=16,
        model_options={"embed_dim": 32, "depth": 1, "num_heads": 2}, threads=1, runs_dir=str(runs_dir),
        progress=False, **overrides))


COMPILED_SPECS = ("dna+sigma",)  # with tests/train/test_train_compile.py's, every registered term


@pytest.mark.slow
@pytest.mark.compiler
@pytest.mark.parametrize("spec", COMPILED_SPECS)
def test_compiled_lm_run_matches_eager(tmp_path, spec):
    """--compile on the lm recipe (inductor on the CPU, causal masks in the graph): the eager run's losses, with
    a training and an evaluation graph and no graph break (tolerance as in test_train_compile.py). One spec: the
    loop, the compile and QK-clip's hook are the image trainer's, whose compiled run of every term is
    tests/train/test_train_compile.py; DnA's two causal branches are the language model's own graph."""
    import torch
    from torch._dynamo.utils import counters

    eager = _lm_run(tmp_path / "eager", attn=spec, amp="none")
    torch._dynamo.reset()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    compiled = _lm_run(tmp_path / "compiled", attn=spec, amp="none", compile=True)
    assert counters["stats"]["unique_graphs"] - graphs >= 2
    assert sum(counters["graph_break"].values()) == breaks
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)
    assert compiled["init"]["val_loss"] == pytest.approx(eager["init"]["val_loss"], rel=1e-5)


def test_bf16_lm_run_stays_near_float32(tmp_path):
    """--amp bf16 on the CPU: the same four steps as float32 to bf16's precision (8 bits of mantissa)."""
    fp32 = _lm_run(tmp_path / "fp32", amp="none")
    bf16 = _lm_run(tmp_path / "bf16", amp="bf16")
    assert bf16["val_loss"] == pytest.approx(fp32["val_loss"], rel=2e-2)
    assert bf16["val_loss"] != fp32["val_loss"]  # it did run in bf16


@pytest.mark.slow
def test_the_lm_recipe_learns(tmp_path):
    """80 steps of the lm recipe (gpt_tiny at width 64, 2 blocks, batch 16 of 64 bytes of the standard library,
    lr 3e-3): measured on 2 CPU cores, bits per byte fell from 7.77-7.82 at initialisation (uniform over 256 bytes is
    8) to 4.09-4.29 (seeds 0, 1, 2; about 4 s each). The test asks for a drop of 2.5 bits, a margin of 1 bit below
    the smallest measured drop (3.53)."""
    from attnlab.train import RECIPES, train

    result = train(RECIPES["lm"].replace(
        max_steps=80, eval_every=80, eval_iters=4, warmup_steps=10, batch_size=16, block_size=64,
        lr=3e-3, min_lr=3e-4, model_options={"embed_dim": 64, "depth": 2, "num_heads": 4}, threads=1,
        runs_dir=str(tmp_path), progress=False, seed=0))
    assert result["init"]["bits_per_byte"] > 7.5
    assert result["bits_per_byte"] < result["init"]["bits_per_byte"] - 2.5, (result["init"], result)


def test_the_llama_shaped_decoder_learns(tmp_path):
    """The same 80 steps on llama_tiny at width 64 (2 blocks, 4 query and 2 key-value heads, SwiGLU 176, RoPE):
    measured on 2 CPU cores, bits per byte fell from 7.70-7.79 at initialisation to 3.74-3.85 (seeds 0, 1, 2; about
    2 s each), drops of 3.85-4.05 bits. The test asks for a drop of 2.8 bits, 1 bit below the smallest."""
    from attnlab.train import RECIPES, train

    result = train(RECIPES["lm"].replace(
        model="llama_tiny", max_steps=80, eval_every=80, eval_iters=4, warmup_steps=10, batch_size=16,
        block_size=64, lr=3e-3, min_lr=3e-4, threads=1, runs_dir=str(tmp_path), progress=False, seed=0,
        model_options={"embed_dim": 64, "depth": 2, "num_heads": 4, "num_kv_heads": 2, "mlp_hidden": 176}))
    assert result["init"]["bits_per_byte"] > 7.5
    assert result["bits_per_byte"] < result["init"]["bits_per_byte"] - 2.8, (result["init"], result)
