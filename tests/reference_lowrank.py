"""Slow, independent float64 references for the low-rank kernels and the LRA tasks. Imports nothing from attnlab.

- softmax attention one head at a time (the quantity Nyströmformer and Performer approximate);
- a Nyström reference written from Xiong et al. 2021's Eq. 14-15 with numpy's SVD pseudo-inverse and landmark
  loops;
- a ListOps evaluator (Nangia and Bowman 2018; LRA's operators) that reads the token string with an explicit stack,
  by a route unlike a recursive generator's.
"""

from __future__ import annotations

import numpy as np


def softmax_attention(q, k, v) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) v per head in float64. q, k, v: (..., N, D) array-likes."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    lead = q.shape[:-2]
    out = np.empty(q.shape[:-2] + (q.shape[-2], v.shape[-1]))
    for idx in np.ndindex(*lead):
        logits = q[idx] @ k[idx].T / np.sqrt(q.shape[-1])
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        out[idx] = (w / w.sum(axis=1, keepdims=True)) @ v[idx]
    return out


def _softmax_rows(a):
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def nystrom_reference(q, k, v, m: int) -> np.ndarray:
    """Eq. 15 with the exact pseudo-inverse, one head (N, D) at a time; landmark i is the mean of tokens
    [floor(i N / m), floor((i + 1) N / m))."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    n, d = q.shape[-2:]
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for idx in np.ndindex(*q.shape[:-2]):
        qs, ks = q[idx] / np.sqrt(d), k[idx]
        seg = [(i * n // m, (i + 1) * n // m) for i in range(m)]
        q_l = np.stack([qs[a:b].mean(axis=0) for a, b in seg])
        k_l = np.stack([ks[a:b].mean(axis=0) for a, b in seg])
        out[idx] = (_softmax_rows(qs @ k_l.T) @ np.linalg.pinv(_softmax_rows(q_l @ k_l.T))
                    @ _softmax_rows(q_l @ ks.T) @ v[idx])
    return out


# ---------------------------------------------------------------------------------------------------- ListOps
def listops_evaluate(tokens: list[str]) -> tuple[int, int, int]:
    """(value, depth, largest argument count) of a ListOps expression given as tokens ("[MAX", "3", "]", ...).

    Operators: MAX, MIN, MED (median; for an even count, the floor of the mean of the two middle values), SM (sum
    mod 10). Depth counts the levels of the tree, leaves included (a bare digit has depth 1).
    """
    stack: list[tuple[str, list[int], int]] = []  # (operator, argument values, deepest argument depth)
    result = None
    widest = 0
    for tok in tokens:
        if tok in ("(", ")"):
            continue
        if tok.startswith("["):
            stack.append((tok[1:], [], 0))
        elif tok == "]":
            op, args, deepest = stack.pop()
            widest = max(widest, len(args))
            s = sorted(args)
            if op == "MAX":
                val = s[-1]
            elif op == "MIN":
                val = s[0]
            elif op == "MED":
                mid = len(s) // 2
                val = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) // 2
            elif op == "SM":
                val = sum(s) % 10
            else:
                raise ValueError(f"unknown operator {op}")
            node = (val, deepest + 1)
            if stack:
                stack[-1][1].append(node[0])
                stack[-1] = (stack[-1][0], stack[-1][1], max(stack[-1][2], node[1]))
            else:
                result = node
        else:
            digit = int(tok)
            assert 0 <= digit <= 9
            if stack:
                stack[-1][1].append(digit)
                stack[-1] = (stack[-1][0], stack[-1][1], max(stack[-1][2], 1))
            else:
                result = (digit, 1)
    assert not stack and result is not None
    return result[0], result[1], widest


def favor_attention(q, k, v, w) -> np.ndarray:
    """FAVOR+ per head in float64, literally: phi(x) = exp(W x - |x|^2 / 2) / sqrt(M) (Lemma 1) on x = q / D^(1/4),
    y = k / D^(1/4), o = phi(x) (phi(y)^T v) / (phi(x) phi(y)^T 1), no stabiliser, no eps. w: (M, D)."""
    return favor_masked(q, k, v, w)


# ---------------------------------------------------------------------------------------------------- masks
def masked_softmax_attention(q, k, v, keep=None, scale=None) -> np.ndarray:
    """softmax over the allowed keys of q k^T * scale (default 1/sqrt(D)), times v, one head and row at a time;
    keep: (N, M) bool (or None: all). A row without any allowed key is zero."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for idx in np.ndindex(*q.shape[:-2]):
        for i in range(q.shape[-2]):
            ok = np.ones(k.shape[-2], dtype=bool) if keep is None else np.asarray(keep)[i]
            if not ok.any():
                continue
            s = np.array([scale * q[idx][i] @ k[idx][j] for j in range(k.shape[-2]) if ok[j]])
            w = np.exp(s - s.max())
            out[idx][i] = (w / w.sum()) @ v[idx][ok]
    return out


def pinv_eq16(a, iters: int, scale: float) -> np.ndarray:
    """Nyströmformer's Eq. 16 from Z_0 = a^T / scale, in numpy: Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4."""
    a = np.asarray(a, dtype=np.float64)
    eye = np.eye(a.shape[-1])
    z = a.T / scale
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_padded_reference(q, k, v, m: int, real) -> np.ndarray:
    """The Nyströmformer authors' masked form for one sequence's heads (H, N, D), exact pseudo-inverse: padded tokens'
    q and k are zero (so landmark i is the sum of segment i's real tokens over the segment's length N / m), and the
    third kernel's softmax runs over the real keys only. ``real``: (N,) bool."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    real = np.asarray(real, dtype=bool)
    n, d = q.shape[-2:]
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for h in range(q.shape[0]):
        qs, ks = np.where(real[:, None], q[h], 0.0) / np.sqrt(d), np.where(real[:, None], k[h], 0.0)
        q_l = np.stack([qs[i * n // m:(i + 1) * n // m].mean(axis=0) for i in range(m)])
        k_l = np.stack([ks[i * n // m:(i + 1) * n // m].mean(axis=0) for i in range(m)])
        third = np.where(real[None, :], q_l @ ks.T, -np.inf)
        out[h] = (_softmax_rows(qs @ k_l.T) @ np.linalg.pinv(_softmax_rows(q_l @ k_l.T))
                  @ _softmax_rows(third) @ v[h])
    return out


def favor_masked(q, k, v, w, causal: bool = False, real=None) -> np.ndarray:
    """FAVOR+ literally (as :func:`favor_attention`), query i summing over the keys j <= i (causal) and/or the real
    keys only (``real``: (N,) bool), one head and one query at a time."""
    q, k, v, w = (np.asarray(t, dtype=np.float64) for t in (q, k, v, w))
    D, M = q.shape[-1], w.shape[0]
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for idx in np.ndindex(*q.shape[:-2]):
        x, y = q[idx] / D ** 0.25, k[idx] / D ** 0.25
        phi_x = np.exp(x @ w.T - 0.5 * (x * x).sum(1, keepdims=True)) / np.sqrt(M)
        phi_y = np.exp(y @ w.T - 0.5 * (y * y).sum(1, keepdims=True)) / np.sqrt(M)
        for i in range(q.shape[-2]):
            ok = np.ones(k.shape[-2], dtype=bool) if real is None else np.asarray(real, dtype=bool).copy()
            if causal:
                ok[i + 1:] = False
            if not ok.any():
                continue
            a = phi_y[ok] @ phi_x[i]
            out[idx][i] = a @ v[idx][ok] / a.sum()
    return out
