"""Pure tensor math (no nn.Module state): Newton–Schulz transform, Gram spectra, effective rank, ..."""

from attnlab.ops import flops as _flops  # noqa: F401  (registers FLOP formulas)
from attnlab.ops.ns import NS_COEFFS, NS_EPS, ns_transform
from attnlab.ops.spectra import effective_rank, gram_eigenvalues, gram_spectrum, leading_fraction

__all__ = ["NS_COEFFS", "NS_EPS", "effective_rank", "gram_eigenvalues", "gram_spectrum", "leading_fraction",
           "ns_transform"]
