"""Training curves of a comparison (as the DnA paper's loss and accuracy curves, Appendix C, Figure 8): train loss,
test loss and top-1 per epoch for every run (a task family may name other panels, ``curve_panels``: detection's
train loss, box AP and mask AP), grouped by variant, as the mean over seeds and a band of +- one sample SD (no band
for one seed).

Runs are read from their files alone: ``config.yaml`` (the variant, model and dataset) and ``metrics.jsonl`` (one
JSON object per epoch with ``epoch``, ``train_loss``, ``test_loss``, ``top1``). ``metrics.jsonl`` is untrusted
input: it is parsed with ``json`` line by line and anything else is a ConfigError naming the file and line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import ConfigError
from ..train.files import CONFIG
from ..train.files import METRICS as METRICS_FILE

METRICS = ("train_loss", "test_loss", "top1")
PANELS = (("train_loss", "train loss"), ("test_loss", "test loss"), ("top1", "test top-1 (%)"))


def panels_of(run_dir: str | Path) -> tuple[tuple[str, str], ...]:
    """The (metric, title) panels of a run's curves: its task family's ``curve_panels``, classification's
    :data:`PANELS` by default (and for a directory without a readable config.yaml)."""
    from ..train.config import load_config
    from ..train.tasks import task_class

    config = Path(run_dir) / CONFIG
    if not config.is_file():
        return PANELS
    try:
        from ..data.registry import dataset

        return tuple(getattr(task_class(dataset(load_config(config).dataset).task), "curve_panels", PANELS))
    except Exception:  # noqa: BLE001 - a config this version cannot read: its epochs say what is wrong
        return PANELS


def read_metrics(path: str | Path, metrics: tuple[str, ...] | None = None) -> list[dict]:
    """The epochs of one ``metrics.jsonl``: ``[{"epoch": int, metric: float for each of metrics}]``; ``metrics``
    default to its run's panels (:func:`panels_of`: ``train_loss``, ``test_loss``, ``top1`` for
    classification)."""
    path = Path(path)
    keys = metrics if metrics is not None else tuple(m for m, _ in panels_of(path.parent))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; training curves need each run's metrics.jsonl.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} cannot be read as UTF-8 text ({type(err).__name__}); rerun the training.") from None
    epochs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            obj = None
        epoch = obj.get("epoch") if isinstance(obj, dict) else None
        values = [obj.get(k) for k in keys] if isinstance(obj, dict) else []
        if (type(epoch) is not int or epoch < 0 or len(values) != len(keys)
                or any(type(v) not in (int, float) for v in values)):
            raise ConfigError(f"{path} line {number} is not a JSON object with an integer epoch and numbers "
                              f"{', '.join(keys)}; rerun the training or remove the run.")
        epochs.append({"epoch": epoch, **{k: float(v) for k, v in zip(keys, values)}})
    return epochs


def _mean_sd(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, sd


def aggregate(runs: dict[str, list[list[dict]]], panels=PANELS) -> dict[str, dict]:
    """{variant: [epochs of each run]} -> {variant: {"runs": n, "epochs": [...], "panels": panels, metric: {"mean",
    "low", "high", "n"}}}: per epoch the mean over the runs that reached it, low / high = mean -+ sample SD."""
    out = {}
    for variant, histories in runs.items():
        epochs = sorted({e["epoch"] for h in histories for e in h})
        entry: dict = {"runs": len(histories), "epochs": epochs, "panels": [list(p) for p in panels]}
        for metric, _ in panels:
            series = {"mean": [], "low": [], "high": [], "n": []}
            for epoch in epochs:
                values = [e[metric] for h in histories for e in h if e["epoch"] == epoch]
                mean, sd = _mean_sd(values)
                for key, v in (("mean", mean), ("low", mean - sd), ("high", mean + sd), ("n", len(values))):
                    series[key].append(v)
            entry[metric] = series
        out[variant] = entry
    return out


def training_curves(run_dirs: list[str | Path]) -> dict[str, dict]:
    """:func:`aggregate` over the runs in ``run_dirs``, grouped by variant (the run's ``attn``; prefixed with
    model and dataset when the runs span several). Runs with no epoch logged yet are left out."""
    from ..train.config import load_config

    found = []
    for run_dir in map(Path, run_dirs):
        config = run_dir / CONFIG
        if not config.is_file():
            raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); give directories written by "
                              f"attnlab train or compare.")
        cfg = load_config(config)
        panels = panels_of(run_dir)
        found.append(((cfg.model, cfg.dataset), cfg.attn, read_metrics(run_dir / METRICS_FILE,
                                                                        tuple(m for m, _ in panels))))
        if panels != panels_of(run_dirs[0]):
            raise ConfigError(f"{run_dir} is a run of another task family than {run_dirs[0]}, whose curves show other "
                              f"metrics; draw the curves of each family's runs apart.")
    if not found:
        raise ConfigError("training curves need at least one run directory.")
    mixed = len({group for group, _, _ in found}) > 1
    runs: dict[str, list[list[dict]]] = {}
    for (model, dataset), attn, epochs in found:
        if epochs:
            runs.setdefault(f"{model}/{dataset}/{attn}" if mixed else attn, []).append(epochs)
    return aggregate(runs, panels_of(run_dirs[0]))


def _variant(key: str) -> str:
    """The variant of a :func:`training_curves` key ("model/dataset/variant" when the runs span several)."""
    return key.rpartition("/")[2]


def plot_training_curves(curves: dict[str, dict], path: str | Path | None = None, *, baseline: str | None = "standard",
                         colors: dict[str, str] | None = None):
    """Small multiples: one row per variant (train loss, test loss, top-1 per epoch: mean line, +- SD band), each
    beside the baseline's curves in grey when ``curves`` hold the baseline, axes shared down each column, whole
    epochs on the x axis; colours from ``colors`` (default :func:`attnlab.analysis.figures.variant_colors`). Written
    to ``path`` when given. Returns the matplotlib Figure."""
    from .figures import BASELINE_COLOR, agg_figure, color_of, integer_ticks, save_png, variant_colors

    colors = colors if colors is not None else variant_colors(map(_variant, curves), baseline)
    panels = [tuple(p) for p in next(iter(curves.values()), {}).get("panels", PANELS)]
    base_name = "".join(str(baseline).split()) if baseline is not None else None
    bases = {key: entry for key, entry in curves.items() if _variant(key) == base_name}
    rows = [key for key in curves if key not in bases] or list(bases)
    fig = agg_figure(figsize=(11, 0.7 + 2.3 * len(rows)))
    axes = fig.subplots(len(rows), len(panels), sharex=True, sharey="col", squeeze=False)

    def draw(ax, entry, metric, color, label, **style):
        series = entry[metric]
        ax.plot(entry["epochs"], series["mean"], color=color, label=f"{label} ({entry['runs']} runs)", **style)
        ax.fill_between(entry["epochs"], series["low"], series["high"], color=color, alpha=0.2, linewidth=0)

    for i, key in enumerate(rows):
        # the baseline of the variant's own model and dataset, when the curves span several
        base = next((e for k, e in bases.items() if k != key and k.rpartition("/")[0] == key.rpartition("/")[0]), None)
        for j, (metric, title) in enumerate(panels):
            ax = axes[i][j]
            if base is not None:
                draw(ax, base, metric, BASELINE_COLOR, f"{base_name} (baseline)", linestyle="--")
            draw(ax, curves[key], metric, color_of(colors, _variant(key), i), key)
            if i == 0:
                ax.set_title(title, fontsize=10)
            if i == len(rows) - 1:
                ax.set_xlabel("epoch")
            integer_ticks(ax.xaxis)
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel(key, fontsize=9)
        axes[i][0].legend(fontsize="x-small", loc="best")
    fig.tight_layout()
    if path is not None:
        save_png(fig, path, dpi=120)
    return fig


LAYER_MAX_LOGIT = "max_logit/layer_"  # the training probe's per-layer key (attnlab.analysis.entropy.training_probe)


def layer_max_logits(run_dirs: list[str | Path]) -> dict[str, dict]:
    """The training probe's per-layer max attention logit over steps (``probe_every``: metrics.jsonl's ``probes``),
    grouped by variant as :func:`training_curves` groups: {variant: {"runs": n, "steps": [...], "layers": {i:
    [mean over the runs that probed step s]}}}. Runs without a probed layer are left out."""
    from ..train.config import load_config
    from ..train.files import read_jsonl

    found: dict[str, dict[int, dict[int, list[float]]]] = {}
    for run_dir in map(Path, run_dirs):
        series: dict[int, dict[int, list[float]]] = {}
        for record in read_jsonl(run_dir / METRICS_FILE):
            for probe in record.get("probes") or []:
                step = probe.get("step") if isinstance(probe, dict) else None
                if type(step) is not int:
                    continue
                for key, value in probe.items():
                    if key.startswith(LAYER_MAX_LOGIT) and key[len(LAYER_MAX_LOGIT):].isdigit() \
                            and type(value) in (int, float) and math.isfinite(value):
                        series.setdefault(int(key[len(LAYER_MAX_LOGIT):]), {})[step] = float(value)
        if series:
            variant = "".join(str(load_config(run_dir / CONFIG).attn).split())
            for layer, by_step in series.items():
                for step, value in by_step.items():
                    found.setdefault(variant, {}).setdefault(layer, {}).setdefault(step, []).append(value)
    out = {}
    for variant, layers in found.items():
        steps = sorted({s for by_step in layers.values() for s in by_step})
        out[variant] = {"runs": max(len(v) for by_step in layers.values() for v in by_step.values()), "steps": steps,
                        "layers": {i: [_mean_sd(layers[i][s])[0] if s in layers[i] else math.nan for s in steps]
                                   for i in sorted(layers)}}
    return out


def plot_layer_max_logits(found: dict[str, dict], path: str | Path | None = None, *, title: str = ""):
    """One panel per variant (shared y axis, logarithmic beyond +-1): each layer's max attention logit against the
    step, darker for deeper layers (the logit growth of Wortsman et al. 2023, arXiv 2309.14322). Written to
    ``path`` when given."""
    from matplotlib import colormaps

    from .figures import agg_figure, save_png

    fig = agg_figure(figsize=(max(4.0, 3.2 * len(found)), 3.2))
    axes = fig.subplots(1, len(found), sharey=True, squeeze=False)[0]
    for ax, (variant, entry) in zip(axes, sorted(found.items())):
        depth = len(entry["layers"])
        for j, (layer, values) in enumerate(entry["layers"].items()):
            ax.plot(entry["steps"], values, color=colormaps["viridis"](0.85 - 0.75 * j / max(depth - 1, 1)),
                    marker=".", label=f"layer {layer}")
        ax.set_title(f"{variant} ({entry['runs']} run{'s' if entry['runs'] != 1 else ''})", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", loc="best")
    axes[0].set_yscale("symlog", linthresh=1.0)  # logits of a clipped and an unclipped model differ by orders
    axes[0].set_ylabel("max attention logit (symlog)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    if path is not None:
        save_png(fig, path, dpi=120)
    return fig


__all__ = ["aggregate", "layer_max_logits", "plot_layer_max_logits", "plot_training_curves", "read_metrics",
           "training_curves"]
