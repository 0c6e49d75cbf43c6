"""DnA's two branches in one Triton kernel for CUDA, forward only (opt-in: ``ATTNLAB_DNA_TRITON=1``).

    o = softmax(scale_pos q+ k^T) v+ + alpha_h * softmin(scale_neg q- k^T) v-

("DnA: Denoising Attention for Visual Tasks", Sec. 3.2 and Algorithm 1, line 13) as one flash-style pass: each
program takes BLOCK_M query rows of one (batch, head), walks the keys in tiles of BLOCK_N, and keeps an online
softmax (running maximum, running sum, rescaled accumulator) for each branch. Both branches read each K tile once,
the softmin branch needs no negated copy of Q-, and alpha_h is applied when the two accumulators are combined, so
there is no separate combine pass. The output is written in the (B, N, H, D) layout head merge reads.

Launch: one grid axis of B * H * ceil(N / BLOCK_M) programs (only that axis allows 2^31 - 1), slice starts in 64
bits, in-tile offsets in 32; tiles from Triton's autotuning over :data:`TILES`, pruned by :func:`prune_configs`.
The custom op ``torch.ops.attnlab.dna_attention_triton`` has a fake implementation and a FLOP formula; it is tested
under Triton's CPU interpreter and opt-in until a GPU measurement decides (docs/methods.md, "DnA", has the design
and docs/perf.md the measurements).

No attention bias or mask (ViT global attention; Swin windows and masks use SDPA), no dropout, no gradient; head
dim a power of two >= 16; fp16, bf16 or fp32 (fp32 products may use TF32 on the GPU).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_flop_count

__all__ = ["TILES", "call_error", "dna_attention_triton", "grid_size", "prune_configs", "triton_error", "warps_for"]

_LOG2E = 1.4426950408889634
_HAVE_TRITON = importlib.util.find_spec("triton") is not None

# (BLOCK_M, BLOCK_N) candidates for the autotuner; prune_configs keeps those that fit a call's N, M and D
TILES = ((16, 16), (16, 32), (32, 32), (32, 64), (64, 32), (64, 64), (128, 64))
_MAX_PAD = 2.0  # a tile may compute at most this multiple of the tightest candidate's padded N x M work
GRID_X_MAX = 2**31 - 1  # CUDA's limit on gridDim.x (y and z: 65,535)
_INT32_MAX = 2**31 - 1


def enabled() -> bool:
    return os.environ.get("ATTNLAB_DNA_TRITON", "0") == "1"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def warps_for(block_m: int, block_n: int, d: int) -> int:
    """Warps per program: 8 where 4 would hold 128 or more 32-bit registers per thread of live tiles (two fp32
    accumulators and two 16-bit query tiles of BLOCK_M x D, two fp32 score tiles of BLOCK_M x BLOCK_N), as at head
    dim 64 from 64-row tiles on, where 4 warps spill; else 4. An estimate: the GPU measurement is pending."""
    live = 3 * block_m * d + 2 * block_m * block_n
    return 8 if live >= 128 * 4 * 32 else 4


def _pad(n: int, block: int) -> int:
    return -(-n // block) * block


def prune_configs(configs, named_args, **kwargs):
    """The autotuner's early prune: for this call's N, M and D, keep each tile whose padded work
    ceil(N / BLOCK_M) BLOCK_M x ceil(M / BLOCK_N) BLOCK_N is within _MAX_PAD of the tightest candidate's (65 tokens
    in 64 x 64 tiles compute 3.9x the useful work), with the warps :func:`warps_for` gives it."""
    args = {**named_args, **kwargs}
    N, M, D = int(args["N"]), int(args["M"]), int(args["D"])
    work = {c: _pad(N, c.kwargs["BLOCK_M"]) * _pad(M, c.kwargs["BLOCK_N"]) for c in configs}
    best = min(work.values())
    return [c for c in configs if work[c] <= _MAX_PAD * best
            and c.num_warps == warps_for(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], D)]


def grid_size(batch_heads: int, n: int, block_m: int) -> tuple[int]:
    """The launch grid: one axis of batch_heads * ceil(n / block_m) programs (the kernel unfolds the program id
    into (batch, head, query tile)), so only the first axis's 2^31 - 1 limit applies."""
    return (batch_heads * -(-n // block_m),)


def _interpreter_bench(kernel_call, quantiles):
    # the interpreter has no timer worth reading: run each candidate once (so each is exercised), keep the first
    kernel_call()
    return [1.0 for _ in quantiles]


@functools.cache
def _kernels():
    """(plain kernel, autotuned kernel), defined on first use (so ``TRITON_INTERPRET`` is read then); None without
    Triton."""
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
        tiles_m = tl.cdiv(N, BLOCK_M)
        pid = tl.program_id(0)
        bh = pid // tiles_m  # query tiles of one head are neighbours: they share its K and V in L2
        # slice and row starts in 64 bits (b * s_b alone passes 2^31 in a large batch); in-tile offsets 32-bit
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        row0 = ((pid % tiles_m) * BLOCK_M).to(tl.int64)
        rows = tl.arange(0, BLOCK_M)
        keys = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, D)
        row_ok = rows < N - row0
        qp += b * sqp_b + h * sqp_h + row0 * sqp_n
        qn += b * sqn_b + h * sqn_h + row0 * sqn_n
        k += b * sk_b + h * sk_h
        vp += b * svp_b + h * svp_h
        vn += b * svn_b + h * svn_h
        out += b * so_b + h * so_h + row0 * so_n
        q_pos = tl.load(qp + rows[:, None] * sqp_n + cols[None, :], mask=row_ok[:, None], other=0.0)
        q_neg = tl.load(qn + rows[:, None] * sqn_n + cols[None, :], mask=row_ok[:, None], other=0.0)
        m_pos = tl.full([BLOCK_M], float("-inf"), tl.float32)
        m_neg = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_pos = tl.zeros([BLOCK_M], tl.float32)
        l_neg = tl.zeros([BLOCK_M], tl.float32)
        acc_pos = tl.zeros([BLOCK_M, D], tl.float32)
        acc_neg = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(0, M, BLOCK_N):
            key_ok = start + keys < M
            kt = tl.load(k + keys[None, :] * sk_n + cols[:, None], mask=key_ok[None, :], other=0.0)  # (D, BLOCK_N)
            s_pos = tl.where(key_ok[None, :], tl.dot(q_pos, kt) * scale_pos, float("-inf"))
            s_neg = tl.where(key_ok[None, :], tl.dot(q_neg, kt) * scale_neg, float("-inf"))
            v_pos = tl.load(vp + keys[:, None] * svp_n + cols[None, :], mask=key_ok[:, None], other=0.0)
            v_neg = tl.load(vn + keys[:, None] * svn_n + cols[None, :], mask=key_ok[:, None], other=0.0)
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
            k += BLOCK_N * sk_n  # pointer arithmetic: 64-bit
            vp += BLOCK_N * svp_n
            vn += BLOCK_N * svn_n
        a = tl.load(alpha + h)
        o = acc_pos / l_pos[:, None] + (a / l_neg)[:, None] * acc_neg
        tl.store(out + rows[:, None] * so_n + cols[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])

    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w) for bm, bn in TILES for w in (4, 8)]
    tuned = triton.autotune(configs, key=["N", "M", "D"], prune_configs_by={"early_config_prune": prune_configs},
                            do_bench=_interpreter_bench if _interpreting() else None)(dna_fwd)
    return dna_fwd, tuned


def triton_error(q: torch.Tensor, k: torch.Tensor, *others: torch.Tensor | None, bias: bool = False) -> str | None:
    """Why :func:`dna_attention_triton` cannot run on these (B, H, N, D) queries / (B, H, M, D) keys (and the call's
    other tensors), or None when it can. ``bias``: the call has an attention bias or mask."""
    tensors = [t for t in (q, k, *others) if t is not None]
    if q.ndim != 4 or k.ndim != 4:
        return "the Triton DnA kernel takes (B, H, N, D) tensors"
    same = q.dtype in (torch.float16, torch.bfloat16, torch.float32) and all(t.dtype == q.dtype for t in tensors
                                                                             if t.ndim == 4)
    return call_error(cuda=all(t.device.type == "cuda" for t in tensors), dtype_ok=same, bias=bias,
                      needs_grad=torch.is_grad_enabled() and any(t.requires_grad for t in tensors),
                      head_dim=q.shape[-1], batch_heads=q.shape[0] * q.shape[1], queries=q.shape[2],
                      row_stride=max(t.stride(-2) for t in tensors if t.ndim == 4))


def call_error(*, cuda: bool, dtype_ok: bool, bias: bool, needs_grad: bool, head_dim: int, batch_heads: int,
               queries: int, row_stride: int) -> str | None:
    """Why the Triton kernel cannot run a call with these properties (decidable before the projection), or None.
    ``dtype_ok``: q, k, v share one of fp16, bf16, fp32; ``row_stride``: the largest token stride of q, k, v."""
    if not enabled():
        return "the Triton DnA kernel is opt-in (ATTNLAB_DNA_TRITON=1)"
    if not cuda and not _interpreting():
        return "the Triton DnA kernel runs on CUDA"
    if bias:
        return "the Triton DnA kernel takes no attention bias or mask"
    if needs_grad:
        return "the Triton DnA kernel is forward-only; this call needs a gradient"
    D = head_dim
    if D < 16 or D & (D - 1):
        return f"the Triton DnA kernel takes a power-of-two head dim >= 16, got {D}"
    if not dtype_ok:
        return "the Triton DnA kernel takes q, k, v of one dtype: fp16, bf16 or fp32"
    if grid_size(batch_heads, queries, min(bm for bm, _ in TILES))[0] > GRID_X_MAX:
        return "the Triton DnA kernel's grid would pass CUDA's 2^31 - 1 programs"
    if max(TILES)[0] * row_stride + head_dim > _INT32_MAX:
        return "the Triton DnA kernel takes row strides below 2^24 elements (its in-tile offsets are 32-bit)"
    if not _HAVE_TRITON:
        return "Triton is not installed"
    return None


def dna_attention_triton(q_pos: torch.Tensor, q_neg: torch.Tensor, k: torch.Tensor, v_pos: torch.Tensor,
                         v_neg: torch.Tensor, alpha: torch.Tensor | None, *, scale_pos: float, scale_neg: float,
                         block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """softmax(scale_pos q+ k^T) v+ + alpha_h softmin(scale_neg q- k^T) v-, (B, H, N, D), a view of a (B, N, H, D)
    buffer; q_*: (B, H, N, D), k and v_*: (B, H, M, D), alpha (H,) or None (= 1). ``block_m``, ``block_n``: fixed
    tiles (both or neither; powers of two >= 16), else the autotuner picks from :data:`TILES`. The caller has
    checked :func:`triton_error`."""
    return torch.ops.attnlab.dna_attention_triton(q_pos, q_neg, k, v_pos, v_neg, alpha, scale_pos, scale_neg,
                                                  block_m or 0, block_n or 0)


@torch.library.custom_op("attnlab::dna_attention_triton", mutates_args=())
def _dna_op(q_pos: torch.Tensor, q_neg: torch.Tensor, k: torch.Tensor, v_pos: torch.Tensor, v_neg: torch.Tensor,
            alpha: Optional[torch.Tensor], scale_pos: float, scale_neg: float, block_m: int,
            block_n: int) -> torch.Tensor:
    plain, tuned = _kernels()
    B, H, N, D = q_pos.shape
    M = k.shape[-2]
    ts = [t if t.stride(-1) == 1 else t.contiguous() for t in (q_pos, q_neg, k, v_pos, v_neg)]
    out = torch.empty(B, N, H, D, dtype=q_pos.dtype, device=q_pos.device).transpose(1, 2)
    alpha = (torch.ones(H, device=q_pos.device) if alpha is None else alpha.detach()).float().contiguous()
    args = (*ts, out, alpha, *(s for t in (*ts, out) for s in t.stride()[:3]), H, N, M,
            scale_pos * _LOG2E, -scale_neg * _LOG2E)
    if block_m:
        plain[grid_size(B * H, N, block_m)](*args, D=D, BLOCK_M=block_m, BLOCK_N=block_n,
                                            num_warps=warps_for(block_m, block_n, D))
    else:
        tuned[lambda meta: grid_size(B * H, N, meta["BLOCK_M"])](*args, D=D)
    return out


@_dna_op.register_fake
def _(q_pos, q_neg, k, v_pos, v_neg, alpha, scale_pos, scale_neg, block_m, block_n):
    B, H, N, D = q_pos.shape
    return q_pos.new_empty(B, N, H, D).transpose(1, 2)


@register_flop_formula(torch.ops.attnlab.dna_attention_triton)
def _flops(q_shape, q_neg_shape, k_shape, v_pos_shape, *args, **kwargs) -> int:
    """The two SDPA calls the kernel replaces (each q k^T and weights @ v), so counts agree across backends."""
    return 2 * sdpa_flop_count(q_shape, k_shape, v_pos_shape)
