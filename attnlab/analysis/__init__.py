"""The papers' instruments on a model and images: head-output spectra, Jacobian conditioning, intruder dimensions,
subspace similarity, attention entropy, head redundancy, robustness under noise, relevance maps, training curves."""

from attnlab.analysis.spectra import HeadSpectra, first_images, head_output_spectra, plot_spectra
from attnlab.analysis.entropy import attention_entropy, max_logits, qk_spectral_norms, training_probe
from attnlab.analysis.jacobian import JacobianConditioning, attention_jacobian, condition_number, jacobian_conditioning
from attnlab.analysis.dna import alpha_stats, branch_instruments, compare_branches, intruder_dimensions  # noqa: F401
from attnlab.analysis.redundancy import head_distance, head_redundancy  # noqa: F401
from attnlab.analysis.robustness import psnr, representational_robustness, token_distance  # noqa: F401
from attnlab.analysis.relevance import Relevance, plot_relevance, relevance_maps, rollout  # noqa: F401
from attnlab.analysis.curves import plot_training_curves, read_metrics, training_curves  # noqa: F401
from attnlab.analysis.evaluation import aurra, auroc, classification_metrics, evaluate, rms_calibration_error  # noqa: F401
