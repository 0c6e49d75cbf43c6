"""configs/lm_lr_sensitivity_ladder.yaml loads as a grid and expands to the study's runs: 8 ladder sizes x 7 rates x
4 variants x z-loss on/off, with Wortsman et al.'s recipe ("Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2309.14322, Section 2), and the report keeps each size's sweep whole."""

from pathlib import Path

import pytest

from attnlab.report.sweeps import _decay_groups
from attnlab.train.grid import grid_runs, load_grid

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "lm_lr_sensitivity_ladder.yaml"
SIZES = ["ladder_d384", "ladder_d512", "ladder_d640", "ladder_d768", "ladder_d1024", "ladder_d1280", "ladder_d1536",
         "ladder_d1792"]
RATES = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]


def test_ladder_grid_expands_to_the_study():
    grid = load_grid(CONFIG)
    runs = grid_runs(grid["base"], grid["variants"], grid["seeds"], grid["datasets"], grid["models"],
                     grid["runs_dir"], grid["variations"])
    assert len(runs) == 8 * 7 * 4 * 2
    assert len({(c.model, c.attn, c.tag) for c in runs}) == len(runs)
    assert sorted({c.model for c in runs}) == sorted(SIZES)
    assert {c.attn for c in runs} == {"standard", "qknorm", "qkclip", "sigma"}
    assert sorted({c.optim.lr for c in runs}) == RATES
    assert {(c.optim.lr, c.lm.z_loss) for c in runs} == {(lr, z) for lr in RATES for z in (0.0, 1e-4)}
    for c in runs:  # their recipe
        assert (c.dataset, c.batch_size, c.lm.block_size, c.run.amp, c.optim.beta2, c.optim.clip_grad) == ("nanogpt", 256, 512, "bf16",
                                                                                        0.95, 1.0)
        assert (c.max_steps, c.sched.warmup_steps, c.sched.min_lr, c.sched.lr_schedule, c.optim.optimizer) == (100_000, 5000, 1e-5,
                                                                                        "cosine", "adamw")
        assert c.optim.lr * c.optim.weight_decay == pytest.approx(1e-4, rel=1e-11)  # independent weight decay 1e-4
        assert c.run.probe_every > 0


def test_the_report_sees_one_sweep_per_size_and_z_loss():
    grid = load_grid(CONFIG)
    runs = grid_runs(grid["base"], ["standard"], [0], None, ["ladder_d384"], "runs", grid["variations"])
    for z in (0.0, 1e-4):
        members = [{"lr": c.optim.lr, "weight_decay": c.optim.weight_decay} for c in runs if c.lm.z_loss == z]
        [(label, group)] = _decay_groups(members)
        assert label == "independent weight decay 0.0001" and len(group) == 7


@pytest.mark.slow
def test_compare_plan_accepts_one_size_of_it(tmp_path, capsys):
    """`attnlab compare --plan` checks every run of the file (model built, corpus read, specs parsed) and trains
    nothing; one size (ladder_d384: its 56 runs) on a tiny nanoGPT corpus of a 32k vocabulary (~15 s)."""
    import pickle

    import numpy as np

    from attnlab.cli import main

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 32000, 20000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 32000, 5000, dtype=np.uint16).tofile(data / "val.bin")
    with (data / "meta.pkl").open("wb") as f:
        pickle.dump({"vocab_size": 32000}, f)
    runs = tmp_path / "runs"
    assert main(["compare", "--config", str(CONFIG), "--plan", "--models", "ladder_d384", "--data-dir", str(data),
                 "--runs-dir", str(runs), "--analyze", "none"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "56 runs: 56 to train, 0 to resume, 0 finished"
    assert lines[0].split() == ["train", "ladder_d384-nanogpt-z_lr_3e-4-standard-s0", "(1", "epoch)"]
    assert not runs.exists() or not any(runs.iterdir())
