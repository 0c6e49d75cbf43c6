"""Write report.md, report.json and one bar plot per (model, dataset) from run directories alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

from attnlab.errors import AttnlabError

from attnlab.report.summary import find_unfinished, format_markdown, scan_runs, summarize


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def plot_group(rows: list[dict], path: str | Path, title: str) -> Path:
    """Bar plot of mean top-1 per variant with sample-SD error bars (none when n = 1), saved as PNG.

    Uses matplotlib's object API with the Agg canvas, so no pyplot state or display is touched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = [r["variant"] for r in rows]
    means = [r["mean"] for r in rows]
    sds = [r["sd"] or 0.0 for r in rows]
    fig = Figure(figsize=(max(3.0, 1.0 + 0.9 * len(rows)), 3.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = ["0.6" if r.get("baseline") else "C0" for r in rows]
    ax.bar(range(len(rows)), means, yerr=sds, capsize=4, color=colors)
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    # Variants differ by tenths of a point: zoom the axis onto the bars instead of starting at 0.
    lo = min(m - s for m, s in zip(means, sds))
    hi = max(m + s for m, s in zip(means, sds))
    pad = max(0.25 * (hi - lo), 0.2)
    ax.set_ylim(max(0.0, lo - pad), hi + pad)
    ax.set_ylabel("Top-1 (%)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def write_report(runs_dir: str | Path, out_dir: str | Path | None = None, *, baseline: str = "standard",
                 plots: bool = True) -> dict:
    """Summarise every finished run below ``runs_dir`` and write the report files into ``out_dir``.

    Writes ``report.md`` (the tables of :func:`format_markdown`, plus lists of unfinished runs and of runs whose
    result.json cannot be read, if any), ``report.json`` (``{"baseline", "rows", "unfinished", "unreadable"}``, rows
    as from :func:`summarize`, unreadable as from :func:`scan_runs`) and, when ``plots``,
    ``report_<model>_<dataset>.png`` per group. The output depends only on the run files (no dates, no absolute
    paths), so running it twice gives identical files.

    Args:
        runs_dir: folder holding ``<name>/result.json`` (searched recursively).
        out_dir: where to write; defaults to ``runs_dir``.
        baseline: the variant that gains and wins refer to.
        plots: also write the PNG bar plots.

    Returns:
        ``{"markdown": str, "rows": list, "markdown_path": Path, "json": Path, "plots": list[Path]}``.
    """
    runs_dir = Path(runs_dir)
    out = Path(out_dir) if out_dir is not None else runs_dir
    runs, unreadable = scan_runs(runs_dir)
    if not runs:
        bad = unreadable[0]
        raise AttnlabError(f"no run under '{runs_dir}' has a readable result.json ({bad['run_dir']}: {bad['problem']})")
    rows = summarize(runs, baseline=baseline)
    unfinished = find_unfinished(runs_dir)

    markdown = "# attnlab report\n\n"
    markdown += (f"Final-epoch top-1 (%) as mean ± sample SD over seeds; gains in percentage points against "
                 f"`{''.join(baseline.split())}`, computed from unrounded "
                 f"means; wins count matched seeds where the variant is strictly higher.\n\n")
    markdown += format_markdown(rows)
    if unfinished:
        markdown += "\nUnfinished runs (no result.json), not included: " + ", ".join(unfinished) + "\n"
    if unreadable:
        markdown += "\nUnreadable runs, not included:\n\n" + "".join(
            f"- {bad['run_dir']}: {bad['problem']}\n" for bad in unreadable)

    out.mkdir(parents=True, exist_ok=True)
    md_path = out / "report.md"
    md_path.write_text(markdown)
    json_path = out / "report.json"
    json_path.write_text(json.dumps({"baseline": baseline, "rows": rows, "unfinished": unfinished,
                                     "unreadable": unreadable}, indent=2) + "\n")

    plot_paths = []
    if plots:
        groups: dict[tuple[str, str], list[dict]] = {}
        for row in rows:
            groups.setdefault((row["model"], row["dataset"], row.get("tag", "")), []).append(row)
        for (model, dataset, tag), group in groups.items():
            name = "_".join(_slug(x) for x in ("report", model, dataset, tag) if x) + ".png"
            plot_paths.append(plot_group(group, out / name, " / ".join(x for x in (model, dataset, tag) if x)))
    return {"markdown": markdown, "rows": rows, "markdown_path": md_path, "json": json_path, "plots": plot_paths}
