"""Pure math used by the compressors and optimizers: bases, orthogonalisation, top-k."""

from .dct import dct_matrix
from .newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, muon_scale, orthogonalize
from .orthogonal import random_orthogonal
from .select import ascending, largest_indices
from .updates import adam_denominator, adam_moments_, add_rms_, add_sign_, add_spectral_, nesterov_outer_

__all__ = ["NS_COEFFICIENTS", "NS_EPS", "NS_STEPS", "adam_denominator", "adam_moments_", "add_rms_", "add_sign_",
           "add_spectral_", "ascending", "dct_matrix", "largest_indices", "muon_scale", "nesterov_outer_", "orthogonalize",
           "random_orthogonal"]
