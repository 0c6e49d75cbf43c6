"""`attnlab sample`: its bad inputs end as one line on stderr with exit code 2 (``attnlab.cli.main`` in this process,
read as a real process: tests/cli/test_bad_inputs.py checks that the two agree)."""

from __future__ import annotations

from cli_runner import in_process


def attnlab(*argv):
    return in_process(list(argv))


def test_not_a_run_directory_is_one_line(tmp_path):
    proc = attnlab("sample", tmp_path, "--prompt", "x")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "is not a run directory" in lines[0], proc.stderr


def test_help_names_the_flags():
    proc = attnlab("sample", "--help")
    assert proc.returncode == 0
    for flag in ("--prompt", "--max-new-tokens", "--temperature", "--top-k", "--prompt-ids"):
        assert flag in proc.stdout
