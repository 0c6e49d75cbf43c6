"""Rebuild report.md, report.json and one self-contained report.html (figures embedded, opens offline) from the run
directories under RUNS_DIR, reading only their files: per variant the final-epoch top-1 as mean and sample SD over
seeds, the gain in percentage points against the baseline computed from unrounded means, and matched-seed wins; the
ablation (NS-Attn Table 2 form), latency from `attnlab bench --json` files (Table 3 form), head-output spectra,
parameters and GFLOPs, training curves and every figure `attnlab analyze` wrote. Unfinished runs and files that
cannot be read are listed on the page."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs_dir", metavar="RUNS_DIR", help="directory holding run folders (each with result.json)")
    p.add_argument("--out", default=None, help="where to write the report (default: RUNS_DIR)")
    p.add_argument("--baseline", default="standard", help="variant the gains and wins are measured against")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--bench", action="append", default=[], metavar="JSON",
                   help="an `attnlab bench --json` file for the latency table (repeatable; files named *bench*.json "
                        "or *latency*.json under RUNS_DIR are read anyway)")


def run(args) -> int:
    from pathlib import Path

    from ..errors import ConfigError
    from ..report import write_report

    for path in args.bench:
        if not Path(path).is_file():
            raise ConfigError(f"--bench {path} is not a file; give the JSON that attnlab bench --json wrote.")

    out = write_report(args.runs_dir, args.out, baseline=args.baseline, plots=not args.no_plots, bench=args.bench)
    print(out["markdown"])
    print(f"\nwrote {out['markdown_path']}, {out['html_path']} and {out['json']}")
    return 0
