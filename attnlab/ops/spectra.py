"""Gram spectra of feature-view matrices and their summaries (NS-Attn: "Newton–Schulz Transformations of
Attention Outputs in Vision Transformers", Sec. 3.4).

For a feature-by-token matrix M (rows x cols; for head outputs X of shape (N, D) pass M = X^T, D x N, eq. 1):

    G = M M^T                                     (eq. 6)
    p_i = lambda_i / sum_j lambda_j,  lambda_1 >= ... >= lambda_rows     (eq. 7)
    p1 = p_1 (leading-eigenvalue fraction)
    r_eff = exp(-sum_i p_i log p_i), natural log, 0 log 0 = 0            (eq. 8, Roy and Vetterli)

All ``rows`` eigenvalues are kept, including the rows - cols zeros when rows > cols (the paper's Swin case:
32 eigenvalues of a 32 x 32 Gram from a 32 x 16 matrix); zeros do not change p1 or r_eff.

A zero matrix has no spectrum to normalise: its p is all zeros (the flag: ``p.sum(-1) == 0``),
``leading_fraction`` gives 0 and ``effective_rank`` gives 0, the rank of the zero matrix, so it can never be
mistaken for a rank-one matrix (r_eff = 1). Callers that average should drop such matrices explicitly.
"""

from __future__ import annotations

import torch

__all__ = ["effective_rank", "gram_eigenvalues", "gram_spectrum", "leading_fraction"]


def gram_eigenvalues(m: torch.Tensor) -> torch.Tensor:
    """Eigenvalues lambda of G = M M^T (eq. 6) for m (..., rows, cols) of any floating dtype: float64 (..., rows),
    sorted descending, the squared singular values of M (exactly non-negative, more accurate for small eigenvalues
    than eigvalsh of G), padded with rows - cols zeros when rows > cols."""
    m = m.detach().to(torch.float64)
    lam = torch.linalg.svdvals(m).square()  # (..., min(rows, cols)), descending
    pad = m.shape[-2] - lam.shape[-1]
    if pad > 0:
        lam = torch.cat([lam, lam.new_zeros(*lam.shape[:-1], pad)], dim=-1)
    return lam


def gram_spectrum(m: torch.Tensor) -> torch.Tensor:
    """Normalised Gram spectrum p (eq. 7): eigenvalues of M M^T sorted descending, divided by their sum; float64
    (..., rows) summing to 1 per matrix, all zeros for a zero matrix (module docstring). m: (..., rows, cols); pass
    ``x.mT`` for head outputs x of shape (..., N, D)."""
    lam = gram_eigenvalues(m)
    total = lam.sum(dim=-1, keepdim=True)
    # where(), not an if: a zero matrix gives p = 0 instead of 0/0 = NaN.
    return torch.where(total > 0, lam / torch.where(total > 0, total, 1.0), 0.0)


def leading_fraction(p: torch.Tensor) -> torch.Tensor:
    """Leading-eigenvalue fraction p1 of normalised spectra p (..., k) sorted descending: p[..., 0]."""
    return p[..., 0]


def effective_rank(p: torch.Tensor) -> torch.Tensor:
    """Entropy effective rank exp(-sum_i p_i ln p_i) with 0 ln 0 = 0 (eq. 8) of normalised spectra p (..., k).

    Returns a tensor of shape (...): between 1 (one direction) and k (flat spectrum) for a normalised p, and 0
    where p is all zeros (the spectrum of a zero matrix, see ``gram_spectrum``).
    """
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # xlogy(0, 0) = 0
    return torch.where(p.sum(dim=-1) > 0, entropy.exp(), 0.0)
