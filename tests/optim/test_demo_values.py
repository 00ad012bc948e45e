"""DeMo's value formats: which it takes, and the one it refuses with a reason."""

import pytest
import torch

import thinwire
from thinwire.wire import CODEC_NAMES


# '8bit' and 'signbit' are refused (below; test_sign_demo.py)
@pytest.mark.parametrize("values", [v for v in CODEC_NAMES if v not in ("8bit", "signbit")])
def test_demo_takes_every_per_chunk_value_format(values):
    p = torch.nn.Parameter(torch.zeros(64, 64))
    assert thinwire.DeMo([p], values=values).param_groups[0]["values"] == values


def test_8bit_values_are_refused_naming_the_argument_and_the_alternative():
    """'8bit' keeps a 256-level table per row; DeMo's rows are chunks of topk values, so the
    table (1,024 bytes) would dwarf the values it describes."""
    p = torch.nn.Parameter(torch.zeros(64, 64))
    with pytest.raises(ValueError, match=r"values='8bit'.*int8.*SparseLoCo"):
        thinwire.DeMo([p], values="8bit")
