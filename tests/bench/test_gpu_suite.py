"""benchmarks/gpu_suite.sh and gpu_suite.py: the JSON kept step by step, a killed suite's record, failures recorded
as failures, the budget and deadlines, the step filter, python3 first; and (slow) the dry run through every GPU code
path that runs on a CPU.

The orchestration tests run the suite's own main() in a subprocess with small fake steps (Python one-liners that
print tables, fail or sleep), so each takes about a second; the dry run runs the real steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_suite.sh"
spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
suite = importlib.util.module_from_spec(spec)
sys.modules["gpu_suite"] = suite  # its dataclasses look their module up while it loads
spec.loader.exec_module(suite)

DRIVER = """
import sys
sys.path.insert(0, {bench!r})
import gpu_suite as g

def py(label, code):
    return g.Cmd(label, [sys.executable, "-c", code])

TABLE = "print('| model | img/s |'); print('|---|---:|'); print('| m | 1.5 |', flush=True)"
STEPS = {{
    "table": g.Step("table", 1, 30, "prints a table", "", lambda p: [py("t", TABLE)]),
    "boom": g.Step("boom", 1, 30, "a row, then an error", "", lambda p: [
        py("b", TABLE + "; raise ValueError('bad input\\\\nsecond line')"), py("never", "print('ran')")]),
    "hang": g.Step("hang", 1, 30, "a row, then waits", "", lambda p: [py("h", TABLE + "; import os, time; "
        "open({marker!r}, 'w').write(str(os.getpid())); time.sleep(60)")]),
    "slow": g.Step("slow", 1, 2, "a row, then overruns its limit", "", lambda p: [py("s", TABLE + "; import time; "
        "time.sleep(60)")]),
    "env": g.Step("env", 1, 30, "fails at once", "", lambda p: [py("e", "import sys; print('environment: torch 2.9 "
        "is older than 2.11', file=sys.stderr); sys.exit(3)")], fatal=True),
    "three": g.Step("three", 1, 30, "three together, the second fails", "", lambda p: [[py(f"k{{i}}",
        f"import sys, time; time.sleep({{i * 0.3}}); print('child {{i}}'); sys.exit({{int(i == 1)}})")
        for i in range(3)]]),
    "together": g.Step("together", 1, 30, "fail fast", "", lambda p: [[py("f0", "import sys; sys.exit(2)"),
        py("f1", "import time; time.sleep(60)")]], fail_fast=True),
}}
names = sys.argv[2].split(",")
sys.exit(g.main([sys.argv[1]], steps=[STEPS[n] for n in names]))
"""


def start(tmp_path, steps: str, budget=None, **env):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(bench=str(ROOT / "benchmarks"), marker=str(tmp_path / "marker")))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    full = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "GPU_SUITE_CACHE": str(tmp_path / "cache"), **env}
    full.pop("OUT", None)
    full.pop("GPU_SUITE_STEPS", None)
    if budget is not None:
        full["GPU_SUITE_BUDGET"] = str(budget)
    out = tmp_path / "out" / "gpu_suite.json"
    proc = subprocess.Popen([sys.executable, str(driver), str(out), steps], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, out


def finish(proc, out, timeout=60):
    stdout, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, json.loads(out.read_text()), stdout, stderr


def rows(step):
    return [r for t in step["tables"] for r in t]


def test_sigterm_mid_step_leaves_the_finished_steps_and_the_killed_steps_rows(tmp_path):
    proc, out = start(tmp_path, "table,hang,boom")
    deadline = time.monotonic() + 30
    while not (tmp_path / "marker").exists():  # the hanging step has printed its row and waits
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    child = int((tmp_path / "marker").read_text())
    proc.send_signal(signal.SIGTERM)
    rc, result, stdout, _ = finish(proc, out)
    assert rc == 128 + signal.SIGTERM
    assert result["interrupted"] == "SIGTERM" and result["finished"] is False
    steps = result["steps"]
    assert [steps[n]["status"] for n in ("table", "hang", "boom")] == ["ok", "killed", "pending"]
    assert rows(steps["table"]) == [{"model": "m", "img/s": 1.5}]
    assert rows(steps["hang"]) == [{"model": "m", "img/s": 1.5}]  # printed before the kill, kept
    assert steps["hang"]["commands"][0]["status"] == "killed"
    with pytest.raises(ProcessLookupError):  # the step's process was ended, not left running
        os.kill(child, 0)
    with tarfile.open(out.with_name("gpu_suite_logs.tar.gz")) as tar:
        names = tar.getnames()
    assert "gpu_suite_logs/table/t.log" in names and "gpu_suite_logs/hang/h.log" in names
    assert not list((tmp_path / "tmp").iterdir())  # the scratch folder removed; the cache is elsewhere


def test_the_json_is_rewritten_while_a_step_runs(tmp_path):
    proc, out = start(tmp_path, "hang")
    deadline = time.monotonic() + 30
    try:
        while True:  # the running step's row appears in the JSON before the step ends
            assert time.monotonic() < deadline
            if out.exists():
                step = json.loads(out.read_text())["steps"]["hang"]
                if step["status"] == "running" and rows(step):
                    break
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        rc, result, _, _ = finish(proc, out)
    assert rc == 128 + signal.SIGINT and result["steps"]["hang"]["status"] == "killed"


def test_a_failing_step_is_recorded_as_failed_with_its_error_and_the_suite_goes_on(tmp_path):
    rc, result, stdout, _ = finish(*start(tmp_path, "boom,three,table"))
    assert rc == 1 and result["finished"] is True
    boom = result["steps"]["boom"]
    assert boom["status"] == "failed"
    assert [c["label"] for c in boom["commands"]] == ["b"]  # the step stopped at its failing command
    assert boom["commands"][0]["rc"] == 1
    assert boom["error"] == ["ValueError: bad input", "second line"]
    assert rows(boom) == [{"model": "m", "img/s": 1.5}]
    three = result["steps"]["three"]  # a parallel phase: every child waited for, each status kept
    assert three["status"] == "failed"
    assert sorted((c["label"], c["rc"]) for c in three["commands"]) == [("k0", 0), ("k1", 1), ("k2", 0)]
    assert result["steps"]["table"]["status"] == "ok"
    assert "boom         failed" in stdout


def test_a_fail_fast_phase_stops_the_others(tmp_path):
    rc, result, _, _ = finish(*start(tmp_path, "together"))
    cmds = {c["label"]: c for c in result["steps"]["together"]["commands"]}
    assert rc == 1 and cmds["f0"]["rc"] == 2 and cmds["f1"]["status"] == "stopped"
    assert cmds["f1"]["seconds"] < 30


def test_a_failed_environment_stops_the_suite_with_one_line(tmp_path):
    rc, result, _, stderr = finish(*start(tmp_path, "env,table"))
    assert rc == 3
    assert stderr.strip().splitlines()[-1] == \
        "gpu_suite: stopped after env: environment: torch 2.9 is older than 2.11"
    assert result["steps"]["env"]["status"] == "failed" and result["steps"]["table"]["status"] == "stopped"


def test_a_step_past_its_limit_keeps_its_rows_and_a_spent_budget_skips_the_rest(tmp_path):
    rc, result, _, _ = finish(*start(tmp_path, "slow,table", budget=suite.MIN_STEP_S + 1))
    slow, table = result["steps"]["slow"], result["steps"]["table"]
    assert rc == 1
    assert slow["status"] == "timed_out" and rows(slow) == [{"model": "m", "img/s": 1.5}]
    assert slow["limit_s"] == 2 and slow["seconds"] < 10
    assert table["status"] == "skipped" and table["commands"] == []


def test_the_step_filter_runs_only_the_named_steps(tmp_path):
    rc, result, _, _ = finish(*start(tmp_path, "table"))
    assert list(result["steps"]) == ["table"] and rc == 0
    steps = suite.steps_table()
    assert [s.name for s in suite.select(steps, "ns_compiled,variants")] == ["variants", "ns_compiled"]
    assert [s.name for s in suite.select(steps, "e2e_cli")] == ["data", "e2e_cli"]  # the data it reads
    with pytest.raises(SystemExit, match="unknown step nope; the steps are env, data"):
        suite.select(steps, "variants,nope")


def test_the_estimates_fit_the_budget_and_the_docs_table_lists_them():
    steps = suite.steps_table()
    assert sum(s.estimate_s for s in steps) <= 500
    doc = (ROOT / "docs" / "perf.md").read_text()
    for s in steps:  # docs/perf.md's step table: name, estimate, limit
        assert f"| `{s.name}` | {s.estimate_s} | {s.limit_s} |" in doc, s.name
    assert f"| **sum** | **{sum(s.estimate_s for s in steps)}** |" in doc


# ------------------------------------------------------------------------------------------------ reading output
def test_tables_survive_lines_written_between_their_rows():
    text = textwrap.dedent("""\
        # a note
        | model | variant | img/s |
        |---|---|---:|
        | vit | standard | 10.5 |
        UserWarning: something on stderr
        | vit | ns | 9.0 |
        | not | a row |
        | a | b |
        |---|---|
        | 1 | x |
        """)
    assert suite.tables(text) == [[{"model": "vit", "variant": "standard", "img/s": 10.5},
                                   {"model": "vit", "variant": "ns", "img/s": 9.0}],
                                  [{"a": 1.0, "b": "x"}]]


def test_error_lines_take_the_exception_of_the_last_traceback():
    text = "ok\nTraceback (most recent call last):\n  File 'x'\n    raise\nRuntimeError: CUDA out of memory\n" \
           "Tried to allocate 2 GiB\n"
    assert suite.error_lines(text) == ["RuntimeError: CUDA out of memory", "Tried to allocate 2 GiB"]
    assert suite.error_lines("a\nb\n\nlast words\n", n=2) == ["b", "last words"]


def plan(tmp_path, dry=False):
    return suite.Plan(dry=dry, py=sys.executable, work=tmp_path, cache=tmp_path / "cache")


def record_with(steps: dict) -> dict:
    base = {"tables": [], "derived": []}
    return {"steps": {name: {**base, **value} for name, value in steps.items()}}


def test_the_trainers_rate_is_epoch_2s_and_epoch_1_alone_is_partial(tmp_path):
    p = plan(tmp_path)
    run = tmp_path / "runs" / "e2e_vit_cifar"
    run.mkdir(parents=True)
    (tmp_path / "logs" / "e2e_cli").mkdir(parents=True)
    line = lambda e, r: json.dumps({"epoch": e, "img_per_s": r, "epoch_seconds": 9.0, "top1": 1.0})  # noqa: E731
    (run / "metrics.jsonl").write_text(line(1, 5000.0) + "\n")  # killed during epoch 2
    rec = {"name": "e2e_cli", "tables": []}
    t = suite.targets(record_with({"e2e_cli": {"derived": suite.cli_after(p, rec)}}), p)
    t = t["attnlab train --compile vit_cifar img/s (epoch 2)"]
    assert t["value"] is None and t["status"] == "partial" and t["met"] is None and "epoch 1" in t["note"]
    (run / "metrics.jsonl").write_text(line(1, 5000.0) + "\n" + line(2, 36000.0) + "\n")
    t = suite.targets(record_with({"e2e_cli": {"derived": suite.cli_after(p, rec)}}), p)
    t = t["attnlab train --compile vit_cifar img/s (epoch 2)"]
    assert t["value"] == 36000.0 and t["status"] == "measured" and t["met"] is True


def test_targets_record_failed_rows_as_missing_and_wrong_results_as_not_met(tmp_path):
    p = plan(tmp_path)
    e2e = [{"model": "vit_cifar", "variant": v, "mode": "compiled", "img/s (median of rounds)": r,
            "ratio to standard": q, "status": s}
           for v, r, q, s in (("standard", 40000.0, 1.0, "ok"), ("ns", 39000.0, 0.975, "ok"),
                              ("dna", "-", "-", "failed: RuntimeError: boom"), ("sigma", 38500.0, 0.9625, "ok"))]
    dna = [{"attention": "dna", "throughput vs standard": 0.9, "check": "reference"},
           {"attention": "dna[triton]", "throughput vs standard": 1.1, "check": "WRONG"}]
    packed = suite.packed_after(p, {"tables": [[{"model": "swin_cifar", "processes": 1.0, "rank": 0.0,
                                                 "img/s": 3000.0}]] + [[{"model": "swin_cifar", "processes": 3.0,
                                                                          "rank": float(i), "img/s": 2100.0}]
                                                                        for i in range(3)]})
    t = suite.targets(record_with({"variants": {"tables": [e2e]}, "dna_vit_b": {"tables": [dna]},
                                   "packed": {"derived": packed}}), p)
    assert t["vit_cifar end-to-end img/s (compiled, bf16, full recipe)"]["met"] is True
    every = t["every variant / standard, training (compiled)"]
    assert every["value"] == 0.9625 and every["status"] == "partial" and every["missing"] == ["dna", "speccond"]
    assert every["met"] is None  # all measured ones pass, but two are missing
    assert t["dna[triton] ViT-B/16 throughput / standard (bf16)"]["met"] is False
    assert t["dna[triton] ViT-B/16 throughput / standard (bf16)"]["status"] == "wrong result"
    assert t["3 packed swin_cifar / one"]["value"] == 2.1 and t["3 packed swin_cifar / one"]["met"] is True
    assert t["swin_cifar end-to-end img/s"]["status"] == "missing"


# ------------------------------------------------------------------------------------------------ the shell wrapper
def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_wrapper_prefers_python3_and_execs_it(tmp_path):
    stub(tmp_path, "python3", 'echo "python3 $*"; exec sleep 30')
    stub(tmp_path, "python", 'echo "python $*"')
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.Popen(["bash", str(SCRIPT), "--list"], env=env, stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first == "python3 benchmarks/gpu_suite.py --list\n"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
        assert time.monotonic() < deadline  # the shell was replaced: a signal to it reaches the suite
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM


# ------------------------------------------------------------------------------------------------ the dry run
def dry_run(tmp_path, steps: str | None = None):
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), "GPU_SUITE_CACHE": str(tmp_path / "c")}
    env.pop("OUT", None)
    env.pop("GPU_SUITE_STEPS", None)
    out = tmp_path / "out" / "gpu_suite.json"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out), *(["--steps", steps] if steps else [])],
                          env=env, capture_output=True, text=True, timeout=3600)
    result = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["dry_run"] is True and result["finished"] is True
    for name, step in result["steps"].items():
        assert step["status"] == "ok" and not step["failed_rows"], (name, step["tail"])
    return result


def check_variants(result):
    variants = rows(result["steps"]["variants"])
    assert [(r["variant"], r["mode"]) for r in variants] == [(v, "compiled") for v in
                                                             ("standard", "ns", "dna", "sigma", "speccond")]
    assert isinstance(result["targets"]["vit_cifar end-to-end img/s (compiled, bf16, full recipe)"]["value"], float)


@pytest.mark.slow
def test_dry_run_of_the_compiled_variants_step(tmp_path):
    """The suite's main step on the CPU: every variant compiled (aot_eager), bf16, the full recipe on the device
    pipeline, each timed against standard (under a minute on 2 idle cores)."""
    result = dry_run(tmp_path, "variants")
    assert list(result["steps"]) == ["variants"]
    check_variants(result)


def test_the_ladder_step_measures_two_sizes_compiled_in_bf16_and_reports_their_mfu(tmp_path):
    """The GPU plan: ladder_d512 and ladder_d1024, compiled, bf16, 16 x 512 tokens of a 32k vocabulary; each row's
    MFU becomes a target entry (no threshold), a row without one ("—" on a CPU) stays missing."""
    step = next(s for s in suite.steps_table() if s.name == "ladder_lm")
    [cmd] = step.phases(plan(tmp_path))
    argv = cmd.argv
    assert argv[argv.index("--ladder") + 1] == "ladder_d512,ladder_d1024"
    assert [argv[argv.index(f) + 1] for f in ("--device", "--amp", "--compile", "--vocab-size", "--batch-size",
                                              "--block-size")] == ["cuda", "bf16", "only", "32000", "16", "512"]
    [dry] = step.phases(suite.Plan.for_dry_run(sys.executable, tmp_path, tmp_path / "cache"))
    assert dry.argv[dry.argv.index("--ladder") + 1] == "ladder_d128" and "cpu" in dry.argv
    record = {"steps": {"ladder_lm": {"tables": [[
        {"model": "ladder_d512", "compiled": "yes", "amp": "bf16", "MFU": 0.41},
        {"model": "ladder_d1024", "compiled": "yes", "amp": "bf16", "MFU": "—"}]], "derived": []}}}
    found = suite.targets(record, plan(tmp_path))
    assert found["ladder_d512 training MFU (compiled, bf16)"]["value"] == 0.41
    assert found["ladder_d512 training MFU (compiled, bf16)"]["status"] == "measured"
    assert found["ladder_d1024 training MFU (compiled, bf16)"]["status"] == "missing"


@pytest.mark.slow
def test_dry_run_of_the_ladder_step(tmp_path):
    """The ladder rows on the CPU: lm_throughput.py --ladder through bf16 autocast, its table parsed (~20 s)."""
    result = dry_run(tmp_path, "ladder_lm")
    [row] = rows(result["steps"]["ladder_lm"])
    assert row["model"] == "ladder_d128" and row["amp"] == "bf16" and row["MFU"] == "—"
    assert isinstance(row["tokens/s (wall)"], float) and row["tokens/s (wall)"] > 0
    assert row["GFLOP/token"] == pytest.approx(0.003, abs=0.0005)


@pytest.mark.slow
def test_dry_run_of_the_vlm_probes_step(tmp_path):
    """The probes' step on the CPU, tiny: both rows (whole step, probes alone) with DnA's time ratio to standard."""
    result = dry_run(tmp_path, "vlm_probes")
    got = rows(result["steps"]["vlm_probes"])
    assert [r["row"] for r in got] == ["step", "probes"]
    assert all(isinstance(r["dna / standard time (median of rounds)"], float) for r in got)
