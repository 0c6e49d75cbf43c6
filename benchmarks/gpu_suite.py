"""Every GPU measurement of attnlab in one command and one JSON file, kept step by step (docs/perf.md, "GPU suite").

    bash benchmarks/gpu_suite.sh [OUT.json]            # $OUT/gpu_suite.json when $OUT is set, else ./gpu_suite.json
    GPU_SUITE_STEPS=variants,ns_compiled bash benchmarks/gpu_suite.sh      # a second call: only those steps
    bash benchmarks/gpu_suite.sh --dry-run             # every step tiny on the CPU, through the GPU code paths there

Each step runs its commands under a deadline (its limit, cut to what is left of GPU_SUITE_BUDGET), as its own
process groups, and fails at the first command that fails; its output goes to a log, its Markdown tables become
rows of the JSON, a failed row keeps the first line of its error, a failed step the first lines of its error. The
JSON (with the targets as measured so far) is rewritten when a step starts and ends, every few seconds while one
runs, and on SIGTERM/SIGINT, after which the step in progress is recorded as killed with the rows it had printed;
the logs are kept beside it as one archive. Variables:

    GPU_SUITE_STEPS    comma-separated step names (or --steps): run only those, in the suite's order
    GPU_SUITE_BUDGET   seconds for the whole call (default 500; the dry run 1800)
    GPU_SUITE_CACHE    inductor/Triton caches and the generated data (default ~/.cache/attnlab-gpu-suite): outside
                       the call's scratch folder, so that a second call on a still-warm machine reuses them
    GPU_SUITE_CIFAR    a folder holding real CIFAR-100 (cifar-100-python/) instead of random pixels
    GPU_SUITE_JOBS     children the compile step runs at once (default: the core count)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
MIN_STEP_S = 10  # a step with less of the budget left is skipped
WRITE_EVERY_S = 2.0  # the JSON while a step runs
KILL_GRACE_S = 5.0  # SIGTERM, then SIGKILL


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ------------------------------------------------------------------------------------------------- what runs
@dataclass
class Cmd:
    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Step:
    """One step: ``phases(plan)`` is a list of Cmd (run in order) or lists of Cmd (run together, each waited for);
    ``estimate_s`` is the time on a cold H200 (``why`` says what it rests on); ``after`` turns files a step wrote
    into tables; ``fatal``: a failure stops the suite (the environment check)."""

    name: str
    estimate_s: int
    limit_s: int
    what: str
    why: str
    phases: Callable[["Plan"], list]
    after: Callable[["Plan", dict], list] | None = None
    fatal: bool = False
    fail_fast: bool = False  # a parallel phase: one failed child stops the others (their numbers mean nothing)
    throttle: bool = False  # a parallel phase: at most plan.jobs children at once (else all together)
    needs: tuple[str, ...] = ()  # steps a filter brings along (the data a step reads; a no-op once made)


@dataclass
class Plan:
    """Sizes and paths of one call: ``Plan.for_gpu`` (the measurement) or ``Plan.for_dry_run`` (tiny, on the CPU)."""

    dry: bool
    py: str
    work: Path
    cache: Path
    device: str = "cuda"
    amp: str = "bf16"
    backend: str = "inductor"
    batch: int = 128
    e2e: tuple[int, int, int] = (100, 10, 4)  # steps per round, warm-up steps, rounds
    variants: tuple[str, ...] = ("ns", "dna", "sigma", "speccond")
    vit_opts: str = ""
    swin_opts: str = ""
    ns_batch: int = 128
    ns_timing: tuple[int, int, int] = (10, 40, 3)  # warm-up, timed forwards, rounds
    dna_model: str = "vit_base_patch16_224"
    dna_opts: str = ""
    dna_batch: int = 128
    dna_dtype: str = "bf16"
    dna_timing: tuple[int, int, int] = (10, 50, 3)
    dna_attn: str = "standard,dna,dna[triton],dna[straightforward]"
    pack_model: str = "swin_cifar"
    pack_steps: int = 100
    pack_batch: int = 128
    cifar_train: int = 50000
    cifar_test: int = 10000
    cli_batch: int = 128
    jobs: int = 1  # the compile step's children at once
    precompile_all: bool = True  # the dry run's compile step runs two children (aot_eager fills no cache)
    child_env: dict[str, str] = field(default_factory=dict)

    @property
    def data(self) -> Path:
        real = os.environ.get("GPU_SUITE_CIFAR")
        return Path(real) if real else self.cache / f"cifar100_{self.cifar_train}"

    @property
    def small_data(self) -> Path:  # the trainer's precompile run: same shapes, a few steps
        return self.cache / "cifar100_1024"

    @classmethod
    def for_gpu(cls, py: str, work: Path, cache: Path) -> "Plan":
        return cls(dry=False, py=py, work=work, cache=cache,
                   jobs=int(os.environ.get("GPU_SUITE_JOBS") or os.cpu_count() or 1))

    @classmethod
    def for_dry_run(cls, py: str, work: Path, cache: Path) -> "Plan":
        triton = subprocess.run([py, "-c", "import triton"], capture_output=True).returncode == 0
        return cls(dry=True, py=py, work=work, cache=cache, device="cpu", backend="aot_eager", batch=4,
                   e2e=(2, 1, 2), vit_opts="{depth: 1}", swin_opts="{depths: [2], num_heads: [3]}", ns_batch=2,
                   ns_timing=(1, 1, 2), dna_model="vit_cifar", dna_opts="{depth: 1, embed_dim: 32, num_heads: 2}",
                   dna_batch=2, dna_dtype="fp32", dna_timing=(0, 1, 1),
                   # Triton's CPU interpreter takes the kernel's path (in fp32: it multiplies bf16 as raw bits)
                   dna_attn="standard,dna," + ("dna[triton]," if triton else "") + "dna[straightforward]",
                   pack_model="swin_cifar", pack_steps=2, pack_batch=2, cifar_train=256, cifar_test=64,
                   cli_batch=32, jobs=1, precompile_all=False, child_env={"OMP_NUM_THREADS": "1"})


def opts(text: str) -> list[str]:
    return ["--model-options", text] if text else []


def e2e_cmd(plan: Plan, label: str, model: str, specs: str, *, precompile: bool = False, rounds: int | None = None):
    steps, warmup, r = plan.e2e
    return Cmd(label, [plan.py, str(BENCH / "train_throughput.py"), "--end-to-end", "--models", model, "--attn", specs,
                       "--modes", "compiled", "--compile-backend", plan.backend, "--device", plan.device, "--amp",
                       plan.amp, "--batch-size", str(plan.batch), "--steps", str(steps), "--warmup", str(warmup),
                       "--rounds", str(r if rounds is None else rounds), "--num-classes", "100",
                       *opts(plan.vit_opts if model == "vit_cifar" else plan.swin_opts)]
               + (["--precompile"] if precompile else []))


def ns_cmd(plan: Plan, label: str, models: str, dtypes: str, compiled: bool, *, precompile: bool = False):
    warmup, iters, rounds = (1, 1, 1) if precompile else plan.ns_timing
    model_opts = plan.vit_opts if models == "vit_cifar" else plan.swin_opts if models == "swin_cifar" else ""
    return Cmd(label, [plan.py, str(BENCH / "ns_overhead.py"), "--models", models, "--attn", "standard,ns",
                       "--device", plan.device, "--dtypes", dtypes, "--compile", "yes" if compiled else "no",
                       "--compile-backend", plan.backend, "--batch-size", str(plan.ns_batch), "--num-classes", "100",
                       "--warmup", str(warmup), "--iters", str(iters), "--rounds", str(rounds), *opts(model_opts)])


def dna_cmd(plan: Plan, label: str, attn: str, *, precompile: bool = False):
    warmup, iters, rounds = (1, 1, 1) if precompile else plan.dna_timing
    env = {"TRITON_INTERPRET": "1"} if plan.dry and "dna[triton]" in attn else {}
    return Cmd(label, [plan.py, str(BENCH / "dna_overhead.py"), "--models", plan.dna_model, "--batch-sizes",
                       str(plan.dna_batch), "--attn", attn, "--device", plan.device, "--dtype", plan.dna_dtype,
                       "--warmup", str(warmup), "--iters", str(iters), "--rounds", str(rounds),
                       *opts(plan.dna_opts)], env)


def lm_cmd(plan: Plan, label: str):
    """The Llama-shaped decoder (llama_mini) against a plain PyTorch model of its shape, training, eager and
    compiled (the dry run: eager, tiny)."""
    small = plan.dry
    return Cmd(label, [plan.py, str(BENCH / "lm_throughput.py"), "--model", "llama_mini", "--device", plan.device,
                       "--modes", "train", "--compile", "none" if small else "both", "--no-memory",
                       "--batch-size", "2" if small else "16", "--block-size", "16" if small else "256",
                       "--rounds", "1" if small else "3", "--steps", "1" if small else "10",
                       "--warmup", "1" if small else "3"], plan.child_env)


def ladder_cmd(plan: Plan, label: str):
    """Training tokens/s and MFU of two ladder sizes (ladder_d512, ladder_d1024: 25M and 202M without embeddings),
    bf16, compiled, batch 16 x 512 tokens of a 32k vocabulary (the dry run: ladder_d128, eager, tiny)."""
    small = plan.dry
    return Cmd(label, [plan.py, str(BENCH / "lm_throughput.py"), "--ladder",
                       "ladder_d128" if small else "ladder_d512,ladder_d1024", "--device", plan.device, "--amp",
                       plan.amp, "--compile", "none" if small else "only", "--vocab-size", "256" if small else "32000",
                       "--batch-size", "2" if small else "16", "--block-size", "16" if small else "512",
                       "--rounds", "1" if small else "3", "--steps", "1" if small else "10",
                       "--warmup", "1" if small else "3"], plan.child_env)


def cli_cmd(plan: Plan, label: str, data: Path, epochs: int, name: str):
    train = ["-m", "attnlab", "train", "--recipe", "ns_cifar", "--model", "vit_cifar", "--dataset", "cifar100",
             "--data-dir", str(data), "--data-options", "{verify_md5: false}", "--epochs", str(epochs),
             "--warmup-epochs", "0",  # a 2-epoch throughput run: the recipe's 10 warm-up epochs would not fit
             "--batch-size", str(plan.cli_batch), "--device", plan.device, "--amp", plan.amp, "--compile",
             "--data-on-device", "--runs-dir", str(plan.work / "runs"), "--name", name, "--no-progress",
             *opts(plan.vit_opts)]
    if plan.backend != "inductor":  # the trainer has no backend option: torch.compile's default replaced
        return Cmd(label, [plan.py, str(BENCH / "with_backend.py"), plan.backend, *train])
    return Cmd(label, [plan.py, *train])


def data_phases(plan: Plan) -> list:
    out = [Cmd("cifar_small", [plan.py, str(BENCH / "fake_cifar.py"), str(plan.small_data), "--train", "1024",
                               "--test", "512"])] if not plan.dry else []
    if not os.environ.get("GPU_SUITE_CIFAR"):
        out.append(Cmd("cifar", [plan.py, str(BENCH / "fake_cifar.py"), str(plan.data), "--train",
                                 str(plan.cifar_train), "--test", str(plan.cifar_test)]))
    return out


def compile_phases(plan: Plan) -> list:
    """Every graph a later step compiles, compiled at once in parallel processes into the shared cache: one cold
    compile is mostly single-threaded Python, and the machine has 16 cores."""
    kids = [e2e_cmd(plan, f"vit_{s}", "vit_cifar", s, precompile=True) for s in ("standard", *plan.variants)]
    kids.append(e2e_cmd(plan, "swin_standard", "swin_cifar", "standard", precompile=True))
    kids += [ns_cmd(plan, f"ns_{m}_{d}", m, d, True, precompile=True) for m in ("vit_cifar", "swin_cifar")
             for d in ("bf16", "fp32")]
    if "dna[triton]" in plan.dna_attn:
        kids.append(dna_cmd(plan, "dna_triton", "dna[triton]", precompile=True))
    if not plan.dry:  # the trainer's own train and (padded) eval graphs, on 8 steps of the same shapes
        kids.append(cli_cmd(plan, "train_cli", plan.small_data, 1, "precompile"))
    for kid in kids:  # 2 Triton build workers each: the children share the cores
        kid.env["TORCHINDUCTOR_COMPILE_THREADS"] = "2"
    return [kids if plan.precompile_all else kids[:2]]


def ns_phases(plan: Plan, label: str, dtypes: str, compiled: bool) -> list:
    """Both models in one process; in the dry run one process each, since each has its own tiny options."""
    if not plan.dry:
        return [ns_cmd(plan, label, "vit_cifar,swin_cifar", dtypes, compiled)]
    return [ns_cmd(plan, f"{label}_{m}", m, dtypes, compiled) for m in ("vit_cifar", "swin_cifar")]


def packed_phases(plan: Plan) -> list:
    def one(rank: int, n: int) -> Cmd:
        return Cmd(f"pack_{n}_{rank}", [plan.py, str(BENCH / "pack.py"), str(rank), str(n), "--work",
                                        str(plan.work), "--model", plan.pack_model, "--steps", str(plan.pack_steps),
                                        "--batch-size", str(plan.pack_batch), "--device", plan.device, "--amp",
                                        plan.amp, "--barrier-timeout", "60" if not plan.dry else "300",
                                        *opts(plan.swin_opts if plan.pack_model == "swin_cifar" else plan.vit_opts)])
    return [one(0, 1), [one(i, 3) for i in range(3)]]


def packed_after(plan: Plan, rec: dict) -> list:
    """The packing ratio from the four processes' rows: three started together against one alone."""
    rows = [r for t in rec["tables"] for r in t if "processes" in r]
    one = [r["img/s"] for r in rows if r["processes"] == 1]
    three = [r["img/s"] for r in rows if r["processes"] == 3]
    if not one or len(three) != 3:
        return []
    return [[{"model": plan.pack_model, "processes": 1.0, "img/s (sum)": one[0], "ratio to one": 1.0},
             {"model": plan.pack_model, "processes": 3.0, "img/s (sum)": sum(three),
              "ratio to one": round(sum(three) / one[0], 3)}]]


def cli_after(plan: Plan, rec: dict) -> list:
    """The trainer's epochs from its metrics.jsonl (kept if the step is stopped after an epoch); epoch 1 includes
    compilation, so the rate is the last epoch's from epoch 2 on."""
    path = plan.work / "runs" / "e2e_vit_cifar" / "metrics.jsonl"
    if not path.exists():
        return []
    shutil.copy(path, plan.work / "logs" / rec["name"] / "metrics.jsonl")
    epochs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"model": "vit_cifar", "epoch": float(m["epoch"]), "img/s": m["img_per_s"],
              "epoch s": m["epoch_seconds"], "top1": m["top1"]} for m in epochs]]


def steps_table() -> list[Step]:
    """The suite's steps, the most valuable first; estimates are seconds on a cold H200 (docs/perf.md)."""
    return [
        Step("env", 15, 60, "versions, every torch/timm/torchvision name attnlab uses, a bf16 training step of each "
             "suite model and variant", "process start and imports ~5, CUDA start ~2, name scan ~1, 9 small "
             "eager steps ~5", lambda p: [Cmd("check_env", [p.py, str(BENCH / "check_env.py"), "--device",
                                                               p.device])], fatal=True),
        Step("data", 5, 60, "50,000 + 10,000 random images in CIFAR-100's layout (and 1,024 for the compile step); "
             "kept in the cache", "numpy writes 180 MB; nothing when a second call finds it", data_phases),
        Step("compile", 120, 200, "every later graph compiled at once, in parallel processes, into the cache",
             "the slowest cold compile (swin_cifar or a vit_cifar variant training graph: Dynamo+AOT tracing "
             "10-16 s on a 2-core VM, inductor lowering and Triton builds ~4x that) with 13 processes on 16 cores",
             compile_phases, throttle=True, needs=("data",)),
        Step("variants", 70, 150, "vit_cifar full recipe on the device pipeline, compiled, bf16, batch 128: "
             "standard (the end-to-end target), then ns, dna, sigma, speccond, each timed against standard",
             "5 x (graph from the cache: Dynamo ~6-10 s, CUDA graphs ~2 s; 4 rounds x 100 steps x 2 at ~40k "
             "img/s ~3 s) + start ~6",
             lambda p: [e2e_cmd(p, "variants", "vit_cifar", ",".join(("standard", *p.variants)))]),
        Step("ns_compiled", 40, 90, "ns_overhead.py, batch 128, compiled, bf16 then fp32, vit_cifar and swin_cifar",
             "8 forward graphs from the cache ~3.5 s each, 8 x 300 forwards of 1-6 ms, start ~6",
             lambda p: ns_phases(p, "ns_compiled", "bf16,fp32", True)),
        Step("e2e_swin", 25, 90, "swin_cifar full recipe, compiled, bf16, batch 128: the end-to-end target",
             "graph from the cache ~10 s, 3 rounds of 100 steps at ~10k img/s ~4 s, start ~6",
             lambda p: [e2e_cmd(p, "e2e_swin", "swin_cifar", "standard", rounds=3)]),
        Step("dna_vit_b", 30, 90, "dna_overhead.py ViT-B/16, batch 128, bf16: standard, dna, dna[triton], "
             "dna[straightforward], each checked against dna", "4 ViT-B builds on the CPU ~8 s, Triton autotune "
             "from the cache ~2 s, 720 forwards of ~9 ms ~7 s, start ~6",
             lambda p: [dna_cmd(p, "dna_vit_b", p.dna_attn)]),
        Step("ns_eager", 22, 90, "ns_overhead.py, batch 128, eager, fp32 and bf16, vit_cifar and swin_cifar",
             "1,200 eager forwards of 4-12 ms (launch-bound) ~10 s, start ~6",
             lambda p: ns_phases(p, "ns_eager", "fp32,bf16", False)),
        Step("packed", 28, 90, "swin_cifar training steps (model step alone, eager, bf16): one process, then 3 "
             "started together behind a barrier", "alone: start ~6 + 100 steps at 3.0k img/s ~4 s; together: "
             "start ~6 + 100 steps at ~2k img/s each ~6 s; warm-ups ~4", packed_phases, packed_after,
             fail_fast=True),
        Step("llama_lm", 35, 120, "lm_throughput.py llama_mini (grouped-query attention, RoPE, SwiGLU), batch 16 x "
             "256 tokens, training, eager and compiled, against a plain PyTorch model of its shape",
             "start ~6, 4 model builds ~3 s, 2 compiles ~10 s each, 3 rounds x 10 steps x 4 arms ~4 s",
             lambda p: [lm_cmd(p, "llama_lm")]),
        Step("ladder_lm", 60, 150, "lm_throughput.py --ladder: ladder_d512 and ladder_d1024 (the size ladder, 25M "
             "and 202M parameters without embeddings), batch 16 x 512 tokens, vocab 32k, training, bf16, compiled: "
             "tokens/s and MFU", "start ~6, 2 builds on the CPU ~5 s, 2 cold compiles ~20 s each (not in the "
             "compile step), 3 rounds x 10 steps of 8k tokens at ~30-120 ms ~5 s",
             lambda p: [ladder_cmd(p, "ladder_lm")]),
        Step("e2e_cli", 30, 90, "attnlab train --compile, recipe ns_cifar, vit_cifar on CIFAR-100's layout, bf16, "
             "device data, 2 epochs: epoch 2's img/s from metrics.jsonl", "start ~7, train and eval graphs from the "
             "cache ~10 s, 2 epochs of 390 steps at ~35k img/s ~3 s, 2 evaluations and checkpoints ~3 s",
             lambda p: [cli_cmd(p, "e2e_cli", p.data, 2, "e2e_vit_cifar")], cli_after, needs=("data",)),
        Step("vlm_probes", 20, 90, "vlm_probes.py: DnA probes / standard probes training-step time on VideoLLaMA3's "
             "SigLIP-NaViT geometry (random weights, frozen), 16 probes at all 27 layers, 2 clips x 16 frames of "
             "224 px, bf16: the whole step and the probes alone", "start ~6, two 400M-parameter encoders built on the "
             "CPU ~6 s, 2 rows x 3 rounds x 13 steps x 2 arms of ~15 ms ~3 s",
             lambda p: [Cmd("vlm_probes", [p.py, str(BENCH / "vlm_probes.py"), "--device", p.device, "--amp", p.amp]
                            + (["--encoder", "dry", "--frames", "2", "--size", "28", "--probes", "4", "--steps", "1",
                                "--warmup", "0", "--rounds", "1"] if p.dry else
                               ["--encoder", "videollama3", "--frames", "16", "--size", "224", "--steps", "10",
                                "--warmup", "3", "--rounds", "3"]), p.child_env)]),
    ]


# ------------------------------------------------------------------------------------------------- reading output
def parse_cell(cell: str):
    try:
        return float(cell)
    except ValueError:
        return cell


def tables(text: str) -> list[list[dict]]:
    """The Markdown tables in a log, as lists of row dicts (numbers where the cells are numbers). A header is the
    line above a ``|---|`` line; a row belongs to the last header with as many cells, so lines another stream wrote
    between two rows (a warning on stderr) do not split a table."""
    found: list[list[dict]] = []
    header, pending = None, None

    def add(cells):
        if header is not None and len(cells) == len(header):
            found[-1].append(dict(zip(header, map(parse_cell, cells))))

    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(c and set(c) <= set("-: ") for c in cells):
            if pending is not None:
                header, pending = pending, None
                found.append([])
            continue
        if pending is not None:
            add(pending)
        pending = cells
    if pending is not None:
        add(pending)
    return found


def error_lines(text: str, n: int = 5) -> list[str]:
    """The first lines of a failure: the exception of the last Python traceback, else the last lines printed."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        block = lines[starts[-1] + 1:]
        first = next((i for i, line in enumerate(block) if line and not line[0].isspace()), None)
        if first is not None:
            return block[first:first + n]
    return [line for line in lines if line.strip()][-n:]


# ------------------------------------------------------------------------------------------------- targets
def step_rows(record: dict, name: str) -> list[dict]:
    rec = record["steps"].get(name)
    return [r for t in (rec["tables"] + rec["derived"]) for r in t] if rec else []


def target(value, goal: str, ok: Callable[[float], bool], source: str, missing=(), wrong=False) -> dict:
    status = "missing" if value is None else "wrong result" if wrong else "partial" if missing else "measured"
    met = None if value is None else (False if wrong or not ok(value) else None if missing else True)
    return {"value": value, "target": goal, "met": met, "status": status, "source": source,
            **({"missing": list(missing)} if missing else {})}


def targets(record: dict, plan: Plan) -> dict:
    def ok_rows(step):
        return [r for r in step_rows(record, step) if r.get("status", "ok") == "ok"]

    def e2e(step, model):
        r = [x for x in ok_rows(step) if x.get("model") == model and x.get("variant") == "standard"]
        return r[0]["img/s (median of rounds)"] if r else None

    out = {"vit_cifar end-to-end img/s (compiled, bf16, full recipe)":
           target(e2e("variants", "vit_cifar"), ">= 30000", lambda v: v >= 30000, "variants"),
           "swin_cifar end-to-end img/s": target(e2e("e2e_swin", "swin_cifar"), ">= 10000", lambda v: v >= 10000,
                                                "e2e_swin")}
    measured = {r["variant"]: r["ratio to standard"] for r in ok_rows("variants") if r.get("variant") != "standard"
                and isinstance(r.get("ratio to standard"), float)}
    out["every variant / standard, training (compiled)"] = target(
        min(measured.values()) if measured else None, ">= 0.95", lambda v: v >= 0.95, "variants",
        missing=[v for v in plan.variants if v not in measured])
    packed = [r["ratio to one"] for r in step_rows(record, "packed") if r.get("processes") == 3.0
              and "ratio to one" in r]
    out["3 packed swin_cifar / one"] = target(packed[0] if packed else None, ">= 2", lambda v: v >= 2, "packed")
    ns = {(r["model"], r["dtype"], r["mode"]): r["ns / standard"] for s in ("ns_eager", "ns_compiled")
          for r in ok_rows(s) if isinstance(r.get("ns / standard"), float)}
    expected = [(m, d, mode) for m in ("vit_cifar", "swin_cifar") for d in ("fp32", "bf16")
                for mode in ("eager", "compiled")]
    out["NS-Attn time / standard, worst row"] = target(
        max(ns.values()) if ns else None, "<= 1.05", lambda v: v <= 1.05, "ns_eager, ns_compiled",
        missing=[" ".join(k) for k in expected if k not in ns])
    dna_rows = step_rows(record, "dna_vit_b")
    for spec in ("dna", "dna[triton]"):
        r = [x for x in dna_rows if x.get("attention") == spec]
        out[f"{spec} ViT-B/16 throughput / standard ({plan.dna_dtype})"] = target(
            r[0]["throughput vs standard"] if r else None, ">= 0.85", lambda v: v >= 0.85, "dna_vit_b",
            wrong=bool(r) and r[0].get("check") == "WRONG")
    lm = [r["/ plain"] for r in ok_rows("llama_lm") if r.get("arm") == "standard" and r.get("mode") == "train"
          and isinstance(r.get("/ plain"), float)]
    out["llama_mini training tokens/s / plain PyTorch, worst of eager and compiled"] = target(
        min(lm) if lm else None, ">= 0.95", lambda v: v >= 0.95, "llama_lm")
    for r in ok_rows("ladder_lm"):  # no threshold: the first GPU run measures them
        mode = "compiled" if r.get("compiled") == "yes" else "eager"
        out[f"{r['model']} training MFU ({mode}, {r.get('amp')})"] = target(
            r.get("MFU") if isinstance(r.get("MFU"), float) else None, "measured", lambda v: True, "ladder_lm")
    epochs = [r for r in step_rows(record, "e2e_cli") if "epoch" in r]
    later = [r for r in epochs if r["epoch"] >= 2]
    t = target(later[-1]["img/s"] if later else None, ">= 30000", lambda v: v >= 30000, "e2e_cli")
    if epochs and not later:
        t.update(status="partial", note="only epoch 1 finished, whose rate includes compilation")
    out["attnlab train --compile vit_cifar img/s (epoch 2)"] = t
    return out


# ------------------------------------------------------------------------------------------------- the run
class Suite:
    def __init__(self, steps: list[Step], plan: Plan, out: Path, budget: float):
        self.steps, self.plan, self.out, self.budget = steps, plan, out, budget
        self.archive_path = out.with_name(out.stem + "_logs.tar.gz")
        self.start = time.monotonic()
        self.running: list[subprocess.Popen] = []
        self.record = {
            "suite": "attnlab benchmarks/gpu_suite.sh", "dry_run": plan.dry,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "budget_s": budget,
            "estimate_s": sum(s.estimate_s for s in steps), "cache": str(plan.cache), "elapsed_s": 0.0,
            "finished": False, "interrupted": None,
            "steps": {s.name: {"name": s.name, "status": "pending", "what": s.what, "estimate_s": s.estimate_s,
                               "estimate_basis": s.why, "limit_s": None, "seconds": None, "commands": [],
                               "tables": [], "derived": [], "notes": [], "failed_rows": [], "error": [],
                               "tail": ""} for s in steps},
            "targets": {},
        }

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    # ---- files
    def write(self) -> None:
        self.record["elapsed_s"] = round(time.monotonic() - self.start, 1)
        self.record["targets"] = targets(self.record, self.plan)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(f".{self.out.name}.tmp")
        tmp.write_text(json.dumps(self.record, indent=1))
        os.replace(tmp, self.out)

    def archive(self) -> None:
        logs = self.plan.work / "logs"
        if not logs.exists():
            return
        tmp = self.archive_path.with_name(f".{self.archive_path.name}.tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(logs, arcname="gpu_suite_logs")
        os.replace(tmp, self.archive_path)

    def collect(self, step: Step, rec: dict) -> None:
        """The step's rows, notes and failures from its logs so far (a killed step keeps what it printed)."""
        texts = [Path(c["log"]).read_text(errors="replace") for c in rec["commands"] if Path(c["log"]).exists()]
        rec["tables"] = [t for text in texts for t in tables(text)]
        rec["notes"] = [line for text in texts for line in text.splitlines() if line.startswith("# ")][-40:]
        rec["failed_rows"] = [r for t in rec["tables"] for r in t
                              if str(r.get("status", r.get("check", ""))).startswith(("failed", "WRONG"))]
        rec["tail"] = "\n".join(f"[{c['label']}] " + t[-1500:] for c, t in zip(rec["commands"], texts))[-4000:]
        if step.after is not None:
            try:
                rec["derived"] = step.after(self.plan, rec)
            except Exception as err:  # noqa: BLE001 - a step's files unreadable: recorded, not fatal
                rec["notes"].append(f"# reading the step's files failed: {type(err).__name__}: {err}")

    # ---- processes
    def kill(self, procs) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + KILL_GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()

    def launch(self, step: Step, rec: dict, cmds: list[Cmd], deadline: float) -> str:
        """Run ``cmds`` together (at most ``plan.jobs`` at once), waiting for each; returns ok, failed or
        timed_out. Each child leads its own process group, so that a kill reaches the processes it started."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
                   filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "TORCHINDUCTOR_CACHE_DIR": str(self.plan.cache / "inductor"),
               "TRITON_CACHE_DIR": str(self.plan.cache / "triton"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
               "TORCHINDUCTOR_AUTOGRAD_CACHE": "1", **self.plan.child_env}
        jobs = self.plan.jobs if step.throttle else len(cmds)
        queue, active, status = list(cmds), {}, "ok"
        last_write = time.monotonic()
        try:
            while queue or active:
                while queue and len(active) < jobs:
                    cmd = queue.pop(0)
                    log = self.plan.work / "logs" / step.name / f"{cmd.label}.log"
                    log.parent.mkdir(parents=True, exist_ok=True)
                    entry = {"label": cmd.label, "command": shlex.join(cmd.argv), "rc": None, "status": "running",
                             "seconds": None, "log": str(log)}
                    rec["commands"].append(entry)
                    with open(log, "w") as f:
                        f.write(f"$ {entry['command']}\n")
                        f.flush()
                        # its own process group (not session: the device tool ends a call's session)
                        proc = subprocess.Popen(cmd.argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                                env={**env, **cmd.env}, preexec_fn=os.setpgrp)
                    active[proc] = (entry, time.monotonic())
                    self.running.append(proc)
                for proc, (entry, t0) in list(active.items()):
                    rc = proc.poll()
                    if rc is None:
                        continue
                    del active[proc]
                    self.running.remove(proc)
                    entry.update(rc=rc, status="ok" if rc == 0 else "failed", seconds=round(time.monotonic() - t0, 1))
                    if rc != 0:
                        status = "failed"
                        entry["error"] = error_lines(Path(entry["log"]).read_text(errors="replace"))
                        if step.fail_fast:  # the others' numbers would mean nothing
                            queue.clear()
                            self.stop(active, "stopped")
                if active and time.monotonic() > deadline:
                    self.stop(active, "timed_out")
                    return "timed_out"
                if time.monotonic() - last_write > WRITE_EVERY_S:
                    self.collect(step, rec)
                    self.write()
                    last_write = time.monotonic()
                if active:
                    time.sleep(0.1)
        except Interrupted:
            self.stop(active, "killed")
            raise
        return status

    def stop(self, active: dict, status: str) -> None:
        self.kill(list(active))
        for proc, (entry, t0) in list(active.items()):
            entry.update(rc=proc.returncode, status=status, seconds=round(time.monotonic() - t0, 1))
            self.running.remove(proc)
        active.clear()

    # ---- steps
    def run_step(self, step: Step) -> str:
        rec = self.record["steps"][step.name]
        left = self.left()
        if left < MIN_STEP_S:
            rec.update(status="skipped", note=f"{left:.0f} s of the {self.budget:g} s budget left")
            return "skipped"
        limit = min(step.limit_s if not self.plan.dry else 10 * step.limit_s, left)
        rec.update(status="running", limit_s=round(limit))
        self.write()
        t0 = time.monotonic()
        status = "ok"
        try:
            for phase in step.phases(self.plan):
                status = self.launch(step, rec, phase if isinstance(phase, list) else [phase], t0 + limit)
                if status != "ok":
                    break
        except Interrupted:
            status = "killed"
            raise
        finally:
            rec.update(status=status, seconds=round(time.monotonic() - t0, 1))
            self.collect(step, rec)
            if status != "ok":
                rec["error"] = next((c["error"] for c in rec["commands"] if c.get("error")), []) or \
                    [f"{status} after {rec['seconds']:g} s (limit {limit:.0f} s)"]
            self.write()
            self.archive()
        return status

    def run(self) -> int:
        def on_signal(signum, frame):
            raise Interrupted(signum)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, on_signal)
        code = 0
        try:
            self.write()
            for step in self.steps:
                status = self.run_step(step)
                print(f"{step.name:<12} {status:<10} {self.record['steps'][step.name]['seconds'] or 0:6.1f} s "
                      f"(estimate {step.estimate_s} s)", flush=True)
                if status != "ok":
                    code = 1
                if status != "ok" and step.fatal:
                    for rest in self.steps[self.steps.index(step) + 1:]:
                        self.record["steps"][rest.name]["status"] = "stopped"
                    err = self.record["steps"][step.name]["error"]
                    print(f"gpu_suite: stopped after {step.name}: {err[-1] if err else status}", file=sys.stderr,
                          flush=True)
                    code = 3
                    break
            self.record["finished"] = True
        except Interrupted as sig:
            self.kill(list(self.running))  # a signal between two children of a step
            for rec in self.record["steps"].values():
                if rec["status"] == "running":  # a signal while the step's own records were being written
                    rec["status"] = "killed"
            self.record["interrupted"] = sig.args[0]
            code = 128 + sig.signum
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)  # the last write is not interrupted
            self.write()
            self.archive()
        self.summary()
        return code

    def summary(self) -> None:
        print(f"\n{'step':<12} {'status':<10} {'s':>6} {'est.':>5}")
        for name, s in self.record["steps"].items():
            print(f"{name:<12} {s['status']:<10} {s['seconds'] or 0:6.1f} {s['estimate_s']:5d}")
        for name, t in self.record["targets"].items():
            print(f"{name}: {t['value']} (target {t['target']}; {t['status']}; met: {t['met']})")
        print(f"wrote {self.out} and {self.archive_path}" + (" (dry run: the numbers mean nothing)"
                                                             if self.plan.dry else ""), flush=True)


def select(steps: list[Step], names: str | None) -> list[Step]:
    if not names:
        return steps
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {s.name for s in steps}]
    if unknown:
        raise SystemExit(f"gpu_suite: unknown step {', '.join(unknown)}; the steps are "
                         f"{', '.join(s.name for s in steps)}")
    wanted += [n for s in steps if s.name in wanted for n in s.needs]
    return [s for s in steps if s.name in wanted]


def main(argv=None, steps: list[Step] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", type=Path, help="the JSON file (default $OUT/gpu_suite.json or ./gpu_suite.json)")
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_SUITE_DRY") == "1",
                   help="every step tiny on the CPU (GPU_SUITE_DRY=1)")
    p.add_argument("--steps", default=os.environ.get("GPU_SUITE_STEPS"), help="comma-separated step names")
    p.add_argument("--list", action="store_true", help="print the steps with their estimates and exit")
    args = p.parse_args(argv)
    chosen = select(steps or steps_table(), args.steps)
    if args.list:
        for s in chosen:
            print(f"{s.name:<12} {s.estimate_s:4d} s  {s.what}")
        print(f"{'sum':<12} {sum(s.estimate_s for s in chosen):4d} s")
        return 0
    out = (args.out or (Path(os.environ["OUT"]) / "gpu_suite.json" if os.environ.get("OUT") else
                        Path("gpu_suite.json"))).resolve()
    budget = float(os.environ.get("GPU_SUITE_BUDGET") or (1800 if args.dry_run else 500))
    default_cache = Path(tempfile.gettempdir()) / "attnlab-gpu-suite-dry" if args.dry_run else \
        Path.home() / ".cache" / "attnlab-gpu-suite"
    cache = Path(os.environ.get("GPU_SUITE_CACHE") or default_cache).resolve()
    work = Path(tempfile.mkdtemp(prefix="gpu_suite."))
    try:
        plan = (Plan.for_dry_run if args.dry_run else Plan.for_gpu)(sys.executable, work, cache)
        return Suite(chosen, plan, out, budget).run()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
