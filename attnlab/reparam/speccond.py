"""Spectral conditioning of attention (the corrected Theorem 3.8 of the NeurIPS 2025 paper, as its rebuttal states it).

    W_Q -> W_Q + lam * I_k,   W_K -> W_K + lam * I_k,   W_V -> W_V + lam * I_k

I_k (the shape of W, m x n) has ones on its main k x k diagonal, k = min(m, n), zeros elsewhere. In timm's fused
``qkv`` weight (3 * A, dim) each of the three (A, dim) blocks gets its own I_k. lam is fixed (a buffer, not trained);
W is the trained parameter. ``targets=qkv+mlp`` also conditions the MLP's Linear weights (the rebuttal's FFN
experiment).

Corrected Theorem 3.8: for A in R^{m x n} with sigma_min(A) < 0.4 and sigma_max(A) > 2, if lam - sigma_max(A) > 1
(condition (1); or the rebuttal's condition (2)) then kappa(A + lam I_k) < kappa(A). Proof sketch (Weyl):
kappa(A + lam I_k) <= (sigma_max + lam) / (lam - sigma_max) < 1 + 2 sigma_max < sigma_max / sigma_min = kappa(A).

Default ``lam=auto``: the smallest value condition (1) allows on the initial weights, lam = max over conditioned
blocks of sigma_max(A) + 1, plus a margin of 1e-3 (so the inequality is strict), stored in each parametrisation's
state (``lam``) so that a saved model reloads with its own lam. Why not 10, the only value on record (a third-party
summary, unverified; it saturates the softmax of small models at initialisation): docs/methods.md, "speccond".

The effective weight is one fused kernel, ``torch.addcmul(W, I_k, lam)``; its backward passes the gradient through
unchanged, so training costs one extra pass over each conditioned weight per forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..errors import SpecError, UnsupportedModelError

#: added to sigma_max + 1 by lam=auto so that condition (1), lam - sigma_max > 1, holds strictly
AUTO_MARGIN = 1e-3


def identity_blocks(shape: tuple[int, int], blocks: int | list[int] = 1, dtype=None, device=None) -> torch.Tensor:
    """I_k for each row block of a weight: ``blocks`` equal blocks, or blocks of the given row counts (a fused qkv
    with grouped keys and values); ones on each block's main diagonal."""
    rows, cols = shape
    widths = _widths(rows, blocks)
    # torch.eye(m, n) has its ones on the main min(m, n) diagonal
    return torch.cat([torch.eye(m, cols, dtype=dtype, device=device) for m in widths])


def _widths(rows: int, blocks: int | list[int]) -> list[int]:
    if isinstance(blocks, int):
        if rows % blocks:
            raise ValueError(f"{rows} rows do not split into {blocks} equal blocks")
        return [rows // blocks] * blocks
    if sum(blocks) != rows:
        raise ValueError(f"{rows} rows do not split into blocks of {blocks}")
    return list(blocks)


class SpectralConditioning(nn.Module):
    """Parametrisation W -> W + lam * I_k (block by block for a fused weight). lam is fixed.

    Args:
        weight: the layer's weight (out, in), used for shape, dtype and device.
        lam: the added multiple of I_k.
        blocks: number of equal row blocks with their own I_k (3 for a fused qkv weight), or their row counts.
    """

    def __init__(self, weight: torch.Tensor, lam: float, blocks: int = 1) -> None:
        super().__init__()
        self.blocks = blocks
        self.register_buffer("eye", identity_blocks(tuple(weight.shape), blocks, weight.dtype, weight.device),
                             persistent=False)
        self.register_buffer("lam", torch.tensor(float(lam), dtype=weight.dtype, device=weight.device))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(weight, self.eye, self.lam)

    def extra_repr(self) -> str:
        return f"lam={float(self.lam):.4g}, blocks={self.blocks}"


def _layers(model: nn.Module, modules: list[nn.Module], targets: str) -> list[tuple[nn.Linear, int]]:
    """(layer, I_k blocks) to condition: each attention's fused qkv (its row blocks), and for ``qkv+mlp`` the
    Linear layers of the MLP that sits next to it in the same transformer block."""
    if targets not in ("qkv", "qkv+mlp"):
        raise SpecError(f"speccond(targets={targets}) is not valid; targets is one of: qkv, qkv+mlp.")
    # one I_k per row block of the fused projection: q, k, v (DnA: q+, q-, k, v+, v-; grouped keys: narrower k, v)
    layers = [(attn.qkv, attn.qkv_widths()) for attn in modules]
    if targets == "qkv+mlp":
        parents = {id(child): parent for parent in model.modules() for child in parent.children()}
        for attn in modules:
            block = parents.get(id(attn))
            mlp = getattr(block, "mlp", None)
            if mlp is None:
                raise UnsupportedModelError(
                    f"speccond(targets=qkv+mlp) needs an 'mlp' next to each attention module, but "
                    f"{type(block).__name__} has none; use targets=qkv.")
            layers.extend((m, 1) for m in mlp.modules() if isinstance(m, nn.Linear))
    return layers


def _blocks_of(weight: torch.Tensor, blocks) -> list[torch.Tensor]:
    return list(weight.detach().split(_widths(weight.shape[0], blocks)))


def auto_lam(layers: list[tuple[nn.Module, int]]) -> float:
    """The smallest lam meeting condition (1) of the corrected Theorem 3.8 on every block: max sigma_max + 1 + margin.
    On the meta device (a model built to check its shapes) there are no values: 1 + margin stands in."""
    if any(layer.weight.is_meta for layer, _ in layers):
        return 1.0 + AUTO_MARGIN
    top = max(float(torch.linalg.matrix_norm(block.double(), 2))
              for layer, blocks in layers for block in _blocks_of(layer.weight, blocks))
    return top + 1.0 + AUTO_MARGIN


def apply_speccond(model: nn.Module, modules: list[nn.Module], lam: float | str = "auto",
                   targets: str = "qkv") -> nn.Module:
    """Add lam * I_k to W_Q, W_K, W_V of every attention module (and the MLP weights for ``qkv+mlp``)."""
    layers = _layers(model, modules, targets)
    if lam == "auto":
        lam = auto_lam(layers)
    elif isinstance(lam, str) or lam < 0:
        raise SpecError(f"speccond(lam={lam}) is not valid; lam is a number >= 0 or 'auto'.")
    for layer, blocks in layers:
        parametrize.register_parametrization(layer, "weight", SpectralConditioning(layer.weight, lam, blocks),
                                             unsafe=True)
    return model


def condition_numbers(weight: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """kappa = sigma_max / sigma_min (over the min(m, n) singular values) of each row block, in float64."""
    singular_values = [torch.linalg.svdvals(block.double()) for block in _blocks_of(weight, blocks)]
    return torch.stack([s[0] / s[-1] for s in singular_values])


__all__ = ["AUTO_MARGIN", "SpectralConditioning", "apply_speccond", "auto_lam", "condition_numbers",
           "identity_blocks"]
