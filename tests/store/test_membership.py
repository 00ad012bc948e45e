"""Sites that die, join later and come back, through the store (DeMo, 3 and 2 sites as
processes sharing only a file:// location; tests/store/membership_sites.py).

restart: site-c is killed before step 3; after `patience` late rounds site-a and site-b stop
waiting for it; a new site-c process starts from the latest snapshot (of a round >= 6),
catches up and is taken again. straggler: site-b sleeps past two deadlines, is presumed gone,
catches up from the manifests (zero-gradient steps while catching up) and is taken again."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import thinwire
from thinwire.optim.protocol import PeerMismatchError
from thinwire.store import StoreGroup, joiner_state, newest_closed_round, publish_snapshot
from thinwire.store.liveness import Liveness

from .membership_sites import CONFIG, KEY, PATIENCE, run_sites

TIMEOUT_S = 1.0
DIE_AT, JOIN_AFTER, STEPS = 3, 6, 12
SLEEP_AT, STRAGGLER_STEPS = 2, 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both scenarios at once (their sites mostly sleep and poll)."""
    restart = tmp_path_factory.mktemp("restart").as_uri()
    straggler = tmp_path_factory.mktemp("straggler").as_uri()
    plans = {"restart": (restart, [{"site": "site-a"}, {"site": "site-b"}, {"site": "site-c", "die_at": DIE_AT},
                                   {"site": "site-c", "join_after": JOIN_AFTER}], STEPS),
             "straggler": (straggler, [{"site": "site-a"},
                                       {"site": "site-b", "sleep": (SLEEP_AT, 2.5 * TIMEOUT_S)}], STRAGGLER_STEPS)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_sites, url, plan, TIMEOUT_S, steps)
                   for name, (url, plan, steps) in plans.items()}
        return {name: (plans[name][0], future.result()) for name, future in futures.items()}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_killed_site_stops_costing_the_live_ones_a_deadline(runs):
    _, (a, b, dead, _) = runs["restart"]
    assert dead is None
    for site in (a, b):
        rounds = {r: (waited, gone) for r, _, waited, gone, _ in site["rounds"]}
        assert all(rounds[r][0] >= 0.9 * TIMEOUT_S for r in range(DIE_AT, DIE_AT + PATIENCE))   # waited for it
        assert rounds[DIE_AT + PATIENCE - 1][1] == ("site-c",)                                # then presumed gone
        gone_rounds = [r for r, (_, gone) in rounds.items() if r >= DIE_AT + PATIENCE and gone]
        waits = sorted(rounds[r][0] for r in gone_rounds)              # measured: 0.005 to 0.05 s
        assert waits and waits[len(waits) // 2] < 0.2 * TIMEOUT_S and waits[-1] < 0.6 * TIMEOUT_S
    assert all(same(a["params"][s], b["params"][s]) for s in range(1, STEPS + 1))             # replicas


def test_a_restarted_site_joins_from_the_latest_snapshot(runs):
    _, (a, b, _, joiner) = runs["restart"]
    first = joiner["first_round"]
    assert first > JOIN_AFTER and joiner["snapshot_step"] == first - 1
    for step, params in joiner["params"].items():            # from the first round it applies on
        assert same(params, a["params"][step]) and same(params, b["params"][step])
    taken = [r for r, accepted, _, _, _ in a["rounds"] if r >= first and "site-c" in accepted]
    assert taken and taken == list(range(taken[0], STEPS + 1))     # taken again, in every round from then on
    back = [r for r, _, _, gone, _ in a["rounds"] if r >= taken[0]]
    assert all(gone == () for r, _, _, gone, _ in a["rounds"] if r in back)
    assert [r for r, *_, included in joiner["rounds"] if included] == taken


def test_a_presumed_gone_straggler_catches_up_and_is_taken_again(runs):
    _, (a, b) = runs["straggler"]
    rounds_a = {r: (accepted, gone) for r, accepted, _, gone, _ in a["rounds"]}
    assert rounds_a[SLEEP_AT + PATIENCE - 1][1] == ("site-b",)                     # presumed gone
    missed = [r for r, *_, included in b["rounds"] if not included]
    assert missed[:PATIENCE] == [SLEEP_AT, SLEEP_AT + 1] and missed == list(range(SLEEP_AT, missed[-1] + 1))
    back = missed[-1] + 1
    assert back <= STRAGGLER_STEPS - 2                                             # back with rounds to spare
    assert all("site-b" in rounds_a[r][0] and rounds_a[r][1] == () for r in range(back, STRAGGLER_STEPS + 1))
    assert all(same(a["params"][s], b["params"][s]) for s in range(1, STRAGGLER_STEPS + 1))


def test_a_joiner_with_another_layout_is_refused_without_taking_a_round(runs):
    url, _ = runs["restart"]
    group = StoreGroup(url, "site-c", ["site-a", "site-b", "site-c"], KEY, CONFIG, 0.1, first_round=STEPS + 1)
    net = torch.nn.Linear(16, 8)                             # not the run's model
    opt = thinwire.DeMo(net.parameters(), process_group=group, lr=1e-2, topk=4, chunk=8)
    net.weight.grad, net.bias.grad = torch.ones(8, 16), torch.ones(8)
    with pytest.raises(PeerMismatchError, match="differ from those the run recorded"):
        opt.step()
    assert group.results == [] and group.next_round == STEPS + 1
    assert newest_closed_round(group.rounds.location) == STEPS


def _stepped(name: str, tmp_path, steps: int):
    """A one-site optimizer over a store after `steps` steps, and its model."""
    group = StoreGroup(tmp_path.as_uri(), "site-a", ["site-a"], KEY, CONFIG)
    net = torch.nn.Linear(8, 8)
    make = {"demo": lambda: thinwire.DeMo(net.parameters(), process_group=group, lr=1e-2, topk=4, chunk=8),
            "sparseloco": lambda: thinwire.SparseLoCo(net.parameters(), process_group=group, sync_every=2,
                                                      topk=4, chunk=8)}
    opt = make[name]()
    for _ in range(steps):
        net.weight.grad, net.bias.grad = torch.ones(8, 8), torch.ones(8)
        opt.step()
    return opt, net, make


def test_a_snapshot_keeps_replicated_state_and_zeroes_per_rank_state(tmp_path):
    opt, _, _ = _stepped("demo", tmp_path, 2)
    assert any(state["momentum"].abs().sum() > 0 for state in opt.state.values())
    state = joiner_state(opt)
    assert state["thinwire_step"] == 2 and "thinwire_comm_stats" not in state
    assert all(not s["momentum"].any() for s in state["state"].values())      # PER_RANK: a new rank's zero
    with pytest.raises(ValueError, match="optimizer: SGD declares no ELASTIC_KINDS"):
        joiner_state(torch.optim.SGD(opt.params, lr=0.1))


def test_a_sparseloco_snapshot_keeps_the_anchor_and_a_joiner_steps_from_it(tmp_path):
    """SparseLoCo: θ₀ (REPLICATED) copied, e (PER_RANK) zero, the inner AdamW's moments left
    out (each replica's own: the joiner's start fresh); a new optimizer loads it and steps on."""
    opt, net, _ = _stepped("sparseloco", tmp_path / "a", 2)
    state = joiner_state(opt)
    for n, p in enumerate(opt.params):
        assert torch.equal(state["outer"][n]["anchor"], opt.state[p]["anchor"])
        assert opt.state[p]["error"].any() and not state["outer"][n]["error"].any()
    assert state["inner"]["state"] == {} and opt.inner.state_dict()["state"]
    joiner, joiner_net, _ = _stepped("sparseloco", tmp_path / "b", 0)
    joiner_net.load_state_dict(net.state_dict())
    joiner.load_state_dict(state)
    joiner_net.weight.grad, joiner_net.bias.grad = torch.ones(8, 8), torch.ones(8)
    joiner.step()
    assert joiner._step == 3


@pytest.mark.parametrize("patience", [0, -1, 1.5, True, "2"])
def test_bad_patience_is_refused(patience):
    with pytest.raises(ValueError, match="patience must be an int >= 1"):
        Liveness("site-a", ("site-a", "site-b"), patience)


def test_bad_snapshot_and_first_round_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="first_round must be an int >= 0"):
        StoreGroup(tmp_path.as_uri(), "site-a", ["site-a"], KEY, CONFIG, first_round=-1)
    with pytest.raises(ValueError, match="patience must be an int >= 1"):
        StoreGroup(tmp_path.as_uri(), "site-a", ["site-a"], KEY, CONFIG, patience=0)
    group = StoreGroup(tmp_path.as_uri(), "site-a", ["site-a"], KEY, CONFIG, patience=3)
    assert group.rounds.liveness.patience == 3
    for every in (0, -2, 1.0, None):
        with pytest.raises(ValueError, match="every must be an int >= 1"):
            publish_snapshot(group, torch.nn.Linear(2, 2), None, every)
