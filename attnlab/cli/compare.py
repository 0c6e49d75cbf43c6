"""`attnlab compare`: train a grid of models x datasets x seeds x attention variants, then print the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnlab.cli.checks import count
from attnlab.cli.train import add_config_flags
from attnlab.errors import ConfigError

_GRID_FLAGS = ("attn", "seeds", "datasets", "models")
LAUNCHERS = ("local", "submitit", "submitit-local")  # attnlab.train.launch.LAUNCHERS, without importing torch
_SLURM_FLAGS = ("partition", "account", "time", "gpus_per_node", "cpus_per_task", "nproc_per_run")
# TrainConfig keys also offered as flags here (the grid's own axes are model, dataset, attn, seed)
_BASE_FLAGS = ("recipe", "epochs", "batch_size", "lr", "weight_decay", "warmup_epochs", "device", "amp", "compile",
               "data_dir", "download", "num_workers", "progress")


def configure(parser: argparse.ArgumentParser) -> None:
    from attnlab.train.config import GRID_PRESETS

    parser.description = (
        "Train every combination of models, datasets, seeds and attention variants one after another\n"
        "(or --jobs N at a time; finished runs are skipped, interrupted ones resumed), add each run's\n"
        "instrument summaries (--analyze), then write and print the report of the runs directory.")
    parser.epilog = ("examples:\n"
                     "  attnlab compare --preset demo              # digits, every demo variant, seeds 0,1,2\n"
                     "  attnlab compare --config configs/grid.yaml\n"
                     "  attnlab compare --models vit_cifar --datasets cifar10 --attn standard,ns --seeds 0,1,3")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--preset", choices=sorted(GRID_PRESETS),
                        help="named grid: demo (seconds per run on a CPU) or ns_table1 (the NS-Attn paper's Table 1); "
                             "the default when neither --config nor grid flags are given is demo")
    parser.add_argument("--config", metavar="YAML",
                        help="grid file: variants, seeds, datasets, models, runs_dir lists and 'base:' training keys")
    parser.add_argument("--attn", metavar="SPECS",
                        help="comma-separated attention specs, e.g. 'standard,ns,dna(variant=q)' (default: every "
                             "registered variant marked for the demo)")
    parser.add_argument("--seeds", metavar="LIST", help="comma-separated seeds, e.g. 0,1,3")
    parser.add_argument("--datasets", metavar="LIST", help="comma-separated dataset names (default: the recipe's)")
    parser.add_argument("--models", metavar="LIST", help="comma-separated model names (default: the recipe's)")
    parser.add_argument("--runs-dir", dest="runs_dir", metavar="DIR",
                        help="where the run directories and the report go (default: the preset's or grid file's, else runs)")
    parser.add_argument("--analyze", default=None, metavar="LIST",
                        help="instruments run on each finished run's first 160 test images, their summaries added to "
                             "result.json and shown as report columns (default: spectra, i.e. p1 and effective rank, "
                             "except on video-LLM grids; 'none' to skip)")
    parser.add_argument("--jobs", type=count(1), default=None, metavar="N",
                        help="train N runs at a time in worker processes (default 1: one after another; the demo "
                             "preset uses 2, one thread each), placed one per GPU when there are several "
                             "(CUDA_VISIBLE_DEVICES respected) and packed on the GPU when there is one; results do "
                             "not depend on N. With --launcher submitit: at most N jobs running at once")
    cluster = parser.add_argument_group("cluster (one job per run through submitit; pip install attnlab[cluster])")
    cluster.add_argument("--launcher", choices=LAUNCHERS, default=None,
                         help="local: this machine (default); submitit: one SLURM job per run, same run directories "
                              "and resume, logs in RUNS_DIR/.submitit; submitit-local: the same jobs as local "
                              "processes (to try a grid before submitting it)")
    cluster.add_argument("--slurm-partition", metavar="NAME", help="SLURM partition of the jobs")
    cluster.add_argument("--slurm-account", metavar="NAME", help="SLURM account charged for the jobs")
    cluster.add_argument("--slurm-time", type=count(1), metavar="MIN", help="time limit of each job in minutes")
    cluster.add_argument("--slurm-gpus-per-node", type=count(0), metavar="N", help="GPUs per job (default 1)")
    cluster.add_argument("--slurm-cpus-per-task", type=count(1), metavar="N", help="CPU cores per job")
    cluster.add_argument("--nproc-per-run", dest="slurm_nproc_per_run", type=count(1), metavar="N",
                         help="processes each run trains with (DDP, or --parallel fsdp): on this machine each run "
                              "under torchrun --nproc_per_node N, one at a time; with --launcher submitit, N tasks "
                              "(and N GPUs) per job")
    parser.add_argument("--no-report", dest="report", action="store_false",
                        help="train only; do not write or print the report")
    parser.add_argument("--plan", action="store_true",
                        help="check every run (model, dataset, spec, options, instruments, run directory) and print "
                             "which would be trained, resumed or skipped, without training")
    group = parser.add_argument_group("training config applied to every run (overrides the recipe and --config)")
    add_config_flags(group, only=_BASE_FLAGS)


def run(args: argparse.Namespace) -> int:
    from attnlab.analysis import training_probe  # for runs with probe_every
    from attnlab.analysis.instruments import INSTRUMENTS
    from attnlab.train import load_grid, run_grid
    from attnlab.train.config import deferred_notes, say_notes
    from attnlab.train.files import RESULT
    from attnlab.train.grid import format_plan, plan_grid

    base = {k: getattr(args, k) for k in _BASE_FLAGS if hasattr(args, k)}
    preset = args.preset
    if preset is None and args.config is None and not any(getattr(args, k) for k in _GRID_FLAGS):
        preset = "demo"
    from attnlab.train.tasks import task_class

    with deferred_notes() as notes:  # said once every check has passed: a refused grid prints its one line
        grid = load_grid(args.config, preset, variants=args.attn, seeds=args.seeds, datasets=args.datasets,
                         models=args.models, runs_dir=args.runs_dir, jobs=args.jobs, launcher=args.launcher,
                         launcher_options={k: getattr(args, "slurm_" + k) for k in _SLURM_FLAGS}, **base)
        progress = grid["base"].run.progress
        what = [w.strip() for w in (args.analyze or "spectra").split(",") if w.strip() and w.strip() != "none"]
        unknown = [w for w in what if w not in INSTRUMENTS]
        if unknown:
            raise ConfigError(f"unknown instrument {unknown[0]!r} in --analyze; choose from: "
                              f"{', '.join(INSTRUMENTS)} (or none).")
        plans = plan_grid(grid["base"], grid["variants"], grid["seeds"], grid["datasets"], grid["models"],
                          grid["runs_dir"], variations=grid["variations"])
        if args.analyze is None and plans and not any(task_class(p["cfg"].family).default_instruments for p in plans):
            what = []  # families whose models the instruments do not read yet (vlm) skip the default spectra
        if what:
            from attnlab.analysis.instruments import check_instruments

            check_instruments(what, [p["cfg"] for p in plans])  # an instrument no run can take: before training
    say_notes(notes)
    if args.plan:
        print(format_plan(plans))
        return 0
    results = run_grid(grid["base"], grid["variants"], grid["seeds"], grid["datasets"], grid["models"],
                       grid["runs_dir"], progress=progress, variations=grid["variations"], jobs=int(grid["jobs"]),
                       probe=training_probe, launcher=grid["launcher"], launcher_options=grid["launcher_options"],
                       plans=plans)
    if what:
        from attnlab.analysis.instruments import annotate_runs

        if progress:
            print(f"analysing finished runs: {', '.join(what)}", flush=True)
        annotate_runs([Path(grid["runs_dir"]) / r["name"] for r in results], what, progress=progress)
        results = [json.loads((Path(grid["runs_dir"]) / r["name"] / RESULT).read_text()) for r in results]
    if not args.report:
        from attnlab.train.files import result_line

        for r in results:
            print(result_line(r))
        return 0
    from attnlab.report import write_report

    report = write_report(grid["runs_dir"])
    print(report["markdown"])
    return 0
