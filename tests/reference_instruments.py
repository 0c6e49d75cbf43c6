"""Slow, independent references for the DnA paper's instruments (head redundancy, representational robustness,
Chefer et al.'s relevance rollout) and the training-curve aggregation: float64 loops over heads, pairs and tokens,
written from the formulas. Imports nothing from attnlab."""

import math
import statistics

import torch


def cosine(a, b):
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float((a * b).sum() / (a.norm() * b.norm()))


def head_distance(maps):
    """maps (H, N, M) of one image: mean over pairs i < j of 1 - cos(W_i, W_j)."""
    H = maps.shape[0]
    pairs = [1 - cosine(maps[i], maps[j]) for i in range(H) for j in range(i + 1, H)]
    return sum(pairs) / len(pairs)


def token_distance(tokens):
    """tokens (T, C) of one image: each centred over its features; mean over i != j of 1 - cos(p_i, p_j)."""
    T = tokens.shape[0]
    centred = [tokens[i].double() - tokens[i].double().mean() for i in range(T)]
    values = [1 - cosine(centred[i], centred[j]) for i in range(T) for j in range(T) if i != j]
    return sum(values) / len(values)


def psnr(clean, noisy, data_range):
    mse = float(((noisy.double() - clean.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(data_range ** 2 / mse)


def rollout(maps, grads):
    """maps, grads: per layer a list of (H, N, N) effective maps and gradients of one image.
    A_bar = mean_h ReLU(grad) * map; R = I, R <- R + A_bar R per layer."""
    N = maps[0].shape[-1]
    R = torch.eye(N, dtype=torch.float64)
    for m, g in zip(maps, grads):
        H = m.shape[0]
        a_bar = torch.zeros(N, N, dtype=torch.float64)
        for h in range(H):
            for i in range(N):
                for j in range(N):
                    a_bar[i, j] += max(float(g[h, i, j]), 0.0) * float(m[h, i, j]) / H
        R = R + a_bar @ R
    return R


def curves(histories, metric):
    """histories: list of runs, each a list of {"epoch", metric}; per epoch (mean, mean - sd, mean + sd)."""
    epochs = sorted({e["epoch"] for h in histories for e in h})
    out = []
    for epoch in epochs:
        values = [e[metric] for h in histories for e in h if e["epoch"] == epoch]
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        out.append((mean, mean - sd, mean + sd))
    return epochs, out
