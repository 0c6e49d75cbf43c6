"""Weight-side methods as ``torch.nn.utils.parametrize`` parametrisations: sigma-Reparam and plain spectral
normalisation (:mod:`.sigma`), spectral conditioning W + lam * I_k (:mod:`.speccond`), and :func:`fold` /
:func:`export_folded` for inference."""

from .fold import export_folded, fold
from .sigma import SigmaReparam, apply_sigma, apply_specnorm, sigma_modules
from .speccond import SpectralConditioning, apply_speccond, auto_lam, condition_numbers, identity_blocks

__all__ = [
    "SigmaReparam", "SpectralConditioning", "apply_sigma", "apply_specnorm", "apply_speccond", "auto_lam",
    "condition_numbers", "export_folded", "fold", "identity_blocks", "sigma_modules",
]
