"""Newton–Schulz transformation of attention head outputs (NS-Attn: "Newton–Schulz Transformations of
Attention Outputs in Vision Transformers", Sec. 2).

For one head, the output X (N tokens x D features) is read as the feature-by-token matrix M = X^T (eq. 1) and

    r = ||M||_F,  Z = M / max(r, eps)                      (eq. 2)
    K times:  A = Z Z^T,  Z <- a Z + (b A + c A^2) Z         (eq. 3, Algorithm 1 lines 10-13)
    T(M) = r Z / max(||Z||_F, eps)                           (eq. 4)

and T(M)^T is returned in the input's layout (eq. 5). One step maps every singular value t of the normalised
matrix to p(t) = a t + b t^3 + c t^5 and keeps the singular vectors.

Three implementations sit side by side:

- ``impl="reference"``: Algorithm 1 literally, batched over the leading dims, in M (D x N) layout.
- ``impl="fast"`` (what ``"auto"`` picks when a gradient is needed, under ``torch.compile`` and off the CPU): the
  same function in the smaller Gram space (D x D, or N x N when N < D). With s = max(r, eps) and A = X^T X / s^2,
  a step is Z <- Z P with P = a I + b A + c A^2, a polynomial in A, so steps accumulate into one small P_K and
  the output is X @ (P_K * r / (s * max(||Z_K||_F, eps))) with no branch on tensor values. Z is re-formed every
  two steps, because float32 rounding in the polynomial grows about 12x per step. The derivation, its rounding
  and the accuracy table: docs/methods.md, "The fast formulation".
- ``impl="kernel"`` (what ``"auto"`` picks for CPU forward passes without gradient): the fast path's algebra as
  one fused C loop per head matrix (``ns_kernel.c``, built on first use by :mod:`attnlab.ops.ns_cpu`). It reads
  the attention kernel's strided output in place and writes with the same strides, so neither the dense copy in
  nor the transposing copy at head merge happens.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from attnlab.errors import ConfigError
from attnlab.ops.ns_cpu import kernel_error, ns_kernel

__all__ = ["IMPLEMENTATIONS", "NS_COEFFS", "NS_EPS", "check_ns_options", "ns_transform"]

# Muon's quintic (a, b, c) and the paper's clamp (eq. 2-4).
NS_COEFFS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
NS_EPS: float = 1e-6

_IMPLS = ("auto", "fast", "kernel", "reference")
_HALF = (torch.float16, torch.bfloat16)
# Polynomial steps per Gram-space block (fast path; NS_BLOCK in ns_kernel.c): Z is re-formed between blocks
# because float32 rounding in a block's polynomial grows about 12x per step (docs/perf.md has the measurements).
_BLOCK = 2


def ns_transform(
    x: torch.Tensor,
    steps: int = 1,
    eps: float = NS_EPS,
    coeffs: tuple[float, float, float] = NS_COEFFS,
    impl: str = "auto",
) -> torch.Tensor:
    """NS-Attn's transformation T of every head output (Algorithm 1 with K = ``steps``).

    Each trailing (N, D) matrix X of ``x`` is transformed as M = X^T (D x N):
    r = ||M||_F, Z = M / max(r, eps); ``steps`` times A = Z Z^T, Z <- a Z + (b A + c A^2) Z;
    result (r Z / max(||Z||_F, eps))^T. Matrices are independent (no mixing across heads or samples).

    Args:
        x: head outputs, shape (..., N, D), e.g. (B, H, N, D_h); any floating dtype.
        steps: number of polynomial iterations K >= 1 (paper: 1 main, 2 in the ablation).
        eps: clamp of both Frobenius-norm divisions (eq. 2 and 4); the paper's 1e-6.
        coeffs: (a, b, c) of the polynomial step (eq. 3); Muon's quintic by default.
        impl: ``"fast"`` (the Gram-space formulation in torch ops), ``"kernel"`` (the same algebra as one fused
            CPU kernel, forward only, see :mod:`attnlab.ops.ns_cpu`), ``"reference"`` (Algorithm 1 literally) or
            ``"auto"``: the kernel where it applies (CPU, float32/64/16, no gradient needed, not being compiled),
            else fast.

    Returns:
        Tensor of ``x``'s shape and dtype. bf16 / fp16 inputs are computed in float32 (autocast is
        switched off inside so the polynomial never runs in half precision) and cast back; float64 stays
        float64. When neither clamp triggers, each output matrix has its input's Frobenius norm; a zero
        matrix maps to zeros (and zero gradient), never NaN.
    """
    check_ns_options(steps, eps, coeffs, impl)
    if x.ndim < 2 or not x.is_floating_point():
        raise ConfigError(
            f"ns_transform expects a floating tensor of shape (..., N, D), got {tuple(x.shape)} {x.dtype}."
        )

    if impl == "auto":  # a direct call's default; a model's head transform asks its dispatcher (NSTransform.choose)
        impl = "fast" if kernel_error(x.float() if x.dtype in _HALF else x) else "kernel"
    return IMPLEMENTATIONS[impl](x, steps, float(eps), tuple(float(v) for v in coeffs))


def _kernel(x: torch.Tensor, steps: int, eps: float, coeffs: tuple[float, float, float]) -> torch.Tensor:
    """The fused CPU kernel on x (half precision in float32; a dense view keeps its strides)."""
    work = x.float() if x.dtype in _HALF else x
    reason = kernel_error(work)
    if reason is not None:
        raise ConfigError(f"ns_transform impl='kernel' is not available here: {reason}.")
    return ns_kernel(work, steps, eps, coeffs).to(x.dtype)


def _torch(fn):
    """``fn`` (the fast or the reference formulation) on a dense float32 (or float64) copy, autocast off."""
    def run(x: torch.Tensor, steps: int, eps: float, coeffs: tuple[float, float, float]) -> torch.Tensor:
        # One dense copy up front: attention kernels return (B, H, N, D) as a strided view of (B, N, H, D), and
        # batched matmuls on such views copy their operands at every product instead of once.
        work = (x.float() if x.dtype in _HALF else x).contiguous()
        device = x.device.type  # meta tensors have no autocast to switch off
        with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext():
            return fn(work, steps, eps, coeffs).to(x.dtype)
    return run


def check_ns_options(steps: int, eps: float, coeffs: tuple[float, float, float], impl: str) -> None:
    """Raise :class:`ConfigError` for options :func:`ns_transform` does not take (used at model conversion)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"ns_transform steps must be an integer >= 1 (the paper uses 1 or 2), got {steps!r}.")
    if not eps > 0:
        raise ConfigError(f"ns_transform eps must be a positive number (the paper uses 1e-6), got {eps!r}.")
    if len(coeffs) != 3:
        raise ConfigError(f"ns_transform coeffs must be three numbers (a, b, c), got {coeffs!r}.")
    if impl not in _IMPLS:
        raise ConfigError(f"ns_transform impl must be one of {', '.join(_IMPLS)}, got {impl!r}.")


def _ns_reference(x: torch.Tensor, steps: int, eps: float, coeffs: tuple[float, float, float]) -> torch.Tensor:
    """Algorithm 1, batched: every line acts on all (..., D, N) feature-view matrices at once."""
    a, b, c = coeffs
    m = x.mT  # line 7: M = X^T, (..., D, N)
    r = torch.linalg.matrix_norm(m, keepdim=True)  # line 8
    z = m / r.clamp_min(eps)  # line 9
    for _ in range(steps):  # lines 10-13
        gram = z @ z.mT
        z = a * z + (b * gram + c * (gram @ gram)) @ z
    m_hat = r * z / torch.linalg.matrix_norm(z, keepdim=True).clamp_min(eps)  # line 14
    return m_hat.mT  # line 15


class _Gram(torch.autograd.Function):
    """G = X^T X (``features=True``) or X X^T, with the backward X (g + g^T) or (g + g^T) X as ONE matmul.

    Autograd would differentiate the two operands separately (two matmuls over X and a full-size add);
    G's symmetry halves that. The backward is written in differentiable ops, so double backward still works.
    """

    @staticmethod
    def forward(x: torch.Tensor, features: bool) -> torch.Tensor:
        return x.mT @ x if features else x @ x.mT

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.features = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        sym = grad + grad.mT
        return (x @ sym if ctx.features else sym @ x), None


def _ns_fast(x: torch.Tensor, steps: int, eps: float, coeffs: tuple[float, float, float]) -> torch.Tensor:
    """The same map in the smaller Gram space, re-forming Z every ``_BLOCK`` steps (module docstring)."""
    # Work in the smaller of the two Gram spaces (a shape test, not a value test, so it compiles to one graph):
    # Z f(Z^T Z) = f(Z Z^T) Z for any polynomial f, so tokens x tokens works as well as features x features.
    features = x.shape[-1] <= x.shape[-2]
    gram = _Gram.apply(x, features)  # (..., n, n), n = min(N, D)
    # r^2 = tr(G): the same sum of squares as ||X||_F^2 (non-negative terms, no cancellation) without another
    # pass over X. The double where keeps d sqrt(r^2) finite at a zero matrix (0 * inf would give NaN).
    r_sq = gram.diagonal(dim1=-2, dim2=-1).sum(dim=-1)[..., None, None]
    r = torch.where(r_sq > 0, r_sq.clamp_min(torch.finfo(x.dtype).tiny).sqrt(), 0.0)
    s = r.clamp_min(eps)
    lead, n = gram.shape[:-2], gram.shape[-1]
    # batched 3-D views so that baddbmm / bmm fuse the polynomial's products with its sums: on small
    # matrices (Swin: 16 x 32 per window and head) each separate elementwise pass costs as much as a product
    gram = (gram / (s * s)).reshape(-1, n, n)  # A: the Gram of Z = X / s (eq. 2)
    eye = torch.eye(n, dtype=x.dtype, device=x.device)
    z, z_div = x, s  # Z = z / z_div: X / s until Z is first re-formed
    for done in range(0, steps, _BLOCK):
        p_total, p_sq = _gram_steps(gram, min(_BLOCK, steps - done), coeffs, eye)
        if done + _BLOCK >= steps:
            break
        # re-form Z = Z P from the current Z and take its Gram afresh (the polynomial's rounding stays bounded)
        q = (p_total / z_div.reshape(-1, 1, 1)).reshape(*lead, n, n)
        z = z @ q if features else q @ z
        z_div = torch.ones_like(s)
        gram = _Gram.apply(z, features).reshape(-1, n, n)
    # ||Z_K||_F^2 = tr(A P^2) = sum(A * P^2) (both symmetric), as one batched dot product; sqrt(clamp_min(.,
    # eps^2)) is max(||Z_K||_F, eps) (eq. 4) with a finite gradient at 0.
    z_sq = torch.bmm(gram.reshape(-1, 1, n * n), p_sq.reshape(-1, n * n, 1))
    z_norm = z_sq.clamp_min(eps * eps).sqrt()
    # fold eq. 4's scalar into the small matrix, not the output
    q = (p_total * (r.reshape(-1, 1, 1) / (z_div.reshape(-1, 1, 1) * z_norm))).reshape(*lead, n, n)
    return z @ q if features else q @ z


def _gram_steps(gram: torch.Tensor, steps: int, coeffs: tuple[float, float, float], eye: torch.Tensor):
    """(P, P^2) for ``steps`` polynomial steps (eq. 3) on a Z whose Gram is ``gram`` (batched, (m, n, n)): Z's
    Gram after the steps is gram @ P^2. P is a polynomial in ``gram``, so every product here commutes."""
    a, b, c = coeffs
    gram0, p_total = gram, None
    for k in range(steps):
        p = torch.baddbmm(torch.add(a * eye, gram, alpha=b), gram, gram, alpha=c)  # aI + bA + cA^2
        p_total = p if p_total is None else p @ p_total
        p_sq = p_total @ p_total
        if k + 1 < steps:
            gram = gram0 @ p_sq  # Gram after k + 1 steps: P A P = A P^2
    return p_total, p_sq


#: the implementations by name (``impl`` of :func:`ns_transform`; the backends of the ``ns`` head transform)
IMPLEMENTATIONS = {"kernel": _kernel, "fast": _torch(_ns_fast), "reference": _torch(_ns_reference)}
