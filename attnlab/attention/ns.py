"""NS-Attn ("NS-Attention: Newton–Schulz Transformations of Attention Outputs in Vision
Transformers", Section 2, Algorithm 1): a Newton–Schulz polynomial step on each head's
feature-by-token output, after value aggregation and before head merge.

    M = X_{b,h}^T (D x N),  r = ||M||_F,  Z = M / max(r, eps)              (eq. 1-2)
    Z <- a Z + (b A + c A^2) Z,  A = Z Z^T,  `steps` times                 (eq. 3)
    X_hat_{b,h} = (r Z / max(||Z||_F, eps))^T                              (eq. 4-5)

A ``head`` term: it composes after any kernel (``ns``, ``dna+ns``) and adds no parameters, so an ``ns`` model loads
a ``standard`` model's state dict. The math lives in :func:`attnlab.ops.ns_transform`. The transform mixes all N
tokens of a head, so causal and caller masks are refused (its record); padded tokens' rows are zero before it, so
they add nothing to the norm or the Gram and real tokens' outputs do not depend on them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import ns_cpu
from ..ops.ns import IMPLEMENTATIONS, NS_COEFFS, NS_EPS, check_ns_options
from .base import Call, Want
from .capabilities import Capabilities, Declares


class NSTransform(Declares, nn.Module):
    """Applies :func:`attnlab.ops.ns_transform` to head outputs of shape (B, H, N, D).

    Args:
        steps: polynomial iterations K (paper: 1; 2 in the ablation of Table 2).
        eps: clamp of both Frobenius-norm divisions (paper: 1e-6).
        backend: ``auto`` (the dispatcher, :meth:`choose`: the fused CPU kernel where :meth:`supports` lets it
            run, else ``fast``), ``fast`` (the Gram-space formulation in torch ops), ``kernel`` (always the fused
            kernel; an error where it cannot run) or ``reference`` (Algorithm 1 literally). See
            :func:`attnlab.ops.ns_transform`.
    """

    #: Swin's window mask is the model's own geometry and is kept; tokens mix, so no KV cache
    capabilities = Capabilities(
        causal="ns cannot honour a causal mask: its transform mixes all N tokens of a head (the Frobenius norm and the "
               "Gram product run over every token), so token i's output depends on later tokens",
        attn_mask="ns cannot honour this attention mask: its transform mixes the outputs of all N tokens of a head, so "
                  "tokens the mask hides from each other meet there; pass padding as key_padding (an AttentionMask), "
                  "whose tokens it leaves out", backends=("kernel", "fast", "reference"))

    def __init__(self, steps: int = 1, eps: float = NS_EPS, backend: str = "auto",
                 coeffs: tuple[float, float, float] = NS_COEFFS) -> None:
        super().__init__()
        self.steps, self.eps, self.coeffs = steps, eps, tuple(coeffs)
        check_ns_options(steps, eps, self.coeffs, backend)  # reject bad options at conversion
        self.use_backend(backend)

    def supports(self, backend: str, call: Call) -> str | None:
        """The torch formulations transform every call; the fused kernel a CPU forward without gradient on head
        matrices it has an instance for (:func:`attnlab.ops.ns_cpu.call_error`)."""
        if backend != "kernel":
            return None
        return ns_cpu.call_error(cpu=call.device.type == "cpu", dtype=call.dtype, needs_grad=call.needs_grad,
                                 N=call.queries, D=call.head_dim)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o: (B, H, N, D) head outputs -> T(o), on the backend :meth:`choose` picks for the call."""
        needs_grad = torch.is_grad_enabled() and o.requires_grad
        call = Call(o.device, o.dtype, needs_grad, self.training, False, False, o.shape[-1], math.prod(o.shape[:-2]),
                    o.shape[-2], o.shape[-2], o.stride(-2), Want(), torch.compiler.is_compiling())
        return IMPLEMENTATIONS[self.choose(call)](o, self.steps, float(self.eps), self.coeffs)

    def extra_repr(self) -> str:
        return f"steps={self.steps}, eps={self.eps:g}, backend={self.backend}"
