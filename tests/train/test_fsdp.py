"""Sharded training (attnlab.train.fsdp, FSDP2 on gloo CPU ranks) against one process.

What must hold: with the global batch split by rank, N sharded ranks train the weights one process trains (the
gradient reduce-scatter averages as the one-process mean does; float32 sums in another order: 1e-5 after a few
AdamW steps); a sharded checkpoint saved at one world size loads at another and training continues to the weights
of an uninterrupted run; activation checkpointing changes no number; bf16 compute stays near fp32.
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


def _close(a: dict, b: dict, atol: float) -> float:
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
def test_sharded_training_equals_one_process_and_resumes_at_another_world_size(tmp_path):
    one = _run(tmp_path, 1, 4, tag="one")
    two = _run(tmp_path, 2, 4, tag="two")
    assert _close(one, two, 0) < 2e-5  # the same weights, up to the order of float32 sums
    first = {k: v for k, v in one.items()}
    # 2 steps at world 2, saved; 2 more at world 1 from that checkpoint = 4 steps uninterrupted
    _run(tmp_path, 2, 2, "--save", str(tmp_path / "ck"), tag="half")
    resumed = _run(tmp_path, 1, 2, "--first", "2", "--load", str(tmp_path / "ck"), tag="resumed")
    assert _close(first, resumed, 0) < 2e-5
    checkpointed = _run(tmp_path, 2, 4, "--checkpoint", tag="ac")
    assert _close(two, checkpointed, 0) == 0.0  # recomputation gives the same numbers
    bf16 = _run(tmp_path, 2, 4, "--bf16", tag="bf16")
    assert 0 < _close(two, bf16, 0) < 5e-2
