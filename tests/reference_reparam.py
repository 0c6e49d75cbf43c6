"""Independent float64 references for the weight-side methods and the Jacobian instrument (numpy, explicit loops).

Imports nothing from attnlab: these are what attnlab's code is checked against.
"""

from __future__ import annotations

import numpy as np


def spectral_norm(w: np.ndarray) -> float:
    """Largest singular value of w read as (out, everything else), by a full SVD."""
    return float(np.linalg.svd(np.asarray(w, np.float64).reshape(w.shape[0], -1), compute_uv=False)[0])


def add_identity_blocks(w: np.ndarray, lam: float, blocks: int) -> np.ndarray:
    """W + lam * I_k applied to each of ``blocks`` equal row blocks, element by element."""
    out = np.array(w, dtype=np.float64, copy=True)
    rows, cols = out.shape
    m = rows // blocks
    for b in range(blocks):
        for i in range(min(m, cols)):
            out[b * m + i, i] += lam
    return out


def kappa(a: np.ndarray) -> float:
    """sigma_max / sigma_min over the min(m, n) singular values."""
    s = np.linalg.svd(np.asarray(a, np.float64), compute_uv=False)
    return float(s[0] / s[-1])


def head_attention(x, w_q, w_k, w_v, b_q, b_k, b_v, scale, bias=None) -> np.ndarray:
    """softmax(q k^T * scale + bias) v for one head, every entry by explicit sums. x (N, C), w (D, C)."""
    n_tok, _ = x.shape
    q = x @ w_q.T + b_q
    k = x @ w_k.T + b_k
    v = x @ w_v.T + b_v
    out = np.zeros((n_tok, w_v.shape[0]))
    for i in range(n_tok):
        logits = np.array([scale * float(np.dot(q[i], k[j])) for j in range(n_tok)])
        if bias is not None:
            logits = logits + bias[i]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        for j in range(n_tok):
            out[i] += p[j] * v[j]
    return out


def finite_difference_jacobian(f, params: list[np.ndarray], h: float = 1e-6) -> np.ndarray:
    """d vec(f) / d [vec(p) for p in params] by central differences, (outputs, total parameters)."""
    params = [np.array(p, dtype=np.float64, copy=True) for p in params]
    columns = []
    for p in params:
        flat = p.reshape(-1)
        for idx in range(flat.size):
            old = flat[idx]
            flat[idx] = old + h
            plus = f(*params).reshape(-1)
            flat[idx] = old - h
            minus = f(*params).reshape(-1)
            flat[idx] = old
            columns.append((plus - minus) / (2 * h))
    return np.stack(columns, axis=1)


def head_attention_autograd(x, w_q, w_k, w_v, b_q, b_k, b_v, scale):
    """softmax(q k^T * scale) v for one head in tensor operators only, so torch's autograd can differentiate it."""
    q, k, v = x @ w_q.T + b_q, x @ w_k.T + b_k, x @ w_v.T + b_v
    logits = (q @ k.T) * scale
    p = (logits - logits.max(1, keepdim=True).values).exp()
    return (p / p.sum(1, keepdim=True)) @ v
