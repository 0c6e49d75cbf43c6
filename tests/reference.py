"""Slow, independent float64 references for the tests, organised by method.

Nothing here imports attnlab: each reference is written from the paper's definitions with numpy, by a route
different from the library's (SVDs and eigendecompositions instead of matrix polynomials, loops instead of
batching), so an agreement means something. Add new methods as new sections.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------------------------------------
# NS-Attn (papers/ns_attention.txt, Sec. 2 and 3.4)
# ----------------------------------------------------------------------------------------------------------

NS_ABC = (3.4445, -4.7750, 2.0315)  # eq. 3, copied from the paper, not from attnlab


def ns_poly(t: np.ndarray, abc=NS_ABC) -> np.ndarray:
    """p(t) = a t + b t^3 + c t^5: what one step (eq. 3) does to each singular value t of Z."""
    a, b, c = abc
    return a * t + b * t**3 + c * t**5


def ns_svd_reference(x, steps: int = 1, eps: float = 1e-6, abc=NS_ABC) -> np.ndarray:
    """NS-Attn's T (eq. 2-5) through the SVD, one matrix at a time, in float64.

    x: array-like (..., N, D) of head outputs. Each M = X^T = U diag(sigma) V^T; Z = M / max(r, eps) has
    singular values t = sigma / max(r, eps); each step (Z <- (aI + bA + cA^2) Z with A = Z Z^T) maps t to p(t)
    with the same U and V; T(M) = r U diag(t_K) V^T / max(||t_K||_2, eps). Returns T(M)^T with x's shape.
    """
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    for idx in np.ndindex(*x.shape[:-2]):
        m = x[idx].T  # (D, N), eq. 1
        u, sigma, vt = np.linalg.svd(m, full_matrices=False)
        r = math.sqrt(float(np.sum(sigma**2)))  # ||M||_F
        t = sigma / max(r, eps)
        for _ in range(steps):
            t = ns_poly(t, abc)
        y_norm = math.sqrt(float(np.sum(t**2)))  # ||Z_K||_F
        m_hat = r * (u * t) @ vt / max(y_norm, eps)
        out[idx] = m_hat.T
    return out


def gram_spectrum_reference(m) -> np.ndarray:
    """Eigenvalues of G = M M^T (eq. 6) for each matrix of m (..., rows, cols), by eigh of the explicit Gram,
    sorted descending and divided by their sum (eq. 7), in float64. Negative rounding noise is set to 0."""
    m = np.asarray(m, dtype=np.float64)
    out = np.empty(m.shape[:-1], dtype=np.float64)
    for idx in np.ndindex(*m.shape[:-2]):
        g = m[idx] @ m[idx].T
        lam = np.clip(np.linalg.eigh(g)[0][::-1], 0.0, None)
        out[idx] = lam / lam.sum()
    return out


def effective_rank_reference(p) -> float:
    """exp(-sum p_i ln p_i) over the non-zero p_i of one spectrum (eq. 8), as a plain Python loop."""
    h = 0.0
    for v in np.asarray(p, dtype=np.float64).ravel():
        if v > 0:
            h -= v * math.log(v)
    return math.exp(h)


def matrices_with_singular_values(shape, sigma, seed: int = 0) -> np.ndarray:
    """Random float64 matrices of ``shape`` (..., N, D), each U diag(sigma) V^T with orthonormal columns U (N x k)
    and V (D x k) from QR of Gaussian draws, k = min(N, D) = len(sigma): NS inputs of a chosen conditioning
    (trained heads are far from Gaussian, Sec. 3.4: p1 ~ 0.7)."""
    *lead, n, d = shape
    sigma = np.asarray(sigma, dtype=np.float64)
    assert sigma.shape == (min(n, d),)
    rng = np.random.default_rng(seed)
    out = np.empty(shape, dtype=np.float64)
    for idx in np.ndindex(*lead):
        u = np.linalg.qr(rng.standard_normal((n, sigma.size)))[0]
        v = np.linalg.qr(rng.standard_normal((d, sigma.size)))[0]
        out[idx] = (u * sigma) @ v.T
    return out


# ----------------------------------------------------------------------------------------------------------
# Softmax cross-attention (Vaswani et al., arXiv:1706.03762, Sec. 3.2.2-3.2.3)
# ----------------------------------------------------------------------------------------------------------

def cross_attention(x, ctx, wq, bq, wk, bk, wv, bv, wo, bo, H, allowed=None) -> np.ndarray:
    """One sample: queries from x (N, dim), keys and values from ctx (M, kv_dim), H heads, float64 loops over heads,
    queries and keys. ``allowed`` (N, M) bool, True where query i may attend key j; a query without any allowed key
    outputs zeros before the output projection. Returns (N, dim)."""
    x, ctx = np.asarray(x, dtype=np.float64), np.asarray(ctx, dtype=np.float64)
    q, k, v = x @ wq.T + bq, ctx @ wk.T + bk, ctx @ wv.T + bv
    N, M, D = x.shape[0], ctx.shape[0], q.shape[1] // H
    heads = np.zeros((N, H * D))
    for h in range(H):
        cols = slice(h * D, (h + 1) * D)
        for i in range(N):
            keys = [j for j in range(M) if allowed is None or allowed[i, j]]
            if not keys:
                continue
            logits = np.array([q[i, cols] @ k[j, cols] / math.sqrt(D) for j in keys])
            w = np.exp(logits - logits.max())
            w /= w.sum()
            heads[i, cols] = sum(wj * v[j, cols] for wj, j in zip(w, keys))
    return heads @ wo.T + bo
