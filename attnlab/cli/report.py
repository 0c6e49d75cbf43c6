"""Rebuild report.md and report.json (and per-group PNG plots) from the run directories under RUNS_DIR, reading
only their files: per variant the final-epoch top-1 as mean and sample SD over seeds, the gain in percentage points
against the baseline computed from unrounded means, and matched-seed wins."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs_dir", metavar="RUNS_DIR", help="directory holding run folders (each with result.json)")
    p.add_argument("--out", default=None, help="where to write the report (default: RUNS_DIR)")
    p.add_argument("--baseline", default="standard", help="variant the gains and wins are measured against")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def run(args) -> int:
    from ..report import write_report

    out = write_report(args.runs_dir, args.out, baseline=args.baseline, plots=not args.no_plots)
    print(out["markdown"])
    print(f"\nwrote {out['markdown_path']} and {out['json']}")
    return 0
