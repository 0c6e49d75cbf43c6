"""Representational robustness under Gaussian noise (DnA paper, "DnA: Denoising Attention for Visual Tasks",
Sec. 4.5, Figure 9).

At the output of every transformer block, for each image with tokens p_1..p_T (class and other prefix tokens
excluded; Swin: the block's H*W tokens), each token mean-centred across its features (p - mean_c p):

    Delta = mean over i != j of 1 - cos(p_i, p_j)                       (Sec. 4.5, Delta_ij)

averaged over images; higher means more separated tokens. Measured on the clean images and on images + N(0,
sigma^2) noise (in the units of the model's input tensor, one fixed-seed draw), for each sigma, with

    PSNR = 10 log10(R^2 / mean((noisy - clean)^2))   (R: the clean images' max - min; inf for sigma = 0)

and the top-1 accuracy on clean and noisy images when labels are given (its drop is the figure's accuracy drop),
plus the fraction of images whose noisy prediction matches the clean one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError, UnsupportedModelError
from .figures import agg_figure, save_png
from .maps import forward_batches, measured_modules

DEFAULT_SIGMAS = (0.1, 0.2, 0.5)


def token_distance(tokens: torch.Tensor) -> torch.Tensor:
    """Mean over token pairs i != j of 1 - cos(p_i - mean p_i, p_j - mean p_j) for tokens (..., T, C) (each
    token centred over its C features); returns (...) float64."""
    p = tokens.double()
    p = p - p.mean(dim=-1, keepdim=True)
    unit = p / p.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    cos = unit @ unit.transpose(-2, -1)
    T = tokens.shape[-2]
    off = cos.sum(dim=(-2, -1)) - cos.diagonal(dim1=-2, dim2=-1).sum(dim=-1)
    return 1 - off / (T * (T - 1))


def psnr(clean: torch.Tensor, noisy: torch.Tensor, data_range: float) -> float:
    """10 log10(data_range^2 / MSE) in dB; inf when the two are equal."""
    mse = (noisy.double() - clean.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(data_range ** 2 / mse)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks holding the attention modules (each attention module's parent), in forward order."""
    named = dict(model.named_modules())
    return [(name.rpartition(".")[0], named[name.rpartition(".")[0]]) for name, _ in measured_modules(model)]


@torch.no_grad()
def _pass(model: nn.Module, images: torch.Tensor, batch_size: int, prefix: int
          ) -> tuple[list[float], torch.Tensor | None]:
    """(per-block mean Delta over images, predictions) for one set of images; predictions are None for a model
    that does not classify (its output is not (n, classes): a detector's backbone)."""
    blocks = _blocks(model)
    sums = [0.0] * len(blocks)

    def hook(index):
        def run(module, args, output):
            tokens = output.flatten(1, -2) if output.dim() > 3 else output[:, prefix:]  # Swin blocks are NHWC
            sums[index] += token_distance(tokens).sum().item()
        return run

    preds = []
    handles = [m.register_forward_hook(hook(i)) for i, (_, m) in enumerate(blocks)]
    handles.append(model.register_forward_hook(
        lambda module, args, out: preds.append(out.argmax(dim=-1).cpu() if out.dim() == 2 else None)))
    forward_batches(model, images, batch_size, handles)
    return [s / images.shape[0] for s in sums], None if preds[0] is None else torch.cat(preds)


def representational_robustness(model: nn.Module, images: torch.Tensor, labels: torch.Tensor | None = None,
                                sigmas: tuple[float, ...] = DEFAULT_SIGMAS, batch_size: int = 32, seed: int = 0,
                                data_range: float | None = None) -> dict:
    """Figure 9 for ``model`` on ``images`` (n, C, H, W), eval mode.

    Returns ``{"layers": block names, "clean": per-block Delta, "top1_clean": % (with labels), "noisy": [{"sigma",
    "psnr", "distance": per-block Delta, "change": noisy minus clean Delta per block, "agreement": fraction of
    predictions unchanged, "top1", "top1_drop" (with labels)}]}``. Noise is drawn once per sigma from a generator
    seeded with ``seed``; ``data_range`` (PSNR's peak) defaults to the clean images' max - min.
    """
    if any(not math.isfinite(s) or s < 0 for s in sigmas):
        raise ConfigError(f"noise sigmas must be finite and non-negative, got {list(sigmas)}.")
    if labels is not None and labels.shape[0] != images.shape[0]:
        raise ConfigError(f"got {labels.shape[0]} labels for {images.shape[0]} images; give one label per image.")
    if not images.is_floating_point():
        raise UnsupportedModelError("representational robustness adds Gaussian noise to images; this model's inputs "
                                    "are token ids, which take no noise.")
    prefix = int(getattr(model, "num_prefix_tokens", 0) or 0)
    clean = images.detach().cpu().float()
    peak = float(clean.max() - clean.min()) if data_range is None else float(data_range)
    layers = [name for name, _ in _blocks(model)]
    clean_dist, clean_pred = _pass(model, clean, batch_size, prefix)
    out: dict = {"layers": layers, "clean": clean_dist, "noisy": []}
    if labels is not None and clean_pred is not None:
        out["top1_clean"] = 100.0 * (clean_pred == labels.cpu()).double().mean().item()
    generator = torch.Generator().manual_seed(seed)
    for sigma in sigmas:
        noisy = clean + sigma * torch.randn(clean.shape, generator=generator)
        dist, pred = _pass(model, noisy, batch_size, prefix)
        row = {"sigma": float(sigma), "psnr": psnr(clean, noisy, peak), "distance": dist,
               "change": [n - c for n, c in zip(dist, clean_dist)]}
        if pred is not None:
            row["agreement"] = (pred == clean_pred).double().mean().item()
        if labels is not None and pred is not None:
            row["top1"] = 100.0 * (pred == labels.cpu()).double().mean().item()
            row["top1_drop"] = out["top1_clean"] - row["top1"]
        out["noisy"].append(row)
    return out


def robustness_summary(result: dict) -> dict[str, float]:
    """``token_distance`` (clean, mean over blocks) and, for the largest sigma, ``token_distance_noisy``,
    ``agreement_noisy`` and (with labels) ``top1_drop``."""
    out = {"token_distance": sum(result["clean"]) / len(result["clean"])}
    if result["noisy"]:
        worst = max(result["noisy"], key=lambda r: r["sigma"])
        out["token_distance_noisy"] = sum(worst["distance"]) / len(worst["distance"])
        out.update({key: worst[k] for key, k in (("agreement_noisy", "agreement"), ("top1_drop", "top1_drop"))
                    if k in worst})
    return out


def plot_robustness(results: dict[str, dict], path, colors: dict[str, str] | None = None) -> None:
    """Figure 9: Delta per block, one panel per sigma (PSNR and top-1 drop in the title), clean solid and noisy
    dashed, one colour per model (label; ``colors`` {label: colour}); written to ``path``."""
    from .figures import color_of, integer_ticks

    sigmas = sorted({r["sigma"] for res in results.values() for r in res["noisy"]})
    fig = agg_figure(figsize=(4 * max(len(sigmas), 1), 3.5))
    for j, sigma in enumerate(sigmas or [None]):
        ax = fig.add_subplot(1, max(len(sigmas), 1), j + 1)
        title = []
        for c, (label, res) in enumerate(results.items()):
            color = color_of(colors or {}, label, c)
            ax.plot(range(len(res["clean"])), res["clean"], color=color, label=label)
            row = next((r for r in res["noisy"] if r["sigma"] == sigma), None)
            if row is not None:
                drop = f", drop {row['top1_drop']:.1f}" if "top1_drop" in row else ""
                ax.plot(range(len(row["distance"])), row["distance"], color=color, linestyle="--",
                        label=f"{label}, noise σ={sigma:g}{drop}")
                title.append(f"PSNR {row['psnr']:.1f} dB")
        ax.set(xlabel="block", ylabel="mean pairwise cosine distance",
               title=f"noise σ={sigma:g}, {title[0]}" if title else "clean")
        integer_ticks(ax.xaxis)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    save_png(fig, path, dpi=120)


__all__ = ["DEFAULT_SIGMAS", "plot_robustness", "psnr", "representational_robustness", "robustness_summary",
           "token_distance"]
