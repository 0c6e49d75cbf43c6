"""End to end: a training process killed with SIGKILL mid-epoch, resumed, ends with the uninterrupted weights."""

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

# Runs in a process of its own (tests/forked.py): argv = runs_dir, kill_at (training forward count at which the
# process SIGKILLs itself; 0 = never). The config uses every random part of the recipe: augmentation in 2 DataLoader
# workers, Mixup/CutMix, repeated augmentation (1280 images = 20 batches of 64 per epoch), drop-path, label smoothing.
SCRIPT = ARM_KILL + textwrap.dedent("""
    runs_dir = sys.argv[1]
    cfg = RECIPES["demo"].replace(
        epochs=3, batch_size=64, augment="recipe", mixup=0.8, cutmix=1.0, mixup_prob=0.5,
        label_smoothing=0.1, repeated_aug=3, drop_path=0.1, num_workers=2, runs_dir=runs_dir, progress=False,
        resume=True)
    print(json.dumps(train(cfg)))
""")


def _run(runs_dir, kill_at: int) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-c", SCRIPT, str(runs_dir), str(kill_at)], capture_output=True,
                      text=True, timeout=600)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_gives_identical_weights(tmp_path):
    whole = _run(tmp_path / "whole", 0)
    assert whole.returncode == 0, whole.stderr
    result = json.loads(whole.stdout.strip().splitlines()[-1])
    name = result["name"]

    killed = _run(tmp_path / "cut", 20 + 20 + 7)  # epoch 3, step 7: two checkpoints exist
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = tmp_path / "cut" / name
    assert not (run / "result.json").exists()
    assert torch.load(run / "trainer_state.pt", weights_only=True)["epoch"] == 2

    resumed = _run(tmp_path / "cut", 0)
    assert resumed.returncode == 0, resumed.stderr
    again = json.loads(resumed.stdout.strip().splitlines()[-1])

    w_whole = weights(tmp_path / "whole" / name / "checkpoint.safetensors")
    w_cut = weights(run / "checkpoint.safetensors")
    assert w_whole.keys() == w_cut.keys()
    assert all(torch.equal(w_whole[k], w_cut[k]) for k in w_whole)
    for key in ("top1", "top5", "test_loss"):
        assert again[key] == result[key]
    lines = lambda d: [json.loads(x) for x in (d / name / "metrics.jsonl").read_text().splitlines()]
    drop = ("epoch_seconds", "img_per_s")
    assert [{k: v for k, v in m.items() if k not in drop} for m in lines(tmp_path / "cut")] == \
           [{k: v for k, v in m.items() if k not in drop} for m in lines(tmp_path / "whole")]
