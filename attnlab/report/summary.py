"""Run directories -> per-variant summaries, following the NS-Attn paper's evaluation protocol (Section 3.1).

For each (model, dataset) group and each attention variant with headline values x_1..x_n (one per seed; the
headline is the metric a run's result.json names under "metric": top-1 for classification, box AP for
detection), each a percentage:

    mean = (1/n) sum_i x_i
    sd   = sqrt( sum_i (x_i - mean)^2 / (n - 1) )        sample SD (ddof=1); None when n < 2
    gain_pp = mean(variant) - mean(baseline)              from unrounded means, in percentage points
    wins = k/m                                            m = seeds run by both variant and baseline,
                                                          k = those seeds where the variant beats the baseline
                                                          (higher, or lower for a metric its task says is better
                                                          lower)

A task's further report columns (detection: mask AP, box and mask AP50/AP75) get the same mean, SD and gain.

Further numeric entries of a run's ``extra`` dict (e.g. ``p1``, ``eff_rank``) are averaged per variant over the
runs that report them.

Runs are compared only when they were trained alike: every key of their ``config.yaml`` (the recipe's defaults
filling those a file leaves out) but the variant, the seed and the runtime keys (device, amp, compile, paths...;
``attnlab.train.config.RUNTIME_KEYS``) must agree. Runs of one (model, dataset, tag) that differ in any other key
(epochs, recipe, lr, model or data options, augmentation...) form separate groups, each titled by the keys that
differ, with its own baseline: a mean, gain or win never mixes them.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabError
from attnlab.report.page import Table, table_markdown
from attnlab.train.files import CONFIG, METRICS, RESULT

REQUIRED_KEYS = ("name", "model", "dataset", "attn", "seed")
NO_VALUE = "—"
METRIC_TITLES = {"top1": "Top-1", "mean_class_accuracy": "Mean class accuracy", "val_loss": "Validation loss"}  # a headline's name in a table; others are their key with spaces ("box AP")


def headline(run: dict) -> str:
    """The metric a run is compared by: its result.json's "metric" (runs from before it was written: top-1)."""
    return str(run.get("metric") or "top1")


def metric_title(metric: str) -> str:
    return METRIC_TITLES.get(metric, metric.replace("_", " "))


def _task(run: dict):
    """The run's Task class (None for an unknown family): its direction and report columns."""
    from attnlab.errors import ConfigError
    from attnlab.train.tasks import task_class

    try:
        return task_class(str(run.get("task") or "image"))
    except ConfigError:
        return None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _variant_label(attn: str) -> str:
    # The spec grammar ignores whitespace, so "ns( steps=2 )" and "ns(steps=2)" are one variant.
    return "".join(str(attn).split())


def _problem(path: Path) -> tuple[dict | None, str]:
    """(the result.json's content, "") or (None, what is wrong with it, completed by the file's path)."""
    try:
        run = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"is not valid JSON ({exc}); rerun the run or delete the file."
    if not isinstance(run, dict):
        return None, f"holds a {type(run).__name__}, not a JSON object with the run's results."
    missing = [k for k in REQUIRED_KEYS if k not in run]
    if missing:
        return None, f"lacks the key(s) {', '.join(missing)}; a result.json needs {', '.join(REQUIRED_KEYS)}."
    metric = headline(run)
    if not _is_number(run.get(metric)):
        return None, f"has {metric}={run.get(metric)!r}; it must be a finite number (percent)."
    return run, ""


# What a run's settings leave out: what the comparison is about, and what may differ without changing the result
_NOT_SETTINGS = frozenset({"attn", "seed"})
_FIRST_KEYS = ("recipe", "epochs")  # named first in a group's title


def run_settings(run_dir: str | Path) -> dict[str, Any]:
    """What a run was trained with besides its variant and seed: its ``config.yaml``'s keys over its recipe's
    defaults (a file that names only a few keys means the recipe's values for the others), flat (``lr``, not
    ``optim.lr``), values in the config's types, runtime keys and other families' keys left out. A run without a
    readable config.yaml gets ``{"config.yaml": "missing"}`` or ``{"config.yaml": "unreadable"}``, which matches
    only runs in the same state."""
    from attnlab.errors import ConfigError
    from attnlab.train.config import RUNTIME_KEYS, flat_settings, read_yaml

    path = Path(run_dir) / CONFIG
    if not path.is_file():
        return {CONFIG: "missing"}
    try:
        data = read_yaml(path, CONFIG)
    except ConfigError:
        data = None
    if not isinstance(data, dict):
        return {CONFIG: "unreadable"}
    settings = flat_settings(data)  # flat keys, whether the file is flat (written before sections) or sectioned
    return {k: v for k, v in settings.items() if k not in RUNTIME_KEYS and k not in _NOT_SETTINGS}


def _setting_text(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(", ", ": "))
    return str(value)


def group_key(run_or_row: dict) -> tuple[str, str, str, str]:
    """(model, dataset, tag, setting): the runs of one comparison share it (``setting`` from :func:`label_settings`)."""
    return (str(run_or_row["model"]), str(run_or_row["dataset"]), str(run_or_row.get("tag") or ""),
            str(run_or_row.get("setting") or ""))


def _beats(a: float, b: float, higher_is_better: bool) -> bool:
    return a > b if higher_is_better else a < b


def group_title(key: tuple[str, str, str, str]) -> str:
    """``"model / dataset[ / tag][ (epochs=2, recipe=demo)]"``."""
    model, dataset, tag, setting = key
    return " / ".join(x for x in (model, dataset, tag) if x) + (f" ({setting})" if setting else "")


def groups(rows: list[dict]) -> dict[tuple[str, str, str, str], list[dict]]:
    """Rows (or runs) by :func:`group_key`, in order of first appearance."""
    out: dict[tuple[str, str, str, str], list[dict]] = {}
    for row in rows:
        out.setdefault(group_key(row), []).append(row)
    return out


def label_settings(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """Copies of ``runs`` with ``setting``: "" where the runs of a (model, dataset, tag) share their ``settings``
    (see :func:`run_settings`; runs without ``settings`` count as alike), else the keys on which they differ, as
    ``"epochs=2, lr=0.005"``. Also returns one ``{"group", "keys", "settings"}`` per (model, dataset, tag) whose runs
    differ (``keys`` the differing keys, ``settings`` each setting's label)."""
    by_group: dict[tuple[str, str, str], list[dict]] = {}
    for run in runs:
        by_group.setdefault(group_key(run)[:3], []).append(run)
    labels: dict[int, str] = {}
    mismatches = []
    for key, members in by_group.items():
        settings = [run.get("settings") or {} for run in members]
        names = sorted({k for s in settings for k in s})
        differ = [k for k in names if len({json.dumps(s.get(k), sort_keys=True, default=str) for s in settings}) > 1]
        differ.sort(key=lambda k: (_FIRST_KEYS.index(k) if k in _FIRST_KEYS else len(_FIRST_KEYS), k))
        for run, setting in zip(members, settings):
            labels[id(run)] = ", ".join(f"{k}={_setting_text(setting.get(k))}" for k in differ)
        if differ:
            mismatches.append({"group": group_title((*key, "")), "keys": differ,
                               "settings": sorted({labels[id(run)] for run in members})})
    return [{**run, "setting": labels[id(run)]} for run in runs], mismatches


def scan_runs(runs_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """Every ``result.json`` below ``runs_dir`` (recursively, sorted by path) as ``(runs, unreadable)``: runs as
    from :func:`load_runs` plus ``settings`` (:func:`run_settings`), and one ``{"run_dir", "problem"}`` per
    result.json that cannot be read or lacks what a report needs, so that one damaged run does not hide the others.
    AttnlabError when ``runs_dir`` does not exist or holds no ``result.json``."""
    root = Path(runs_dir)
    if not root.is_dir():
        raise AttnlabError(f"runs directory '{root}' does not exist; pass the folder that holds the runs/<name>/ directories.")
    paths = sorted(root.rglob(RESULT))
    if not paths:
        raise AttnlabError(
            f"no finished runs found under '{root}' (no result.json); train some runs first or pass the folder that holds them."
        )
    runs, unreadable = [], []
    for path in paths:
        run_dir = path.parent.relative_to(root).as_posix()
        run, problem = _problem(path)
        if run is None:
            unreadable.append({"run_dir": run_dir, "problem": f"result.json {problem}"})
        else:
            runs.append({**run, "run_dir": run_dir, "settings": run_settings(path.parent)})
    return runs, unreadable


def load_runs(runs_dir: str | Path) -> list[dict]:
    """Every ``result.json`` below ``runs_dir`` (recursively, sorted by path): its content plus ``run_dir`` (relative
    to ``runs_dir``); unfinished runs (no result.json) are not returned (:func:`find_unfinished`). AttnlabError when
    ``runs_dir`` does not exist, holds no ``result.json``, or one is malformed (:func:`scan_runs` lists those)."""
    runs, unreadable = scan_runs(runs_dir)
    if unreadable:
        bad = unreadable[0]
        raise AttnlabError(f"{(Path(runs_dir) / bad['run_dir']).as_posix()}/{bad['problem']}")
    return runs


def find_unfinished(runs_dir: str | Path) -> list[str]:
    """Run directories below ``runs_dir`` that have a ``metrics.jsonl`` or a ``config.yaml`` (a run writes it before
    its first epoch) but no ``result.json`` (relative, sorted)."""
    root = Path(runs_dir)
    if not root.is_dir():
        return []
    dirs = {p.parent for name in (METRICS, CONFIG) for p in root.rglob(name)}
    return sorted(d.relative_to(root).as_posix() for d in dirs if not (d / RESULT).exists())


def _mean(xs: list[float]) -> float:
    # statistics.mean sums exactly (fractions), so the mean does not depend on the order of the seeds.
    return float(statistics.mean(xs))


def _sd(xs: list[float]) -> float | None:
    return float(statistics.stdev(xs)) if len(xs) >= 2 else None


def summarize(runs: list[dict], baseline: str = "standard") -> list[dict]:
    """One row per (model, dataset, tag, setting, variant) of ``runs`` (dicts as from :func:`load_runs`; ``setting``:
    :func:`label_settings`, so runs trained differently are never one group), groups sorted by that key, within a
    group the baseline row first, then the other variants by name. Each row holds ``model, dataset, tag, setting,
    variant, baseline`` (bool), ``n, seeds`` (sorted), ``metric`` (the headline's key), ``by_seed`` {seed: headline}
    (``top1_by_seed`` too for classification), ``mean, sd`` (the headline), ``top5_mean`` (None if absent),
    ``gain_pp`` and ``wins`` (``"k/m"``; with ``wins_k, wins_n``) against ``baseline``, None for the baseline row and
    in groups without it, ``columns`` {name: {"mean", "sd", "gain_pp"}} for the task's further report columns, and
    ``extras`` {name: mean}. AttnlabError when two runs share model, dataset, variant and seed (matched-seed pairing
    would be ambiguous)."""
    baseline = _variant_label(baseline)
    if not all("setting" in run for run in runs):
        runs = label_settings(runs)[0]
    by_group: dict[tuple[str, str, str, str], dict[str, dict[Any, dict]]] = {}
    for run in runs:
        key = group_key(run)
        variant = _variant_label(run["attn"])
        by_seed = by_group.setdefault(key, {}).setdefault(variant, {})
        seed = run["seed"]
        if seed in by_seed:
            where = [r.get("run_dir", r.get("name")) for r in (by_seed[seed], run)]
            raise AttnlabError(
                f"two runs of {group_title(key)} / {variant} have seed {seed} ({where[0]} and {where[1]}); "
                "keep one per seed so matched-seed comparisons are unambiguous."
            )
        by_seed[seed] = run

    rows = []
    for (model, dataset, tag, setting) in sorted(by_group):
        variants = by_group[(model, dataset, tag, setting)]
        base_runs = variants.get(baseline)
        first = next(iter(next(iter(variants.values())).values()))
        metric, task = headline(first), _task(first)
        higher = task.higher_is_better if task is not None else True
        own = getattr(task, "columns_of", None)  # a family whose columns depend on the runs (vlm: its categories)
        columns = [c for c in (own(first) if own else getattr(task, "report_columns", ())) if c != metric]
        base_mean = _mean([r[metric] for r in base_runs.values()]) if base_runs else None
        order = ([baseline] if base_runs else []) + sorted(v for v in variants if v != baseline)
        for variant in order:
            by_seed = variants[variant]
            seeds = sorted(by_seed, key=lambda s: (str(type(s)), s))
            top1 = [float(by_seed[s][metric]) for s in seeds]
            mean = _mean(top1)
            top5 = [float(by_seed[s]["top5"]) for s in seeds if _is_number(by_seed[s].get("top5"))]
            extras: dict[str, list[float]] = {}
            for s in seeds:
                for name, value in (by_seed[s].get("extra") or {}).items():
                    if _is_number(value):
                        extras.setdefault(name, []).append(float(value))
            row = {
                "model": model, "dataset": dataset, "tag": tag, "setting": setting, "variant": variant,
                "baseline": variant == baseline, "n": len(seeds), "seeds": seeds, "metric": metric,
                "percent": getattr(task, "percent", True), "by_seed": {str(s): by_seed[s][metric] for s in seeds},
                **({"top1_by_seed": {str(s): by_seed[s]["top1"] for s in seeds}} if metric == "top1" else {}),
                "mean": mean, "sd": _sd(top1), "top5_mean": _mean(top5) if top5 else None,
                "gain_pp": None, "wins": None, "wins_k": None, "wins_n": None,
                "columns": {name: _column(by_seed, base_runs if variant != baseline else None, name)
                            for name in columns},
                "extras": {name: _mean(vals) for name, vals in sorted(extras.items())},
            }
            if base_runs and variant != baseline:
                row["gain_pp"] = mean - base_mean
                shared = [s for s in seeds if s in base_runs]
                k = sum(_beats(by_seed[s][metric], base_runs[s][metric], higher) for s in shared)
                row.update(wins=f"{k}/{len(shared)}", wins_k=k, wins_n=len(shared))
            rows.append(row)
    return rows


def _column(by_seed: dict, base_runs: dict | None, name: str) -> dict:
    """Mean, sample SD and gain over the baseline's mean of a further report column (None where no run has it)."""
    values = [float(r[name]) for r in by_seed.values() if _is_number(r.get(name))]
    base = [float(r[name]) for r in (base_runs or {}).values() if _is_number(r.get(name))]
    mean = _mean(values) if values else None
    gain = mean - _mean(base) if mean is not None and base else None
    return {"mean": mean, "sd": _sd(values), "gain_pp": gain}


def _fmt_extra(x: float | None) -> str:
    if x is None:
        return NO_VALUE
    # Spectral metrics (p1 ~ 0.7, eff_rank ~ 2.5) read best with 2 decimals; condition numbers (~1e10) do not.
    if x == 0 or 0.01 <= abs(x) < 1e5:
        return f"{x:.2f}"
    return f"{x:.3g}"


def format_top1(mean: float, sd: float | None) -> str:
    """``"93.88 ± 0.20"``; the mean alone when the SD is undefined (one seed)."""
    return f"{mean:.2f}" if sd is None else f"{mean:.2f} ± {sd:.2f}"


def format_gain(gain: float | None) -> str:
    """Signed, 2 decimals (``"+0.38"``); an em dash for the baseline or a group without it."""
    if gain is None:
        return NO_VALUE
    # A gain that rounds to zero prints "+0.00", never "-0.00".
    return f"{gain if round(gain, 2) != 0 else 0.0:+.2f}"


def accuracy_tables(rows: list[dict]) -> list[Table]:
    """One :class:`~attnlab.report.page.Table` per comparison (:func:`group_key`): Variant | headline (mean ± SD) |
    Gain (pp) | Wins | n | the task's further columns (mean ± SD, gain) | extras..., the baseline first (as
    :func:`summarize` orders the rows). Classification's headline is Top-1; detection's box AP, then mask AP,
    AP50 and AP75."""
    tables: list[Table] = []
    for key, group in groups(rows).items():
        extra_names = sorted({name for row in group for name in row.get("extras", {})})
        columns = list(group[0].get("columns", {}))
        title = metric_title(group[0].get("metric", "top1"))
        gain = "Gain (pp)" if group[0].get("percent", True) else "Gain"
        header = ["Variant", f"{title} (mean ± SD)", gain, "Wins", "n",
                  *(h for c in columns for h in (f"{metric_title(c)} (mean ± SD)", gain)), *extra_names]
        cells = []
        for row in group:
            label = f"{row['variant']} (baseline)" if row.get("baseline") else row["variant"]
            further = []
            for c in columns:
                col = row["columns"][c]
                further += [NO_VALUE if col["mean"] is None else format_top1(col["mean"], col["sd"]),
                            format_gain(col["gain_pp"])]
            cells.append([label, format_top1(row["mean"], row["sd"]), format_gain(row["gain_pp"]),
                          row["wins"] or NO_VALUE, str(row["n"]), *further,
                          *(_fmt_extra(row.get("extras", {}).get(name)) for name in extra_names)])
        tables.append(Table(header, cells, title=group_title(key)))
    return tables


def format_markdown(rows: list[dict]) -> str:
    """One Markdown table per (model, dataset): Variant | Top-1 (mean ± SD) | Gain (pp) | Wins | n | extras...

    Gains are computed from unrounded means and then rounded, so they can differ by 0.01 from the difference of
    the rounded means shown beside them (as in the paper).
    """
    return "\n\n".join(table_markdown(t) for t in accuracy_tables(rows)) + "\n"
