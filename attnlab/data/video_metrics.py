"""Video classification metrics: top-1, top-5, mean class accuracy, and the multi-view score average.

For N clips with class scores s_i (K,) and labels y_i:

    top-k                 (1/N) sum_i [y_i among the k highest s_i]             (k capped at K)
    mean class accuracy   (1/|C|) sum_{c in C} (1/N_c) sum_{i: y_i = c} [argmax s_i = c]
                          C = the classes that occur among the labels, N_c their counts: the mean of the per-class
                          recalls, Toyota Smarthome's metric (Das et al., ICCV 2019), which weighs rare classes as
                          much as frequent ones; a class with no clip in the split has no recall and does not count
    multi-view            a clip evaluated on V views (temporal clips x spatial crops, as TimeSformer tests) scores
                          s_i = (1/V) sum_v softmax(logits_iv), the views' probabilities averaged

Ties in top-k go to the lower class index (``torch.topk`` on the CPU). The functions return fractions;
:func:`evaluate_video` reports per cent, as the papers' tables, with the test loss -log s_i[y_i] averaged (the
cross-entropy for one view).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from attnlab.errors import ConfigError


def _check(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores, labels = torch.as_tensor(scores), torch.as_tensor(labels).reshape(-1).long()
    if scores.ndim != 2 or scores.shape[0] != labels.numel() or labels.numel() == 0:
        raise ConfigError(f"scores must be (N, K) with one label per row, not {tuple(scores.shape)} for "
                          f"{labels.numel()} labels.")
    if labels.min() < 0 or labels.max() >= scores.shape[1]:
        raise ConfigError(f"labels must lie in 0..{scores.shape[1] - 1}, the score columns; got "
                          f"{int(labels.min())}..{int(labels.max())}.")
    return scores, labels


def topk_accuracy(scores, labels, k: int = 1) -> float:
    """Fraction of clips whose label is among their ``k`` highest scores."""
    scores, labels = _check(scores, labels)
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    return float((top == labels[:, None]).any(dim=1).double().mean())


def mean_class_accuracy(scores, labels) -> float:
    """Mean over the classes present in ``labels`` of the fraction of their clips predicted right."""
    scores, labels = _check(scores, labels)
    correct = (scores.argmax(dim=1) == labels).double()
    classes = labels.unique()
    return float(torch.stack([correct[labels == c].mean() for c in classes]).mean())


def average_views(logits: torch.Tensor) -> torch.Tensor:
    """Class probabilities (N, K) from logits (N, K) (one view) or (N, V, K): the views' softmaxes averaged."""
    probs = logits.float().softmax(dim=-1)
    return probs.mean(dim=1) if probs.ndim == 3 else probs


def video_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """test_loss (nats), top1, top5 and mean_class_accuracy (per cent) of class probabilities (N, K)."""
    probs, labels = _check(probs, labels)
    picked = probs.double().gather(1, labels[:, None]).clamp_min(1e-12)
    return {"test_loss": float(-picked.log().mean()), "top1": 100 * topk_accuracy(probs, labels, 1),
            "top5": 100 * topk_accuracy(probs, labels, 5),
            "mean_class_accuracy": 100 * mean_class_accuracy(probs, labels)}


@torch.no_grad()
def predict_video(model: nn.Module, loader, device: torch.device | str = "cpu", *,
                  amp_dtype: torch.dtype | None = None, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities (N, K), labels (N,)) over ``loader``: batches (B, C, T, H, W) or (B, V, C, T, H, W), the
    views of a clip averaged (:func:`average_views`); ``model`` in eval mode for the pass, under autocast to
    ``amp_dtype`` when given. ``pad_to``: forwards of fewer clips are padded with zero clips to this many (a compiled
    model sees one shape; in eval mode each clip is computed on its own, so the others' logits are unchanged)."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    probs, labels = [], []
    try:
        for clips, y in loader:
            clips = clips.to(device, non_blocking=True)
            views = clips.shape[1] if clips.ndim == 6 else 0
            flat = clips.flatten(0, 1) if views else clips  # several views per clip: one forward over all
            n = flat.shape[0]
            if pad_to is not None and n < pad_to:
                flat = torch.cat([flat, flat.new_zeros((pad_to - n, *flat.shape[1:]))])
            with autocast:
                logits = model(flat)[:n].float()
            probs.append(average_views(logits.reshape(clips.shape[0], views, -1) if views else logits).cpu())
            labels.append(torch.as_tensor(y).reshape(-1))
    finally:
        model.train(was_training)
    if not probs:
        raise ConfigError("the evaluation loader yielded no clips; give a split with at least one.")
    return torch.cat(probs), torch.cat(labels)


def evaluate_video(model: nn.Module, loader, device: torch.device | str = "cpu") -> dict[str, float]:
    """:func:`video_metrics` of ``model`` on ``loader`` (multi-view batches averaged)."""
    return video_metrics(*predict_video(model, loader, device))


__all__ = ["average_views", "evaluate_video", "mean_class_accuracy", "predict_video", "topk_accuracy",
           "video_metrics"]
