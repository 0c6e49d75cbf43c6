"""What every figure of attnlab shares: one colour per variant, and PNGs written as checkpoints are.

Colours: the baseline is always the same grey and no other variant is grey; the other variants take the colours of
matplotlib's tab10 and then tab20 (greys left out) in sorted order, so every figure drawn for one set of variants
(the report's bars and curves, analyze's spectra, redundancy and robustness plots) gives a variant one colour.

Writing: a figure is rendered into memory, then a temporary file in the same directory is renamed over the target
(``attnlab.train.checkpoint.atomic_write``). A reader never sees a half-written PNG, and a symlink at the target is
replaced, never followed, so a figure never lands outside the folder it is written to.
"""

from __future__ import annotations

import io
from pathlib import Path

BASELINE_COLOR = "#808080"
# tab10 without its grey (#7f7f7f), then tab20's light shades without theirs: 18 colours none of them grey
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
           "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")


def _label(variant: str) -> str:
    return "".join(str(variant).split())  # the spec grammar ignores whitespace


def variant_colors(variants, baseline: str | None = "standard") -> dict[str, str]:
    """{variant: colour} for ``variants`` (whitespace in a spec ignored): ``baseline`` grey, the others from
    ``PALETTE`` in sorted order (repeating after 18)."""
    names = sorted({_label(v) for v in variants})
    base = _label(baseline) if baseline is not None else None
    others = [v for v in names if v != base]
    colors = {v: PALETTE[i % len(PALETTE)] for i, v in enumerate(others)}
    if base in names:
        colors[base] = BASELINE_COLOR
    return colors


def color_of(colors: dict[str, str], variant: str, index: int = 0) -> str:
    """``colors[variant]``, or the palette's ``index``-th colour for a variant the mapping lacks."""
    return colors.get(_label(variant), PALETTE[index % len(PALETTE)])


def integer_ticks(axis) -> None:
    """Ticks at whole numbers only, for axes that count (epochs, blocks, layers, indices)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def agg_figure(**kwargs):
    """A matplotlib ``Figure(**kwargs)`` on the Agg canvas: no pyplot state or display is touched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str | Path, **savefig_kwargs) -> Path:
    """Write the matplotlib ``fig`` to ``path`` as PNG (``savefig_kwargs`` go to ``Figure.savefig``); returns it."""
    from ..train.checkpoint import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig_kwargs)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


__all__ = ["BASELINE_COLOR", "PALETTE", "agg_figure", "color_of", "integer_ticks", "save_png", "variant_colors"]
