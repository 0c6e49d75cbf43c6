"""The papers' instruments on a model and images: head-output spectra, Jacobian conditioning, intruder dimensions,
subspace similarity, attention entropy."""

from attnlab.analysis.spectra import HeadSpectra, first_images, head_output_spectra, plot_spectra
from attnlab.analysis.entropy import attention_entropy, max_logits, qk_spectral_norms, training_probe
from attnlab.analysis.jacobian import JacobianConditioning, attention_jacobian, condition_number, jacobian_conditioning
from attnlab.analysis.dna import alpha_stats, branch_instruments, compare_branches, intruder_dimensions  # noqa: F401
