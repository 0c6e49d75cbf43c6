"""Spectra of head outputs (NS-Attn paper, Section 3.4, eq. 6-8, Figure 2).

For every attention block and head, each sample's (ViT) or window's (Swin) output right before head merge is read
as the feature-by-token matrix M (D x N); its Gram matrix G = M M^T gives sorted eigenvalues normalised to sum 1
(p_1 >= ... >= p_D), the leading fraction p_1 and the entropy effective rank exp(-sum p_i ln p_i). Metrics are
computed per matrix, averaged within each block, then averaged over blocks: for ViT, where every block holds the
same number of matrices, this is the mean over all matrices; for Swin it is the paper's per-block summary.
For NS models the matrices are the transformed outputs (what head merge receives).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..attention.base import AttnlabAttention, Want
from ..errors import UnsupportedModelError
from ..ops.spectra import effective_rank, gram_spectrum, leading_fraction
from .figures import agg_figure, save_png
from .maps import forward_batches


@dataclass
class HeadSpectra:
    """Per attention block: normalised spectra (matrices, H, D), p1 and effective rank (matrices, H), float64."""

    layers: list[str]
    spectra: list[torch.Tensor] = field(default_factory=list)
    p1: list[torch.Tensor] = field(default_factory=list)
    eff_rank: list[torch.Tensor] = field(default_factory=list)

    def block_means(self) -> list[dict]:
        return [
            {"layer": name, "p1": p1.mean().item(), "eff_rank": er.mean().item(),
             "p1_per_head": p1.mean(0).tolist(), "eff_rank_per_head": er.mean(0).tolist(),
             "matrices": int(p1.numel())}
            for name, p1, er in zip(self.layers, self.p1, self.eff_rank)
        ]

    def mean_spectrum(self) -> torch.Tensor | None:
        """Mean normalised spectrum over blocks (each block's mean over its matrices and heads); None when blocks
        have different head dims."""
        per_block = [s.mean(dim=(0, 1)) for s in self.spectra]
        if len({s.numel() for s in per_block}) != 1:
            return None
        return torch.stack(per_block).mean(0)

    def summary(self) -> dict:
        blocks = self.block_means()
        spectrum = self.mean_spectrum()
        return {"p1": sum(b["p1"] for b in blocks) / len(blocks),
                "eff_rank": sum(b["eff_rank"] for b in blocks) / len(blocks),
                "mean_spectrum": spectrum.tolist() if spectrum is not None else None, "blocks": blocks}


def head_output_spectra(model: nn.Module, images: torch.Tensor, batch_size: int = 32) -> HeadSpectra:
    """Spectra of every block's and head's pre-merge outputs on ``images`` (n, C, H, W).

    The paper's protocol: the first 160 test images in 5 batches of 32 (see :func:`first_images`), eval mode,
    ``torch.inference_mode()``. The model must carry attnlab attention modules (``build_model`` or ``convert``).
    """
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, AttnlabAttention)]
    if not modules:
        raise UnsupportedModelError("head_output_spectra needs attnlab attention modules; build the model with "
                                    "attnlab.build_model or pass it through attnlab.convert first.")
    result = HeadSpectra(layers=[name for name, _ in modules])
    chunks: list[list[torch.Tensor]] = [[] for _ in modules]

    def record(index, found):  # found.heads: (B, H, N, D), the tensor head merge receives
        chunks[index].append(gram_spectrum(found.heads.detach().mT).cpu())

    with torch.inference_mode():
        forward_batches(model, images, batch_size, [m.observe(Want(heads=True), lambda _, found, i=i: record(i, found))
                                                    for i, (_, m) in enumerate(modules)], watch=modules)
    for parts in chunks:
        p = torch.cat(parts)  # (matrices, H, D)
        result.spectra.append(p)
        result.p1.append(leading_fraction(p))
        result.eff_rank.append(effective_rank(p))
    return result


def first_images(dataset, n: int = 160) -> torch.Tensor:
    """The first ``n`` images of a dataset, in order (the paper: first 160 test images, no shuffling)."""
    n = min(n, len(dataset))
    return torch.stack([dataset[i][0] for i in range(n)])


def plot_spectra(curves: dict[str, HeadSpectra | list[float]], path, title: str = "Mean normalised head-output spectrum",
                 colors: dict[str, str] | None = None):
    """Figure 2 of the paper: the mean normalised eigenvalue spectrum per variant (log scale), written as PNG;
    ``colors`` {label: colour} (default: :func:`attnlab.analysis.figures.variant_colors` of the labels)."""
    from .figures import color_of, integer_ticks, variant_colors

    colors = colors if colors is not None else variant_colors(curves)
    fig = agg_figure(figsize=(5.5, 3.6), dpi=120)
    ax = fig.add_subplot()
    for i, (label, curve) in enumerate(curves.items()):
        values = curve.mean_spectrum().tolist() if isinstance(curve, HeadSpectra) else list(curve)
        ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=label,
                color=color_of(colors, label, i))
    integer_ticks(ax.xaxis)
    ax.set(yscale="log", xlabel="eigenvalue index i (sorted)", ylabel="mean normalised eigenvalue p_i")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    return path
