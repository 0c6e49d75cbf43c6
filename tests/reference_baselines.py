"""Independent float64 references for the `diff` and `cog` baselines: per-batch, per-head, per-entry loops written
from the formulas (docs/methods.md), importing nothing from attnlab.

Shapes: x (B, N, C); qkv_w (3*H*D, C) laid out [q | k | v], each head's D features contiguous (timm's layout);
Swin's ``mask`` is (num_windows, N, N) with 0 / -100 and window ``b % num_windows`` for batch row b.
"""

from __future__ import annotations

import math

import torch


def rel_pos_bias(table: torch.Tensor, win_h: int, win_w: int) -> torch.Tensor:
    """Swin's relative-position bias (H, N, N) from its table ((2Wh-1)(2Ww-1), H), indexed by hand."""
    coords = [(y, x) for y in range(win_h) for x in range(win_w)]
    n = len(coords)
    out = torch.empty(table.shape[1], n, n, dtype=table.dtype)
    for i, (yi, xi) in enumerate(coords):
        for j, (yj, xj) in enumerate(coords):
            out[:, i, j] = table[(yi - yj + win_h - 1) * (2 * win_w - 1) + (xi - xj + win_w - 1)]
    return out


def _split(x, qkv_w, qkv_b, H, D):
    """q, k, v as nested lists [b][h] of (N, D) tensors."""
    C3 = qkv_w.shape[0]
    y = x @ qkv_w.T + (qkv_b if qkv_b is not None else 0)
    width = C3 // 3
    q, k, v = y[..., :width], y[..., width:2 * width], y[..., 2 * width:]
    per = lambda t: [[t[b, :, h * D:(h + 1) * D] for h in range(H)] for b in range(x.shape[0])]
    return per(q), per(k), per(v)


def _softmax(row: list[float]) -> list[float]:
    finite = [r for r in row if r != -math.inf]
    m = max(finite)
    e = [math.exp(r - m) if r != -math.inf else 0.0 for r in row]
    s = sum(e)
    return [t / s for t in e]


def _logits(qi, k, scale, b, h, i, bias, mask):
    """Row i of one head's logits as a list: k_j . q_i * scale (+ position bias) (+ Swin mask)."""
    s = (k @ qi) * scale
    if bias is not None:
        s = s + bias[h, i]
    if mask is not None:
        s = s + mask[b % mask.shape[0], i]
    return s.tolist()


def _merge(heads_out, proj_w, proj_b):
    """heads_out [b][h] of (N, Dv) -> (B, N, C) through the output projection."""
    merged = torch.stack([torch.cat(row, dim=-1) for row in heads_out])
    return merged @ proj_w.T + (proj_b if proj_b is not None else 0)


def diff_attention(x, qkv_w, qkv_b, proj_w, proj_b, H, lam_q1, lam_k1, lam_q2, lam_k2, sub_w, depth,
                   bias=None, mask=None, eps=1e-5):
    """Differential attention, timm's mathematics; returns (output (B, N, C), branches [b][h] of (o1, o2)).

    Head h uses D = C_attn / H value features; its q and k split into halves of d = D/2 (first half branch 1).
    A_i = softmax(q_i k_i^T / sqrt(d) + bias + mask);  o = (1 - li) * rmsnorm((A1 - lam A2) v) * sub_w.
    """
    D = qkv_w.shape[0] // 3 // H
    d = D // 2
    li = 0.8 - 0.6 * math.exp(-0.3 * depth)
    lam = math.exp(float(torch.dot(lam_q1, lam_k1))) - math.exp(float(torch.dot(lam_q2, lam_k2))) + li
    Q, K, V = _split(x, qkv_w, qkv_b, H, D)
    B, N = x.shape[0], x.shape[1]
    outs, branches = [], []
    for b in range(B):
        row_out, row_br = [], []
        for h in range(H):
            q, k, v = Q[b][h], K[b][h], V[b][h]
            A = []
            for half in (slice(0, d), slice(d, D)):
                A.append(torch.tensor([
                    _softmax(_logits(q[i, half], k[:, half], d ** -0.5, b, h, i, bias, mask)) for i in range(N)],
                    dtype=x.dtype))
            o1, o2 = A[0] @ v, A[1] @ v
            o = (A[0] - lam * A[1]) @ v
            o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + eps) * sub_w * (1 - li)
            row_out.append(o)
            row_br.append((o1, o2))
        outs.append(row_out)
        branches.append(row_br)
    return _merge(outs, proj_w, proj_b), branches


def cog_weights(q, k, scale, b, h, bias=None, mask=None, keep=None):
    """Cog weights (N, N) of one head: w_ij = sign(s_ij) exp|s_ij| / sum_{j' unmasked} exp|s_ij'|, 0 when masked.

    Masked: Swin ``mask`` entry != 0, or ``keep[i, j]`` False. s includes the position bias, never the mask.
    """
    N = q.shape[0]
    W = torch.zeros(N, N, dtype=q.dtype)
    for i in range(N):
        s = _logits(q[i], k, scale, b, h, i, bias, None)
        off = [(mask is not None and float(mask[b % mask.shape[0], i, j]) != 0.0) or
               (keep is not None and not bool(keep[i, j])) for j in range(N)]
        p = _softmax([-math.inf if off[j] else abs(s[j]) for j in range(N)])
        for j in range(N):
            W[i, j] = math.copysign(p[j], s[j]) if s[j] != 0 else 0.0
    return W


def cog_attention(x, qkv_w, qkv_b, proj_w, proj_b, H, bias=None, mask=None, keep=None):
    """Cog attention output (B, N, C): per head o = W v with W from :func:`cog_weights`, scale 1/sqrt(D)."""
    D = qkv_w.shape[0] // 3 // H
    Q, K, V = _split(x, qkv_w, qkv_b, H, D)
    outs = [[cog_weights(Q[b][h], K[b][h], D ** -0.5, b, h, bias, mask, keep) @ V[b][h] for h in range(H)]
            for b in range(x.shape[0])]
    return _merge(outs, proj_w, proj_b)
