"""ViTDet's decomposed relative positions (MViTv2, Li et al., arXiv 2112.01526, Sec. 3.1; ViTDet, arXiv 2203.16527)
against a float64 loop over query and key positions written from the formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.ops.relpos import decomposed_rel_pos


def _loop(q, table_h, table_w, size):
    """B[(i_h, i_w), (j_h, j_w)] = q_i . R_h[i_h - j_h + h - 1] + q_i . R_w[i_w - j_w + w - 1], one entry at a time."""
    h, w = size
    out = np.zeros((q.shape[0], h * w, h * w))
    for n in range(q.shape[0]):
        for i in range(h * w):
            for j in range(h * w):
                (ih, iw), (jh, jw) = divmod(i, w), divmod(j, w)
                out[n, i, j] = q[n, i] @ table_h[ih - jh + h - 1] + q[n, i] @ table_w[iw - jw + w - 1]
    return out


@pytest.mark.parametrize("size", [(3, 3), (2, 4)])
def test_decomposed_relative_positions_equal_the_formula(size):
    g = torch.Generator().manual_seed(0)
    h, w = size
    q = torch.randn(1, 3, h * w, 8, generator=g, dtype=torch.float64)
    table_h = torch.randn(2 * h - 1, 8, generator=g, dtype=torch.float64)
    table_w = torch.randn(2 * w - 1, 8, generator=g, dtype=torch.float64)
    got = decomposed_rel_pos(q, table_h, table_w, size, size)
    np.testing.assert_allclose(got[0].numpy(), _loop(q[0].numpy(), table_h.numpy(), table_w.numpy(), size),
                               rtol=1e-12, atol=1e-12)
