"""`attnlab train` and `attnlab compare` through attnlab.cli.main."""

from __future__ import annotations

import json

from attnlab.cli import main

TINY = ["--recipe", "demo", "--epochs", "1", "--batch-size", "64", "--no-progress"]


def test_train_flags_config_and_resume(tmp_path, capsys):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("recipe: demo\nseed: 4\nepochs: 3\n")
    assert main(["train", "--config", str(cfg), "--epochs", "1", "--batch-size", "64", "--no-progress",
                 "--runs-dir", str(tmp_path / "runs")]) == 0
    run = tmp_path / "runs" / "vit_digits-digits-standard-s4"
    result = json.loads((run / "result.json").read_text())
    assert result["seed"] == 4 and result["epochs"] == 1  # file, then the flag over it
    assert run.name in capsys.readouterr().out
    # resuming a finished run by its directory returns at once with the same result
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert json.loads((run / "result.json").read_text()) == result
    # without --resume an existing run is refused: one line, exit code 2
    assert main(["train", "--config", str(cfg), "--epochs", "1", "--batch-size", "64", "--no-progress",
                 "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--resume" in err


def test_unknown_config_key_is_one_line_exit_2(tmp_path, capsys):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("recipe: demo\nepoch: 3\n")
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'epoch'" in err and "epochs" in err


def test_compare_runs_grid_skips_finished_and_prints_report(tmp_path, capsys):
    runs = tmp_path / "runs"
    args = ["compare", "--models", "vit_digits", "--datasets", "digits", "--attn", "standard", "--seeds", "0,1",
            "--runs-dir", str(runs), *TINY]
    assert main(args) == 0
    out = capsys.readouterr().out
    names = sorted(p.name for p in runs.iterdir() if (p / "result.json").exists())
    assert names == ["vit_digits-digits-standard-s0", "vit_digits-digits-standard-s1"]
    assert "standard" in out and "vit_digits" in out
    stamp = (runs / names[0] / "result.json").stat().st_mtime_ns
    assert main(args) == 0  # everything done: nothing retrained
    assert (runs / names[0] / "result.json").stat().st_mtime_ns == stamp
