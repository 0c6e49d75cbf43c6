"""Nyströmformer attention (Xiong et al., "Nyströmformer: A Nyström-Based Algorithm for Approximating
Self-Attention", AAAI 2021, arXiv:2102.03902), Eq. 14-16, as a kernel term ``nystrom``.

Per head, with m landmarks q~, k~ (segment means of q and k, Sec. 3.2) and the iterative pseudo-inverse (Eq. 16):

    o_h = softmax(q k~^T / sqrt(D)) softmax(q~ k~^T / sqrt(D))^+ softmax(q~ k^T / sqrt(D)) v  [+ conv(v)]

The optional skip ``conv(v)`` is the authors' depthwise convolution over the tokens of each head's values
(kernel (conv, 1), one filter per head, no bias). The formula is in :func:`attnlab.ops.lowrank.nystrom_attention`.
The q, k, v projections are the standard module's, so weight terms (``nystrom+speccond``) act on them as on softmax
attention. No additive bias: Swin's windows (relative-position bias) and attention masks are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SpecError, UnsupportedModelError
from ..ops.lowrank import nystrom_attention
from .base import AttnlabAttention, norm_in_dtype


class NystromAttention(AttnlabAttention):
    """Nyström approximation of softmax attention; arguments as :class:`AttnlabAttention` plus:

    Args:
        landmarks: number of landmarks m (paper: 64; m >= N uses every token).
        pinv: ``"iterative"`` (Eq. 16) or ``"exact"`` (SVD pseudo-inverse).
        iters: iterations of Eq. 16 (paper: 6).
        conv: kernel length of the depthwise-convolution skip on v (odd; 0: none).
    """

    global_only = "nystrom"

    def __init__(self, dim: int, num_heads: int = 8, *, landmarks: int = 64, pinv: str = "iterative",
                 iters: int = 6, conv: int = 0, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        if conv and conv % 2 == 0:
            raise SpecError(f"nystrom(conv={conv}) is not valid; conv is an odd kernel length (e.g. 33) or 0.")
        self.landmarks, self.pinv, self.iters, self.conv_size = landmarks, pinv, iters, conv
        self.conv = (nn.Conv2d(self.num_heads, self.num_heads, (conv, 1), padding=(conv // 2, 0), bias=False,
                               groups=self.num_heads) if conv else None)

    def attend(self, q, k, v, mask=None, attn_mask=None) -> torch.Tensor:
        if attn_mask is not None or mask is not None:
            raise UnsupportedModelError("nystrom takes no attention mask; run it on unmasked (global) attention.")
        o = nystrom_attention(q, k, v, self.landmarks, scale=self.scale,
                              pinv_iters=None if self.pinv == "exact" else self.iters)
        return o if self.conv is None else o + self.conv(v)

    def head_output(self, x, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None, *, head: int) -> torch.Tensor:
        """One head's o (N, D) from x (N, C) and its weights (D, C): the Jacobian instrument's formula."""
        q, k, v = (x @ w.T + (b if b is not None else 0) for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v)))
        q, k = norm_in_dtype(self.q_norm, q), norm_in_dtype(self.k_norm, k)
        o = nystrom_attention(q, k, v, self.landmarks, scale=self.scale,
                              pinv_iters=None if self.pinv == "exact" else self.iters)
        if self.conv is not None:
            weight = self.conv.weight[head : head + 1].detach().to(x.dtype)
            o = o + nn.functional.conv2d(v[None], weight, padding=(self.conv_size // 2, 0))[0]
        return o

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, landmarks={self.landmarks}, pinv={self.pinv}, iters={self.iters}, conv={self.conv_size}"


__all__ = ["NystromAttention"]
