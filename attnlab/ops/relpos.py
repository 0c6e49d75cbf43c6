"""ViTDet's position terms (Li et al., arXiv 2203.16527; the decomposed relative positions of MViTv2, Li et al.,
arXiv 2112.01526, Sec. 3.1): pure functions, the parameters live in :mod:`attnlab.models.vitdet`.

    B[(i_h, i_w), (j_h, j_w)] = q_(i) . R_h[i_h - j_h] + q_(i) . R_w[i_w - j_w]        added to q k^T / sqrt(D)

The bias depends on the query (not scaled by 1/sqrt(D)), so it is formed per forward from the queries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rel_pos_table(q_size: int, k_size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    """(q_size, k_size, D) embeddings R[i - j] of a (2 L - 1, D) table, linearly resized when 2 max(q, k) - 1 != L
    entries are needed, the shorter side's coordinates stretched when the sizes differ (MViTv2's ``get_rel_pos``)."""
    length = 2 * max(q_size, k_size) - 1
    if rel_pos.shape[0] != length:
        rel_pos = F.interpolate(rel_pos.t()[None], size=length, mode="linear")[0].t()
    q_coords = torch.arange(q_size, device=rel_pos.device)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size, device=rel_pos.device)[None, :] * max(q_size / k_size, 1.0)
    return rel_pos[((q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)).long()]


def decomposed_rel_pos(q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor,
                       q_size: tuple[int, int], k_size: tuple[int, int]) -> torch.Tensor:
    """The additive logit bias (B, H, N, M) of queries q (B, H, N, D) on a q_size = (h, w) grid (N = h w, row-major)
    against keys on a k_size grid, from tables ``rel_pos_h`` (2 h - 1, D) and ``rel_pos_w`` (2 w - 1, D)."""
    (qh, qw), (kh, kw) = q_size, k_size
    r_h, r_w = rel_pos_table(qh, kh, rel_pos_h).to(q.dtype), rel_pos_table(qw, kw, rel_pos_w).to(q.dtype)
    grid = q.reshape(*q.shape[:2], qh, qw, q.shape[-1])
    bias_h = torch.einsum("bnhwc,hkc->bnhwk", grid, r_h)
    bias_w = torch.einsum("bnhwc,wkc->bnhwk", grid, r_w)
    return (bias_h[..., :, None] + bias_w[..., None, :]).reshape(*q.shape[:3], kh * kw)


def interpolate_abs_pos(abs_pos: torch.Tensor, num_prefix_tokens: int, hw: tuple[int, int]) -> torch.Tensor:
    """detectron2's ``get_abs_pos``: a square pretraining grid of position embeddings (1, prefix + S*S, C), prefix
    tokens dropped, resized to ``hw`` by bicubic interpolation (``align_corners=False``, no antialiasing) when the
    grid differs -> (1, h, w, C)."""
    grid = abs_pos[:, num_prefix_tokens:]
    size = math.isqrt(grid.shape[1])
    if size * size != grid.shape[1]:
        raise ValueError(f"{grid.shape[1]} position embeddings are not a square grid")
    if (size, size) == tuple(hw):
        return grid.reshape(1, size, size, -1)
    out = F.interpolate(grid.reshape(1, size, size, -1).permute(0, 3, 1, 2), size=tuple(hw), mode="bicubic",
                        align_corners=False)
    return out.permute(0, 2, 3, 1)


__all__ = ["decomposed_rel_pos", "interpolate_abs_pos", "rel_pos_table"]
