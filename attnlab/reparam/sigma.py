"""sigma-Reparam (Zhai et al. 2023) and plain spectral normalisation, as ``torch.nn.utils.parametrize`` parametrisations.

    W_hat = gamma * W / sigma(W)            (sigma-Reparam; gamma a learned scalar per layer)
    W_hat = W / sigma(W)                    (``specnorm``: the ablation without gamma)

sigma(W) is the largest singular value of W (a convolution's weight read as ``(out, in * kh * kw)``), estimated by
power iteration as the authors' vision code does it: the right singular vector u is a buffer, moved by ONE iteration
(two matrix-vector products) per training forward and never in eval mode, with no gradient through the iteration:

    v = W u / ||W u||,   u <- W^T v / ||W^T v||,   sigma = v^T W u   (gradient d sigma / dW = v u^T)

With the updated u, v^T W u = ||W^T v||, so sigma costs no third product. In eval mode u stays put; ``estimate``
picks sigma there:

    stored   (default)  v = W u / ||W u||,  sigma = ||W u||           (the stored u, one product)
    refresh  (authors') v = W u / ||W u||,  sigma = ||W^T v||         (one more power-iteration step, not saved)

Both are at most sigma_max and agree once u has converged (why ``stored`` is the default: docs/methods.md,
"sigma-Reparam"). u starts at the exact top right singular vector (one float64 eigh at conversion), so both are exact
at step 0. ``gamma_init="sigma"`` (default) sets gamma = sigma(W0), so W_hat = W at step 0 and converting a model
changes none of its outputs (the authors' vision code); a number (the note's literal ``gamma = 1``) sets gamma to it.

W_hat = W * (gamma / sigma) is one elementwise pass over W, never over the activations; the backward is written out
(:class:`_ScaleBySigma`) so that autograd adds two passes over W, not five:

    dL/dW = (gamma / sigma) G - (gamma / sigma^2) <G, W> v u^T,   dL/dgamma = <G, W> / sigma,   G = dL/dW_hat

At inference :func:`attnlab.fold` evaluates W_hat once and drops the parametrisation.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..errors import SpecError

#: guards the divisions by ||W u|| for an all-zero weight
_EPS = 1e-12
#: eval-mode sigma: ||W u|| of the stored u, or the authors' ||W^T v|| after one unsaved step (module docstring)
ESTIMATES = ("stored", "refresh")


class _ScaleBySigma(torch.autograd.Function):
    """W_hat = W * gamma / sigma with sigma = v^T W u, u and v constants; the backward in two passes over W."""

    @staticmethod
    def forward(weight, gamma, u, v, sigma):
        return weight * (gamma / sigma)

    @staticmethod
    def setup_context(ctx, inputs, output):
        weight, gamma, u, v, sigma = inputs
        ctx.save_for_backward(weight, gamma, u, v, sigma)

    @staticmethod
    def backward(ctx, grad):
        weight, gamma, u, v, sigma = ctx.saved_tensors
        g_dot_w = torch.dot(grad.reshape(-1), weight.reshape(-1))  # <G, W>
        grad_weight = grad_gamma = None
        if ctx.needs_input_grad[0]:
            scale = gamma / sigma
            grad_weight = grad * scale
            # rank-one correction from d sigma / dW = v u^T, added in place (one pass, no outer-product temporary)
            correction = u * (-scale * g_dot_w / sigma)
            if grad_weight.is_contiguous():
                grad_weight.view(grad_weight.shape[0], -1).addr_(v, correction)
            else:  # e.g. a channels-last conv weight's gradient
                grad_weight = grad_weight + torch.outer(v, correction).view(grad_weight.shape)
        if ctx.needs_input_grad[1]:
            grad_gamma = (g_dot_w / sigma).reshape(gamma.shape)
        return grad_weight, grad_gamma, None, None, None


@torch.no_grad()
def top_right_singular_vector(w: torch.Tensor) -> torch.Tensor:
    """The unit right singular vector of the largest singular value of w (out, fan_in), in w's dtype.

    From the Gram matrix of the smaller side in float64 (an eigh of min(out, fan_in)^2 entries; squaring costs
    precision only in the small singular values). A full SVD of a wide matrix took LAPACK seconds per layer.
    """
    w64 = w.double()
    if w64.shape[0] < w64.shape[1]:
        u = w64.T @ torch.linalg.eigh(w64 @ w64.T).eigenvectors[:, -1]
    else:
        u = torch.linalg.eigh(w64.T @ w64).eigenvectors[:, -1]
    norm = torch.linalg.vector_norm(u)
    # an all-zero weight: any unit vector will do (a select, not a branch: no value is read, so meta tensors pass)
    unit = torch.where(norm > 0, u / norm.clamp_min(torch.finfo(u.dtype).tiny), w.shape[1] ** -0.5)
    return unit.to(w.dtype)


class SigmaReparam(nn.Module):
    """Parametrisation W -> gamma * W / sigma(W) (``learn_gamma=True``) or W / sigma(W) (plain spectral norm).

    Args:
        weight: the layer's current (effective) weight, (out, in) or (out, in, kh, kw); used for the initial u and
            sigma(W0).
        gamma_init: ``"sigma"`` for gamma = sigma(W0) (W_hat = W at step 0) or a number; ignored without gamma.
        learn_gamma: False gives plain spectral normalisation (gamma fixed at 1, not a parameter).
        estimate: sigma in eval mode, ``"stored"`` (||W u||) or ``"refresh"`` (the authors': ||W^T v|| after one
            unsaved power-iteration step); training forwards are the same for both.

    State (in the state dict): ``u`` (in * kh * kw,) the power-iteration vector; ``gamma`` () when learned.
    """

    def __init__(self, weight: torch.Tensor, gamma_init: float | str = "sigma", learn_gamma: bool = True,
                 estimate: str = "stored") -> None:
        super().__init__()
        if estimate not in ESTIMATES:
            raise SpecError(f"estimate={estimate!r} is not valid; estimate is one of: {', '.join(ESTIMATES)}.")
        self.estimate = estimate
        with torch.no_grad():
            w = weight.detach().reshape(weight.shape[0], -1)
            self.register_buffer("u", top_right_singular_vector(w))
            sigma0 = torch.linalg.vector_norm(torch.mv(w, self.u)).clamp_min(_EPS)  # what eval mode computes
        self.learn_gamma = learn_gamma
        if learn_gamma:
            value = sigma0 if gamma_init == "sigma" else torch.tensor(float(gamma_init))
            self.gamma = nn.Parameter(value.detach().clone().to(weight.dtype).reshape(()))
        else:
            self.register_buffer("gamma", torch.ones((), dtype=weight.dtype), persistent=False)

    @torch.no_grad()
    def _power_iteration(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u, v, sigma) for ``w`` (out, fan_in); one iteration moving ``self.u`` in training, none in eval."""
        wu = torch.mv(w, self.u)
        if not self.training:
            sigma = torch.linalg.vector_norm(wu).clamp_min(_EPS)
            if self.estimate == "stored":
                return self.u, wu / sigma, sigma
            v = wu / sigma
            wtv = torch.mv(w.t(), v)
            sigma = torch.linalg.vector_norm(wtv).clamp_min(_EPS)  # the refreshed u is used here, never stored
            return wtv / sigma, v, sigma
        v = wu / torch.linalg.vector_norm(wu).clamp_min(_EPS)
        wtv = torch.mv(w.t(), v)
        sigma = torch.linalg.vector_norm(wtv).clamp_min(_EPS)  # = v^T W u_new
        u = wtv / sigma
        self.u.copy_(u)
        return u, v, sigma  # the new tensor, not the buffer: backward must see this step's u

    @torch.no_grad()
    def sigma_of(self, weight: torch.Tensor) -> torch.Tensor:
        """sigma(W) as an eval forward divides by it (``estimate``), with the current u; moves nothing."""
        w = weight.reshape(weight.shape[0], -1).to(self.u.dtype)
        sigma = torch.linalg.vector_norm(torch.mv(w, self.u)).clamp_min(_EPS)
        if self.estimate == "refresh":
            sigma = torch.linalg.vector_norm(torch.mv(w.t(), torch.mv(w, self.u) / sigma)).clamp_min(_EPS)
        return sigma

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        device = weight.device.type
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
            # the power iteration and the scaled weight stay in the parameter's precision; the layer casts after
            with torch.autocast(device, enabled=False):
                return self._reparam(weight)
        return self._reparam(weight)

    def _reparam(self, weight: torch.Tensor) -> torch.Tensor:
        w = weight.reshape(weight.shape[0], -1)
        u, v, sigma = self._power_iteration(w.detach())
        return _ScaleBySigma.apply(weight, self.gamma, u, v, sigma)

    def extra_repr(self) -> str:
        return f"fan_in={self.u.numel()}, learn_gamma={self.learn_gamma}, estimate={self.estimate}"


def _targets(model: nn.Module, modules: list[nn.Module], targets: str) -> list[nn.Module]:
    """Every Linear and Conv2d of the model (``all``), or the Linears inside the attention modules (``attn``).

    Each weight is reparametrised at most once, and a weight an ``nn.Embedding`` shares (a language model's head tied
    to its token embedding) stays plain: the embedding reads rows of it as token vectors, and reparametrising it in
    the head alone would make the two uses of one matrix differ."""
    if targets == "all":
        layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    elif targets == "attn":
        layers = list({id(m): m for attn in modules for m in attn.modules() if isinstance(m, nn.Linear)}.values())
    else:
        raise SpecError(f"targets={targets!r} is not valid; targets is one of: all, attn.")
    seen = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out = []
    for layer in layers:
        weight = layer.parametrizations.weight.original if parametrize.is_parametrized(layer, "weight") \
            else layer.weight
        if id(weight) not in seen:
            seen.add(id(weight))
            out.append(layer)
    return out


def _register(layers: Iterable[nn.Module], gamma_init: float | str, learn_gamma: bool,
              estimate: str = "stored") -> None:
    for layer in layers:
        # initialise from the effective weight, so this composes after another parametrisation (e.g. speccond)
        # unsafe=True skips parametrize's trial forward, which in training mode would move u once
        parametrize.register_parametrization(layer, "weight", SigmaReparam(layer.weight, gamma_init, learn_gamma,
                                                                            estimate), unsafe=True)


def apply_sigma(model: nn.Module, modules: list[nn.Module], gamma_init: float | str = "sigma",
                targets: str = "all", estimate: str = "stored") -> nn.Module:
    """Give every targeted layer the parametrisation W_hat = gamma * W / sigma(W) (registry entry ``sigma``)."""
    if gamma_init != "sigma" and not isinstance(gamma_init, (int, float)):
        raise SpecError(f"sigma(gamma_init={gamma_init}) is not valid; gamma_init is 'sigma' or a number.")
    _register(_targets(model, modules, targets), gamma_init, learn_gamma=True, estimate=estimate)
    return model


def apply_specnorm(model: nn.Module, modules: list[nn.Module], targets: str = "all",
                   estimate: str = "stored") -> nn.Module:
    """Give every targeted layer W_hat = W / sigma(W), plain spectral normalisation (registry entry ``specnorm``)."""
    _register(_targets(model, modules, targets), "sigma", learn_gamma=False, estimate=estimate)
    return model


def sigma_modules(model: nn.Module) -> list[tuple[str, SigmaReparam]]:
    """(qualified layer name, parametrisation) of every SigmaReparam in ``model``."""
    out = []
    for name, m in model.named_modules():
        if parametrize.is_parametrized(m, "weight"):
            out.extend((name, p) for p in m.parametrizations.weight if isinstance(p, SigmaReparam))
    return out


__all__ = ["SigmaReparam", "apply_sigma", "apply_specnorm", "sigma_modules", "top_right_singular_vector"]
