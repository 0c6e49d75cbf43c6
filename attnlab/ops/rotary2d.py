"""2-D rotary positions of a patch grid, as Qwen2-VL's vision encoder and VideoLLaMA3's SigLIP-NaViT compute them
(Su et al., "RoFormer", arXiv:2104.09864, extended to rows and columns; Wang et al., "Qwen2-VL", arXiv:2409.12191).

A token at row r and column c of the patch grid, head dimension D, gets D/2 angles, half from its row and half from
its column, paired rotate-half style (feature i with feature i + D/2):

    a = [r f_0, ..., r f_{D/4-1}, c f_0, ..., c f_{D/4-1}],     f_j = theta^(-4j / D)
    x' = x * cos([a, a]) + rotate_half(x) * sin([a, a]),       rotate_half(x) = [-x2, x1]

The tokens of a frame are in merge-block order (VideoLLaMA3's processor): the grid is cut into m x m blocks, blocks
in raster order, and the m x m tokens of each block in raster order; :func:`grid_positions` gives each token's (r, c).
"""

from __future__ import annotations

import torch
from torch import nn


def grid_positions(h: int, w: int, merge: int, device=None) -> torch.Tensor:
    """(h * w, 2) long: the (row, column) of each token of an h x w patch grid in merge-block order."""
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    # (block row, row in block, block column, column in block) -> blocks first, then the tokens inside a block
    return torch.stack([t.permute(0, 2, 1, 3).reshape(-1) for t in (rows, cols)], dim=-1)


class Rotary2D(nn.Module):
    """Rotates queries and keys (..., N, D) of the frames of one patch grid (module docstring); the encoder sets
    the grid with :meth:`set_grid` before its blocks run, and every block's attention shares this module (its
    ``rotary``). No parameters: state dicts do not change. The grid is state: a block recomputed later (activation
    checkpointing) must see the grid of its own forward.

    The angles r f_j, c f_j are computed in float32, as VideoLLaMA3 and Hugging Face compute them; their cosines and
    the rotation run in float32 for half-precision inputs (VideoLLaMA3 rotates in float32) and in the input's own
    precision above it (a float64 model is rotated in float64)."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2-D rotary positions split each head into row and column pairs, so the head dimension "
                             f"must be a multiple of 4, not {head_dim}")
        self.head_dim, self.theta = head_dim, float(theta)
        half = head_dim // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.grid: tuple[int, int, int] | None = None

    def set_grid(self, h: int, w: int, merge: int = 1) -> None:
        """The patch grid (h rows, w columns, merge size) of the frames the next calls rotate."""
        self.grid = (int(h), int(w), int(merge))

    def angles(self, device=None) -> torch.Tensor:
        """(N, D/2) float32 angles of the grid's tokens in merge-block order."""
        if self.grid is None:
            raise RuntimeError("Rotary2D has no grid; the encoder calls set_grid(h, w, merge) before its blocks run")
        pos = grid_positions(*self.grid, device=device).float()
        inv = self.inv_freq.to(device=device, dtype=torch.float32)
        return torch.cat([pos[:, :1] * inv, pos[:, 1:] * inv], dim=-1)

    def forward(self, *ts: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, ...]:
        """Each of ``ts`` (..., N, D), N = h * w tokens of one frame, rotated by its tokens' angles."""
        if offset:
            raise ValueError("Rotary2D rotates whole frames; it takes no cached offset")
        a = self.angles(ts[0].device)
        out = []
        for x in ts:
            dtype = torch.promote_types(x.dtype, torch.float32)
            full = torch.cat([a, a], dim=-1).to(dtype)
            y = x.to(dtype)
            y1, y2 = y.chunk(2, dim=-1)
            out.append((y * full.cos() + torch.cat([-y2, y1], dim=-1) * full.sin()).to(x.dtype))
        return tuple(out)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta:g}, grid={self.grid}"


__all__ = ["Rotary2D", "grid_positions"]
