"""Pure math used by the compressors and optimizers: bases, orthogonalisation."""

from .dct import dct_matrix
from .newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, muon_scale, orthogonalize
from .orthogonal import random_orthogonal

__all__ = ["NS_COEFFICIENTS", "NS_EPS", "NS_STEPS", "dct_matrix", "muon_scale", "orthogonalize",
           "random_orthogonal"]
