"""Run directories -> tables (mean, sample SD, gains from unrounded means, matched-seed wins) and plots."""

from attnlab.report.summary import (
    find_unfinished,
    format_gain,
    format_markdown,
    format_top1,
    load_runs,
    scan_runs,
    summarize,
)
from attnlab.report.write import plot_group, write_report

__all__ = [
    "find_unfinished",
    "format_gain",
    "format_markdown",
    "format_top1",
    "load_runs",
    "plot_group",
    "scan_runs",
    "summarize",
    "write_report",
]
