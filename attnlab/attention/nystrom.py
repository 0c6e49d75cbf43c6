"""Nyströmformer attention (Xiong et al., "Nyströmformer: A Nyström-Based Algorithm for Approximating
Self-Attention", AAAI 2021, arXiv:2102.03902), Eq. 14-16, as a kernel term ``nystrom``.

Per head, with m landmarks q~, k~ (segment means of q and k, Sec. 3.2) and the iterative pseudo-inverse (Eq. 16):

    o_h = softmax(q k~^T / sqrt(D)) softmax(q~ k~^T / sqrt(D))^+ softmax(q~ k^T / sqrt(D)) v  [+ conv(v)]

exact softmax attention when m >= N (the authors' fallback). ``conv(v)``: the authors' optional depthwise
convolution over each head's value tokens (their LRA configurations: kernel 35). The formula:
:func:`attnlab.ops.lowrank.nystrom_attention`; key padding as the authors mask it; docs/methods.md, "Low-rank
kernels".
"""

from __future__ import annotations

from torch import nn

from ..errors import SpecError
from ..ops.lowrank import Z0_SCALES, nystrom_attention
from .base import AttnlabAttention, Intermediates
from .capabilities import Capabilities, global_only


class NystromAttention(AttnlabAttention):
    """Nyström approximation of softmax attention; arguments as :class:`AttnlabAttention` plus:

    Args:
        landmarks: number of landmarks m (paper: 64; m >= N is exact softmax attention).
        pinv: ``"iterative"`` (Eq. 16) or ``"exact"`` (SVD pseudo-inverse).
        iters: iterations of Eq. 16 (paper: 6).
        conv: kernel length of the depthwise-convolution skip on v (odd; 0: none; the authors' LRA code: 35).
        z0: scale of Eq. 16's initial guess (:func:`attnlab.ops.lowrank.iterative_pinv`): ``head`` (per matrix,
            default), ``authors`` (one maximum over the batch), ``lucidrains``.
    """

    capabilities = Capabilities(
        causal="nystrom cannot honour a causal mask: its landmarks are means over segments of the whole sequence, so "
               "every output depends on every token",
        attn_mask="nystrom cannot honour this attention mask: it takes no attn_mask or window bias, only key padding "
                  "(an AttentionMask)",
        window=global_only("nystrom"), bias=global_only("nystrom"), intermediates=("head",))

    def __init__(self, dim: int, num_heads: int = 8, *, landmarks: int = 64, pinv: str = "iterative",
                 iters: int = 6, conv: int = 0, z0: str = "head", **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        if conv and conv % 2 == 0:
            raise SpecError(f"nystrom(conv={conv}) is not valid; conv is an odd kernel length (e.g. 35) or 0.")
        if z0 not in Z0_SCALES:
            raise SpecError(f"nystrom(z0={z0}) is not valid; z0 is one of: {', '.join(Z0_SCALES)}.")
        self.landmarks, self.pinv, self.iters, self.conv_size, self.z0 = landmarks, pinv, iters, conv, z0
        self.conv = (nn.Conv2d(self.num_heads, self.num_heads, (conv, 1), padding=(conv // 2, 0), bias=False,
                               groups=self.num_heads) if conv else None)

    def kernel(self, q, k, v, mask, want, backend):
        keep = None if mask is None else mask.keep()  # key padding: the other parts are refused
        kp = None if keep is None else keep[..., 0, :]
        o = nystrom_attention(q, k, v, self.landmarks, scale=self.scale, z0=self.z0, key_padding=kp,
                              pinv_iters=None if self.pinv == "exact" else self.iters)
        if self.conv is not None:  # one filter per head: the heads are the convolution's groups
            o = o + self.conv(v if kp is None else v * kp[..., None])
        return o, Intermediates()

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, landmarks={self.landmarks}, pinv={self.pinv}, iters={self.iters}, "
                f"conv={self.conv_size}, z0={self.z0}")


__all__ = ["NystromAttention"]
