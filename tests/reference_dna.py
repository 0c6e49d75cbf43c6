"""Independent float64 references for DnA, written from the paper's formula with per-head, per-row loops in numpy.

Imports nothing from attnlab. softmin is its own normalised exponential exp(-z_j) / sum_l exp(-z_l) over the
allowed positions (not softmax of anything from the module).
"""

from __future__ import annotations

import numpy as np


def softmax_row(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def softmin_row(z: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """exp(-z_j) / sum over allowed l of exp(-z_l); 0 where not allowed."""
    w = np.zeros_like(z)
    neg = -z[allowed]
    e = np.exp(neg - neg.max())
    w[allowed] = e / e.sum()
    return w


def dna_heads(q_pos, q_neg, k, v_pos, v_neg, alpha, scale_pos, scale_neg, rel_bias=None, mask_add=None,
              allowed=None):
    """One sample, all heads: q_*: (H, N, D), k, v_*: (H, M, D), alpha: (H,) (or None for alpha = 1).

    s+_ij = scale_pos q+_i . k_j + rel_bias[h, i, j] + mask_add[i, j]  -> softmax over j
    s-_ij = scale_neg q-_i . k_j + rel_bias[h, i, j]                   -> softmin over allowed j
    o_h   = W+ v+ + alpha_h W- v-
    Returns (o, w_pos, w_neg) with o: (H, N, D), w_*: (H, N, M).
    """
    H, N, _ = q_pos.shape
    M = k.shape[1]
    o = np.zeros((H, N, v_pos.shape[2]))
    w_pos = np.zeros((H, N, M))
    w_neg = np.zeros((H, N, M))
    for h in range(H):
        a = 1.0 if alpha is None else alpha[h]
        for i in range(N):
            sp = np.array([scale_pos * np.dot(q_pos[h, i], k[h, j]) for j in range(M)])
            sn = np.array([scale_neg * np.dot(q_neg[h, i], k[h, j]) for j in range(M)])
            if rel_bias is not None:
                sp = sp + rel_bias[h, i]
                sn = sn + rel_bias[h, i]
            if mask_add is not None:
                sp = sp + mask_add[i]
            ok = np.ones(M, dtype=bool) if allowed is None else allowed[i]
            w_pos[h, i] = softmax_row(sp)
            w_neg[h, i] = softmin_row(sn, ok)
            o[h, i] = w_pos[h, i] @ v_pos[h] + a * (w_neg[h, i] @ v_neg[h])
    return o, w_pos, w_neg


def split_heads(y: np.ndarray, H: int) -> np.ndarray:
    """(N, H*D) -> (H, N, D): head h holds features [h*D, (h+1)*D)."""
    N, A = y.shape
    return y.reshape(N, H, A // H).transpose(1, 0, 2)


def dna_self_attention(x, weights, biases, proj_w, proj_b, H, alpha, scale_pos, scale_neg, rel_bias=None,
                       mask_add=None, allowed=None):
    """A whole DnA block on one sample x: (N, dim). ``weights`` / ``biases``: dicts with q_pos, q_neg, k, v_pos,
    v_neg (each (A, dim) / (A,)); a shared projection is given under both names. Returns (N, dim)."""
    names = ("q_pos", "q_neg", "k", "v_pos", "v_neg")
    proj = {n: x @ weights[n].T + (0 if biases is None else biases[n]) for n in names}
    heads = {n: split_heads(p, H) for n, p in proj.items()}
    o, _, _ = dna_heads(heads["q_pos"], heads["q_neg"], heads["k"], heads["v_pos"], heads["v_neg"], alpha,
                        scale_pos, scale_neg, rel_bias, mask_add, allowed)
    merged = o.transpose(1, 0, 2).reshape(x.shape[0], -1)
    return merged @ proj_w.T + proj_b


def dna_cross_attention(x, ctx, weights, biases, proj_w, proj_b, H, alpha, scale_pos, scale_neg, allowed=None):
    """Cross DnA on one sample: queries from x (N, dim), keys and values from ctx (M, kv_dim). Returns (N, dim)."""
    proj = {n: (x if n.startswith("q") else ctx) @ weights[n].T + (0 if biases is None else biases[n])
            for n in ("q_pos", "q_neg", "k", "v_pos", "v_neg")}
    heads = {n: split_heads(p, H) for n, p in proj.items()}
    mask_add = None if allowed is None else np.where(allowed, 0.0, -np.inf)
    o, _, _ = dna_heads(heads["q_pos"], heads["q_neg"], heads["k"], heads["v_pos"], heads["v_neg"], alpha,
                        scale_pos, scale_neg, None, mask_add, allowed)
    return o.transpose(1, 0, 2).reshape(x.shape[0], -1) @ proj_w.T + proj_b
