"""Sharded training (attnlab.train.fsdp, FSDP2 on gloo CPU ranks) against one process.

What must hold here (the trainer's sharded runs: tests/train/test_train_ddp.py): a sharded checkpoint saved at one
world size loads at another and training continues to the weights of an uninterrupted run (float32 sums in another
order: 2e-5 after a few AdamW steps); the blocks are the FSDP units; a sharded run refuses what it cannot do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _run(tmp_path, world: int, steps: int, *extra: str, tag: str) -> dict[str, torch.Tensor]:
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), str(world), str(steps), "--tag", tag, *extra],
                          capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / f"weights-{tag}.pt")


def _close(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_blocks_are_the_units():
    from attnlab.models import build_model
    from attnlab.train.fsdp import blocks_of

    model = build_model("llama_tiny")
    assert blocks_of(model) == list(model.blocks)
    import timm

    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=10)
    assert len(blocks_of(swin)) == sum(len(stage.blocks) for stage in swin.layers)


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path):
    """2 steps on 2 sharded ranks, saved (torch.distributed.checkpoint), then 2 steps in one process from that
    checkpoint: the weights of 4 uninterrupted steps in one process (float32 sums in another order)."""
    one = _run(tmp_path, 1, 4, tag="one")
    _run(tmp_path, 2, 2, "--save", str(tmp_path / "ck"), tag="half")
    resumed = _run(tmp_path, 1, 2, "--first", "2", "--load", str(tmp_path / "ck"), tag="resumed")
    assert _close(one, resumed) < 2e-5
    assert _close(one, _run(tmp_path, 1, 2, tag="two_steps")) > 1e-3  # the check can tell 2 steps from 4


def test_a_sharded_run_refuses_what_it_cannot_do_before_it_starts():
    from attnlab.errors import ConfigError
    from attnlab.train.config import make_config
    from attnlab.train.loop import _check_sharded

    for key, value, flag in (("ema", True, "--ema"), ("probe_every", 5, "--probe-every")):
        with pytest.raises(ConfigError, match=f"^{flag} .* not available with --parallel fsdp; drop it or use "
                                              f"--parallel ddp"):
            _check_sharded(make_config("demo", **{key: value}))


def test_a_model_without_blocks_is_refused_for_checkpointing_and_sharding():
    import timm

    from attnlab.errors import ConfigError
    from attnlab.train.fsdp import checkpoint_blocks

    with pytest.raises(ConfigError, match="^ResNet has no transformer blocks .* without --activation-checkpointing"):
        checkpoint_blocks(timm.create_model("resnet18", pretrained=False))
