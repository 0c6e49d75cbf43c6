"""Rebuild report.md, report.json and one self-contained report.html (figures embedded, opens offline) from the run
directories under RUNS_DIR, reading only their files: per variant the final-epoch top-1 as mean and sample SD over
seeds, the gain in percentage points against the baseline computed from unrounded means, and matched-seed wins; the
ablation (NS-Attn Table 2 form), latency from `attnlab bench --json` files (Table 3 form), head-output spectra,
parameters and GFLOPs, training curves and every figure `attnlab analyze` wrote. Unfinished runs and files that
cannot be read are listed on the page."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import AttnlabError, ConfigError, did_you_mean
from .checks import output_dir


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs_dir", metavar="RUNS_DIR", help="directory holding run folders (each with result.json)")
    p.add_argument("--out", default=None, help="where to write the report (default: RUNS_DIR)")
    p.add_argument("--baseline", default=None, help="variant the gains and wins are measured against (default: "
                                                     "standard)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--bench", action="append", default=[], metavar="JSON",
                   help="an `attnlab bench --json` file for the latency table (repeatable; files named *bench*.json "
                        "or *latency*.json under RUNS_DIR are read anyway)")


def run(args) -> int:
    from ..report import write_report
    from ..report.summary import load_runs

    if Path(args.runs_dir).exists() and not Path(args.runs_dir).is_dir():
        raise ConfigError(f"RUNS_DIR {args.runs_dir} is a file; give the folder that holds the run directories.")
    output_dir(args.out or args.runs_dir, "--out")
    if args.baseline is not None:  # a baseline no run has is a typo; the default may be absent from a grid
        variants = sorted({"".join(str(r["attn"]).split()) for r in load_runs(args.runs_dir)})
        if "".join(args.baseline.split()) not in variants:
            raise ConfigError(f"--baseline {args.baseline!r} is no run's variant"
                              f"{did_you_mean(args.baseline, variants)}; the runs' variants are: "
                              f"{', '.join(variants)}.")

    from ..report.tables import read_bench

    for path in args.bench:  # a file named on the command line must be one; those found below RUNS_DIR are listed
        if not Path(path).is_file():
            raise ConfigError(f"--bench {path} is not a file; give the JSON that attnlab bench --json wrote.")
        try:
            read_bench(path)
        except AttnlabError as err:
            raise ConfigError(f"--bench {path}: {err}") from None

    out = write_report(args.runs_dir, args.out, baseline=args.baseline or "standard", plots=not args.no_plots,
                       bench=args.bench)
    print(out["markdown"])
    print(f"\nwrote {out['markdown_path']}, {out['html_path']} and {out['json']}")
    return 0
