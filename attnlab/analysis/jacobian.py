"""Jacobian conditioning of self-attention (the spectral-conditioning paper's Figures 2-4, rightmost plots); weights,
masks and cost as docs/methods.md, "Jacobian conditioning instrument", says. For block l, head h and one input
sequence X (N, C) (a ViT image's tokens or one Swin window), W_Q, W_K, W_V (D, C) the head's rows of the effective
fused qkv weight (under ``sigma`` gamma W / sigma(W), under ``speccond`` W + lam I_k):

    O_h(W_Q, W_K, W_V) = softmax(q k^T / sqrt(D) + bias) v,   q = X W_Q^T + b_Q,  k = X W_K^T + b_K,  v = X W_V^T + b_V
    J = d vec(O_h) / d [vec(W_Q), vec(W_K), vec(W_V)]        (N * D rows, 3 * D * C columns; row-major vec)
    kappa(J) = sigma_max / sigma_min over its min(N * D, 3 * D * C) singular values

with key padding, only the n real tokens' outputs are rows of J (n * D rows). For every mechanism (XCiT's and
DaViT's channel attentions, Nyström and FAVOR+ alike) O_h is the module's own forward on the block's captured
input, read from its per-head output intermediate (:func:`head_function`). J comes from ``torch.func.jacrev``
(reverse mode: N * D outputs are fewer than 3 * D * C inputs), kappa from ``torch.linalg.svdvals``, in float64 by
default: the paper reports kappa up to 1e10, beyond float32's reach. Each J costs a backward through the block's
input and an (N D) x (3 D C) SVD: pass a few images and, if need be, a subset of blocks and heads.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call, jacrev

from ..attention.base import Want
from ..attention.capabilities import capabilities_of
from ..errors import ConfigError, UnsupportedModelError
from ..models import attention_modules
from .maps import eval_mode, forward_batches


def attention_jacobian(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                       head_fn: Callable[..., torch.Tensor], rows: torch.Tensor | None = None,
                       **kwargs) -> torch.Tensor:
    """J = d vec(O) / d [vec(W_Q), vec(W_K), vec(W_V)] of ``head_fn(x, w_q, w_k, w_v, **kwargs)`` (N, D), shape
    (N * D, 3 * D * C); ``rows`` (N,) bool keeps the outputs of those tokens only (the real ones of a padded
    sequence), (n * D, 3 * D * C)."""
    def f(wq, wk, wv):
        o = head_fn(x, wq, wk, wv, **kwargs)
        return o if rows is None else o[rows]

    parts = jacrev(f, argnums=(0, 1, 2))(w_q, w_k, w_v)  # each (N, D, D, C)
    return torch.cat([p.reshape(p.shape[0] * p.shape[1], -1) for p in parts], dim=1)


def condition_number(j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kappa, sigma_max, sigma_min) of a matrix over its min(m, n) singular values; kappa = inf when singular."""
    # same singular values; LAPACK's path for a wide matrix ran ~50x slower than for its tall transpose
    s = torch.linalg.svdvals(j if j.shape[0] >= j.shape[1] else j.mT.contiguous())
    return s[0] / s[-1], s[0], s[-1]


@dataclass
class JacobianConditioning:
    """Condition numbers of the attention Jacobian, indexed [block, head, sequence] (NaN where a block lacks a head).
    ``blocks`` are the attention modules' names, ``heads`` and ``sequences`` the indices measured (a sequence is an
    image for ViT, a window of the batch for Swin)."""

    kappa: torch.Tensor
    sigma_max: torch.Tensor
    sigma_min: torch.Tensor
    blocks: list[str]
    heads: list[int]
    sequences: list[int] = field(default_factory=list)

    def log10_mean(self) -> torch.Tensor:
        """Per block: the mean over heads and sequences of log10 kappa (the paper averages over heads and layers)."""
        return self.kappa.log10().nanmean(dim=(1, 2))

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "heads": self.heads, "sequences": self.sequences, "kappa": self.kappa.tolist(),
                "sigma_max": self.sigma_max.tolist(), "sigma_min": self.sigma_min.tolist()}


def head_function(module: nn.Module, head: int, mask=None, sequence: int | None = None,
                  dtype: torch.dtype | None = None) -> Callable[..., torch.Tensor]:
    """One head of ``module`` (an attention module, copied in ``dtype``: the Jacobian's) as a function of x (N, C)
    and that head's rows of the effective fused projection, weights (D, C) and biases (D,; one not given is zero): the
    module's own forward (explicit backend, ``mask`` its resolved :class:`~attnlab.attention.mask.Mask`) read from its
    per-head output intermediate (``Want(heads=True)``: padded queries' rows zeroed, the head transform applied). With
    ``sequence``, x is the batch (B, N, C) the mask was resolved for and that row of it is measured."""
    own = copy.deepcopy(module).to(dtype)  # its norms, kernel and head transform in the Jacobian's dtype
    weight = own.qkv.weight.detach()  # the effective weight (parametrisations applied)
    bias = None if own.qkv.bias is None else own.qkv.bias.detach()
    own.qkv = nn.Linear(own.dim, len(weight), bias=bias is not None)  # plain: the rows given are the effective ones
    own.use_backend("explicit")
    rows = torch.cat([torch.arange(r.start, r.stop) for r in head_rows(own, head)])  # the head's q, k, v rows
    seen = []
    own.observe(Want(heads=True), lambda mod, found: seen.append(found.heads))

    def f(x, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None):
        params = {"qkv.weight": weight.index_copy(0, rows, torch.cat([w_q, w_k, w_v]))}
        if bias is not None or b_q is not None:
            b_h = torch.cat([weight.new_zeros(len(w_q)) if b is None else b for b in (b_q, b_k, b_v)])
            params["qkv.bias"] = (weight.new_zeros(len(weight)) if bias is None else bias).index_copy(0, rows, b_h)
        functional_call(own, params, (x[None] if sequence is None else x,), {"attn_mask": mask})
        return seen.pop()[0 if sequence is None else sequence, head]
    return f


def head_rows(module: nn.Module, head: int) -> list[slice]:
    """The rows of ``head``'s query and of its key and value head (grouped-query attention) in the fused ``qkv``."""
    D, A, g = module.head_dim, module.attn_dim, head // (module.num_heads // module.num_kv_heads)
    return [slice(start, start + D) for start in (head * D, A + g * D, A + module.kv_dim + g * D)]


def jacobian_conditioning(model: nn.Module, images: torch.Tensor, *, blocks: Sequence[int] | None = None,
                          heads: Sequence[int] | None = None, sequences: Sequence[int] | None = None,
                          dtype: torch.dtype = torch.float64) -> JacobianConditioning:
    """Condition number of each attention head's Jacobian w.r.t. its W_Q, W_K, W_V at the inputs ``images`` (B, C,
    H, W) produce, every block's input captured by one eval-mode forward, for a model with softmax attention
    (``build_model(..., attn="standard" / "sigma" / ...)``). ``blocks``: the attention modules (indices in forward
    order) to measure, default all; ``heads``: default all of each block; ``sequences``: the rows of a block's input
    to measure (images for ViT, windows for Swin), default ``[0]``; ``dtype``: of the Jacobian and its SVD."""
    found = attention_modules(model)
    chosen = [found[i] for i in (range(len(found)) if blocks is None else blocks)]
    for name, module in chosen:
        if "head" not in capabilities_of(module).intermediates:
            raise UnsupportedModelError(
                f"the attention Jacobian is defined for softmax attention, but {name} is {type(module).__name__}; "
                f"measure a model built with a softmax kernel (standard, optionally with ns, sigma, speccond, qknorm).")
    sequences = [0] if sequences is None else list(sequences)
    inputs, masks, results = {}, {}, []
    with eval_mode(model):
        # each module's input x and its forward's resolved mask (Swin's windows and position bias, causal order, key
        # padding) from one forward pass
        hooks = [m.register_forward_pre_hook(lambda mod, a, kw: inputs.update({mod: (a[0] if a else kw["x"]).detach()}),
                                             with_kwargs=True) for _, m in chosen]
        hooks += [m.observe(Want(), lambda mod, found: masks.update({mod: found.mask})) for _, m in chosen]
        with torch.no_grad():
            forward_batches(model, images, len(images), hooks, watch=chosen)
        for name, module in chosen:
            x_all, mask = inputs[module], masks[module]
            if mask is not None and mask.from_queries:
                raise UnsupportedModelError(
                    f"{name} adds a position bias computed from its queries (ViTDet's relative positions), which the "
                    f"attention Jacobian would hold fixed although it depends on W_Q; measure a model without it.")
            B = x_all.shape[0]
            if any(not 0 <= s < B for s in sequences):
                raise ConfigError(f"sequences={sequences} is out of range for {name}, whose input holds {B} "
                                  f"sequences (images for ViT, windows of the batch for Swin); use 0 to {B - 1}.")
            head_list = [h for h in (range(module.num_heads) if heads is None else heads) if h < module.num_heads]
            with torch.no_grad():
                weight = module.qkv.weight.to(dtype)  # effective weight (parametrisations applied)
                bias = None if module.qkv.bias is None else module.qkv.bias.to(dtype)
            kappas = []
            for h, s in itertools.product(head_list, sequences):
                rows = head_rows(module, h)
                b_q, b_k, b_v = (None,) * 3 if bias is None else (bias[r] for r in rows)
                real = None if mask is None or mask.key_padding is None else mask.key_padding[s]
                j = attention_jacobian(x_all.to(dtype), *(weight[r] for r in rows),
                                       head_function(module, h, mask, s, dtype), rows=real, b_q=b_q, b_k=b_k, b_v=b_v)
                kappas.append(torch.stack(condition_number(j)))
            results.append((head_list, torch.stack(kappas).view(len(head_list), len(sequences), 3)))
    # Swin's stages differ in head count: heads a block does not have are NaN
    all_heads = sorted({h for hs, _ in results for h in hs})
    out = torch.full((len(results), len(all_heads), len(sequences), 3), float("nan"), dtype=dtype)
    for b, (hs, values) in enumerate(results):
        out[b, [all_heads.index(h) for h in hs]] = values
    out = out.detach()  # a measurement: no autograd graph back into the model's parameters
    return JacobianConditioning(out[..., 0], out[..., 1], out[..., 2], [n for n, _ in chosen], all_heads, sequences)


__all__ = ["JacobianConditioning", "attention_jacobian", "condition_number", "head_function",
           "jacobian_conditioning"]
