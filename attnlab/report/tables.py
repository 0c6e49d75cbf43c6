"""The report's tables beyond accuracy, in the forms of the NS-Attn paper's tables, read from files alone.

Ablation (Table 2 form): per model, one row per dataset and one column per variant, each cell mean ± sample SD of
final-epoch top-1 over seeds; the best mean of a row in bold.

Latency (Table 3 form), from ``attnlab bench --json`` files: for model m with round means t_{m,1..R} (ms/batch)

    mean = (1/R) sum_r t_{m,r}          sd = sqrt( sum_r (t_{m,r} - mean)^2 / (R - 1) )
    overhead = 100 * (mean(m) / mean(baseline) - 1) %

Head-output spectra (Section 3.4): per variant the mean over runs of each run's p1 and effective rank (a run's
value is the mean over its blocks, each block's the mean over images and heads); for Swin also per block, averaged
over seeds, as the paper summarises Swin "by block within each seed and then averaged across seeds". Values come
from ``analysis.json`` (``attnlab analyze --what spectra``) or, failing that, the ``extra`` of ``result.json``.

Parameters and operations per variant: the run's own model rebuilt from its ``config.yaml``, parameters counted
and one batch-1 forward counted by ``FlopCounterMode`` (GMACs = the DnA paper's "GFLOPs", GFLOPs = 2 x GMACs).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.report.page import Table
from attnlab.report.summary import NO_VALUE, _is_number, format_top1, group_key, group_title, groups

BENCH_PATTERNS = ("*bench*.json", "*latency*.json")  # where `attnlab bench --json` output is looked for
# analyze's figure names (file stem, after any "<run>-" prefix) -> the instrument they belong to
FIGURE_GROUPS = {**{name: name for name in ("spectra", "redundancy", "robustness", "relevance", "curves")},
                 **dict.fromkeys(("intruders", "value_similarity", "branch_cosine", "alpha"), "branches")}


def ablation_tables(rows: list[dict], min_variants: int = 3) -> list[Table]:
    """Table 2 form per (model, tag, setting) with at least ``min_variants`` variants: Dataset | variant ...
    (baseline first, then as in ``rows``); cells mean ± SD, the best mean of each row in bold, an em dash where not
    run."""
    by_model: dict[tuple[str, str, str], dict[str, dict[str, dict]]] = {}
    order: dict[tuple[str, str, str], list[str]] = {}
    for row in rows:
        key = (row["model"], row.get("tag", ""), row.get("setting", ""))
        by_model.setdefault(key, {}).setdefault(row["dataset"], {})[row["variant"]] = row
        names = order.setdefault(key, [])
        if row["variant"] not in names:
            names.insert(0 if row.get("baseline") else len(names), row["variant"])
    baselines = {row["variant"] for row in rows if row.get("baseline")}
    tables = []
    for (model, tag, setting), datasets in by_model.items():
        variants = order[(model, tag, setting)]
        if len(variants) < min_variants:
            continue
        cells = []
        for dataset, found in datasets.items():
            best = max(r["mean"] for r in found.values())
            line = [dataset]
            for v in variants:
                r = found.get(v)
                text = NO_VALUE if r is None else format_top1(r["mean"], r["sd"])
                line.append(f"**{text}**" if r is not None and r["mean"] == best and len(found) > 1 else text)
            cells.append(line)
        header = ["Dataset", *(f"{v} (baseline)" if v in baselines else v for v in variants)]
        tables.append(Table(header, cells, title=group_title((model, "", tag, setting))))
    return tables


def find_bench_files(runs_dir: str | Path) -> list[Path]:
    """``attnlab bench --json`` outputs below ``runs_dir``: JSON files whose name contains "bench" or "latency"."""
    root = Path(runs_dir)
    return sorted({p for pattern in BENCH_PATTERNS for p in root.rglob(pattern) if p.is_file()})


def read_bench(path: str | Path) -> dict:
    """One ``attnlab bench --json`` result, checked: ``models`` maps names to ``round_ms`` lists of finite numbers
    and ``baseline`` is one of them. Raises AttnlabError saying what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise AttnlabError(f"{path.name} is not valid JSON ({type(err).__name__}); rerun attnlab bench --json.") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models or data.get("baseline") not in models:
        raise AttnlabError(f"{path.name} is not an attnlab bench --json result (it needs 'models' and a "
                           "'baseline' among them); rerun attnlab bench --json.")
    for name, entry in models.items():
        rounds = entry.get("round_ms") if isinstance(entry, dict) else None
        if not isinstance(rounds, list) or not rounds or not all(_is_number(t) and t > 0 for t in rounds):
            raise AttnlabError(f"{path.name}: model {name!r} has no list of positive round means 'round_ms'; "
                               "rerun attnlab bench --json.")
    return data


def latency_stats(round_ms: list[float]) -> tuple[float, float | None]:
    """(mean, sample SD) across round means; SD None for one round."""
    return statistics.fmean(round_ms), (statistics.stdev(round_ms) if len(round_ms) >= 2 else None)


def latency_tables(results: list[dict]) -> list[Table]:
    """Table 3 form: one table per list of compared variants, one row per bench result: Backbone | Setting |
    variant ms/batch ... | Overhead per non-baseline variant. Mean, SD and overhead are recomputed from round_ms."""
    grouped: dict[tuple[str, ...], list[dict]] = {}
    for res in results:
        names = [res["baseline"]] + [n for n in res["models"] if n != res["baseline"]]
        grouped.setdefault(tuple(names), []).append(res)
    tables = []
    for names, group in grouped.items():
        header = ["Backbone", "Setting", f"{names[0]} (baseline)", *names[1:],
                  *(f"Overhead {n}" if len(names) > 2 else "Overhead" for n in names[1:])]
        cells = []
        for res in group:
            stats = {n: latency_stats(res["models"][n]["round_ms"]) for n in names}
            base = stats[names[0]][0]
            rounds = len(res["models"][names[0]]["round_ms"])
            setting = ", ".join(str(x) for x in (
                res.get("device"), res.get("dtype"), "compiled" if res.get("compiled") else "eager",
                f"batch {res.get('batch_size', '?')}", f"{rounds} x ({res.get('warmup', '?')} + {res.get('iters', '?')})"
            ) if x is not None)
            cells.append([str(res.get("model", "?")), setting, *(format_top1(*stats[n]) for n in names),
                          *(f"{100.0 * (stats[n][0] / base - 1.0):+.1f}%" for n in names[1:])])
        tables.append(Table(header, cells, align=["l", "l"] + ["r"] * (len(header) - 2)))
    return tables


def read_analyses(runs_dir: str | Path, runs: list[dict]) -> tuple[dict[str, dict], list[Path], list[dict]]:
    """Every ``analysis.json`` below ``runs_dir``: ``(by_run, dirs, problems)``.

    ``by_run`` maps a run's ``run_dir`` to its entry (analyze labels an entry with the run directory's name; the
    first file in path order wins); ``dirs`` are the folders holding an analysis.json (their figures are analyze's);
    ``problems`` one ``{"path", "problem"}`` per file that cannot be read.
    """
    root = Path(runs_dir)
    names = {Path(r["run_dir"]).name: r["run_dir"] for r in runs}
    if "." in {r["run_dir"] for r in runs}:
        names[root.resolve().name] = "."
    by_run: dict[str, dict] = {}
    dirs, problems = [], []
    for path in sorted(root.rglob("analysis.json")):
        rel = path.relative_to(root).as_posix()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
            problems.append({"path": rel, "problem": f"is not a readable analysis ({type(err).__name__}); rerun "
                                                     "attnlab analyze."})
            continue
        dirs.append(path.parent)
        for label, entry in data.items():
            if isinstance(entry, dict) and "attn" in entry and label in names:
                by_run.setdefault(names[label], entry)
    return by_run, dirs, problems


def _run_spectra(run: dict, analysis: dict | None) -> dict | None:
    spectra = (analysis or {}).get("spectra")
    if isinstance(spectra, dict) and _is_number(spectra.get("p1")) and _is_number(spectra.get("eff_rank")):
        blocks = [b for b in spectra.get("blocks") or [] if isinstance(b, dict) and _is_number(b.get("p1"))
                  and _is_number(b.get("eff_rank")) and "layer" in b]
        return {"p1": spectra["p1"], "eff_rank": spectra["eff_rank"], "blocks": blocks}
    extra = run.get("extra") or {}
    if _is_number(extra.get("p1")) and _is_number(extra.get("eff_rank")):
        return {"p1": extra["p1"], "eff_rank": extra["eff_rank"], "blocks": []}
    return None


def spectral_tables(rows: list[dict], runs: list[dict], analyses: dict[str, dict]) -> list[Table]:
    """Per comparison (:func:`~attnlab.report.summary.group_key`) with spectra: Variant | p1 | r_eff | runs; for Swin models also Block | variant
    p1 | variant r_eff ... (means over the runs that have each block)."""
    measured: dict[tuple, list[dict]] = {}
    for run in runs:
        found = _run_spectra(run, analyses.get(run["run_dir"]))
        if found is not None:
            measured.setdefault((group_key(run), "".join(str(run["attn"]).split())), []).append(found)
    tables = []
    for key, group in groups(rows).items():
        model, title = key[0], group_title(key)
        have = [(r["variant"], measured[(key, r["variant"])]) for r in group if (key, r["variant"]) in measured]
        if not have:
            continue
        cells = [[v, f"{statistics.fmean(m['p1'] for m in ms):.2f}",
                  f"{statistics.fmean(m['eff_rank'] for m in ms):.2f}", str(len(ms))] for v, ms in have]
        tables.append(Table(["Variant", "p1", "r_eff", "runs"], cells, title=title))
        if "swin" not in model.lower():
            continue
        layers: list[str] = []
        for _, ms in have:
            for m in ms:
                layers += [b["layer"] for b in m["blocks"] if b["layer"] not in layers]
        if not layers:
            continue
        block_cells = []
        for layer in layers:
            line = [layer]
            for _, ms in have:
                values = [b for m in ms for b in m["blocks"] if b["layer"] == layer]
                line += ([f"{statistics.fmean(b['p1'] for b in values):.2f}",
                          f"{statistics.fmean(b['eff_rank'] for b in values):.2f}"] if values else [NO_VALUE] * 2)
            block_cells.append(line)
        header = ["Block", *(f"{v} {k}" for v, _ in have for k in ("p1", "r_eff"))]
        tables.append(Table(header, block_cells, title=f"{title}, per block"))
    return tables


def analysis_figures(dirs: list[Path], skip: set[Path] = frozenset()) -> dict[str, list[Path]]:
    """The PNGs in analyze's output folders, grouped by instrument (``FIGURE_GROUPS``; unknown names under
    "other"), each group sorted by path; files in ``skip`` (the report's own) are left out."""
    groups: dict[str, list[Path]] = {}
    for d in dirs:
        for png in sorted(d.glob("*.png")):
            if png.resolve() in skip:
                continue
            stem = png.stem
            group = next((g for name, g in FIGURE_GROUPS.items() if stem == name or stem.endswith("-" + name)),
                         "other")
            if png not in groups.setdefault(group, []):
                groups[group].append(png)
    return {g: sorted(paths) for g, paths in groups.items()}


_COSTS: dict[bytes, dict] = {}  # config.yaml's bytes -> its counts: the same config builds the same model


def run_costs(run_dir: Path) -> dict:
    """Parameters and batch-1 forward multiply-adds of the model a run trains, rebuilt from its config.yaml (once
    per process for each distinct config.yaml)."""
    from attnlab.train.run import CONFIG

    try:
        key = (Path(run_dir) / CONFIG).read_bytes()
    except OSError:
        return _count_costs(run_dir)  # Run.open says what is wrong
    if key not in _COSTS:
        _COSTS[key] = _count_costs(run_dir)
    return dict(_COSTS[key])


def _count_costs(run_dir: Path) -> dict:
    import torch

    from attnlab.analysis.cost import count_macs
    from attnlab.train.run import Run

    run = Run.open(run_dir)
    try:  # on the meta device nothing is allocated or initialised
        with torch.device("meta"):
            model = run.build_model().eval()
            macs = count_macs(model, run.task.example_input(1, "meta"))
    except (RuntimeError, NotImplementedError):  # sigma's set-up reads a value (.item()), which meta cannot give
        with torch.random.fork_rng(devices=[]):
            model = run.build_model().eval()
        macs = count_macs(model, run.task.example_input(1))
    return {"params": sum(p.numel() for p in model.parameters()), "macs": macs}


def cost_tables(rows: list[dict], runs: list[dict], runs_dir: Path) -> tuple[list[Table], list[dict]]:
    """Per comparison: Variant | Params (M) | GMACs | GFLOPs | x params | x GMACs (against the first row, the
    baseline when present; MMACs and MFLOPs when the smallest count is below a giga), from one run per variant; ``problems`` for runs whose config cannot be built."""
    first: dict[tuple, dict] = {}
    for run in runs:
        first.setdefault((group_key(run), "".join(str(run["attn"]).split())), run)
    tables, problems = [], []
    for key, group in groups(rows).items():
        costs = []
        for row in group:
            run = first[(key, row["variant"])]
            try:
                costs.append((row["variant"], run_costs(runs_dir / run["run_dir"])))
            except (AttnlabError, OSError) as err:
                problems.append({"path": f"{run['run_dir']}/config.yaml",
                                 "problem": f"cannot rebuild the model for its cost: {' '.join(str(err).split())}"})
        if not costs:
            continue
        base = costs[0][1]
        # a small model reads 0.6425 MMACs rather than 0.0006425 GMACs
        unit, scale = ("GMACs", 1e9) if min(c["macs"] for _, c in costs) >= 1e9 else ("MMACs", 1e6)
        cells = [[v, f"{c['params'] / 1e6:.3f}", f"{c['macs'] / scale:.4g}", f"{2 * c['macs'] / scale:.4g}",
                  f"{c['params'] / base['params']:.3f}", f"{c['macs'] / base['macs']:.3f}"] for v, c in costs]
        tables.append(Table(["Variant", "Params (M)", unit, unit.replace("MACs", "FLOPs"), "x params", "x MACs"],
                            cells, title=group_title(key)))
    return tables, problems


__all__ = ["ablation_tables", "analysis_figures", "cost_tables", "find_bench_files", "latency_stats",
           "latency_tables", "read_analyses", "read_bench", "run_costs", "spectral_tables"]
