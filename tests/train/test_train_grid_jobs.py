"""run_grid with jobs=2 (spawned workers) gives the same runs as one after another."""

import torch
from train_helpers import tiny, weights

from attnlab.train import run_grid


def test_parallel_grid_equals_sequential(tmp_path):
    args = (["standard", "ns"], [0], None, None)
    seq = run_grid(tiny(tmp_path / "seq", epochs=1), *args, tmp_path / "seq", progress=False, jobs=1)
    par = run_grid(tiny(tmp_path / "par", epochs=1), *args, tmp_path / "par", progress=False, jobs=2)
    assert [r["name"] for r in seq] == [r["name"] for r in par] == ["vit_digits-digits-standard-s0",
                                                                    "vit_digits-digits-ns-s0"]
    for a, b in zip(seq, par):
        assert a["top1"] == b["top1"]
        wa = weights(tmp_path / "seq" / a["name"] / "checkpoint.safetensors")
        wb = weights(tmp_path / "par" / b["name"] / "checkpoint.safetensors")
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
