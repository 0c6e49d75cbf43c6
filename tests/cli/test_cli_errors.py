"""A user's mistake gives one line on stderr and exit code 2, never a traceback (``attnlab.cli.main`` in this process,
read as a real process: tests/cli/test_bad_inputs.py checks that the two agree)."""

import os
import sys
from pathlib import Path

import forked
import pytest
from cli_runner import in_process

CASES = [
    (["train", "--model", "no_such_model", "--dataset", "digits"], "unknown model 'no_such_model'"),
    (["train", "--model", "vit_digits", "--dataset", "mnist"], "cifar10"),
    (["train", "--model", "vit_digits", "--dataset", "digits", "--attn", "ns(step=2)"], "its options are: steps"),
    (["bench", "--model", "vit_digits", "--attn", "standard,bogus"], "valid names are"),
    (["train", "--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "--download"),
    (["analyze", "--what", "spectra"], "run directories"),
]


@pytest.mark.parametrize("argv,expected", CASES, ids=["model", "dataset", "spec", "bench-spec", "missing-cifar",
                                                      "analyze-no-target"])
def test_bad_input_is_one_line_exit_2(argv, expected, tmp_path):
    proc = in_process([*argv, *(["--runs-dir", str(tmp_path)] if argv[0] == "train" else [])], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert expected in lines[0]


def test_every_command_has_help(tmp_path):
    from attnlab.cli import COMMANDS

    for name in COMMANDS:  # through main: `train --help` prints once the --recipe it shows is read
        proc = in_process([name, "--help"], cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: attnlab {name}"), (name, proc.stderr)
        assert not proc.stderr.strip() and not list(tmp_path.iterdir()), name


@pytest.mark.parametrize("command", ["compare", "analyze", "report"])
def test_only_train_runs_under_torchrun(command, tmp_path, monkeypatch, capsys):
    # under torchrun a grid would start each run once per rank, into the same directories: refused before anything
    from attnlab.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.chdir(tmp_path)
    argv = {"compare": ["compare", "--preset", "demo", "--runs-dir", str(tmp_path / "runs")],
            "analyze": ["analyze", str(tmp_path)], "report": ["report", str(tmp_path)]}[command]
    monkeypatch.setattr("os._exit", lambda code: sys.exit(code))  # a torchrun worker leaves with os._exit
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only `attnlab train` is distributed" in err[0], err
    assert ("--jobs N" in err[0]) == (command == "compare")
    assert list(tmp_path.iterdir()) == []  # nothing written


WORKER_EXIT = """
import atexit, sys
import attnlab.cli as cli
atexit.register(lambda: print("interpreter shutdown ran", flush=True))
if sys.argv[1] == "crash":
    cli._main = lambda argv: 1 / 0
print("buffered output", end="")  # not flushed by the command: os._exit must not lose it
cli.main(["report", sys.argv[2]])
"""


@pytest.mark.parametrize("case", ["error", "crash"])
def test_a_torchrun_worker_exits_without_interpreter_shutdown(case, tmp_path):
    # gloo threads can still release tensors while Python finalises, which aborts the process: workers skip it
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0"}
    proc = forked.run([sys.executable, "-c", WORKER_EXIT, case, str(tmp_path)], capture_output=True, text=True,
                      timeout=120, env=env)
    assert proc.stdout == "buffered output", proc.stdout
    if case == "error":
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "only `attnlab train` is distributed" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 1
        assert "ZeroDivisionError" in proc.stderr and "Traceback" in proc.stderr, proc.stderr


def test_a_run_that_failed_in_set_up_is_removed_one_with_a_logged_epoch_stays(tmp_path):
    from attnlab.cli.train import _missing_dirs, _remove_unstarted

    def make(name: str, metrics: str) -> list[Path]:
        made = _missing_dirs(tmp_path / "new" / name)
        run = made[0]
        (run / "tensorboard").mkdir(parents=True)
        (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"header")
        (run / "config.yaml").write_text("model: vit_digits\n")
        (run / "metrics.jsonl").write_text(metrics)
        return made

    _remove_unstarted(make("set_up", ""))  # what set-up writes: gone, with the parent it made
    assert not (tmp_path / "new").exists()
    _remove_unstarted(make("epoch", '{"epoch": 1}\n'))  # one epoch logged: kept, to resume
    assert (tmp_path / "new" / "epoch" / "metrics.jsonl").read_text() == '{"epoch": 1}\n'
