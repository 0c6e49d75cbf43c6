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
    q, k, v, w = (np.asarray(t, dtype=np.float64) for t in (q, k, v, w))
    D, M = q.shape[-1], w.shape[0]
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for idx in np.ndindex(*q.shape[:-2]):
        x, y = q[idx] / D ** 0.25, k[idx] / D ** 0.25
        phi_x = np.exp(x @ w.T - 0.5 * (x * x).sum(1, keepdims=True)) / np.sqrt(M)
        phi_y = np.exp(y @ w.T - 0.5 * (y * y).sum(1, keepdims=True)) / np.sqrt(M)
        out[idx] = (phi_x @ (phi_y.T @ v[idx])) / (phi_x @ phi_y.sum(0))[:, None]
    return out
