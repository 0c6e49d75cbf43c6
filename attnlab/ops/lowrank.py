"""Low-rank approximations of softmax attention: Nyströmformer and Performer's FAVOR+, as pure functions.

Nyströmformer (Xiong et al., "Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention", AAAI 2021,
arXiv:2102.03902), Eq. 14-16. With m landmarks q~, k~ (means of m contiguous segments of the queries and keys)

    o = softmax(q k~^T / sqrt(D)) Z softmax(q~ k^T / sqrt(D)) v,    Z ~ softmax(q~ k~^T / sqrt(D))^+

where Z is the Moore-Penrose pseudo-inverse, computed by the paper's iteration (Eq. 16; Razavi et al. 2014)

    Z_0 = A^T / (||A||_1 ||A||_inf),    Z_{j+1} = Z_j (13 I - A Z_j (15 I - A Z_j (7 I - A Z_j))) / 4

or exactly (SVD). Cost O(N m D + m^3) instead of O(N^2 D). With m = N the landmarks are q and k themselves, so
with the exact pseudo-inverse o = S S^+ S v = S v, softmax attention.

Performer (Choromanski et al., "Rethinking Attention with Performers", ICLR 2021, arXiv:2009.14794), FAVOR+ with
positive random features (Lemma 1): for w_1..w_M with rows marginally N(0, I_D),

    phi(x) = exp(W x - ||x||^2 / 2) / sqrt(M),    E[phi(x) . phi(y)] = exp(x . y),

applied to x = q / D^(1/4), y = k / D^(1/4), so phi(x) . phi(y) estimates exp(q . k / sqrt(D)), and

    o = phi(q) (phi(k)^T v) / (phi(q) (phi(k)^T 1)),

linear in N. The rows of W are drawn orthogonal in blocks of D (Sec. 2.4: lower variance, still unbiased) and
rescaled to the lengths of independent Gaussian vectors, so each row is marginally N(0, I_D).
"""

from __future__ import annotations

import math

import torch


# ---------------------------------------------------------------------------------------------- Nyströmformer
def segment_means(x: torch.Tensor, m: int) -> torch.Tensor:
    """Landmarks: means of ``m`` contiguous, near-equal segments of the tokens. x: (..., N, D) -> (..., m, D).

    Segment i covers tokens [floor(i N / m), floor((i + 1) N / m)), so every token is in exactly one segment (the
    paper's N / m segments when m divides N); m >= N gives x itself.
    """
    n = x.shape[-2]
    if m >= n:
        return x
    if n % m == 0:
        return x.unflatten(-2, (m, n // m)).mean(dim=-2)
    bounds = torch.div(torch.arange(m + 1, device=x.device) * n, m, rounding_mode="floor")
    cum = torch.nn.functional.pad(x.cumsum(dim=-2), (0, 0, 1, 0))
    sums = cum[..., bounds[1:], :] - cum[..., bounds[:-1], :]
    return sums / (bounds[1:] - bounds[:-1]).to(x.dtype).unsqueeze(-1)


def iterative_pinv(a: torch.Tensor, iters: int = 6) -> torch.Tensor:
    """Nyströmformer's Eq. 16: ``iters`` steps of the Razavi et al. iteration towards a^+. a: (..., m, m).

    Z_0 = a^T / (||a||_1 ||a||_inf) per matrix (max column sum times max row sum); the authors' code takes the two
    maxima over the whole batch instead, which only shrinks Z_0 further.
    """
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    norm_1 = a.abs().sum(dim=-2).amax(dim=-1)
    norm_inf = a.abs().sum(dim=-1).amax(dim=-1)
    z = a.mT / (norm_1 * norm_inf)[..., None, None]
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, landmarks: int, *, scale: float,
                      pinv_iters: int | None = 6) -> torch.Tensor:
    """Nyströmformer's o (Eq. 15). q, k, v: (..., N, D) -> (..., N, D).

    ``pinv_iters=None`` uses the exact pseudo-inverse (``torch.linalg.pinv``) instead of Eq. 16's iteration.
    """
    q = q * scale
    q_land, k_land = segment_means(q, landmarks), segment_means(k, landmarks)
    kernel_1 = (q @ k_land.mT).softmax(dim=-1)             # (N, m)
    kernel_2 = (q_land @ k_land.mT).softmax(dim=-1)        # (m, m)
    kernel_3 = (q_land @ k.mT).softmax(dim=-1)             # (m, N)
    z = torch.linalg.pinv(kernel_2) if pinv_iters is None else iterative_pinv(kernel_2, pinv_iters)
    return kernel_1 @ (z @ (kernel_3 @ v))


# ---------------------------------------------------------------------------------------------- Performer
def orthogonal_gaussian(features: int, dim: int, *, generator: torch.Generator | None = None,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(features, dim) random matrix whose rows are orthogonal within each block of ``dim`` rows and marginally
    N(0, I_dim): Q of the QR decomposition of a Gaussian block, rows rescaled by the norms of fresh Gaussian rows."""
    blocks = []
    for start in range(0, features, dim):
        g = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        q = q * torch.sign(torch.diagonal(r))  # Haar-distributed Q (sign convention of the QR fixed)
        blocks.append(q.T[: features - start])
    w = torch.cat(blocks)
    norms = torch.randn(features, dim, generator=generator, dtype=torch.float64).norm(dim=-1, keepdim=True)
    return (w * norms).to(dtype)


def positive_features(x: torch.Tensor, projection: torch.Tensor, *, stabilise: str = "row") -> torch.Tensor:
    """phi(x) = exp(W x - ||x||^2 / 2) / sqrt(M) (Lemma 1), times a constant that cancels in attention.

    x: (..., N, D), projection W: (M, D) -> (..., N, M). ``stabilise`` subtracts the largest exponent before exp:
    ``"row"`` per token (queries: the constant cancels in each row's normalisation), ``"all"`` over the tokens of
    each sequence (keys: one constant per head, cancelling in numerator and denominator alike), ``"none"`` for the
    exact phi.
    """
    wx = x @ projection.mT
    half_norm = 0.5 * (x * x).sum(dim=-1, keepdim=True)
    if stabilise == "row":  # max_j (wx_j - |x|^2 / 2) = max_j wx_j - |x|^2 / 2: the norm cancels
        offset = wx.amax(dim=-1, keepdim=True).detach()
    elif stabilise == "all":
        offset = half_norm + (wx.amax(dim=-1, keepdim=True) - half_norm).amax(dim=-2, keepdim=True).detach()
    else:
        offset = half_norm
    offset = offset + 0.5 * math.log(projection.shape[0])  # the 1 / sqrt(M), inside the exp
    if torch.is_grad_enabled() and (x.requires_grad or projection.requires_grad):
        return (wx - offset).exp()
    return wx.sub_(offset).exp_()  # in place: each (N, M) temporary is a fresh allocation, page faults and all


def performer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                        eps: float = 1e-6) -> torch.Tensor:
    """FAVOR+ (Sec. 2.2-2.4). q, k, v: (..., N, D), projection (M, D) -> (..., N, D).

    Equal to ``phi(q) (phi(k)^T v) / (phi(q) (phi(k)^T 1))`` with :func:`positive_features`, arranged so every
    (N, M) tensor is an (N, D) x (D, M) product and one subtract-and-exp: D^(-1/4) is folded into W; each query's
    factor exp(-|x|^2 / 2) / sqrt(M) is a row constant that cancels in its ratio, so phi(q) is exp(W x - max_j W x);
    each key's phi(k) is exp(W y - max_j W y) times a per-key weight c = exp(max_j W y - |y|^2 / 2 - C), C the
    largest exponent over the keys (a constant that cancels), applied to the (N, D) values instead of the (N, M)
    features. Every exponent is <= 0, so nothing overflows. ``eps`` only guards the division.
    """
    w = projection * q.shape[-1] ** -0.25
    in_place = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or w.requires_grad))
    wq, wk = q @ w.mT, k @ w.mT                                           # (..., N, M)
    top_q, top_k = wq.amax(-1, keepdim=True).detach(), wk.amax(-1, keepdim=True).detach()
    phi_q = wq.sub_(top_q).exp_() if in_place else (wq - top_q).exp()
    phi_k = wk.sub_(top_k).exp_() if in_place else (wk - top_k).exp()
    log_c = top_k - (0.5 * q.shape[-1] ** -0.5) * (k * k).sum(-1, keepdim=True)
    c = (log_c - log_c.amax(-2, keepdim=True).detach()).exp()             # (..., N, 1), <= 1
    kv = phi_k.mT @ (v * c)                                               # (..., M, D): D columns, BLAS's fast shape
    z = torch.einsum("...nm,...n->...m", phi_k, c.squeeze(-1))            # phi(k)^T 1, as a sum rather than a GEMV
    den = torch.einsum("...nm,...m->...n", phi_q, z).unsqueeze(-1)
    return (phi_q @ kv) / (den + eps)


__all__ = ["segment_means", "iterative_pinv", "nystrom_attention", "orthogonal_gaussian", "positive_features",
           "performer_attention"]
