"""Sites that die, join later and come back: DeMo on a tiny model, one process per site,
sharing nothing but a file:// store.

    run_sites(url, plans, round_timeout, steps) -> one result per plan (None: the site died)

A plan is a dict: 'site' (its id), and optionally 'die_at' (the process exits before that
step: killed for good), 'join_after' (it waits for a snapshot of a round >= this, starts
from it and joins the run going), 'sleep' ((step, seconds): asleep before that step).

Every site's "compute" is a COMPUTE_S sleep (standing in for a real model's forward and
backward) plus the tiny model's; a site skips both and steps with zero gradients while
`group.catching_up()`. Live sites publish a snapshot every SNAPSHOT_EVERY rounds. Each
result: {'params': {step: tensors after it}, 'rounds': [(round, accepted sites, waited_s,
gone, included)], 'first_round', 'snapshot_step'}.
"""

from __future__ import annotations

import os
import time
import traceback

import torch

import thinwire
from thinwire.store import StoreGroup, latest_snapshot, publish_snapshot
from thinwire.train.launch import exit_process

from .train_sites import run_processes

KEY, CONFIG = b"the membership run's key", '{"test": "store membership"}'
SETTINGS = dict(lr=1e-2, topk=4, chunk=8)
COMPUTE_S = 0.2
SNAPSHOT_EVERY = 2
PATIENCE = 2


def model() -> torch.nn.Module:
    torch.manual_seed(0)                                   # the same initial model on every site
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _snapshot(url: str, after: int) -> tuple[int, dict]:
    """The latest snapshot once one of a round >= `after` is there."""
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        found = latest_snapshot(url, KEY, CONFIG)
        if found is not None and found[0] >= after:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"no snapshot of a round >= {after}")


def _compute(net, params, group, rank: int, step: int) -> None:
    net.zero_grad()
    if group.catching_up():                                # no forward/backward: the message misses anyway
        for p in params:
            p.grad = torch.zeros_like(p)
        return
    time.sleep(COMPUTE_S)
    data = torch.Generator().manual_seed(1000 * rank + step)     # each site its own data
    x, y = torch.randn(8, 16, generator=data), torch.randn(8, 8, generator=data)
    torch.nn.functional.mse_loss(net(x), y).backward()


def train(url: str, sites: list[str], plan: dict, round_timeout: float, steps: int) -> dict:
    net, first_round, state = model(), 0, None
    if plan.get("join_after") is not None:
        round, state = _snapshot(url, plan["join_after"])
        net.load_state_dict(state["model"])
        first_round = round + 1                            # DeMo: round s is step s's (round 0 the handshake)
    group = StoreGroup(url, plan["site"], sites, KEY, CONFIG, round_timeout, join_timeout=60.0,
                       first_round=first_round, poll=(0.01, 0.1), patience=PATIENCE)
    opt = thinwire.DeMo(net.parameters(), process_group=group, **SETTINGS)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    params, history, rank = list(net.parameters()), {}, sites.index(plan["site"])
    for step in range(first_round or 1, steps + 1):
        if plan.get("die_at") == step:
            os._exit(0)                                    # killed: no result, no goodbye
        if plan.get("sleep", (None,))[0] == step:
            time.sleep(plan["sleep"][1])
        _compute(net, params, group, rank, step)
        opt.step()
        publish_snapshot(group, net, opt, SNAPSHOT_EVERY)
        history[step] = [p.detach().clone() for p in params]
    rounds = [(r.round, tuple(r.messages), r.waited_s, r.gone, r.included) for r in group.results]
    snapshot_step = None if state is None else state["optimizer"]["thinwire_step"]
    return {"params": history, "rounds": rounds, "first_round": first_round, "snapshot_step": snapshot_step}


def _site_main(tmpdir: str, index: int, url: str, sites: list[str], plan: dict, round_timeout: float,
               steps: int) -> None:
    torch.set_num_threads(1)
    path = os.path.join(tmpdir, f"result{index}.pt")
    try:
        torch.save(("ok", train(url, sites, plan, round_timeout, steps)), path)
    except BaseException:
        torch.save(("error", traceback.format_exc()), path)
    exit_process(0)


def run_sites(url: str, plans: list[dict], round_timeout: float, steps: int, timeout: float = 120.0) -> list:
    """Run every plan as its own process; their results in order (None for a site that died)."""
    sites = sorted({plan["site"] for plan in plans})
    outcomes = run_processes(_site_main, [(url, sites, plan, round_timeout, steps) for plan in plans], timeout)
    results, errors = [], []
    for plan, outcome in zip(plans, outcomes):
        if not isinstance(outcome, tuple):
            results.append(None)
            if plan.get("die_at") is None:
                errors.append(f"{plan['site']}: hung or died (exit code {outcome})")
            continue
        status, value = outcome
        if status == "error":
            errors.append(f"{plan['site']} raised:\n{value}")
        results.append(value)
    assert not errors, "\n".join(errors)
    return results
