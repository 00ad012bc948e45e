"""Two tiers on a transformers architecture: every configuration the two-tier suite runs
(test_sharded.py: all of `registry.REGISTRY`) on the tiny Llama of families.py, 2 sites x 2
ranks on real gloo (4 processes, one spawn), sharded as the harness shards it
(`thinwire.train.sites.shard_model`: each decoder layer its own FSDP2 unit, then the root),
the optimizer across the sites with `process_group=`.

FSDP2 splits each parameter along dim 0 over the site's 2 ranks: k_proj / v_proj [8, 32] ->
[4, 32], gate / up [88, 32] -> [44, 32], down [32, 88] -> [16, 88], RMSNorm gains [32] -> [16],
embedding and head [64, 32] -> [32, 32]. 8 steps, a checkpoint at 6 (families.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.optim.families import ranks_of, run_families_two_tier, spawn
from tests.optim.sharded import SITES
from tests.optim.test_sharded import NAMES, WORLD


@pytest.fixture(scope="module")
def runs():
    return spawn(run_families_two_tier, WORLD, NAMES)


def results(runs, name: str) -> list:
    return ranks_of(runs, name, "the two-tier Llama run")


names = pytest.mark.parametrize("name", NAMES)


@names
def test_llama_identical_across_sites(runs, name):
    """Every rank's shards equal those of the rank holding the same shard in the other site, and
    every rank's gathered model is the same (LoRDO / DiLoCo: the run ends on a sync)."""
    ranks = results(runs, name)
    shards = WORLD // SITES
    for r in range(shards, WORLD):
        assert torch.equal(ranks[r]["local"], ranks[r % shards]["local"]), f"rank {r} drifted"
    for r in ranks[1:]:
        assert torch.equal(r["full"], ranks[0]["full"])


@names
def test_llama_loss_falls_and_every_parameter_moves(runs, name):
    """final < initial on the held-out batch (the bound argued in test_families.py), finite
    parameters, and every whole (gathered) parameter moved."""
    for r in results(runs, name):
        assert r["finite"]
        assert r["loss_after"] < r["loss_before"], (r["loss_before"], r["loss_after"])
        assert r["unmoved"] == [], r["unmoved"]


@names
def test_llama_resume_bit_identical(runs, name):
    """This rank's shards and optimizer state saved at step 6, loaded into a sharded Llama of
    another init seed and a new optimizer: the resumed shards end bit for bit where the run's do."""
    for r in results(runs, name):
        assert torch.equal(r["resumed"], r["local"])
