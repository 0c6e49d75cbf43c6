"""Head redundancy (DnA paper, "DnA: Denoising Attention for Visual Tasks", Appendix C.5 (C), Figure 12).

For heads i, j of one layer and one branch, with attention-weight maps W_i, W_j (N x M, read as vectors of N*M
entries) of one image (ViT) or window (Swin):

    Delta_ij = 1 - cos(W_i, W_j) = 1 - <W_i, W_j>_F / (||W_i||_F ||W_j||_F)

averaged over the H(H-1)/2 head pairs, then over images (and windows). It is the paper's pairwise cosine distance
between heads' attention weights: 0 when all heads attend identically (fully redundant), 1 when their maps are
mutually orthogonal (disjoint supports); higher means less redundancy. The paper measures each branch of DnA
separately (sigma(Q_i^+ K_i^T) and the softmin map of Q_i^-); here so are Differential attention's A1 and A2, and the
one map of standard (with or without ns) and Cog layers. The whole map is one vector (the paper does not say
whether it compares rows or maps).
"""

from __future__ import annotations

import torch
from torch import nn

from .maps import capture_maps, forward_batches
from .figures import agg_figure, save_png


def _cosines(maps: torch.Tensor) -> torch.Tensor:
    """(..., H, H) cos(W_i, W_j) of maps (..., H, N, M), each map one vector; float64."""
    flat = maps.double().flatten(-2)
    unit = flat / flat.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return unit @ unit.transpose(-2, -1)


def head_distance(maps: torch.Tensor) -> torch.Tensor:
    """Mean over head pairs i < j of 1 - cos(W_i, W_j) for maps (..., H, N, M); returns (...) float64 (nan for
    one head)."""
    H = maps.shape[-3]
    i, j = torch.triu_indices(H, H, offset=1, device=maps.device)
    return (1 - _cosines(maps)[..., i, j]).mean(dim=-1)


def pair_distances(maps: torch.Tensor) -> torch.Tensor:
    """(H, H) matrix of 1 - cos(W_i, W_j) averaged over the leading dimensions of maps (..., H, N, M); float64."""
    return (1 - _cosines(maps)).reshape(-1, maps.shape[-3], maps.shape[-3]).mean(dim=0)


@torch.no_grad()
def head_redundancy(model: nn.Module, images: torch.Tensor, batch_size: int = 32) -> list[dict]:
    """Per attention layer of ``model`` on ``images`` (n, C, H, W), eval mode: ``{"layer": name, "branches":
    {branch: {"distance": mean Delta over pairs and images, "pairs": (H, H) list}}}``, branch ``attn`` for one-map
    mechanisms, ``pos`` / ``neg`` for DnA and Differential. UnsupportedModelError for a module whose maps cannot be
    read (timm's own modules: convert first; unknown mechanisms)."""
    sums: dict[tuple[int, str], list] = {}

    def record(index, name, module, branches):
        for branch, b in branches.items():
            acc = sums.setdefault((index, branch), [name, 0.0, 0, 0.0])
            acc[1] += head_distance(b.weights).sum().item()
            acc[2] += b.weights.shape[0]
            acc[3] = acc[3] + pair_distances(b.weights).cpu() * b.weights.shape[0]

    with capture_maps(model, record):
        forward_batches(model, images, batch_size)
    layers: dict[int, dict] = {}
    for (index, branch), (name, total, count, pairs) in sorted(sums.items()):
        layer = layers.setdefault(index, {"layer": name, "branches": {}})
        layer["branches"][branch] = {"distance": total / count, "pairs": (pairs / count).tolist()}
    return [layers[i] for i in sorted(layers)]


def redundancy_summary(layers: list[dict]) -> dict[str, float]:
    """``head_distance`` (one-map models) or ``head_distance_pos`` / ``head_distance_neg``: means over layers."""
    names = sorted({b for layer in layers for b in layer["branches"]})
    out = {}
    for branch in names:
        values = [layer["branches"][branch]["distance"] for layer in layers if branch in layer["branches"]]
        out["head_distance" if branch == "attn" else f"head_distance_{branch}"] = sum(values) / len(values)
    return out


def plot_redundancy(results: dict[str, list[dict]], path, colors: dict[str, str] | None = None) -> None:
    """Figure 12: mean head distance per layer, one line per model (label; ``colors`` {label: colour}) and branch
    (one line style per branch); written to ``path``."""
    from .figures import color_of, integer_ticks

    fig = agg_figure(figsize=(9, 4))
    ax = fig.add_subplot()
    for n, (label, layers) in enumerate(results.items()):
        branches = sorted({b for layer in layers for b in layer["branches"]}, key=lambda b: (b != "attn", b))
        for k, branch in enumerate(branches):
            xs = [i for i, layer in enumerate(layers) if branch in layer["branches"]]
            ys = [layers[i]["branches"][branch]["distance"] for i in xs]
            ax.plot(xs, ys, marker="o", label=label if branch == "attn" else f"{label} ({branch})",
                    color=color_of(colors or {}, label, n), linestyle=("-", "--", ":", "-.")[k % 4])
    integer_ticks(ax.xaxis)
    ax.set(xlabel="attention layer", ylabel="mean 1 - cos between heads' maps",
           title="Head redundancy (higher: less redundant)")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the lines, not on them
    fig.tight_layout()
    save_png(fig, path, dpi=120)


__all__ = ["head_distance", "head_redundancy", "pair_distances", "plot_redundancy", "redundancy_summary"]
