"""Evaluation: top-1, top-5, loss and the robustness metrics of the DnA paper ("DnA: Denoising Attention for Visual
Tasks", Sec. 4.5 Table 4 on ImageNet-A; App. C.3 Table 10 on ImageNet-O and -R), which follow Hendrycks et al.
("Natural Adversarial Examples", arXiv 1907.07174) and their released calibration tools.

For N examples with softmax probabilities p_i, confidence c_i = max_k p_ik and correct_i = [argmax_k p_ik = y_i]:

    RMS calibration error  sqrt( sum_b |B_b|/N * (mean_{i in B_b} c_i - mean_{i in B_b} correct_i)^2 )
        bins B_b: the examples sorted by confidence (ascending, stable), cut into consecutive bins of 100; the last
        bin takes the remainder (N < 100: one bin). Every bin counts; Hendrycks' released loop
        (``range(len(bins) - 1)``) leaves the last bin out, which ``drop_last_bin=True`` reproduces.
    AURRA  the area under the response-rate / accuracy curve: sort by confidence (descending, stable) and average,
        over k = 1..N, the accuracy of the k most confident examples (Hendrycks' ``aurra``).
    AUROC  out-of-distribution detection with the anomaly score s = -max_k p_k, out-of-distribution examples the
        positives: P(s_out > s_in) + 1/2 P(s_out = s_in), the Mann-Whitney U statistic over N_in * N_out pairs.

The metric functions take and return fractions; :func:`evaluate` reports top-1, top-5 and the three metrics in per
cent (as the papers' tables), the loss as the mean cross-entropy in nats.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data.images import MAX_PIXELS, open_image
from ..errors import ConfigError, DatasetError

BIN_SIZE = 100


def _as_1d(name: str, t) -> torch.Tensor:
    t = torch.as_tensor(t, dtype=torch.float64).reshape(-1)
    if t.numel() == 0:
        raise ConfigError(f"{name} is empty; give at least one example.")
    return t


def rms_calibration_error(confidence, correct, bin_size: int = BIN_SIZE, drop_last_bin: bool = False) -> float:
    """RMS calibration error (module docstring) of ``confidence`` (N,) in [0, 1] and ``correct`` (N,) 0/1."""
    conf, corr = _as_1d("confidence", confidence), _as_1d("correct", correct)
    if conf.shape != corr.shape:
        raise ConfigError(f"confidence has {conf.numel()} values and correct {corr.numel()}; give one of each per "
                          f"example.")
    order = torch.sort(conf, stable=True).indices
    conf, corr = conf[order], corr[order]
    n = conf.numel()
    edges = list(range(0, n, bin_size))[: max(1, n // bin_size)] + [n]  # the last bin absorbs the remainder
    bins = list(zip(edges[:-1], edges[1:]))
    if drop_last_bin:
        bins = bins[:-1]
    total = sum((hi - lo) / n * float(conf[lo:hi].mean() - corr[lo:hi].mean()) ** 2 for lo, hi in bins)
    return math.sqrt(total)


def aurra(confidence, correct) -> float:
    """Area under the response-rate accuracy curve: mean over k of the accuracy of the k most confident examples."""
    conf, corr = _as_1d("confidence", confidence), _as_1d("correct", correct)
    order = torch.sort(conf, descending=True, stable=True).indices
    hits = torch.cumsum(corr[order], 0)
    return float((hits / torch.arange(1, conf.numel() + 1, dtype=torch.float64)).mean())


def auroc(score_in, score_out) -> float:
    """P(score_out > score_in) + 1/2 P(tie): the area under the ROC curve of ``score`` as a detector of the
    out-of-distribution examples (higher = more anomalous), from average ranks (Mann-Whitney U)."""
    s_in, s_out = _as_1d("in-distribution scores", score_in), _as_1d("out-of-distribution scores", score_out)
    scores = torch.cat([s_in, s_out])
    values, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # 0-based rank of each distinct value's first occurrence
    avg_rank = (first + (counts + 1) / 2.0).to(torch.float64)  # 1-based average rank of ties
    rank_out = avg_rank[inverse[s_in.numel():]].sum()
    n_in, n_out = s_in.numel(), s_out.numel()
    u = rank_out - n_out * (n_out + 1) / 2.0
    return float(u / (n_in * n_out))


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, bin_size: int = BIN_SIZE
                           ) -> dict[str, float]:
    """top1, top5 (per cent), loss (mean cross-entropy), rms_calibration_error and aurra (per cent), n; ``logits``
    (N, C), ``labels`` (N,)."""
    logits, labels = logits.double(), labels.long()
    probs = logits.softmax(-1)
    conf, pred = probs.max(-1)
    correct = (pred == labels).double()
    k = min(5, logits.shape[-1])
    top5 = (logits.topk(k, -1).indices == labels[:, None]).any(-1).double()
    return {
        "n": int(labels.numel()),
        "top1": 100.0 * float(correct.mean()),
        "top5": 100.0 * float(top5.mean()),
        "loss": float(F.cross_entropy(logits, labels)),
        "rms_calibration_error": 100.0 * rms_calibration_error(conf, correct, bin_size),
        "aurra": 100.0 * aurra(conf, correct),
    }


def anomaly_score(logits: torch.Tensor) -> torch.Tensor:
    """-max softmax probability per example, (N,): higher = more anomalous."""
    return -logits.double().softmax(-1).max(-1).values


def image_folder(root: str | Path, transform, *, channels: int = 3, what: str = "folder",
                 max_pixels: int = MAX_PIXELS):
    """torchvision's ImageFolder of ``root`` (one subfolder per class; files with an image extension), each image
    read with ``channels`` channels (1: greyscale, 3: RGB) before ``transform``.

    Every file's header is read first, so a file that is not an image or has more than ``max_pixels`` pixels (a
    decompression bomb) is refused in one DatasetError naming it, before any image is evaluated.
    """
    from torchvision.datasets import ImageFolder

    if channels not in (1, 3):
        raise ConfigError(f"the model takes {channels}-channel images, but {what} images are read as greyscale (1) "
                          "or RGB (3).")
    mode = "L" if channels == 1 else "RGB"

    def load(path: str):
        with open_image(path, what, max_pixels) as image:
            try:
                return image.convert(mode)
            except (OSError, SyntaxError, ValueError) as err:  # a header that reads, pixels that do not
                raise DatasetError(f"{what} file {path} cannot be decoded ({' '.join(str(err).split())[:120]}); "
                                   "remove it or replace it.") from None

    data = ImageFolder(str(root), transform=transform, loader=load, allow_empty=True)
    for path, _ in data.samples:
        open_image(path, what, max_pixels).close()
    return data


@torch.inference_mode()
def predict(model: nn.Module, dataset, *, batch_size: int = 64, device: str | torch.device = "cpu",
            noise_std: float = 0.0, seed: int = 0, limit: int | None = None,
            class_indices: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, labels) of ``model`` in eval mode over ``dataset`` (map-style, (image, label) items), in order.

    ``noise_std``: Gaussian noise N(0, noise_std^2) added to each normalised input image (one seeded draw per batch,
    the same whatever the device). ``class_indices``: keep only these logit columns (a folder with a subset of the
    model's classes, e.g. ImageNet-A's 200); labels index that subset.
    """
    if noise_std < 0 or not math.isfinite(noise_std):
        raise ConfigError(f"noise std {noise_std} is not valid; give a finite number of at least 0.")
    n = len(dataset) if limit is None else min(limit, len(dataset))
    if n == 0:
        raise ConfigError("the evaluation set has no images; give a split or folder with at least one image.")
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    cols = None if class_indices is None else torch.as_tensor(list(class_indices), dtype=torch.long)
    outs, labels = [], []
    try:
        for start in range(0, n, batch_size):
            items = [dataset[i] for i in range(start, min(n, start + batch_size))]
            x = torch.stack([torch.as_tensor(it[0]) for it in items]).float()
            if noise_std:
                x = x + noise_std * torch.randn(x.shape, generator=gen)
            logits = model(x.to(device)).float().cpu()
            if cols is not None and int(cols.max()) >= logits.shape[-1]:
                raise ConfigError(f"class index {int(cols.max())} is beyond the model's {logits.shape[-1]} outputs; "
                                  "give class indices (or --classes names) of the model's own classes.")
            if cols is not None:
                logits = logits[:, cols]
            outs.append(logits)
            labels.append(torch.as_tensor([int(it[1]) for it in items]))
    finally:
        model.train(was_training)
    return torch.cat(outs), torch.cat(labels)


def evaluate(model: nn.Module, dataset, *, ood: Iterable | None = None, batch_size: int = 64,
             device: str | torch.device = "cpu", noise_std: float = 0.0, seed: int = 0, limit: int | None = None,
             class_indices: Sequence[int] | None = None, bin_size: int = BIN_SIZE) -> dict[str, Any]:
    """Top-1, top-5, loss, RMS calibration error and AURRA of ``model`` on ``dataset``; with ``ood`` (a dataset of
    out-of-distribution images, labels ignored) also ``auroc`` of the anomaly score -max softmax (per cent).

    The noise, ``class_indices`` and ``limit`` apply to both sets alike; see :func:`predict`.
    """
    opts = dict(batch_size=batch_size, device=device, noise_std=noise_std, seed=seed, limit=limit,
                class_indices=class_indices)
    logits, labels = predict(model, dataset, **opts)
    if int(labels.max()) >= logits.shape[-1] or int(labels.min()) < 0:
        raise ConfigError(f"the labels run to {int(labels.max())} but the model gives {logits.shape[-1]} classes; "
                          f"evaluate on a set with the model's classes (or name the classes it holds).")
    result: dict[str, Any] = classification_metrics(logits, labels, bin_size)
    if noise_std:
        result["noise_std"] = noise_std
    if ood is not None:
        ood_logits, _ = predict(model, ood, **{**opts, "seed": seed + 1})
        result["ood_n"] = int(ood_logits.shape[0])
        result["auroc"] = 100.0 * auroc(anomaly_score(logits), anomaly_score(ood_logits))
    return result


__all__ = ["BIN_SIZE", "MAX_PIXELS", "anomaly_score", "aurra", "auroc", "classification_metrics", "evaluate",
           "image_folder", "predict", "rms_calibration_error"]
