"""Independent float64 references for QK-norm, QK-clip and the entropy / logit instruments (NumPy loops).

Imports nothing from attnlab. Weights follow PyTorch's Linear layout: ``qkv_w`` (3*H*D, C), ``qkv_b`` (3*H*D,) or
None; tokens ``x`` (B, N, C). Head h's query rows are [h*D, (h+1)*D), its key rows [H*D + h*D, H*D + (h+1)*D).
"""

from __future__ import annotations

import math

import numpy as np


def _np(t):
    return t.detach().double().cpu().numpy() if hasattr(t, "detach") else np.asarray(t, dtype=np.float64)


def head_qk(qkv_w, qkv_b, x, num_heads, q_norm=None, k_norm=None):
    """q, k per head: (B, H, N, D) float64, computed token by token; ``q_norm`` / ``k_norm``: optional
    (weight, bias, eps) of a LayerNorm over the head dimension (QK-norm)."""
    w, x = _np(qkv_w), _np(x)
    b = np.zeros(w.shape[0]) if qkv_b is None else _np(qkv_b)
    H = num_heads
    D = w.shape[0] // 3 // H
    B, N, _ = x.shape
    q = np.zeros((B, H, N, D))
    k = np.zeros((B, H, N, D))
    for bi in range(B):
        for n in range(N):
            out = w @ x[bi, n] + b
            for h in range(H):
                q[bi, h, n] = out[h * D:(h + 1) * D]
                k[bi, h, n] = out[H * D + h * D:H * D + (h + 1) * D]
    if q_norm is not None:
        q = layer_norm(q, *q_norm)
    if k_norm is not None:
        k = layer_norm(k, *k_norm)
    return q, k


def max_logit(qkv_w, qkv_b, x, num_heads, q_norm=None, k_norm=None, allowed=None):
    """Per head max over batch, i, j of q_i . k_j / sqrt(D), one (N, N) product per image and head. Returns (H,).
    ``allowed`` (B, N, N) bool: only those positions count."""
    q, k = head_qk(qkv_w, qkv_b, x, num_heads, q_norm, k_norm)
    B, H, N, D = q.shape
    best = np.full(H, -np.inf)
    for h in range(H):
        for bi in range(B):
            logits = q[bi, h] @ k[bi, h].T
            if allowed is not None:
                logits = np.where(allowed[bi], logits, -np.inf)
            best[h] = max(best[h], float(logits.max()) / math.sqrt(D))
    return best


def softmax_rows(logits):
    """Row softmax of a float64 array (..., N)."""
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def entropy(p):
    """-sum p log p over the last axis, with 0 log 0 = 0."""
    p = np.asarray(p, dtype=np.float64)
    terms = np.where(p > 0, -p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return terms.sum(axis=-1)


def row_entropies(qkv_w, qkv_b, x, num_heads, bias=None, q_norm=None, k_norm=None):
    """Attention row entropies (B, H, N) of softmax(q k^T / sqrt(D) + bias); bias broadcastable to (B, H, N, N)."""
    q, k = head_qk(qkv_w, qkv_b, x, num_heads, q_norm, k_norm)
    D = q.shape[-1]
    logits = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D)
    if bias is not None:
        logits = logits + _np(bias)
    return entropy(softmax_rows(logits))


def qk_spectral_norm(qkv_w, num_heads):
    """||W_q,h^T W_k,h||_2 per head from a full SVD of the (C, C) matrix. Returns (H,)."""
    w = _np(qkv_w)
    H = num_heads
    D = w.shape[0] // 3 // H
    out = []
    for h in range(H):
        wq = w[h * D:(h + 1) * D]
        wk = w[H * D + h * D:H * D + (h + 1) * D]
        out.append(np.linalg.svd(wq.T @ wk, compute_uv=False)[0])
    return np.array(out)


def layer_norm(x, weight, bias, eps):
    """LayerNorm over the last axis, float64."""
    x = _np(x)
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * _np(weight) + _np(bias)
