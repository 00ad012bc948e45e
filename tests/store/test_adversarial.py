"""Objects that do not belong, at the optimizer level: 2 sites train DeMo through a file://
store while a third process, the attacker, writes into the run's round folders

    round r1+1  a forged object at site-b's key (random bytes signed with another key)
    round r1+2  a replayed one at site-b's key (its genuine round-r1 object, copied)
    round r1+3  a truncated copy of site-a's genuine round-r1 object at site-a's key

each before that site writes (the sites wait for the attacker's go between steps; r1 is the
first step's round). Each round's manifest names the object rejected with its reason, a
warning names it, and nothing from it is applied: every parameter and momentum of both sites,
after every step, equals those of a run where that site was simply absent from that round
(the round closed without it before it wrote; no deadline is raced: every round waits 60 s). The sites clip
(clip='median-norm'), so the clip runs over rounds that delivered one row and two.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import thinwire
from thinwire.store import RoundExchange, StoreGroup
from thinwire.store.envelope import open_envelope, run_fingerprint, seal
from thinwire.store.manifest import Manifest, manifest_key, message_key
from thinwire.store.urls import open_location
from thinwire.train.launch import exit_process, start_method

from .train_sites import CONFIG, KEY, SETTINGS, SITES

STEPS = 5
# step -> (the site whose message is kept out, why): forged, replayed, truncated
ATTACKS = {2: (1, "forged"), 3: (1, "replayed"), 4: (0, "garbled")}


def _wait_for(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.005)


def _announce(path: str, text: str = "") -> None:
    """`path` with `text`, appearing whole: a reader polling for it never sees it empty."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(rank: int, group, side: str, store_dir: str, attacked: bool) -> dict:
    """train_sites.train's model and data, DeMo with the clip; between steps each site waits
    for the attacker's go (attacked) or, where the attack would keep it out, for the round
    to close without it (the reference: simply absent)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = thinwire.DeMo(model.parameters(), process_group=group, clip="median-norm", **SETTINGS["demo"])
    params, history, first = list(model.parameters()), [], None
    for step in range(1, STEPS + 1):
        data = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 8, generator=data)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if attacked:
            _wait_for(os.path.join(side, f"go-{step}"))
        elif ATTACKS.get(step, (None,))[0] == rank:          # absent: the round closes without it first
            _close_without_me(store_dir, rank, first + step - 1)
        opt.step()
        if step == 1:
            first = group.results[-1].round
            _announce(os.path.join(side, f"round-{rank}"), str(first))
        history.append([t.detach().clone() for t in params] + [opt.state[p]["momentum"].clone() for p in params])
    return {"history": history, "missed": group.missed_rounds, "first": first}


def _close_without_me(store_dir: str, rank: int, round: int) -> None:
    """The reference's absence, with no deadline to race: once the other site's message is
    in, this site closes the round (`RoundExchange.close`) before writing its own, so the
    manifest takes the other's message and names this site late, as a deadline would."""
    _wait_for(os.path.join(store_dir, message_key(round, SITES[1 - rank])))
    RoundExchange(f"file://{store_dir}", SITES[rank], SITES, KEY, CONFIG).close(round)


def _site_main(rank: int, out: str, side: str, store_dir: str, attacked: bool) -> None:
    torch.set_num_threads(1)
    warnings = _Warnings()
    logging.getLogger("thinwire.store").addHandler(warnings)
    try:
        group = StoreGroup(f"file://{store_dir}", SITES[rank], SITES, KEY, CONFIG, 60.0,
                           join_timeout=120.0, poll=(0.01, 0.05), patience=10)
        result = _train(rank, group, side, store_dir, attacked)
        torch.save(("ok", {**result, "warnings": warnings.lines}), os.path.join(out, f"site{rank}.pt"))
    except BaseException:
        torch.save(("error", traceback.format_exc()), os.path.join(out, f"site{rank}.pt"))
    exit_process(0)


def _attacker_main(out: str, side: str, store_dir: str) -> None:
    """Plants the three objects for rounds r1+1 .. r1+3, then lets the sites go on."""
    try:
        store = open_location(f"file://{store_dir}")
        _announce(os.path.join(side, "go-1"))
        _wait_for(os.path.join(side, "round-0"))
        first = int(open(os.path.join(side, "round-0")).read())
        genuine = {}
        for site in SITES:                                  # both sites' round-r1 objects
            while (blob := store.get(message_key(first, site))) is None:
                time.sleep(0.005)
            genuine[site] = blob
        forged = seal(os.urandom(len(genuine["site-b"])), key=b"not the run's key",
                      fingerprint=run_fingerprint(CONFIG), round=first + 1, site="site-b")
        assert store.put_once(message_key(first + 1, "site-b"), forged)
        assert store.put_once(message_key(first + 2, "site-b"), genuine["site-b"])
        assert store.put_once(message_key(first + 3, "site-a"), genuine["site-a"][:-40])
        for step in range(2, STEPS + 1):
            _announce(os.path.join(side, f"go-{step}"))
        torch.save(("ok", first), os.path.join(out, "attacker.pt"))
    except BaseException:
        torch.save(("error", traceback.format_exc()), os.path.join(out, "attacker.pt"))
    exit_process(0)


def _run(attacked: bool) -> dict:
    """Both sites (and the attacker) as processes sharing a fresh store folder; their results
    and the rounds' manifests."""
    ctx = mp.get_context(start_method())
    with tempfile.TemporaryDirectory() as tmp:
        store_dir, side = os.path.join(tmp, "store"), os.path.join(tmp, "side")
        os.makedirs(store_dir)
        os.makedirs(side)
        procs = [ctx.Process(target=_site_main, args=(r, tmp, side, store_dir, attacked), daemon=True)
                 for r in range(len(SITES))]
        if attacked:
            procs.append(ctx.Process(target=_attacker_main, args=(tmp, side, store_dir), daemon=True))
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        names = [f"site{r}.pt" for r in range(len(SITES))] + (["attacker.pt"] if attacked else [])
        results, errors = {}, []
        for name in names:
            path = os.path.join(tmp, name)
            status, value = torch.load(path, weights_only=False) if os.path.exists(path) else ("error", "hung or died")
            results[name] = value
            errors += [f"{name} raised:\n{value}"] if status != "ok" else []
        assert not errors, "\n".join(errors)
        store = open_location(f"file://{store_dir}")
        first = results["site0.pt"]["first"]
        manifests = {}
        for step in range(1, STEPS + 1):
            r = first + step - 1
            blob = store.get(manifest_key(r))
            payload = open_envelope(blob, key=KEY, fingerprint=run_fingerprint(CONFIG), round=r).payload
            manifests[step] = Manifest.from_json(payload)
        return {"sites": [results[f"site{r}.pt"] for r in range(len(SITES))], "manifests": manifests}


@pytest.fixture(scope="module")
def runs():
    """The attacked run and the reference (victims simply absent), run at once on threads."""
    got = {}

    def run(name, attacked):
        got[name] = _run(attacked)
    threads = [threading.Thread(target=run, args=("attacked", True)),
               threading.Thread(target=run, args=("absent", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(got) == {"attacked", "absent"}, "a run failed: see the thread's traceback above"
    return got


def test_each_bad_object_is_rejected_by_the_manifest_with_its_reason_and_logged(runs):
    manifests, sites = runs["attacked"]["manifests"], runs["attacked"]["sites"]
    first = sites[0]["first"]
    for step, manifest in manifests.items():
        victim, reason = ATTACKS.get(step, (None, None))
        honest = [s for r, s in enumerate(SITES) if r != victim]
        assert sorted(manifest.accepted) == honest, step
        assert manifest.rejected == ({} if victim is None else {SITES[victim]: reason}), step
        assert manifest.late == (), step
    warnings = [line for s in sites for line in s["warnings"]]
    for step, (victim, reason) in ATTACKS.items():
        r, name = first + step - 1, SITES[victim]
        assert any(line.startswith(f"round {r}: rejected {name}'s message: {reason}") for line in warnings), (step, warnings)
        assert f"round {r}: {name}'s message is not in the manifest ({reason}); keep it for a later round" \
            in sites[victim]["warnings"]
    for rank in range(len(SITES)):
        assert sites[rank]["missed"] == [first + s - 1 for s, (v, _) in ATTACKS.items() if v == rank]


def test_nothing_from_a_rejected_object_is_applied(runs):
    """Every parameter and momentum, both sites, every step: bit for bit the run where the
    victim was absent from those rounds (the reference's manifests say 'late' instead)."""
    absent = runs["absent"]
    for step, (victim, _) in ATTACKS.items():
        assert absent["manifests"][step].late == (SITES[victim],)
    for rank in range(len(SITES)):
        got, want = runs["attacked"]["sites"][rank]["history"], absent["sites"][rank]["history"]
        for step, (a, b) in enumerate(zip(got, want), start=1):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, step)
    for step in range(1, STEPS + 1):                                # replicas identical
        a, b = (runs["attacked"]["sites"][r]["history"][step - 1] for r in range(2))
        n = len(a) // 2
        assert all(torch.equal(x, y) for x, y in zip(a[:n], b[:n])), step
