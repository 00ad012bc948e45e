"""Pure math used by the compressors and optimizers: bases, orthogonalisation, top-k."""

from .dct import dct_matrix
from .newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, muon_scale, orthogonalize
from .orthogonal import random_orthogonal
from .select import largest_indices

__all__ = ["NS_COEFFICIENTS", "NS_EPS", "NS_STEPS", "dct_matrix", "largest_indices", "muon_scale",
           "orthogonalize", "random_orthogonal"]
