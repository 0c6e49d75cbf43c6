"""Attention entropy, maximum attention logits and the spectral norm of W_Q W_K^T, per layer and head.

These are the instruments of sigma-Reparam's account of instability (Zhai et al. 2023): its Theorem 3.1 bounds the
lowest attainable attention entropy by a quantity that falls exponentially in ||W_Q W_K^T||_2, and a collapse of
the entropy is what it watches in training. QK-norm and QK-clip act on the same quantity through the logits.

For query i of head h, with weights A_ij = softmax_j(l_ij) over the N keys of its sequence (ViT) or window (Swin):

    H_i = - sum_j A_ij log A_ij   (nats; 0 for one-hot, log N for uniform attention)

- ``mean``: H_i averaged over every query of every image (sigma-Reparam's per-head attention entropy);
- ``low``: the mean of the ``topk_percent`` % lowest H_i of the head (at least one query), the collapsed tail that
  the mean hides: a head with a few one-hot queries has a low ``low`` before its ``mean`` moves.

l_ij = q_h,i . k_h,j / sqrt(D) + bias_ij is the forward's own float32 logits intermediate (QK-norm included), plus
its resolved mask's position bias and mask (Swin's relative-position bias and window mask, ViTDet's relative
positions, the call's mask), whatever backend computed the output. Masks: a key that the call's mask excludes (causal order,
key padding, Swin's window mask) has weight 0 and is not in the maximum; the queries of padded tokens are measured
neither in the entropy nor in the maximum, so a padded sequence model (which passes its key-padding mask to its
blocks) and a causal one are measured on their real positions only. Only softmax kernels are measured
(``standard``, with or without ``ns``, which acts after the weights): DnA, Diff and Cog do not form one
row-stochastic softmax per head, and those layers raise UnsupportedModelError (or are skipped with
``skip_unsupported=True``).

The maximum logit is max over images, i, j of q_h,i . k_h,j / sqrt(D): QK-clip's S_max (bias excluded unless
``include_bias``). The spectral norm is that of the bilinear form of the logits, x_i^T (W_q,h^T W_k,h) x_j with
PyTorch's (out, in) weight layout (the paper's W_Q W_K^T with W in (in, out) layout), without the 1/sqrt(D) and
without the projection biases, computed exactly (QR + SVD, float64) for each head of every module with a fused qkv.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..attention.base import AttnlabAttention, Want
from ..attention.capabilities import capabilities_of
from ..errors import UnsupportedModelError
from ..models.convert import attention_modules
from .maps import forward_batches, measured_modules, unconverted


def _softmax_modules(model: nn.Module, skip_unsupported: bool) -> list[tuple[str, nn.Module]]:
    keep = []
    for name, module in measured_modules(model):
        if capabilities_of(module).plain_softmax:
            keep.append((name, module))
        elif not skip_unsupported:
            raise UnsupportedModelError(unconverted(name, module) if not isinstance(module, AttnlabAttention) else (
                f"attention module {name!r} is {type(module).__name__}, which does not form one softmax per head; "
                f"attention entropy and logits are measured for the standard kernel (with or without ns)."))
    return keep


@torch.no_grad()
def _collect(model: nn.Module, images: torch.Tensor, *, want_entropy: bool, include_bias: bool, batch_size: int,
             skip_unsupported: bool) -> list[dict]:
    """Run ``images`` through ``model`` (eval mode, every module's mode restored after) and gather per-head row
    entropies and maxima."""
    modules = _softmax_modules(model, skip_unsupported)
    records = [{"layer": name, "entropies": [], "max_logit": None, "num_keys": 0} for name, _ in modules]

    def make_observer(record):
        def seen(module, found):
            qk, mask = found.logits, found.mask
            logits = None if qk is None else qk if mask is None else mask.add_to(qk)
            rows = None if mask is None else mask.key_padding  # (B, N): padded queries are not measured
            if include_bias:  # bias and mask added (Swin's -100 included), over the real queries
                m = (logits if rows is None else logits.masked_fill(~rows[:, None, :, None], float("-inf")))
                m = m.amax(dim=(0, 2, 3))
            else:
                m = found.max_logits  # the forward's own, over the positions its mask allows
            m = m.double()
            record["max_logit"] = m if record["max_logit"] is None else torch.maximum(record["max_logit"], m)
            if want_entropy:
                B, H, N, M = qk.shape
                record["num_keys"] = M
                ent = torch.special.entr(logits.softmax(dim=-1)).sum(dim=-1)  # (B, H, N); entr(0) = 0
                ent = ent.transpose(0, 1)  # (H, B, N)
                ent = ent.reshape(H, -1) if rows is None else ent[:, rows]
                record["entropies"].append(ent.double().cpu())
        return seen

    want = Want(logits=want_entropy or include_bias, max_logits=None if include_bias else float("-inf"))
    handles = [m.observe(want, make_observer(r)) for (_, m), r in zip(modules, records)]
    forward_batches(model, images, batch_size, handles, watch=modules)  # modes restored after: a caller may mix them
    return records


def attention_entropy(model: nn.Module, images: torch.Tensor, topk_percent: float = 10.0, batch_size: int = 64,
                      skip_unsupported: bool = False) -> list[dict]:
    """Per layer and head attention entropy (nats) of ``model`` on ``images`` (B, C, H, W), in eval mode.

    Returns one dict per softmax attention module in forward order: ``layer`` (module name), ``mean`` (H,) the
    mean over images and queries of H_i = -sum_j A_ij log A_ij, ``low`` (H,) the mean of the ``topk_percent`` %
    lowest H_i of each head, and ``log_n`` = log N, the entropy of uniform attention over that module's N keys.
    Tensors are float64 on the CPU.
    """
    if not 0 < topk_percent <= 100:
        raise ValueError(f"topk_percent must be in (0, 100], got {topk_percent}")
    return [_summarise(r, topk_percent) for r in _collect(
        model, images, want_entropy=True, include_bias=False, batch_size=batch_size, skip_unsupported=skip_unsupported)]


def _summarise(record: dict, topk_percent: float) -> dict:
    rows = torch.cat(record["entropies"], dim=1)  # (H, images * queries)
    count = max(1, math.ceil(rows.shape[1] * topk_percent / 100))
    low = rows.topk(count, dim=1, largest=False).values.mean(dim=1)
    return {"layer": record["layer"], "mean": rows.mean(dim=1), "low": low, "log_n": math.log(record["num_keys"])}


def max_logits(model: nn.Module, images: torch.Tensor, include_bias: bool = False, batch_size: int = 64,
               skip_unsupported: bool = False) -> list[dict]:
    """Per layer and head max over images, queries and keys of q.k/sqrt(D) (QK-clip's S_max), in eval mode.

    ``include_bias`` adds Swin's position bias and window mask (or a ViT attn_mask) first. Returns one dict per
    softmax attention module: ``layer`` and ``max`` (H,), float64 on the CPU.
    """
    return [{"layer": r["layer"], "max": r["max_logit"].cpu()}
            for r in _collect(model, images, want_entropy=False, include_bias=include_bias, batch_size=batch_size,
                              skip_unsupported=skip_unsupported)]


@torch.no_grad()
def qk_spectral_norms(model: nn.Module) -> list[dict]:
    """||W_q,h^T W_k,h||_2 for every head h of every attention module (the logits' bilinear form, Theorem 3.1).

    W_q,h, W_k,h: rows [h*D, (h+1)*D) of the q and k blocks of the fused ``qkv`` weight (the effective weight when
    it is reparametrised), shape (D, C). With A^T = Q_a R_a and B^T = Q_b R_b (reduced QR), A^T B = Q_a R_a R_b^T
    Q_b^T, so the norm is the largest singular value of the D x D matrix R_a R_b^T. Returns one dict per module:
    ``layer`` and ``norm`` (H,), float64 on the CPU. Works for timm's modules too; Diff attention is refused (its
    logits use half-heads).
    """
    out = []
    for name, module in attention_modules(model):
        if capabilities_of(module).qk_split != 1:
            raise UnsupportedModelError(
                f"attention module {name!r} is {type(module).__name__}, whose logits use half-heads; the per-head "
                f"spectral norm of W_q W_k^T is defined for kernels whose logits are q_h k_h^T.")
        H, H_kv = module.num_heads, getattr(module, "num_kv_heads", module.num_heads)  # timm's: no grouping
        w = module.qkv.weight.detach().double().cpu()
        D = module.head_dim
        a = w[: H * D].view(H, D, -1)  # (H, D, C)
        # each query head's key head (grouped-query attention: one per group of query heads)
        b = w[H * D: (H + H_kv) * D].view(H_kv, D, -1).repeat_interleave(H // H_kv, 0)
        if a.shape[-1] >= D:
            ra = torch.linalg.qr(a.transpose(1, 2)).R  # (H, D, D)
            rb = torch.linalg.qr(b.transpose(1, 2)).R
            norm = torch.linalg.matrix_norm(ra @ rb.transpose(1, 2), ord=2)
        else:
            norm = torch.linalg.matrix_norm(a.transpose(1, 2) @ b, ord=2)
        out.append({"layer": name, "norm": norm})
    return out


def training_probe(model: nn.Module, images: torch.Tensor, topk_percent: float = 10.0,
                   batch_size: int = 64) -> dict[str, float]:
    """Flat scalars for a training log, from one eval-mode pass over ``images`` (the model's mode is restored).

    Keys: ``entropy/mean`` (mean over layers and heads of the per-head mean entropy), ``entropy/min_head`` (the
    lowest per-head mean), ``entropy/low`` (mean over heads of the ``topk_percent`` % tail), ``entropy/layer_<i>``
    (per-layer mean over heads, i counting measured layers), ``max_logit/max`` and ``max_logit/mean`` (over heads
    of the per-head maximum), ``max_logit/layer_<i>`` (the largest of layer i's heads: the per-layer logit growth of
    Wortsman et al. 2023, arXiv 2309.14322), ``qk_spectral_norm/max`` and ``qk_spectral_norm/mean``. Layers that
    are not softmax attention are left out; keys whose layers are all left out are absent. Records nothing into
    QK-clip (eval mode).
    """
    out: dict[str, float] = {}
    found = attention_modules(model)
    records = _collect(model, images, want_entropy=True, include_bias=False, batch_size=batch_size,
                       skip_unsupported=True) if any(capabilities_of(m).plain_softmax for _, m in found) else []
    if records:
        layers = [_summarise(r, topk_percent) for r in records]
        for i, (layer, record) in enumerate(zip(layers, records)):
            out[f"entropy/layer_{i}"] = float(layer["mean"].mean())
            out[f"max_logit/layer_{i}"] = float(record["max_logit"].max())  # the logit growth, layer by layer
        means = torch.cat([layer["mean"] for layer in layers])
        lows = torch.cat([layer["low"] for layer in layers])
        maxima = torch.cat([r["max_logit"] for r in records])
        out.update({"entropy/mean": float(means.mean()), "entropy/min_head": float(means.min()),
                    "entropy/low": float(lows.mean()), "max_logit/max": float(maxima.max()),
                    "max_logit/mean": float(maxima.mean())})
    if found and all(capabilities_of(m).qk_split == 1 for _, m in found):
        norms = torch.cat([r["norm"] for r in qk_spectral_norms(model)])
        out.update({"qk_spectral_norm/max": float(norms.max()), "qk_spectral_norm/mean": float(norms.mean())})
    return out


__all__ = ["attention_entropy", "max_logits", "qk_spectral_norms", "training_probe"]
