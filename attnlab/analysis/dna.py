"""DnA's instruments (DnA paper Sec. 4.4, Appendix C.5) for any two-branch attention, DnA and Differential; see
docs/methods.md, "Two-branch convention (DnA and diff) and instruments". Per attention layer, sample (ViT) or window
(Swin) and head, from the real forward's branch outputs O+, O- (N x D, before alpha / lambda) and values V+, V-
(N x D; diff shares V, so V+ = V-):

- intruder dimensions (Sec. 4.4 (a)): U+ and U- the top-k left singular vectors of O+ and O- (k = 10; at most
  min(N, D)). A vector u of U+ is an intruder when |cos(u, w)| < eps for every w in U- (eps = cos(pi/3)); the count
  is 0..k, higher means the branches span more separate subspaces.
- value similarity C(V+, V-) = <V+, V->_F / (||V+||_F ||V-||_F) in [-1, 1] (Sec. 4.4 (b); the paper's display
  divides by ||V+||_F twice, its trace form and stated range use both norms, as here).
- branch cosine <O+, O->_F / (||O+||_F ||O-||_F) (Sec. 4.4: 0.96 for diff, 0.32 for DnA on ImageNet).
- alpha statistics per layer (Appendix C.5 (D), Figure 11): mean, max, min and sample SD of alpha_h over heads
  (diff: its one lambda per layer, SD 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..attention.base import Want
from ..attention.capabilities import capabilities_of
from ..errors import UnsupportedModelError
from .figures import agg_figure, save_png
from .maps import forward_batches

DEFAULT_K = 10
DEFAULT_EPS = math.cos(math.pi / 3)
MEASURES = ("intruders", "value_similarity", "branch_cosine")  # BranchInstruments' per-layer tensors


def intruder_dimensions(a: torch.Tensor, b: torch.Tensor, k: int = DEFAULT_K, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Number of a's top-k left singular vectors whose |cosine| with every one of b's top-k stays below eps.
    a, b: (..., N, D). Returns (...) int64 counts in [0, k'] with k' = min(k, N, D). Computed in float64."""
    kk = min(k, a.shape[-2], a.shape[-1])
    ua, ub = (torch.linalg.svd(t.double(), full_matrices=False).U[..., :kk] for t in (a, b))
    cos = (ua.transpose(-2, -1) @ ub).abs()  # (..., k', k'): singular vectors are unit, their sign arbitrary
    return (cos.amax(dim=-1) < eps).sum(dim=-1)


def frobenius_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a, b>_F / (||a||_F ||b||_F) over the last two dimensions, (...); float64."""
    a, b = a.double(), b.double()
    return (a * b).sum(dim=(-2, -1)) / (a.flatten(-2).norm(dim=-1) * b.flatten(-2).norm(dim=-1))


value_similarity = branch_cosine = frobenius_cosine  # C(V+, V-) of the values, and the cosine of the branch outputs


def two_branch_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module whose record declares the two-branch convention (DnA, diff), in forward order."""
    found = [(n, m) for n, m in model.named_modules() if "branches" in capabilities_of(m).intermediates]
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no two-branch attention; build or convert it with attn='dna' or 'diff'.")
    return found


def alpha_stats(model: nn.Module) -> list[dict]:
    """Per two-branch layer: ``{"layer", "name", "kind" ("alpha" or "lambda"), "values", "mean", "max", "min",
    "sd"}``; sd is the sample SD over heads (0 for one value)."""
    out = []
    for index, (name, module) in enumerate(two_branch_modules(model)):
        kind, values = module.branch_coefficients()
        values = values.detach().double().cpu().reshape(-1)
        out.append({"layer": index, "name": name, "kind": kind, "values": values.tolist(),
                    "mean": float(values.mean()), "max": float(values.max()), "min": float(values.min()),
                    "sd": float(values.std()) if values.numel() > 1 else 0.0})
    return out


@dataclass
class BranchInstruments:
    """Per two-branch layer: (samples or windows, H) tensors of intruder counts, C(V+, V-) and branch cosine."""

    layers: list[str]
    k: int = DEFAULT_K
    eps: float = DEFAULT_EPS
    intruders: list[torch.Tensor] = field(default_factory=list)
    value_similarity: list[torch.Tensor] = field(default_factory=list)
    branch_cosine: list[torch.Tensor] = field(default_factory=list)
    alpha: list[dict] = field(default_factory=list)

    def pooled(self, name: str) -> torch.Tensor:
        """All values of one measure over layers, samples and heads, flattened."""
        return torch.cat([t.reshape(-1).double() for t in getattr(self, name)])

    def summary(self) -> dict:
        """Means and medians of each measure over every (sample, head, layer), and the intruder histogram 0..k."""
        intr = self.pooled("intruders")
        out = {"k": self.k, "eps": self.eps, "values": int(intr.numel())}
        for key in MEASURES:
            v = self.pooled(key)
            out[f"{key}_mean"], out[f"{key}_median"] = float(v.mean()), float(v.median())
        return out | {"intruders_hist": torch.bincount(intr.long(), minlength=self.k + 1).tolist(),
                      "alpha_mean_per_layer": [a["mean"] for a in self.alpha]}


@torch.no_grad()
def branch_instruments(model: nn.Module, images: torch.Tensor, k: int = DEFAULT_K, eps: float = DEFAULT_EPS,
                       batch_size: int = 32) -> BranchInstruments:
    """Run ``model`` (eval mode, no grad) on ``images`` and measure, at every two-branch layer and for every sample
    (Swin: window) and head, the intruder count, C(V+, V-) and the branch cosine, from its kernel's branch outputs
    and values in the real forward (Swin's windows, causal order, key padding as it received them); plus alpha
    statistics."""
    modules = two_branch_modules(model)
    result = BranchInstruments(layers=[n for n, _ in modules], k=k, eps=eps, alpha=alpha_stats(model))
    parts = [{key: [] for key in MEASURES} for _ in modules]  # per layer, each measure's per-batch tensors

    def record(index, found):
        (o_pos, o_neg), (v_pos, v_neg) = found.branches, found.values
        values = intruder_dimensions(o_pos, o_neg, k, eps), value_similarity(v_pos, v_neg), branch_cosine(o_pos, o_neg)
        for key, value in zip(MEASURES, values):
            parts[index][key].append(value.cpu())

    forward_batches(model, images, batch_size, [m.observe(Want(branches=True), lambda mod, found, i=i: record(i, found))
                                                for i, (_, m) in enumerate(modules)], watch=modules)
    for key in MEASURES:
        getattr(result, key).extend(torch.cat(p[key]) for p in parts)
    return result


def plot_branch_instruments(results: dict[str, BranchInstruments], out_dir: str | Path) -> list[Path]:
    """Histograms (intruder counts, C(V+, V-), branch cosine) with one series per model, and alpha statistics per
    layer; one PNG each in ``out_dir``. Returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    k, paths, first = max(r.k for r in results.values()), [], next(iter(results.values()))

    def save(fig, name):
        fig.axes[-1].legend()
        fig.tight_layout()
        paths.append(save_png(fig, out_dir / name, dpi=120))

    for key, label in zip(MEASURES, (f"intruder dimensions (k={first.k}, eps={first.eps:.3g})", "C(V+, V-)",
                                     "cosine(O+, O-)")):
        fig = agg_figure(figsize=(6, 4))
        ax = fig.add_subplot()
        # one bar per bin and model, side by side; a bin per intruder count 0..k (its density: the fraction)
        bins = torch.arange(k + 2) - 0.5 if key == "intruders" else torch.linspace(-1, 1, 41)
        ax.hist([r.pooled(key).numpy() for r in results.values()], bins=bins.numpy(), density=True,
                label=[f"{name} (mean {float(r.pooled(key).mean()):.2f})" for name, r in results.items()])
        ax.set(xlabel=label, ylabel="density", title=f"{label} per sample, head and layer")
        save(fig, f"{key}.png")
    fig = agg_figure(figsize=(10, 3))
    for j, stat in enumerate(("mean", "max", "min", "sd")):
        ax = fig.add_subplot(1, 4, j + 1)
        for name, r in results.items():
            ax.plot([a["layer"] for a in r.alpha], [a[stat] for a in r.alpha], marker="o", label=name)
        ax.set(xlabel="layer", title=f"alpha {stat}")
    save(fig, "alpha.png")
    return paths


def compare_branches(models: dict[str, nn.Module], images: torch.Tensor, out_dir: str | Path | None = None,
                     k: int = DEFAULT_K, eps: float = DEFAULT_EPS, batch_size: int = 32) -> dict[str, dict]:
    """The paper's DnA-versus-Differential comparison in one call: :func:`branch_instruments` on each model (same
    images), histograms written to ``out_dir`` when given; returns ``{name: summary}``."""
    results = {name: branch_instruments(m, images, k=k, eps=eps, batch_size=batch_size) for name, m in models.items()}
    if out_dir is not None:
        plot_branch_instruments(results, out_dir)
    return {name: r.summary() for name, r in results.items()}


__all__ = ["BranchInstruments", "alpha_stats", "branch_cosine", "branch_instruments", "compare_branches",
           "frobenius_cosine", "intruder_dimensions", "plot_branch_instruments", "two_branch_modules",
           "value_similarity"]
