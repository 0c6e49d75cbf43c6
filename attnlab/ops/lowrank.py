"""Low-rank approximations of softmax attention: Nyströmformer and Performer's FAVOR+, as pure functions.

Nyströmformer (Xiong et al., "Nyströmformer: A Nyström-Based Algorithm for Approximating Self-Attention", AAAI 2021,
arXiv:2102.03902), Eq. 14-16. With m landmarks q~, k~ (means of m contiguous segments of the queries and keys)

    o = softmax(q k~^T / sqrt(D)) Z softmax(q~ k^T / sqrt(D)) v,    Z ~ softmax(q~ k~^T / sqrt(D))^+

where Z is the Moore-Penrose pseudo-inverse, computed by the paper's iteration (Eq. 16; Razavi et al. 2014)

    Z_0 = A^T / (||A||_1 ||A||_inf),    Z_{j+1} = Z_j (13 I - A Z_j (15 I - A Z_j (7 I - A Z_j))) / 4

or exactly (SVD). Cost O(N m D + m^3) instead of O(N^2 D). With m >= N there is nothing to approximate and softmax
attention is computed exactly, as the authors do.

Performer (Choromanski et al., "Rethinking Attention with Performers", ICLR 2021, arXiv:2009.14794), FAVOR+ with
positive random features (Lemma 1): for w_1..w_M with rows marginally N(0, I_D),

    phi(x) = exp(W x - ||x||^2 / 2) / sqrt(M),    E[phi(x) . phi(y)] = exp(x . y),

applied to x = q / D^(1/4), y = k / D^(1/4), so phi(x) . phi(y) estimates exp(q . k / sqrt(D)), and

    o = phi(q) (phi(k)^T v) / (phi(q) (phi(k)^T 1)),

linear in N, with W's rows orthogonal in blocks of D (Sec. 2.4: lower variance, still unbiased;
:func:`orthogonal_gaussian`). The causal form takes both sums by prefix sums (Sec. 2.2; query i sees keys j <= i).
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


Z0_SCALES = ("head", "authors", "lucidrains")


def iterative_pinv(a: torch.Tensor, iters: int = 6, z0: str = "head") -> torch.Tensor:
    """Nyströmformer's Eq. 16: ``iters`` steps of the Razavi et al. iteration towards a^+. a: (..., m, m).

    Z_0 = a^T / s, with s by ``z0``: ``head`` ||a||_1 ||a||_inf of each matrix (max column sum times max row sum;
    the paper's choice, which keeps the samples of a batch independent); ``authors`` the one largest column sum over
    the whole batch and every head (the Nyströmformer authors' LRA code, which couples the samples of a batch: for
    softmax rows ||a||_inf = 1, so per matrix it is the same start); ``lucidrains`` the largest column sum times the
    largest row sum over the whole batch (lucidrains/nystrom-attention).
    """
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    cols, rows = a.abs().sum(dim=-2), a.abs().sum(dim=-1)
    if z0 == "head":
        scale = (cols.amax(dim=-1) * rows.amax(dim=-1))[..., None, None]
    elif z0 == "authors":
        scale = cols.amax()
    elif z0 == "lucidrains":
        scale = cols.amax() * rows.amax()
    else:
        raise ValueError(f"z0 must be one of {', '.join(Z0_SCALES)}, got {z0!r}")
    z = a.mT / scale
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, landmarks: int, *, scale: float,
                      pinv_iters: int | None = 6, z0: str = "head", key_padding: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Nyströmformer's o (Eq. 15). q, k, v: (..., N, D) -> (..., N, D).

    ``landmarks >= N``: exact softmax attention (the authors' fallback; there is nothing to approximate).
    ``pinv_iters=None`` uses the exact pseudo-inverse (``torch.linalg.pinv``) instead of Eq. 16's iteration, whose
    Z_0 ``z0`` selects (:func:`iterative_pinv`). ``key_padding`` (broadcastable to (..., N), True at real tokens: a
    mask's keep map over keys, which opens a sequence of padding only), as the authors mask: padded tokens' q and k
    are zero, so a landmark is its segment's sum over real tokens divided by the segment's length, and padded keys
    are excluded from the softmax over keys (the third kernel, and the exact fallback).
    """
    keep = None
    if key_padding is not None:
        q, k = q * key_padding.unsqueeze(-1), k * key_padding.unsqueeze(-1)
        keep = key_padding.unsqueeze(-2)  # (..., 1, N)
    q = q * scale
    if landmarks >= q.shape[-2]:
        logits = q @ k.mT
        return (logits if keep is None else logits.masked_fill(~keep, float("-inf"))).softmax(dim=-1) @ v
    q_land, k_land = segment_means(q, landmarks), segment_means(k, landmarks)
    kernel_1 = (q @ k_land.mT).softmax(dim=-1)             # (N, m)
    kernel_2 = (q_land @ k_land.mT).softmax(dim=-1)        # (m, m)
    logits_3 = q_land @ k.mT                               # (m, N)
    kernel_3 = (logits_3 if keep is None else logits_3.masked_fill(~keep, float("-inf"))).softmax(dim=-1)
    z = torch.linalg.pinv(kernel_2) if pinv_iters is None else iterative_pinv(kernel_2, pinv_iters, z0)
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
                        key_padding: torch.Tensor | None = None, causal: bool = False, chunk: int = 64,
                        eps: float | None = None) -> torch.Tensor:
    """FAVOR+ (Sec. 2.2-2.4). q, k, v: (..., N, D), projection (M, D) -> (..., N, D).

    Equal to ``phi(q) (phi(k)^T v) / (phi(q) (phi(k)^T 1))`` with :func:`positive_features`, arranged so every
    (N, M) tensor is an (N, D) x (D, M) product and one subtract-and-exp: D^(-1/4) is folded into W; each query's
    factor exp(-|x|^2 / 2) / sqrt(M) is a row constant that cancels in its ratio, so phi(q) is exp(W x - max_j W x);
    each key's phi(k) is exp(W y - max_j W y) times a per-key weight c = exp(max_j W y - |y|^2 / 2 - C), C the
    largest exponent over the keys (a constant that cancels), applied to the (N, D) values instead of the (N, M)
    features. Every exponent is <= 0, so nothing overflows.

    ``key_padding`` (broadcastable to (..., N), True at real keys): padded keys get weight c = 0, so they are in
    neither sum (and C is taken over the real keys). ``causal``: the unidirectional FAVOR+ of the paper's Sec. 2.2,
    query i over keys j <= i, by prefix sums of phi(k_j) v_j^T and phi(k_j) computed ``chunk`` tokens at a time
    (within a chunk the masked (chunk x chunk) product, across chunks the running (M, D) state), with query i's
    constant C taken over its keys j <= i, so that no output depends on a later token even in rounding. The
    denominator is floored at ``eps`` (default the dtype's smallest normal number): it guards 0 / 0 for a query
    without any key and changes nothing else.
    """
    w = projection * q.shape[-1] ** -0.25
    in_place = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or w.requires_grad))
    wq, wk = q @ w.mT, k @ w.mT                                           # (..., N, M)
    top_q, top_k = wq.amax(-1, keepdim=True).detach(), wk.amax(-1, keepdim=True).detach()
    phi_q = wq.sub_(top_q).exp_() if in_place else (wq - top_q).exp()
    phi_k = wk.sub_(top_k).exp_() if in_place else (wk - top_k).exp()
    log_c = top_k - (0.5 * q.shape[-1] ** -0.5) * (k * k).sum(-1, keepdim=True)
    if key_padding is not None:
        log_c = log_c.masked_fill(~key_padding.unsqueeze(-1), float("-inf"))
    floor = torch.finfo(q.dtype).tiny if eps is None else eps
    if causal:
        return _causal_favor(phi_q, phi_k, v, log_c.squeeze(-1), floor, chunk)
    top_c = log_c.amax(-2, keepdim=True).detach()
    c = (log_c - top_c.clamp_min(torch.finfo(log_c.dtype).min)).exp()   # (..., N, 1), <= 1; 0 at padded keys
    kv = phi_k.mT @ (v * c)                                               # (..., M, D): D columns, BLAS's fast shape
    z = torch.einsum("...nm,...n->...m", phi_k, c.squeeze(-1))            # phi(k)^T 1, as a sum rather than a GEMV
    den = torch.einsum("...nm,...m->...n", phi_q, z).unsqueeze(-1)
    return (phi_q @ kv) / den.clamp_min(floor)


def _causal_favor(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, log_c: torch.Tensor, floor: float,
                  chunk: int) -> torch.Tensor:
    """sum_{j <= i} (phi_q_i . phi_k_j) c_ij v_j / sum_{j <= i} (phi_q_i . phi_k_j) c_ij for every query i, (..., N, D),
    with c_ij = exp(log_c_j - C_i) and C_i = max_{j <= i} log_c_j: the constant that cancels in query i's ratio is
    taken over its own keys only, so no output depends on a later token, not even in its rounding (a maximum over
    all N would be). Inside each chunk of T tokens the masked T x T product; across chunks each chunk's state
    phi_k^T [v, 1] weighted against the chunk's last C, rescaled to the query's C (every factor <= 1, as in an
    online softmax)."""
    N = phi_q.shape[-2]
    T = max(1, min(chunk, N))
    pad = -N % T
    if pad:  # zero features and weight 0: padded keys add nothing, padded queries are cut off below
        phi_q, phi_k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, v))
        log_c = torch.nn.functional.pad(log_c, (0, pad), value=float("-inf"))
    n = (N + pad) // T
    lowest = torch.finfo(log_c.dtype).min
    run = log_c.detach().cummax(-1).values.clamp_min(lowest).unflatten(-1, (n, T))  # C_i, (..., n, T)
    lc = log_c.unflatten(-1, (n, T))
    qc, kc = phi_q.unflatten(-2, (n, T)), phi_k.unflatten(-2, (n, T))    # (..., n, T, M)
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1).unflatten(-2, (n, T))  # (..., n, T, D + 1)
    before_i = torch.ones(T, T, dtype=torch.bool, device=v.device).tril()
    weight = (lc[..., None, :] - run[..., :, None]).masked_fill(~before_i, float("-inf")).exp()  # c_ij, j <= i
    out = ((qc @ kc.mT) * weight) @ values                                # (..., n, T, D + 1): inside the chunk
    if n > 1:
        last = run[..., -1]                                               # (..., n): C at each chunk's last token
        state = kc.mT @ (values * (lc - last[..., None]).exp()[..., None])  # (..., n, M, D + 1)
        ref = torch.cat([last[..., :1], last[..., :-1]], dim=-1)         # chunk t's reference: C ending chunk t - 1
        earlier = torch.ones(n, n, dtype=torch.bool, device=v.device).tril(-1)  # s < t
        mix = (last[..., None, :] - ref[..., :, None]).masked_fill(~earlier, float("-inf")).exp()  # (..., n, n)
        before = torch.einsum("...ts,...smd->...tmd", mix, state)         # sum_{s<t} state_s exp(C_s - ref_t)
        scale = (ref[..., None] - run).exp().masked_fill(~earlier.any(-1)[:, None], 0.0)  # exp(ref_t - C_i) <= 1
        out = out + (qc @ before) * scale[..., None]
    out = out.flatten(-3, -2)[..., :N, :]
    return out[..., :-1] / out[..., -1:].clamp_min(floor)


__all__ = ["Z0_SCALES", "iterative_pinv", "nystrom_attention", "orthogonal_gaussian", "performer_attention",
           "positive_features", "segment_means"]
