"""Two tiers: every configuration of `registry.REGISTRY` on FSDP2 shards, 2 sites x 2 ranks on
real gloo (FSDP2 reduce-scatters inside a site; the optimizer exchanges each shard with the
rank holding it in the other site), and at one rank per site against the flat path.

Expected bytes are the registry's hand-derived wire formulas applied to each rank's shard
shapes with the two sites as the world: the inter-site payload is the shard's message.
"""

from __future__ import annotations

import pytest

from tests.dist import run_workers
from tests.optim.registry import APM_WARMUP, REGISTRY, expected_payload
from tests.optim.sharded import SITES, run_one_per_site, run_one_site, run_two_tier

NAMES = list(REGISTRY)
WORLD = 4                                  # 2 sites x 2 ranks
STATE_RATIO = 0.55                         # issue 14: sharded state <= 0.55x the one-rank-per-site figure


@pytest.fixture(scope="module")
def two_tier():
    return run_workers(run_two_tier, WORLD, args=(NAMES,), timeout=900)


@pytest.fixture(scope="module")
def one_per_site():
    return run_workers(run_one_per_site, SITES, args=(NAMES,), timeout=900)


@pytest.fixture(scope="module")
def one_site():
    return run_workers(run_one_site, 2, args=(NAMES,), timeout=900)


def ranks_of(results: list, name: str) -> list:
    ranks = [r[name] for r in results]
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, errors[0]
    return ranks


@pytest.mark.parametrize("name", NAMES)
def test_shards_identical_across_sites(two_tier, name):
    ranks = ranks_of(two_tier, name)
    shards = WORLD // SITES
    for r in range(shards, WORLD):                 # the rank holding the same shard in site 0
        assert torch_equal(ranks[r]["local"], ranks[r % shards]["local"]), f"rank {r} drifted"
    for r in ranks[1:]:                            # and so every rank sees the same whole model
        assert torch_equal(r["full"], ranks[0]["full"])


@pytest.mark.parametrize("name", NAMES)
def test_resume_bit_identical(two_tier, name):
    for r in ranks_of(two_tier, name):
        assert torch_equal(r["resumed"], r["local"])


@pytest.mark.parametrize("name", NAMES)
def test_loss_falls(two_tier, name):
    for r in ranks_of(two_tier, name):
        assert r["loss_after"] < 0.8 * r["loss_before"], (r["loss_before"], r["loss_after"])


@pytest.mark.parametrize("name", NAMES)
def test_inter_site_bytes_equal_the_wire_format_of_the_shard(two_tier, name):
    every = REGISTRY[name].every
    for r in ranks_of(two_tier, name):
        expected = expected_payload(name, SITES, r["shapes"])
        previous = {}
        for step, (status, by_tag) in enumerate(r["log"]):
            assert status == "ok"
            for tag, nbytes in expected.items():
                if name.startswith("apmsqueeze-compressed") and step < APM_WARMUP + REGISTRY[name].delay:
                    continue
                if tag == "downlink" and r["site_rank"] != 0:
                    nbytes = 0                                  # a broadcast's payload is the root's
                sent = by_tag.get(tag, {}).get("payload_bytes", 0) - previous.get(tag, {}).get("payload_bytes", 0)
                assert sent == (nbytes if (step + 1) % every == 0 else 0), (step, tag)
            previous = by_tag


@pytest.mark.parametrize("name", NAMES)
def test_state_per_rank_is_split_across_the_site(two_tier, one_per_site, name):
    sharded = max(r["state_nbytes"] for r in ranks_of(two_tier, name))
    whole = max(r["state_nbytes"] for r in ranks_of(one_per_site, name))
    assert 0 < sharded <= STATE_RATIO * whole, (sharded, whole)


@pytest.mark.parametrize("name", NAMES)
def test_one_rank_per_site_is_the_flat_path(one_per_site, name):
    for r in ranks_of(one_per_site, name):
        assert torch_equal(r["sharded"], r["flat"])


# Newton–Schulz runs in bf16 (as torch.optim.Muon): the site's reduce-scatter mean and the
# reference's autograd mean differ in the last bits, which moves NS's output by bf16's 2^-8
# relative (measured: 1.3e-4 for EF21-Muon, 1.2e-3 for torch Muon on DTensors after 12 steps);
# NS on each shard alone instead of the whole matrix differs by 0.066 (measured, EF21-Muon).
NEWTON_SCHULZ = {"dense-muon": 5e-3, "ef21-server": 5e-3, "ef21-replicated": 5e-3, "ef21-replicated-overlap": 5e-3}
# The 1-bit scale is one per chunk of a rank's flat momentum, and SparseLoCo's 2-bit levels one
# set per tensor, that is per shard, so a shard's message is not the whole's by design; the
# two-tier tests above cover these configurations.
NOT_THE_WHOLE = {"apmsqueeze-compressed", "apmsqueeze-compressed-overlap", "sparseloco", "sparseloco-overlap",
                 "sparseloco-delayed"}


@pytest.mark.parametrize("name", [n for n in NAMES if n not in NOT_THE_WHOLE])
def test_shards_of_one_site_match_the_whole_matrix_reference(one_site, name):
    import torch
    for r in ranks_of(one_site, name):
        assert torch.allclose(r["sharded"], r["reference"], rtol=1e-4, atol=NEWTON_SCHULZ.get(name, 1e-5)), \
            float((r["sharded"] - r["reference"]).abs().max())


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)
