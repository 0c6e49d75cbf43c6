"""Learning-rate sweeps across model sizes, drawn as Wortsman et al. 2023 draw them ("Small-scale proxies for
large-scale Transformer training instabilities", arXiv 2309.14322, Figure 1 and its companions): final loss against
the peak rate, one panel per method with one line per model size, and the LR sensitivity against the model size
(parameters, log axis), one line per method.

A ladder is the sweeps (:func:`attnlab.report.sweeps.lr_sweeps`) of at least two models on one dataset, with one
headline and one setting (the keys that tell a model's sweeps apart, e.g. ``z_loss=0.0001``); a method is a line of
the sweeps, (variant, warm-up). Per (size, method), as for one sweep,

    LR sensitivity = (1/n) sum_i min(L(eta_i), L_0) - min_i L(eta_i)

Model size: for the ladder presets (``ladder_d*``, :mod:`attnlab.models.ladder`) the parameters without the two
embedding matrices, from the preset's rule (it does not depend on the vocabulary, which the dataset sets); for
any other model result.json's ``params``, which counts every parameter. Each size says which it is.
"""

from __future__ import annotations

import math

from attnlab.report.page import Table
from attnlab.report.summary import NO_VALUE, metric_title
from attnlab.report.sweeps import lr_sensitivity

NON_EMBEDDING = "non-embedding (ladder preset)"
ALL_PARAMS = "all parameters (result.json)"


def model_size(model: str, params: int | float | None) -> tuple[int | None, str]:
    """(parameter count, its source): the ladder preset's non-embedding count, else result.json's ``params``."""
    from attnlab.models.ladder import LADDER_PRESETS, count_parameters

    if model in LADDER_PRESETS:
        return count_parameters(LADDER_PRESETS[model][0]["embed_dim"])[0], NON_EMBEDDING
    if isinstance(params, (int, float)) and not isinstance(params, bool) and params > 0:
        return int(params), ALL_PARAMS
    return None, "unknown"


def _text(value) -> str:
    from attnlab.report.summary import _setting_text

    return _setting_text(value)


def _method(variant: str, warmup: str, mixed: bool) -> str:
    return variant if not mixed else f"{variant} (no warm-up)" if warmup == "none" else f"{variant} (warm-up {warmup})"


def lr_ladders(sweeps: list[dict]) -> list[dict]:
    """The ladders among ``sweeps``: one ``{"title", "metric", "dataset", "setting", "sizes": [{"model", "params",
    "source"}] (ascending), "methods": {method: {model: {eta: point}}}, "sensitivity": {method: {model: value or
    None}}}`` per (dataset, setting, headline) swept on at least two models of known size. A method is
    ``variant`` or ``variant (warm-up ...)`` where a ladder has lines with and without warm-up."""
    by_data: dict[tuple[str, str], list[dict]] = {}
    for sweep in sweeps:
        by_data.setdefault((sweep["dataset"], sweep["metric"]), []).append(sweep)
    by_key: dict[tuple[str, str, str], list[dict]] = {}
    for (dataset, metric), members in by_data.items():
        # a key one model was swept with several values of (z_loss on and off) tells ladders apart; a key that
        # differs between models only (a per-size step count) does not
        per_model: dict[str, list[dict]] = {}
        for sweep in members:
            per_model.setdefault(sweep["model"], []).append(sweep)
        varying = sorted({k for group in per_model.values() for s in group for k in s["settings"]
                          if len({_text(g["settings"].get(k)) for g in group}) > 1})
        for sweep in members:
            label = ", ".join([f"{k}={_text(sweep['settings'].get(k))}" for k in varying]
                              + [sweep["decay"]] * bool(sweep.get("decay")))
            by_key.setdefault((dataset, label, metric), []).append(sweep)
    ladders = []
    for (dataset, setting, metric), members in sorted(by_key.items()):
        sizes = {}
        for sweep in members:
            params, source = model_size(sweep["model"], sweep.get("params"))
            if params is not None:
                sizes[sweep["model"]] = {"model": sweep["model"], "params": params, "source": source}
        if len(sizes) < 2:
            continue
        mixed = len({warmup == "none" for s in members for _, warmup in s["lines"]}) > 1
        methods: dict[str, dict[str, dict]] = {}
        for sweep in members:
            if sweep["model"] in sizes:
                for (variant, warmup), points in sweep["lines"].items():
                    methods.setdefault(_method(variant, warmup, mixed), {})[sweep["model"]] = points
        order = sorted(sizes.values(), key=lambda s: (s["params"], s["model"]))
        ladders.append({"title": dataset + (f" ({setting})" if setting else ""), "metric": metric,
                        "dataset": dataset, "setting": setting, "sizes": order,
                        "methods": {m: methods[m] for m in sorted(methods)},
                        "sensitivity": {m: {model: lr_sensitivity(points) for model, points in methods[m].items()}
                                        for m in sorted(methods)}})
    return ladders


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def ladder_tables(ladders: list[dict]) -> list[Table]:
    """Per ladder: Model | Parameters | one column per method, the LR sensitivity (— where a size has no such line
    or no loss at init), sizes ascending; the best (lowest) of each row in bold."""
    tables = []
    for ladder in ladders:
        methods = list(ladder["methods"])
        cells = []
        for size in ladder["sizes"]:
            values = [ladder["sensitivity"][m].get(size["model"]) for m in methods]
            known = [v for v in values if v is not None]
            best = min(known) if known else None
            cells.append([size["model"], f"{_params(size['params'])} ({size['source'].split(' (')[0]})",
                          *(NO_VALUE if v is None else f"**{v:.4f}**" if v == best and len(known) > 1
                            else f"{v:.4f}" for v in values)])
        tables.append(Table(["Model", "Parameters", *methods], cells, title=ladder["title"],
                            align=["l", "r", *["r"] * len(methods)]))
    return tables


def _plain_log_labels(axis) -> None:
    """A log axis labelled at its major ticks only, as plain numbers (1e+06 rather than 10^6 and its minor ticks)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _size_colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.9 * i / max(n - 1, 1)) for i in range(n)]  # small: dark, large: yellow-green, as Wortsman


def ladder_figure(ladder: dict, colors: dict[str, str] | None = None):
    """One panel per method: final loss against the peak rate (log axis), one line per size (viridis, small to
    large; the loss axis stops a little above the largest loss at init, where a diverged run's loss is off the
    chart); and a last panel: LR sensitivity against the parameter count (log axis), one line per method (its
    variant's report colour). A matplotlib Figure on the Agg canvas."""
    from attnlab.analysis.figures import agg_figure, color_of, variant_colors

    methods = list(ladder["methods"])
    variants = sorted({m.split(" (")[0] for m in methods})
    colors = colors if colors is not None else variant_colors(variants)
    sizes = ladder["sizes"]
    size_color = dict(zip((s["model"] for s in sizes), _size_colors(len(sizes))))
    panels = len(methods) + 1
    cols = min(panels, 4)
    rows = math.ceil(panels / cols)
    fig = agg_figure(figsize=(3.3 * cols, 2.9 * rows + 0.4), dpi=110)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    title = metric_title(ladder["metric"]).lower()
    inits = [p["init"] for m in methods for pts in ladder["methods"][m].values() for p in pts.values()
             if p["init"] is not None]
    finals = [p["final"] for m in methods for pts in ladder["methods"][m].values() for p in pts.values()]
    low, high = min(finals), max(max(inits) if inits else max(finals), min(finals))
    pad = 0.05 * (high - low or 1.0)
    for ax, method in zip(axes, methods):
        for size in sizes:
            points = ladder["methods"][method].get(size["model"])
            if not points:
                continue
            rates = sorted(points)
            ax.plot(rates, [points[lr]["final"] for lr in rates], marker="o", markersize=3,
                    color=size_color[size["model"]], label=f"{_params(size['params'])}")
        ax.set(xscale="log", ylim=(low - pad, high + pad), xlabel="peak learning rate")
        ax.set_title(method, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel(f"final {title}")
    axes[0].legend(fontsize="x-small", title="parameters", title_fontsize="x-small", loc="best")
    ax = axes[len(methods)]
    for i, method in enumerate(methods):
        xs = [(s["params"], ladder["sensitivity"][method].get(s["model"])) for s in sizes]
        xs = [(p, v) for p, v in xs if v is not None]
        if xs:
            ax.plot(*zip(*xs), marker="o", markersize=3, label=method,
                    color=color_of(colors, method.split(" (")[0], i),
                    linestyle="--" if method.endswith("(no warm-up)") else "-")
    sources = {s["source"] for s in sizes}
    ax.set(xscale="log", xlabel="parameters" + (" (non-embedding)" if sources == {NON_EMBEDDING} else ""),
           ylabel="LR sensitivity")
    ax.set_title("LR sensitivity against size", fontsize=9)
    _plain_log_labels(ax.xaxis)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="x-small", loc="best")
    for extra in axes[panels:]:
        extra.set_visible(False)
    fig.suptitle(ladder["title"], fontsize=10)
    fig.tight_layout()
    return fig


def ladder_max_logits(ladder: dict, runs_dir) -> dict[str, dict[str, dict]]:
    """The training probe's max attention logit (the largest over layers) over training, per method and size, of
    each size's runs at the largest rate whose runs logged it: {method: {model: {"lr", "runs", "steps", "max"}}}
    (:func:`attnlab.analysis.curves.layer_max_logits` reads metrics.jsonl; mean over seeds per layer first)."""
    from pathlib import Path

    from attnlab.analysis.curves import layer_max_logits
    from attnlab.errors import AttnlabError
    from attnlab.train.files import METRICS

    out: dict[str, dict[str, dict]] = {}
    for method, by_model in ladder["methods"].items():
        for model, points in by_model.items():
            for lr in sorted(points, reverse=True):
                dirs = [Path(runs_dir) / d for d in points[lr].get("run_dirs", [])]
                try:  # a damaged metrics.jsonl is named under "Not included" by the training curves already
                    found = layer_max_logits([d for d in dirs if (d / METRICS).is_file()])
                except AttnlabError:
                    found = {}
                if len(found) == 1:
                    [entry] = found.values()
                    layers = list(entry["layers"].values())
                    peak = [max((v[i] for v in layers if not math.isnan(v[i])), default=math.nan)
                            for i in range(len(entry["steps"]))]
                    out.setdefault(method, {})[model] = {"lr": lr, "runs": entry["runs"], "steps": entry["steps"],
                                                         "max": peak}
                    break
    return out


def max_logit_figure(ladder: dict, found: dict[str, dict[str, dict]]):
    """One panel per method: the max attention logit over training steps (log axis), one line per size (the
    colours of :func:`ladder_figure`), labelled with the rate it was read at."""
    from attnlab.analysis.figures import agg_figure

    sizes = [s for s in ladder["sizes"]]
    size_color = dict(zip((s["model"] for s in sizes), _size_colors(len(sizes))))
    methods = [m for m in ladder["methods"] if m in found]
    cols = min(len(methods), 4)
    rows = math.ceil(len(methods) / cols)
    fig = agg_figure(figsize=(3.3 * cols, 2.9 * rows + 0.4), dpi=110)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, method in zip(axes, methods):
        for size in sizes:
            entry = found[method].get(size["model"])
            if entry:
                ax.plot(entry["steps"], entry["max"], color=size_color[size["model"]],
                        label=f"{_params(size['params'])}, lr {entry['lr']:.0e}")
        ax.set(yscale="log", xlabel="step")
        _plain_log_labels(ax.yaxis)
        ax.set_title(method, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="xx-small", loc="best")
    axes[0].set_ylabel("max attention logit")
    for extra in axes[len(methods):]:
        extra.set_visible(False)
    fig.suptitle(f"{ladder['title']}: max attention logit over training", fontsize=10)
    fig.tight_layout()
    return fig


def ladders_json(ladders: list[dict], logits: list[dict] | None = None) -> list[dict]:
    """The ladders as JSON (report.json's ``lr_ladders``): sizes, and per method and size the LR sensitivity and
    the max attention logit over training where runs logged it."""
    logits = logits or [{} for _ in ladders]
    return [{"title": ld["title"], "metric": ld["metric"], "dataset": ld["dataset"], "setting": ld["setting"],
             "sizes": ld["sizes"],
             "methods": [{"method": m, "sizes": [{"model": model, "lr_sensitivity": ld["sensitivity"][m][model],
                                                  "max_logit": found.get(m, {}).get(model)}
                                                 for model in (s["model"] for s in ld["sizes"])
                                                 if model in ld["methods"][m]]}
                         for m in ld["methods"]]}
            for ld, found in zip(ladders, logits)]


__all__ = ["ALL_PARAMS", "NON_EMBEDDING", "ladder_figure", "ladder_max_logits", "ladder_tables", "ladders_json",
           "lr_ladders", "max_logit_figure", "model_size"]
