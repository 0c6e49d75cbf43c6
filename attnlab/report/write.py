"""Write report.md, report.html and report.json, with a bar plot and training curves per (model, dataset), from run
directories (and the analysis and benchmark files beside them) alone."""

from __future__ import annotations

import json
import os
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


def _problem_items(problems: list[dict]) -> list[str]:
    return [f"{p['path']}: {p['problem']}" for p in problems]


def write_report(runs_dir: str | Path, out_dir: str | Path | None = None, *, baseline: str = "standard",
                 plots: bool = True, bench: list[str | Path] = (), costs: bool = True) -> dict:
    """Summarise every finished run below ``runs_dir`` and write the report files into ``out_dir``.

    Writes ``report.md``, ``report.html`` (the same sections, figures embedded: one file that opens offline) and
    ``report.json``. Sections: accuracy (:func:`format_markdown`), ablation in NS-Attn Table 2 form (models with
    three or more variants), latency in Table 3 form (``attnlab bench --json`` files named ``*bench*.json`` or
    ``*latency*.json`` below ``runs_dir``, plus ``bench``), head-output spectra (``analysis.json`` files or the
    runs' ``extra``), parameters and GFLOPs per variant (``costs``), figures (with ``plots``: a top-1 bar plot
    ``report_<model>_<dataset>.png`` and training curves ``report_curves_<model>_<dataset>.png`` per group, then
    every PNG in a folder holding an analysis.json, grouped by instrument), and last what was not included:
    unfinished runs, runs whose result.json cannot be read, files that cannot be read. The output depends only on
    the run files (no dates, no absolute paths), so running it twice gives identical files.

    Args:
        runs_dir: folder holding ``<name>/result.json`` (searched recursively).
        out_dir: where to write; defaults to ``runs_dir``.
        baseline: the variant that gains and wins refer to.
        plots: also write the PNG plots (bars and training curves).
        bench: further ``attnlab bench --json`` files for the latency table.
        costs: count parameters and GFLOPs (rebuilds one model per variant on the CPU).

    Returns:
        ``{"markdown", "html", "rows", "markdown_path", "html_path", "json", "plots": list[Path]}``.
    """
    from attnlab.report.page import Figure, Section, render_html, render_markdown
    from attnlab.report.summary import accuracy_tables
    from attnlab.report.tables import (ablation_tables, analysis_figures, cost_tables, find_bench_files,
                                       latency_stats, latency_tables, read_analyses, read_bench, spectral_tables)

    runs_dir = Path(runs_dir)
    out = Path(out_dir) if out_dir is not None else runs_dir
    runs, unreadable = scan_runs(runs_dir)
    if not runs:
        bad = unreadable[0]
        raise AttnlabError(f"no run under '{runs_dir}' has a readable result.json ({bad['run_dir']}: {bad['problem']})")
    rows = summarize(runs, baseline=baseline)
    unfinished = find_unfinished(runs_dir)
    problems: list[dict] = []
    out.mkdir(parents=True, exist_ok=True)

    title = "attnlab report"
    intro = (f"Final-epoch top-1 (%) as mean ± sample SD over seeds; gains in percentage points against "
             f"`{''.join(baseline.split())}`, computed from unrounded means; wins count matched seeds where the "
             f"variant is strictly higher.")
    sections = [Section("Accuracy", tables=accuracy_tables(rows))]

    ablation = ablation_tables(rows)
    if ablation:
        sections.append(Section("Ablation (NS-Attn Table 2 form)", paragraphs=[
            "Final-epoch top-1 (%), mean ± sample SD over seeds, one row per dataset; the best mean in bold."],
            tables=ablation))

    bench_results, bench_json = [], []
    bench_paths = {p.resolve(): p for p in [*find_bench_files(runs_dir), *map(Path, bench)]}  # a file once
    for path in bench_paths.values():
        name = path.relative_to(runs_dir).as_posix() if path.is_relative_to(runs_dir) else path.name
        try:
            result = read_bench(path)
        except AttnlabError as err:
            problems.append({"path": name, "problem": " ".join(str(err).split())})
            continue
        bench_results.append(result)
        base = latency_stats(result["models"][result["baseline"]]["round_ms"])[0]
        bench_json.append({"file": name, "model": result.get("model"), "baseline": result["baseline"],
                           "models": {m: dict(zip(("mean_ms", "sd_ms"), latency_stats(e["round_ms"])),
                                              overhead_pct=100.0 * (latency_stats(e["round_ms"])[0] / base - 1.0))
                                      for m, e in result["models"].items()}})
    if bench_results:
        sections.append(Section("Latency (NS-Attn Table 3 form)", paragraphs=[
            "Forward ms/batch from `attnlab bench --json`: mean over all rounds' timed forwards ± the sample SD "
            "across round means; overhead against the baseline from unrounded means. Setting: device, dtype, "
            "mode, batch, rounds x (warm-up + timed forwards)."], tables=latency_tables(bench_results)))

    analyses, analysis_dirs, analysis_problems = read_analyses(runs_dir, runs)
    problems += analysis_problems
    spectra = spectral_tables(rows, runs, analyses)
    if spectra:
        sections.append(Section("Head-output spectra (NS-Attn Section 3.4)", paragraphs=[
            "Leading-eigenvalue fraction p1 and entropy effective rank r_eff of each head's feature-view Gram "
            "matrix, mean over runs (seeds); per block for Swin."], tables=spectra))

    cost = []
    if costs:
        cost, cost_problems = cost_tables(rows, runs, runs_dir)
        problems += cost_problems
        if cost:
            sections.append(Section("Parameters and operations", paragraphs=[
                "Per variant, batch-1 forward: GMACs are the DnA paper's \"GFLOPs\" (multiply-adds); GFLOPs = 2 x "
                "GMACs; ratios against the first row."], tables=cost))

    plot_paths: list[Path] = []
    figures: list[Section] = []
    if plots:
        from attnlab.analysis.curves import plot_training_curves, read_metrics, training_curves

        bars, curves = [], []
        for (model, dataset, tag), group in _groups(rows).items():
            label = " / ".join(x for x in (model, dataset, tag) if x)
            slug = "_".join(_slug(x) for x in (model, dataset, tag) if x)
            path = plot_group(group, out / f"report_{slug}.png", label)
            bars.append(Figure(path, f"Top-1 per variant, {label} (bars: mean, whiskers: sample SD)"))
            dirs = []
            for run in runs:
                if (str(run["model"]), str(run["dataset"]), str(run.get("tag") or "")) != (model, dataset, tag):
                    continue
                try:
                    read_metrics(runs_dir / run["run_dir"] / "metrics.jsonl")
                    dirs.append(runs_dir / run["run_dir"])
                except AttnlabError as err:
                    problems.append({"path": f"{run['run_dir']}/metrics.jsonl",
                                     "problem": " ".join(str(err).split()).replace(str(runs_dir) + "/", "")})
            try:
                found = training_curves(dirs) if dirs else {}
            except AttnlabError as err:  # a config.yaml that cannot be read
                problems.append({"path": label, "problem": f"no training curves: {' '.join(str(err).split())}"})
                found = {}
            if found:
                path = out / f"report_curves_{slug}.png"
                plot_training_curves(found, path)
                curves.append(Figure(path, f"Training curves, {label}: mean over seeds ± sample SD per variant"))
        plot_paths = [f.path for f in bars + curves]
        figures.append(Section("Top-1 per variant", figures=bars))
        if curves:
            figures.append(Section("Training curves", figures=curves))
    own = {p.resolve() for p in plot_paths}
    for group, paths in analysis_figures(analysis_dirs, skip=own).items():
        figures.append(Section(f"attnlab analyze: {FIGURE_TITLES.get(group, group)}", figures=[
            Figure(p, p.relative_to(runs_dir).as_posix() if p.is_relative_to(runs_dir) else p.name) for p in paths]))
    if figures:
        sections.append(Section("Figures", subsections=figures))

    left_out = []
    if unfinished:
        left_out.append(Section("Unfinished runs", paragraphs=[
            "Unfinished runs (no result.json), not included: " + ", ".join(unfinished)]))
    if unreadable:
        left_out.append(Section("Unreadable runs", paragraphs=["Unreadable runs, not included:"],
                                items=[f"{bad['run_dir']}: {bad['problem']}" for bad in unreadable]))
    if problems:
        left_out.append(Section("Unreadable files", paragraphs=["Files that could not be read, left out:"],
                                items=_problem_items(problems)))
    if left_out:
        sections.append(Section("Not included", subsections=left_out))

    markdown = render_markdown(title, intro, sections, out)
    page = render_html(title, intro, sections)
    md_path = out / "report.md"
    md_path.write_text(markdown)
    html_path = out / "report.html"
    html_path.write_text(page)
    json_path = out / "report.json"
    tables = {s.title: [{"title": t.title, "header": t.header, "rows": t.rows} for t in s.tables]
              for s in sections if s.tables}
    json_path.write_text(json.dumps({
        "baseline": baseline, "rows": rows, "unfinished": unfinished, "unreadable": unreadable, "problems": problems,
        "latency": bench_json, "tables": tables,
        "figures": [Path(os.path.relpath(f.path, out)).as_posix() for s in figures for f in s.figures]},
        indent=2) + "\n")
    return {"markdown": markdown, "html": page, "rows": rows, "markdown_path": md_path, "html_path": html_path,
            "json": json_path, "plots": plot_paths}


FIGURE_TITLES = {
    "spectra": "head-output spectra (NS-Attn Figure 2)",
    "redundancy": "head redundancy (DnA Appendix C.5, Figure 12)",
    "robustness": "representational robustness (DnA Section 4.5, Figure 9)",
    "relevance": "signed relevance maps (DnA Section 4.3)",
    "curves": "training curves",
    "branches": "DnA branch instruments (intruder dimensions, C(V+, V-), branch cosine, alpha)",
    "other": "other figures",
}


def _groups(rows: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["dataset"], row.get("tag", "")), []).append(row)
    return groups
