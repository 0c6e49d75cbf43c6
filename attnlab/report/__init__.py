"""Run directories -> tables (mean, sample SD, gains from unrounded means, matched-seed wins; ablation, latency,
spectra, parameters and GFLOPs), figures, and report.md / report.json / one self-contained report.html."""

from attnlab.report.page import Figure, Section, Table, render_html, render_markdown
from attnlab.report.summary import (accuracy_tables, find_unfinished, format_gain, format_markdown, format_top1,
                                    load_runs, scan_runs, summarize)
from attnlab.report.tables import ablation_tables, latency_tables, read_bench, spectral_tables
from attnlab.report.write import plot_group, write_report

__all__ = ["Figure", "Section", "Table", "ablation_tables", "accuracy_tables", "find_unfinished", "format_gain",
           "format_markdown", "format_top1", "latency_tables", "load_runs", "plot_group", "read_bench", "render_html",
           "render_markdown", "scan_runs", "spectral_tables", "summarize", "write_report"]
