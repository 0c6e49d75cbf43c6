"""DnA's two branches in one Triton kernel for CUDA, forward only (opt-in: ``ATTNLAB_DNA_TRITON=1``).

    o = softmax(scale_pos q+ k^T) v+ + alpha_h * softmax(-scale_neg q- k^T) v-

(papers/dna_denoising_attention.txt, Sec. 3.2) as one flash-style pass: each program takes BLOCK_M query rows of one
(batch, head), walks the keys in tiles of BLOCK_N, and keeps an online softmax (running maximum, running sum,
rescaled accumulator) for each branch. Both branches read each K tile once, the softmin branch needs no negated
copy of Q-, and alpha_h is applied when the two accumulators are combined, so there is no separate combine pass.
The output is written in the (B, N, H, D) layout head merge reads. Two SDPA calls, which this replaces, measure
0.76x standard ViT-B/16 throughput on an H200 (REFERENCES.md); whether this kernel does better has NOT been
measured: no GPU was lent to the task that wrote it. It is tested for correctness under Triton's interpreter on
the CPU (``TRITON_INTERPRET=1``, tests/ops/test_dna_triton.py), hence opt-in until a GPU run decides.

No attention bias or mask (ViT global attention; Swin windows and masks use SDPA), no dropout, no gradient; head
dim a power of two >= 16; fp16, bf16 or fp32 (fp32 products may use TF32 on the GPU).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["dna_attention_triton", "triton_error"]

_LOG2E = 1.4426950408889634


def enabled() -> bool:
    return os.environ.get("ATTNLAB_DNA_TRITON", "0") == "1"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _kernel():
    """The jitted kernel, defined on first use (so ``TRITON_INTERPRET`` is read then); None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def dna_fwd(qp, qn, k, vp, vn, out, alpha,
                sqp_b, sqp_h, sqp_n, sqn_b, sqn_h, sqn_n, sk_b, sk_h, sk_n,
                svp_b, svp_h, svp_n, svn_b, svn_h, svn_n, so_b, so_h, so_n,
                H, N, M, scale_pos, scale_neg,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # scale_pos, scale_neg: the branches' logit factors in log2 units (scale_neg < 0: the softmin branch)
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, D)
        row_ok = rows < N
        q_pos = tl.load(qp + b * sqp_b + h * sqp_h + rows[:, None] * sqp_n + cols[None, :], mask=row_ok[:, None],
                        other=0.0)
        q_neg = tl.load(qn + b * sqn_b + h * sqn_h + rows[:, None] * sqn_n + cols[None, :], mask=row_ok[:, None],
                        other=0.0)
        m_pos = tl.full([BLOCK_M], float("-inf"), tl.float32)
        m_neg = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_pos = tl.zeros([BLOCK_M], tl.float32)
        l_neg = tl.zeros([BLOCK_M], tl.float32)
        acc_pos = tl.zeros([BLOCK_M, D], tl.float32)
        acc_neg = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(0, M, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < M
            kt = tl.load(k + b * sk_b + h * sk_h + keys[None, :] * sk_n + cols[:, None], mask=key_ok[None, :],
                         other=0.0)  # (D, BLOCK_N)
            s_pos = tl.where(key_ok[None, :], tl.dot(q_pos, kt) * scale_pos, float("-inf"))
            s_neg = tl.where(key_ok[None, :], tl.dot(q_neg, kt) * scale_neg, float("-inf"))
            v_pos = tl.load(vp + b * svp_b + h * svp_h + keys[:, None] * svp_n + cols[None, :], mask=key_ok[:, None],
                            other=0.0)
            v_neg = tl.load(vn + b * svn_b + h * svn_h + keys[:, None] * svn_n + cols[None, :], mask=key_ok[:, None],
                            other=0.0)
            # online softmax per branch: rescale what was summed under the old maximum
            new_pos = tl.maximum(m_pos, tl.max(s_pos, 1))
            new_neg = tl.maximum(m_neg, tl.max(s_neg, 1))
            p_pos = tl.exp2(s_pos - new_pos[:, None])
            p_neg = tl.exp2(s_neg - new_neg[:, None])
            r_pos = tl.exp2(m_pos - new_pos)
            r_neg = tl.exp2(m_neg - new_neg)
            l_pos = l_pos * r_pos + tl.sum(p_pos, 1)
            l_neg = l_neg * r_neg + tl.sum(p_neg, 1)
            acc_pos = acc_pos * r_pos[:, None] + tl.dot(p_pos.to(v_pos.dtype), v_pos)
            acc_neg = acc_neg * r_neg[:, None] + tl.dot(p_neg.to(v_neg.dtype), v_neg)
            m_pos = new_pos
            m_neg = new_neg
        a = tl.load(alpha + h)
        o = acc_pos / l_pos[:, None] + (a / l_neg)[:, None] * acc_neg
        tl.store(out + b * so_b + h * so_h + rows[:, None] * so_n + cols[None, :], o.to(out.dtype.element_ty),
                 mask=row_ok[:, None])

    return dna_fwd


def triton_error(q: torch.Tensor, k: torch.Tensor, *others: torch.Tensor | None, bias: bool = False) -> str | None:
    """Why :func:`dna_attention_triton` cannot run on these (B, H, N, D) queries / (B, H, M, D) keys (and the call's
    other tensors), or None when it can. ``bias``: the call has an attention bias or mask."""
    if not enabled():
        return "the Triton DnA kernel is opt-in (ATTNLAB_DNA_TRITON=1)"
    tensors = [t for t in (q, k, *others) if t is not None]
    if any(t.device.type != "cuda" for t in tensors) and not _interpreting():
        return "the Triton DnA kernel runs on CUDA"
    if bias:
        return "the Triton DnA kernel takes no attention bias or mask"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "the Triton DnA kernel is forward-only; this call needs a gradient"
    if torch.compiler.is_compiling():
        return "the Triton DnA kernel is not traced by torch.compile"
    if q.ndim != 4 or k.ndim != 4:
        return "the Triton DnA kernel takes (B, H, N, D) tensors"
    D = q.shape[-1]
    if D < 16 or D & (D - 1):
        return f"the Triton DnA kernel takes a power-of-two head dim >= 16, got {D}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or any(t.dtype != q.dtype for t in (q, k, *others)
                                                                              if t is not None and t.ndim == 4):
        return "the Triton DnA kernel takes q, k, v of one dtype: fp16, bf16 or fp32"
    if _kernel() is None:
        return "Triton is not installed"
    return None


def dna_attention_triton(q_pos: torch.Tensor, q_neg: torch.Tensor, k: torch.Tensor, v_pos: torch.Tensor,
                         v_neg: torch.Tensor, alpha: torch.Tensor | None, *, scale_pos: float, scale_neg: float,
                         block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """softmax(scale_pos q+ k^T) v+ + alpha_h softmin(scale_neg q- k^T) v-, (B, H, N, D), a view of a (B, N, H, D)
    buffer; q_*: (B, H, N, D), k and v_*: (B, H, M, D) with unit feature stride (a projection's views are), alpha
    (H,) or None (= 1). The caller has checked :func:`triton_error`."""
    B, H, N, D = q_pos.shape
    M = k.shape[-2]
    ts = [t if t.stride(-1) == 1 else t.contiguous() for t in (q_pos, q_neg, k, v_pos, v_neg)]
    out = torch.empty(B, N, H, D, dtype=q_pos.dtype, device=q_pos.device).transpose(1, 2)
    alpha = (torch.ones(H, device=q_pos.device) if alpha is None else alpha.detach()).float().contiguous()
    strides = [s for t in (*ts, out) for s in t.stride()[:3]]
    grid = (-(-N // block_m), B * H)
    _kernel()[grid](*ts, out, alpha, *strides, H, N, M, scale_pos * _LOG2E, -scale_neg * _LOG2E,
                    D=D, BLOCK_M=block_m, BLOCK_N=block_n)
    return out
