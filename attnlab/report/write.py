"""Write report.md, report.html and report.json, with a bar plot and training curves per (model, dataset), from run
directories (and the analysis and benchmark files beside them) alone."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter
from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.report.page import Figure, Section, Table, render_html, render_markdown
from attnlab.report.summary import (NO_VALUE, accuracy_tables, find_unfinished, group_key, group_title, groups,
                                    label_settings, metric_title, scan_runs, summarize)
from attnlab.report.ladder import (ladder_figure, ladder_max_logits, ladder_tables, ladders_json, lr_ladders,
                                   max_logit_figure)
from attnlab.report.sweeps import lr_sweeps, sensitivity_tables, sweep_figure, sweeps_json
from attnlab.report.tables import (ablation_tables, analysis_figures, cost_tables, find_bench_files, latency_stats,
                                   latency_tables, read_analyses, read_bench, spectral_tables)
from attnlab.train.files import METRICS, RESULT


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def plot_group(rows: list[dict], path: str | Path, title: str, colors: dict[str, str] | None = None) -> Path:
    """:func:`group_figure` saved as PNG at ``path`` (written atomically); returns ``path``."""
    from attnlab.analysis.figures import save_png

    return save_png(group_figure(rows, title, colors), path)


def group_figure(rows: list[dict], title: str, colors: dict[str, str] | None = None):
    """Top-1 of one comparison (rows of :func:`~attnlab.report.summary.summarize`) as a matplotlib Figure: bars of
    the mean per variant on an axis from 0 (whiskers: sample SD, none when n = 1), and, when the group has its
    baseline, the gain of each other variant in percentage points on an axis of its own around 0, where
    differences of a tenth of a point show without a cut axis.

    ``colors``: {variant: colour} (default :func:`attnlab.analysis.figures.variant_colors` of these rows). Uses
    matplotlib's object API with the Agg canvas, so no pyplot state or display is touched.
    """
    from attnlab.analysis.figures import agg_figure, color_of, variant_colors

    base = next((r["variant"] for r in rows if r.get("baseline")), None)
    colors = colors if colors is not None else variant_colors([r["variant"] for r in rows], base)
    gains = [r for r in rows if r.get("gain_pp") is not None]
    width = max(3.0, 1.0 + 0.55 * len(rows))
    fig = agg_figure(figsize=(width + (1.0 + 0.55 * len(gains) if gains else 0.0), 3.4), dpi=120)
    panels = fig.subplots(1, 2, width_ratios=[len(rows), max(len(gains), 1)]) if gains else [fig.add_subplot()]
    ax = panels[0]
    x = range(len(rows))
    means, sds = [r["mean"] for r in rows], [r["sd"] or 0.0 for r in rows]
    bar_colors = [color_of(colors, r["variant"], i) for i, r in enumerate(rows)]
    ax.bar(x, means, yerr=sds, capsize=3, color=bar_colors)
    for i, (m, sd) in enumerate(zip(means, sds)):  # the mean above its whisker
        ax.annotate(f"{m:.1f}", (i, m + sd), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(list(x), [r["variant"] for r in rows], rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, min(110.0, max(m + s for m, s in zip(means, sds)) * 1.12) or 1.0)  # from 0: bars read as ratios
    ax.set_ylabel(f"{metric_title(rows[0].get('metric', 'top1'))} (%)")
    ax.set_title(title, fontsize=9)
    if gains:
        gx = panels[1]
        gx.axhline(0.0, color=colors.get(base, "0.5"), linewidth=1.2)
        gx.errorbar(range(len(gains)), [r["gain_pp"] for r in gains], yerr=[r["sd"] or 0.0 for r in gains],
                    fmt="none", ecolor="0.3", capsize=3, linewidth=0.8)
        gx.scatter(range(len(gains)), [r["gain_pp"] for r in gains], zorder=3,
                   c=[color_of(colors, r["variant"], i) for i, r in enumerate(gains)])
        gx.set_xticks(range(len(gains)), [r["variant"] for r in gains], rotation=35, ha="right", fontsize=8)
        gx.set(xlim=(-0.6, len(gains) - 0.4), ylabel=f"gain vs {base} (pp)")
        gx.set_title("gain (whiskers: variant's SD)", fontsize=9)
        gx.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def write_report(runs_dir: str | Path, out_dir: str | Path | None = None, *, baseline: str = "standard",
                 plots: bool = True, bench: list[str | Path] = (), costs: bool = True) -> dict:
    """Summarise every finished run below ``runs_dir`` and write ``report.md``, ``report.html`` (the same sections,
    figures embedded: one file that opens offline) and ``report.json`` into ``out_dir`` (default ``runs_dir``); the
    sections are listed in docs/reporting.md. Runs are compared only when trained alike (:func:`~attnlab.report.
    summary.label_settings`). The output depends only on the run files, so running it twice gives identical files;
    each is written atomically, and a symlink in the way is replaced, not followed.

    ``baseline``: the variant gains and wins refer to; ``plots``: also write the PNG figures; ``bench``: further
    ``attnlab bench --json`` files for the latency table; ``costs``: count parameters and GFLOPs (rebuilds one model
    per variant on the CPU). Returns ``{"markdown", "html", "rows", "markdown_path", "html_path", "json", "plots":
    list[Path]}``.
    """
    from attnlab.analysis.curves import layer_max_logits, read_metrics
    from attnlab.analysis.figures import save_png, variant_colors
    from attnlab.train.checkpoint import atomic_write_text

    runs_dir = Path(runs_dir)
    out = Path(out_dir) if out_dir is not None else runs_dir
    runs, unreadable = scan_runs(runs_dir)
    if not runs:
        bad = unreadable[0]
        raise AttnlabError(f"no run under '{runs_dir}' has a readable result.json ({bad['run_dir']}: {bad['problem']})")
    runs, mismatches = label_settings(runs)
    rows = summarize(runs, baseline=baseline)
    unfinished = find_unfinished(runs_dir)
    problems: list[dict] = []
    out.mkdir(parents=True, exist_ok=True)

    title = "attnlab report"
    measured = " and ".join(sorted({metric_title(r["metric"]) for r in rows})) or "Top-1"
    percent = all(r.get("percent", True) for r in rows)  # a language model's loss is no percentage
    intro = (f"Final-epoch {measured}{' (%)' if percent else ''} as mean ± sample SD over seeds; gains"
             f"{' in percentage points' if percent else ' (differences of means)'} against "
             f"`{''.join(baseline.split())}`, computed from unrounded means; wins count matched seeds where the "
             f"variant is strictly better. Runs are compared only when trained alike: the same config but for "
             f"variant, seed and runtime keys (device, paths, ...).")
    about = provenance(runs_dir, runs, rows, unfinished=unfinished, unreadable=unreadable)
    sections = [Section("What was trained", items=[f"**{k}**: {v}" for k, v in about.items()]),
                Section("Accuracy", paragraphs=[
                    f"{m['group']}: these runs differ in more than variant and seed ({', '.join(m['keys'])}), so "
                    f"they form {len(m['settings'])} separate comparisons, each with its own baseline; no gain or "
                    f"win is computed between them." for m in mismatches], tables=accuracy_tables(rows))]

    ablation = ablation_tables(rows)
    if ablation:
        sections.append(Section("Ablation (NS-Attn Table 2 form)", paragraphs=[
            "Final-epoch top-1 (%), mean ± sample SD over seeds, one row per dataset; the best mean in bold."],
            tables=ablation))

    sweeps = lr_sweeps(runs)
    if sweeps:
        sections.append(Section("Learning-rate sensitivity (Wortsman et al. 2023)", paragraphs=[
            "Runs trained alike but for the peak learning rate (\"Small-scale proxies for large-scale Transformer "
            "training instabilities\", arXiv 2309.14322): LR sensitivity = mean over the swept rates of min(final "
            "loss, loss at initialisation) minus the best final loss; losses are means over seeds, the loss at "
            "initialisation the evaluation before the first step."], tables=sensitivity_tables(sweeps)))
    ladders = lr_ladders(sweeps)
    if ladders:
        sections.append(Section("LR sensitivity across model sizes (Wortsman et al. 2023, Figure 1)", paragraphs=[
            "The sweeps of several models on one dataset and setting: LR sensitivity per model size (rows) and "
            "method (columns), the lowest of a row in bold. Parameters: without the embedding matrices for the "
            "ladder presets (ladder_d*, from the preset), else every parameter (result.json's params)."],
            tables=ladder_tables(ladders)))
    ladder_logits = [ladder_max_logits(ladder, runs_dir) for ladder in ladders]

    # the runs of each comparison whose metrics.jsonl reads, and the training probe's per-layer max logits in them
    group_dirs: dict[tuple, list[Path]] = {}
    maxima_of: dict[tuple, dict] = {}
    for key in groups(rows):
        dirs = group_dirs.setdefault(key, [])
        for run in (r for r in runs if group_key(r) == key):
            try:
                read_metrics(runs_dir / run["run_dir"] / METRICS)
                dirs.append(runs_dir / run["run_dir"])
            except AttnlabError as err:
                problems.append({"path": f"{run['run_dir']}/metrics.jsonl",
                                 "problem": " ".join(str(err).split()).replace(str(runs_dir) + "/", "")})
        try:
            maxima_of[key] = layer_max_logits(dirs) if dirs else {}  # runs with probe_every logged them
        except AttnlabError as err:  # a config.yaml that cannot be read
            problems.append({"path": group_title(key), "problem": f"no training curves: {' '.join(str(err).split())}"})
            maxima_of[key] = None
    logit_tables, logit_json = max_logit_tables(maxima_of)
    if logit_tables:
        sections.append(Section("Max attention logit per layer (Wortsman et al. 2023)", paragraphs=[
            "The training probe's largest attention logit (before the softmax, over the heads of a "
            "layer and the probe's inputs) per layer at the last probed step, mean over the seeds that probed it; "
            "max is the largest layer's. The figures show it over training."], tables=logit_tables))

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
                "Per variant, batch-1 forward: MACs are multiply-adds (the DnA paper's \"GFLOPs\" are GMACs); FLOPs "
                "= 2 x MACs; giga (G) or mega (M) as reads best; ratios against the first row."], tables=cost))

    plot_paths: list[Path] = []
    figures: list[Section] = []
    if plots:
        from attnlab.analysis.curves import plot_layer_max_logits, plot_training_curves, training_curves

        colors = variant_colors([r["variant"] for r in rows], baseline)  # one colour per variant in every figure
        bars, curves, logits = [], [], []
        for key, group in groups(rows).items():
            label = group_title(key)
            slug = "_".join(_slug(x) for x in key[:3] if x)
            if key[3]:  # a setting's label can be long: a short digest names its files
                slug += "_" + hashlib.sha1(key[3].encode()).hexdigest()[:8]
            path = plot_group(group, out / f"report_{slug}.png", label, colors)
            bars.append(Figure(path, f"{metric_title(group[0]['metric'])} per variant, {label} (bars: mean from 0, "
                                     f"whiskers: sample SD; "
                                     f"points: gain against the baseline)"))
            dirs, maxima = group_dirs[key], maxima_of[key]
            try:
                found = training_curves(dirs) if dirs and maxima is not None else {}
            except AttnlabError as err:  # a config.yaml that cannot be read
                problems.append({"path": label, "problem": f"no training curves: {' '.join(str(err).split())}"})
                found = {}
            maxima = maxima or {}
            if found:
                path = out / f"report_curves_{slug}.png"
                plot_training_curves(found, path, baseline=baseline, colors=colors)
                curves.append(Figure(path, f"Training curves, {label}: mean over seeds ± sample SD, one row per "
                                           f"variant beside the baseline (grey, dashed)"))
            if maxima:
                path = out / f"report_max_logit_{slug}.png"
                plot_layer_max_logits(maxima, path, title=label)
                logits.append(Figure(path, f"Max attention logit per layer over training, {label} (the training "
                                           f"probe, probe_every; mean over seeds)"))
        rates = []
        for sweep in sweeps:
            path = save_png(sweep_figure(sweep, colors), out / f"report_lr_{_slug(sweep['title'])}.png")
            rates.append(Figure(path, f"Final {metric_title(sweep['metric']).lower()} against the peak learning rate, "
                                      f"{sweep['title']}" + (" (dashed: no warm-up)" if sweep["mixed_warmup"] else "")))
        sizes = []
        for ladder, found in zip(ladders, ladder_logits):
            slug = _slug(ladder["title"])
            path = save_png(ladder_figure(ladder, colors), out / f"report_sizes_{slug}.png")
            sizes.append(Figure(path, f"Final {metric_title(ladder['metric']).lower()} against the peak learning "
                                      f"rate per model size, and LR sensitivity against size, {ladder['title']}"))
            if found:
                path = save_png(max_logit_figure(ladder, found), out / f"report_sizes_max_logit_{slug}.png")
                sizes.append(Figure(path, f"Max attention logit (largest over layers) over training per model "
                                          f"size, at each size's largest rate with probes, {ladder['title']}"))
        rates += sizes
        plot_paths = [f.path for f in bars + curves + logits + rates]
        titles = sorted({metric_title(r["metric"]) for r in rows})
        figures.append(Section(f"{' and '.join(titles)} per variant", figures=bars))
        if curves:
            figures.append(Section("Training curves", figures=curves))
        if logits:
            figures.append(Section("Max attention logit per layer (Wortsman et al. 2023)", figures=logits))
        if rates:
            figures.append(Section("Loss against learning rate", figures=rates))
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
                                items=[f"{p['path']}: {p['problem']}" for p in problems]))
    if left_out:
        sections.append(Section("Not included", subsections=left_out))

    markdown = render_markdown(title, intro, sections, out)
    page = render_html(title, intro, sections)
    md_path, html_path, json_path = out / "report.md", out / "report.html", out / "report.json"
    tables = {s.title: [{"title": t.title, "header": t.header, "rows": t.rows} for t in s.tables]
              for s in sections if s.tables}
    data = {"baseline": baseline, "provenance": about, "mismatched": mismatches, "rows": rows,
            "unfinished": unfinished, "unreadable": unreadable, "problems": problems, "latency": bench_json,
            "lr_sweeps": sweeps_json(sweeps), "max_logits": logit_json,
            "lr_ladders": ladders_json(ladders, ladder_logits),
            "tables": tables,
            "figures": [Path(os.path.relpath(f.path, out)).as_posix() for s in figures for f in s.figures]}
    atomic_write_text(md_path, markdown)
    atomic_write_text(html_path, page)
    atomic_write_text(json_path, json.dumps(data, indent=2) + "\n")
    return {"markdown": markdown, "html": page, "rows": rows, "markdown_path": md_path, "html_path": html_path,
            "json": json_path, "plots": plot_paths}


def _logit(value: float) -> str:
    """A max logit for a table: one decimal from 100 on (955.3), two from 1 (88.96), else three digits (0.0812)."""
    if value != value:
        return NO_VALUE
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def max_logit_tables(maxima_of: dict[tuple, dict | None]) -> tuple[list[Table], list[dict]]:
    """One table per comparison with probed max logits (``maxima_of``: group key -> :func:`~attnlab.analysis.
    curves.layer_max_logits`): a row per variant, each layer's value at the variant's last probed step, and the
    largest; and the same numbers unrounded for report.json."""
    tables, numbers = [], []
    for key, maxima in maxima_of.items():
        if not maxima:
            continue
        depth = 1 + max(i for entry in maxima.values() for i in entry["layers"])
        cells = []
        for variant, entry in sorted(maxima.items()):
            last = max((j for j, _ in enumerate(entry["steps"])
                        if all(v[j] == v[j] for v in entry["layers"].values())), default=len(entry["steps"]) - 1)
            values = {i: entry["layers"][i][last] for i in entry["layers"]}
            top = max((v for v in values.values() if v == v), default=float("nan"))
            cells.append([variant, str(entry["steps"][last])] +
                         [_logit(values.get(i, float("nan"))) for i in range(depth)] + [_logit(top),
                                                                                       str(entry["runs"])])
            numbers.append({"group": group_title(key), "variant": variant, "step": entry["steps"][last],
                            "runs": entry["runs"], "layers": [values.get(i) for i in range(depth)], "max": top})
        tables.append(Table(["Variant", "step", *[f"layer {i}" for i in range(depth)], "max", "runs"], cells,
                            title=group_title(key)))
    return tables, numbers


def _counted(values: list[str], of: int | None = None) -> str:
    """"a" when all alike, else "a (3 runs), b (1 run)"; with ``of`` (the number of runs) also how many did not
    record a value."""
    counts = Counter(values)
    text = (next(iter(counts)) if len(counts) == 1 else
            ", ".join(f"{v} ({n} run{'s' if n != 1 else ''})" for v, n in sorted(counts.items())))
    missing = (of or 0) - len(values)
    return text + (f" ({missing} run{'s' if missing != 1 else ''} recorded none)" if missing > 0 else "")


def provenance(runs_dir: Path, runs: list[dict], rows: list[dict], *, unfinished: list[str] = (),
               unreadable: list[dict] = ()) -> dict[str, str]:
    """What the report is about, from the runs' files: how many runs, variants and seeds; models and datasets;
    recipe and epochs; when the runs finished (result.json's ``finished``, else the time the file was written,
    UTC); the machine and attnlab version they recorded (``machine``, ``attnlab_version``); and this report's
    attnlab version."""
    from attnlab import __version__

    def setting(run: dict, key: str):
        value = (run.get("settings") or {}).get(key)
        return run.get(key) if value is None else value

    days = []
    for run in runs:
        finished = run.get("finished")
        if isinstance(finished, str) and re.match(r"\d{4}-\d{2}-\d{2}", finished):
            days.append(finished[:10])
        else:
            try:
                written = (runs_dir / run["run_dir"] / RESULT).stat().st_mtime
            except OSError:
                continue
            days.append(time.strftime("%Y-%m-%d", time.gmtime(written)))
    seeds = sorted({r["seed"] for r in runs}, key=lambda s: (str(type(s)), s))
    left = [f"{len(unfinished)} unfinished"] * bool(unfinished) + [f"{len(unreadable)} unreadable"] * bool(unreadable)
    recorded = [str(r["machine"]) for r in runs if r.get("machine")]
    versions = [str(r["attnlab_version"]) for r in runs if r.get("attnlab_version")]
    return {
        "Runs": (f"{len(runs)} finished" + (f" ({', '.join(left)}, not included)" if left else "") +
                 f"; {len({r['variant'] for r in rows})} variants; seeds {', '.join(map(str, seeds))}; "
                 f"{len(groups(rows))} comparison{'s' if len(groups(rows)) != 1 else ''}"),
        "Models and datasets": _counted([f"{r['model']} on {r['dataset']}" for r in runs]),
        "Recipe": _counted([f"{setting(r, 'recipe') or NO_VALUE}, {setting(r, 'epochs') or NO_VALUE} epochs"
                            for r in runs]),
        "Finished": (f"{min(days)} to {max(days)}" if len(set(days)) > 1 else days[0] if days else NO_VALUE) + " (UTC)",
        "Machine": _counted(recorded, len(runs)) if recorded else "not recorded in the runs' result.json",
        "attnlab": (f"runs trained with {_counted(versions, len(runs))}; " if versions else "") +
                   f"report by {__version__}",
    }


FIGURE_TITLES = {
    "spectra": "head-output spectra (NS-Attn Figure 2)",
    "redundancy": "head redundancy (DnA Appendix C.5, Figure 12)",
    "robustness": "representational robustness (DnA Section 4.5, Figure 9)",
    "relevance": "signed relevance maps (DnA Section 4.3)",
    "curves": "training curves",
    "branches": "DnA branch instruments (intruder dimensions, C(V+, V-), branch cosine, alpha)",
    "other": "other figures",
}
