"""Learning-rate sweeps in the manner of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer
training instabilities", arXiv 2309.14322): final loss against the peak learning rate, and its learning-rate
sensitivity.

A sweep is the finished runs of one (model, dataset) trained alike but for their learning rates (``lr`` and
what a grid's ``variations`` change with it: ``min_lr``, ``warmup_lr``, the warm-up length, the tag), over at least
two peak rates, for a task whose headline is a loss (lower is better). Its lines are (variant, warm-up); a point is
(peak rate eta, final loss L(eta), loss at initialisation L_0), each the mean over the seeds run at that rate, L_0
the headline of the evaluation before the first step (result.json's ``init``, written by tasks with
``eval_at_init``). They define, over the swept rates eta_1..eta_n,

    LR sensitivity = (1/n) sum_i min(L(eta_i), L_0) - min_i L(eta_i)

0 for a variant whose loss does not depend on the rate; each term is capped at L_0, so a run that ends worse than
it started counts as no progress. A run that stopped at a non-finite loss has no result.json: a line missing a
rate of its sweep says so beside its value, which is then over the rates it has (Wortsman et al. count such a run
as L_0).

Weight decay: runs whose ``weight_decay`` is one value are one sweep (PyTorch's AdamW decays by lr(t) x
weight_decay: coupled to the rate); runs whose ``lr x weight_decay`` is one value are one sweep too, with
independent weight decay lambda = lr x weight_decay (Wortsman et al.'s "independent weight decay": the schedule
scales it, the peak rate does not), as a grid that sets ``weight_decay: lambda / lr`` per rate trains them.
"""

from __future__ import annotations

import statistics

from attnlab.report.page import Table
from attnlab.report.summary import NO_VALUE, _is_number, _task, _variant_label, headline, label_settings, metric_title

# the keys a learning-rate variation changes; runs differing in others are different sweeps
LR_KEYS = frozenset({"lr", "min_lr", "warmup_lr", "warmup_steps", "warmup_epochs", "tag"})
DECAY = "weight_decay"  # may change with the rate where lr x weight_decay does not (module docstring)


def _warmup(settings: dict) -> str:
    """"none", "500 steps" or "0.5 epochs": the run's linear warm-up (steps take precedence, as in training)."""
    steps = settings.get("warmup_steps")
    if steps is not None:
        return f"{steps} steps" if steps else "none"
    epochs = settings.get("warmup_epochs") or 0
    return f"{epochs:g} epochs" if epochs else "none"


def _decay_groups(members: list[dict]) -> list[tuple[str, list[dict]]]:
    """``members`` (one sweep but for weight decay) as [(decay label, runs)]: one group when weight_decay is one value
    ("" as before) or lr x weight_decay is one value ("independent weight decay 1e-4"), else one per weight_decay
    ("weight_decay=0.1")."""
    decays = {r["weight_decay"] for r in members}
    if len(decays) <= 1:
        return [("", members)]
    products = [r["lr"] * r["weight_decay"] for r in members if isinstance(r["weight_decay"], (int, float))]
    if len(products) == len(members) and max(products) - min(products) <= 1e-6 * abs(max(products)):
        return [(f"independent weight decay {statistics.fmean(products):.3g}", members)]
    by_decay: dict = {}
    for run in members:
        by_decay.setdefault(run["weight_decay"], []).append(run)
    return [(f"weight_decay={d:g}" if isinstance(d, (int, float)) else f"weight_decay={d}", rs)
            for d, rs in sorted(by_decay.items(), key=lambda kv: str(kv[0]))]


def _rate(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e")


def lr_sweeps(runs: list[dict]) -> list[dict]:
    """The sweeps among ``runs`` (:func:`~attnlab.report.summary.scan_runs`' dicts, with ``settings``): one
    ``{"title", "metric", "model", "dataset", "setting", "decay", "settings", "params", "rates": {warmup: [eta...]
    swept with it}, "lines": {(variant, warmup): {eta: {"final", "init", "n", "run_dirs"}}}, "mixed_warmup"}`` per
    sweep (``init`` None where a run at that rate recorded none; ``setting``: what tells it from the model's other
    sweeps, weight decay included; ``decay``: the weight decay part of it ("" where one value); ``settings``: its
    runs' shared settings but for the rate and weight decay; ``params``: result.json's parameter count, if any;
    ``mixed_warmup``: lines with and without warm-up). A warm-up that was run at one rate only makes no line."""
    found = []
    for run in runs:
        settings = run.get("settings") or {}
        task = _task(run)
        lr = settings.get("lr")
        if task is None or task.higher_is_better or not isinstance(lr, (int, float)) or lr <= 0:
            continue
        rest = {k: v for k, v in settings.items() if k not in LR_KEYS and k != DECAY}
        found.append({**run, "tag": "", "settings": rest, "lr": float(lr), "warmup": _warmup(settings),
                      DECAY: settings.get(DECAY)})
    by_sweep: dict[tuple, list[dict]] = {}
    for run in label_settings(found)[0]:  # runs trained differently apart from the rate: separate sweeps
        by_sweep.setdefault((run["model"], run["dataset"], run["setting"], headline(run)), []).append(run)
    split = {}
    for (model, dataset, setting, metric), members in by_sweep.items():  # weight decay: coupled or independent
        for decay, runs in _decay_groups(members):
            split[(model, dataset, ", ".join(x for x in (setting, decay) if x), metric)] = (decay, runs)
    sweeps = []
    for (model, dataset, setting, metric), (decay, members) in sorted(split.items()):
        swept: dict[str, set[float]] = {}  # the rates run with each warm-up: a line is measured against its own
        for run in members:
            swept.setdefault(run["warmup"], set()).add(run["lr"])
        members = [r for r in members if len(swept[r["warmup"]]) >= 2]  # a warm-up run at one rate: no sweep
        if not members:
            continue
        points: dict[tuple[str, str], dict[float, list[dict]]] = {}
        for run in members:
            points.setdefault((_variant_label(run["attn"]), run["warmup"]), {}).setdefault(run["lr"], []).append(run)
        lines = {}
        for key in sorted(points):
            lines[key] = {}
            for lr, at in sorted(points[key].items()):
                inits = [(r.get("init") or {}).get(metric) for r in at]
                lines[key][lr] = {"final": statistics.fmean(float(r[metric]) for r in at), "n": len(at),
                                  "init": statistics.fmean(inits) if all(_is_number(v) for v in inits) else None,
                                  "run_dirs": sorted(r["run_dir"] for r in at if r.get("run_dir"))}
        sweeps.append({"title": f"{model} / {dataset}" + (f" ({setting})" if setting else ""), "metric": metric,
                       "model": model, "dataset": dataset, "setting": setting, "decay": decay,
                       "settings": members[0]["settings"],
                       "params": next((r["params"] for r in members if _is_number(r.get("params"))), None),
                       "rates": {w: sorted(swept[w]) for w in sorted({w for _, w in lines})}, "lines": lines,
                       "mixed_warmup": len({w == "none" for _, w in lines}) > 1})
    return sweeps


def lr_sensitivity(points: dict[float, dict]) -> float | None:
    """mean over the rates of min(final, init) minus the best final (module docstring); None without every init."""
    if not points or any(p["init"] is None for p in points.values()):
        return None
    best = min(p["final"] for p in points.values())
    return statistics.fmean(min(p["final"], p["init"]) for p in points.values()) - best


def sensitivity_tables(sweeps: list[dict]) -> list[Table]:
    """Per sweep: Variant | Warm-up | Rates | Best final loss | at lr | Loss at init | LR sensitivity."""
    tables = []
    for sweep in sweeps:
        title = metric_title(sweep["metric"]).lower()
        cells = []
        for (variant, warmup), points in sweep["lines"].items():
            best = min(points, key=lambda lr: points[lr]["final"])
            missing = [lr for lr in sweep["rates"][warmup] if lr not in points]
            rates = f"{len(points)} of {len(sweep['rates'][warmup])}" + (
                f" (no finished run at {', '.join(map(_rate, missing))})" if missing else "")
            inits = [p["init"] for p in points.values()]
            value = lr_sensitivity(points)
            cells.append([variant, warmup, rates, f"{points[best]['final']:.4f}", _rate(best),
                          f"{statistics.fmean(inits):.4f}" if None not in inits else NO_VALUE,
                          f"{value:.4f}" if value is not None else f"{NO_VALUE} (no loss at init recorded)"])
        tables.append(Table(["Variant", "Warm-up", "Rates", f"Best final {title}", "at lr", f"{title.capitalize()} "
                             "at init", "LR sensitivity"], cells, title=sweep["title"],
                            align=["l", "l", "l", "r", "r", "r", "r"]))
    return tables


def sweep_figure(sweep: dict, colors: dict[str, str] | None = None):
    """Final loss against the peak rate (log axis), one line per variant (its report colour), warm-up solid and no
    warm-up dashed when the sweep has both; a matplotlib Figure on the Agg canvas."""
    from attnlab.analysis.figures import agg_figure, color_of, variant_colors

    variants = sorted({v for v, _ in sweep["lines"]})
    colors = colors if colors is not None else variant_colors(variants)
    both = sweep["mixed_warmup"]
    fig = agg_figure(figsize=(6.0, 3.8), dpi=120)
    ax = fig.add_subplot()
    for (variant, warmup), points in sweep["lines"].items():
        rates = sorted(points)
        label = variant if not both else f"{variant} (no warm-up)" if warmup == "none" else \
            f"{variant} (warm-up {warmup})"
        ax.plot(rates, [points[lr]["final"] for lr in rates], marker="o", label=label,
                color=color_of(colors, variant, variants.index(variant)),
                linestyle="--" if both and warmup == "none" else "-")
    ax.set(xscale="log", xlabel="peak learning rate", ylabel=f"final {metric_title(sweep['metric']).lower()}")
    ax.set_title(sweep["title"], fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="x-small", loc="best")
    fig.tight_layout()
    return fig


def sweeps_json(sweeps: list[dict]) -> list[dict]:
    """The sweeps as JSON (report.json): per line its swept rates, points and LR sensitivity."""
    return [{"title": s["title"], "metric": s["metric"],
             "lines": [{"variant": v, "warmup": w, "rates": s["rates"][w], "lr_sensitivity": lr_sensitivity(points),
                        "points": [{"lr": lr, **p} for lr, p in sorted(points.items())]}
                       for (v, w), points in s["lines"].items()]} for s in sweeps]


__all__ = ["LR_KEYS", "lr_sensitivity", "lr_sweeps", "sensitivity_tables", "sweep_figure", "sweeps_json"]
