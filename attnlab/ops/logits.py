"""Per-head maximum attention logits, max over batch, query i and key j of (q_h,i . k_h,j) * scale, without ever
holding the (B, H, N, M) logits (ViT-B/16 at batch 256: 0.5 GB per layer): tiles of at most :data:`CHUNK_ELEMENTS`
float32 elements, and a Cauchy-Schwarz screen that skips the exact pass for heads that cannot exceed a threshold.
QK-clip (Kimi K2's MuonClip) reads them as an attention forward's intermediate; docs/methods.md, "qkclip".
"""

from __future__ import annotations

import torch

from .sdpa import causal_keep

CHUNK_ELEMENTS = 1 << 24  # the most float32 elements a tile of logits, or of q or k, holds (64 MiB)
BOUND_MARGIN = 1e-4  # relative margin on the bound, so float32 rounding cannot certify a head that is over tau


def max_scaled_logits(q: torch.Tensor, k: torch.Tensor, scale: float, heads: torch.Tensor | None = None,
                      keep: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """Per-head max of (q_i . k_j) * scale over batch, i and j, in float32, computed tile by tile.

    q: (B, H, N, D), k: (B, H, M, D); ``heads``: indices of the heads to compute (default all); ``keep``: bool,
    broadcastable to (B, 1, N, M), True where a position counts; ``causal``: only j <= i counts. Returns
    (len(heads),) or (H,), -inf for a head without any position. No intermediate holds more than
    :data:`CHUNK_ELEMENTS` elements when that is >= D.
    """
    (B, H, N, D), M = q.shape, k.shape[-2]
    count, block = H if heads is None else heads.numel(), CHUNK_ELEMENTS
    # the largest (samples, heads, queries, keys) per tile whose logits (tb th tr tc elements) and float32 q and k
    # slices (tb th tr D, tb th tc D) each hold at most max(block, D) elements
    tc = min(M, max(1, block // D))
    tr = min(N, max(1, block // max(tc, D)))
    per_head = max(tr * max(tc, D), tc * D)
    th = min(count, max(1, block // per_head))
    tb = min(B, max(1, block // (th * per_head)))
    keep = None if keep is None else keep.expand(B, 1, N, M)  # a view: tiles slice it without copying
    out = torch.full((count,), float("-inf"), device=q.device, dtype=torch.float32)

    def tile(t, b0, h0, r0, size):  # a tile of samples, heads (the selected ones) and tokens, in float32
        t = t[b0:b0 + tb, :, r0:r0 + size]
        return (t[:, h0:h0 + th] if heads is None else t.index_select(1, heads[h0:h0 + th])).float()
    with torch.autocast(q.device.type, enabled=False):  # under autocast the matmul would run in bf16 / fp16
        for h0 in range(0, count, th):
            for b0 in range(0, B, tb):
                for r0 in range(0, N, tr):
                    qt = tile(q, b0, h0, r0, tr)
                    for c0 in range(0, M, tc):
                        logits = qt @ tile(k, b0, h0, c0, tc).transpose(-2, -1)
                        if causal:
                            logits = logits.masked_fill(~causal_keep(*logits.shape[-2:], q.device, r0 - c0), -torch.inf)
                        if keep is not None:
                            logits = logits.masked_fill(~keep[b0:b0 + tb, :, r0:r0 + tr, c0:c0 + tc], -torch.inf)
                        torch.maximum(out[h0:h0 + th], logits.amax(dim=(0, 2, 3)), out=out[h0:h0 + th])
    return out * scale


def _max_norms(t: torch.Tensor) -> torch.Tensor:
    """max over tokens of ||t_i|| per sample and head, (B, H) float32, from float32 tiles of at most
    max(CHUNK_ELEMENTS, H D) elements."""
    B, H, N, D = t.shape
    tokens = min(N, max(1, CHUNK_ELEMENTS // (H * D)))
    samples = min(B, max(1, CHUNK_ELEMENTS // (tokens * H * D)))
    out = torch.full((B, H), float("-inf"), device=t.device, dtype=torch.float32)
    for b0 in range(0, B, samples):
        for n0 in range(0, N, tokens):
            norms = torch.linalg.vector_norm(t[b0:b0 + samples, :, n0:n0 + tokens].float(), dim=-1).amax(dim=-1)
            torch.maximum(out[b0:b0 + samples], norms, out=out[b0:b0 + samples])
    return out


def screened_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, tau: float, *,
                        keep: torch.Tensor | None = None, causal: bool = False,
                        query_padding: torch.Tensor | None = None, select: bool | None = None) -> torch.Tensor:
    """Per-head max logit where it matters for a threshold ``tau``: exact S_max,h for every head that could exceed
    it, and for the others the Cauchy-Schwarz bound (<= tau) that shows it cannot.

        bound_h = (1 + margin) * scale * max_b (max_i ||q_b,h,i|| * max_j ||k_b,h,j||)  >=  S_max,h

    Heads with bound_h > tau get :func:`max_scaled_logits` (``tau=-inf``: every head exact). ``select`` (default: on
    the CPU) computes only those heads, which needs their indices on the host; otherwise (a GPU: no host sync) every
    head's, returning ``where(bound > tau, exact, bound)``: the same values. q: (B, H, N, D), k: (B, H, M, D);
    ``keep`` (broadcastable to (B, H, N, M); a position counts where any head keeps it) and ``causal`` as
    :func:`max_scaled_logits`; ``query_padding`` (B, M) bool, True at real tokens, the queries being the last N:
    padded queries (and keys, when M = N) are out of the bound and the maximum. Returns (H,) float32.
    """
    if select is None:  # torch.compile: the dense path, one graph (selecting needs a data-dependent shape)
        select = q.device.type == "cpu" and not torch.compiler.is_compiling()
    if keep is not None:
        keep = keep.reshape((1,) * (4 - keep.ndim) + keep.shape)
        keep = keep.any(dim=1, keepdim=True) if keep.shape[1] > 1 else keep  # never too low a maximum
    qb, kb = q, k
    if query_padding is not None:
        real = query_padding[:, None, -q.shape[-2]:, None]
        qb, kb = q * real, k * real if k.shape[-2] == q.shape[-2] else k
        keep = None if keep is None else keep & real  # the keep map opens padded queries' rows: closed here
    bound = (_max_norms(qb) * _max_norms(kb)).amax(dim=0) * (scale * (1 + BOUND_MARGIN))
    over = bound > tau
    if not select:
        return torch.where(over, max_scaled_logits(q, k, scale, keep=keep, causal=causal), bound)
    heads = over.nonzero().flatten()
    if heads.numel() == 0:
        return bound
    return bound.index_put((heads,), max_scaled_logits(q, k, scale, heads=heads, keep=keep, causal=causal))


__all__ = ["BOUND_MARGIN", "CHUNK_ELEMENTS", "max_scaled_logits", "screened_max_logits"]
