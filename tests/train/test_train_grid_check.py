"""A grid is checked before it trains: one bad run (dataset, model, spec, instrument, duplicate) trains nothing,
and `compare --plan` says what would be trained, resumed or skipped without training."""

from __future__ import annotations

import pytest
from train_helpers import STEPS_PER_EPOCH_64

from attnlab.cli import main

GRID = ["compare", "--models", "vit_digits", "--datasets", "digits", "--attn", "standard", "--seeds", "0",
        "--recipe", "demo", "--epochs", "1", "--batch-size", "64", "--no-progress", "--analyze", "none",
        "--no-report"]


def _grid(runs, **flags):
    args = [*GRID, "--runs-dir", str(runs)]
    for flag, value in flags.items():
        args[args.index(flag) + 1] = value
    return args


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("flag, value, says", [
    ("--datasets", "digits,cifar10", "CIFAR-10"),         # cifar10 files missing from an empty --data-dir
    ("--models", "vit_digits,no_such_model", "no_such_model"),
    ("--attn", "standard,no_such_variant", "no_such_variant"),
    ("--attn", "ns,ns(steps=1)", "twice"),                 # two specs, one run directory
    ("--analyze", "spectra,no_such_instrument", "no_such_instrument"),
])
def test_a_grid_with_one_bad_run_trains_nothing(tmp_path, capsys, flag, value, says):
    runs = tmp_path / "runs"
    args = [*_grid(runs, **{flag: value}), "--data-dir", str(tmp_path / "empty")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert _files(runs) == []  # the good runs listed before the bad one were not trained either


class Interrupt(Exception):
    pass


def test_compare_plan_says_what_it_would_do_and_trains_nothing(tmp_path, capsys, on_train_forward):
    runs = tmp_path / "runs"
    assert main(_grid(runs, **{"--epochs": "2"})) == 0  # seed 0 finished

    def interrupt(count, output):
        if count == STEPS_PER_EPOCH_64 + 3:
            raise Interrupt
    on_train_forward(interrupt)
    with pytest.raises(Interrupt):  # seed 1 stopped in epoch 2: epoch 1 checkpointed
        main(_grid(runs, **{"--epochs": "2", "--seeds": "1"}))
    before = {p: (runs / p).stat().st_mtime_ns for p in _files(runs)}
    capsys.readouterr()

    assert main([*_grid(runs, **{"--epochs": "2", "--seeds": "0,1,2"}), "--plan"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].split()[:2] == ["skip", "vit_digits-digits-standard-s0"] and "(finished, top1 " in out[0]
    assert out[1].split()[:2] == ["resume", "vit_digits-digits-standard-s1"] and "after epoch 1 of 2" in out[1]
    assert out[2].split()[:2] == ["train", "vit_digits-digits-standard-s2"]
    assert out[3] == "3 runs: 1 to train, 1 to resume, 1 finished"
    assert {p: (runs / p).stat().st_mtime_ns for p in _files(runs)} == before  # nothing written

    # a resume that would change the recipe is found by the plan too, before anything trains
    assert main([*_grid(runs, **{"--epochs": "3", "--seeds": "0,1,2"}), "--plan"]) == 2
    assert "differs in epochs" in capsys.readouterr().err
