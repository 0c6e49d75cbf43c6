"""Independent float64 references for channel attention: XCiT's cross-covariance attention (El-Nouby et al.,
arXiv:2106.09681, Sec. 3.2) and DaViT's channel attention (Ding et al., arXiv:2204.03645, Sec. 3.2, as the authors'
code and timm name the projections), each with spectral conditioning W + lam I_k on the q, k and v weights.

Nothing here imports attnlab. Written with numpy, one head and one image at a time, the D x D map formed entry by
entry from column dot products over tokens, and I_k built from its definition (ones on the main diagonal).
"""

from __future__ import annotations

import numpy as np


def conditioned(w: np.ndarray, lam: float) -> np.ndarray:
    """W + lam I_k, I_k of W's shape with ones on the main min(m, n) diagonal (spectral conditioning, Thm. 3.8)."""
    out = np.array(w, dtype=np.float64)
    for i in range(min(out.shape)):
        out[i, i] += lam
    return out


def layer_norm_rows(a: np.ndarray, gamma, beta, eps: float = 1e-6) -> np.ndarray:
    """Each row (a token's D features) standardised with the biased variance, then scaled and shifted."""
    mean = a.mean(axis=1, keepdims=True)
    var = ((a - mean) ** 2).mean(axis=1, keepdims=True)
    return (a - mean) / np.sqrt(var + eps) * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)


def _softmax_rows(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _split_qkv(w_qkv, b_qkv, lam):
    w_qkv = np.asarray(w_qkv, np.float64)
    A = w_qkv.shape[0] // 3
    ws = [conditioned(w_qkv[i * A:(i + 1) * A], lam) for i in range(3)]  # one I_k per q, k, v block
    bs = [np.zeros(A) if b_qkv is None else np.asarray(b_qkv, np.float64)[i * A:(i + 1) * A] for i in range(3)]
    return ws, bs


def _heads(x, w_qkv, b_qkv, num_heads, lam):
    """Per image and head: q, k, v (N, D)."""
    (wq, wk, wv), (bq, bk, bv) = _split_qkv(w_qkv, b_qkv, lam)
    D = wq.shape[0] // num_heads
    for b in range(x.shape[0]):
        xb = np.asarray(x[b], np.float64)
        q, k, v = xb @ wq.T + bq, xb @ wk.T + bk, xb @ wv.T + bv
        for h in range(num_heads):
            cols = slice(h * D, (h + 1) * D)
            yield b, h, q[:, cols], k[:, cols], v[:, cols]


def xca_reference(x, w_qkv, b_qkv, w_proj, b_proj, temperature, num_heads: int, lam: float = 0.0,
                  norms=None) -> np.ndarray:
    """XCA (eq. 2): A_h = softmax(tau_h q^_h^T k^_h) over features, q^, k^ with unit-norm columns; o_h = v_h A_h^T.

    x: (B, N, C); w_qkv: (3A, C); temperature: (H,); returns (B, N, C_out) after the output projection.
    ``norms``: ((gamma_q, beta_q), (gamma_k, beta_k)) of a per-token LayerNorm of q and k before the columns are
    normalised (QK-norm).
    """
    x = np.asarray(x, np.float64)
    B, N, _ = x.shape
    A = np.asarray(w_qkv).shape[0] // 3
    D = A // num_heads
    out = np.zeros((B, N, A))
    for b, h, q, k, v in _heads(x, w_qkv, b_qkv, num_heads, lam):
        if norms is not None:
            q, k = layer_norm_rows(q, *norms[0]), layer_norm_rows(k, *norms[1])
        logits = np.empty((D, D))
        for i in range(D):
            for j in range(D):
                qi, kj = q[:, i], k[:, j]
                logits[i, j] = temperature[h] * (qi @ kj) / (np.sqrt(qi @ qi) * np.sqrt(kj @ kj))
        attn = _softmax_rows(logits)
        out[b, :, h * D:(h + 1) * D] = v @ attn.T  # token n, feature i: sum_j A_ij v_nj
    return out @ np.asarray(w_proj, np.float64).T + np.asarray(b_proj, np.float64)


def davit_channel_reference(x, w_qkv, b_qkv, w_proj, b_proj, num_heads: int, lam: float = 0.0,
                            norms=None) -> np.ndarray:
    """DaViT's channel attention: A_h = softmax(k_h^T v_h / sqrt(D)) over features; o_h = q_h A_h^T (N x D).

    ``norms``: ((gamma, beta) for k, (gamma, beta) for v), a per-token LayerNorm of the map's two factors (QK-norm).
    """
    x = np.asarray(x, np.float64)
    B, N, _ = x.shape
    A = np.asarray(w_qkv).shape[0] // 3
    D = A // num_heads
    out = np.zeros((B, N, A))
    for b, h, q, k, v in _heads(x, w_qkv, b_qkv, num_heads, lam):
        if norms is not None:
            k, v = layer_norm_rows(k, *norms[0]), layer_norm_rows(v, *norms[1])
        logits = np.array([[k[:, i] @ v[:, j] for j in range(D)] for i in range(D)]) / np.sqrt(D)
        attn = _softmax_rows(logits)
        out[b, :, h * D:(h + 1) * D] = q @ attn.T
    return out @ np.asarray(w_proj, np.float64).T + np.asarray(b_proj, np.float64)


def davit_channel_v2_reference(x, w_qkv, b_qkv, w_proj, b_proj, num_heads: int) -> np.ndarray:
    """DaViT v2 (Florence-2) channel attention: A_h = softmax(q_h^T k_h / sqrt(N)); o_h = v_h A_h^T."""
    x = np.asarray(x, np.float64)
    B, N, _ = x.shape
    A = np.asarray(w_qkv).shape[0] // 3
    D = A // num_heads
    out = np.zeros((B, N, A))
    for b, h, q, k, v in _heads(x, w_qkv, b_qkv, num_heads, 0.0):
        attn = _softmax_rows(q.T @ k / np.sqrt(N))
        out[b, :, h * D:(h + 1) * D] = v @ attn.T
    return out @ np.asarray(w_proj, np.float64).T + np.asarray(b_proj, np.float64)


def xca_head_output(x, wq, wk, wv, bq, bk, bv, tau):
    """One XCA head (N, D) from x (N, C) and its weight rows, in torch float64 (for Jacobians by autograd)."""
    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv
    qn = q / q.pow(2).sum(0, keepdim=True).sqrt()
    kn = k / k.pow(2).sum(0, keepdim=True).sqrt()
    return v @ (tau * qn.T @ kn).softmax(dim=1).T


def davit_channel_head(x, wq, wk, wv, bq, bk, bv) -> np.ndarray:
    """One DaViT channel head (N, D) from x (N, C) and its weight rows: q_h softmax(k_h^T v_h / sqrt(D))^T."""
    x = np.asarray(x, np.float64)
    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv
    D = q.shape[1]
    logits = np.array([[k[:, i] @ v[:, j] for j in range(D)] for i in range(D)]) / np.sqrt(D)
    return q @ _softmax_rows(logits).T
