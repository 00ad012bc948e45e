"""A tiny model trained by DeMo or SparseLoCo on 2 sites, over gloo or through a store.

    run_gloo(kind)                                  # tests.dist: 2 gloo processes
    run_store(kind, url, round_timeout, late=None, options=None, patience=2)  # 2 processes sharing only the store
    late = (rank, step, seconds): that site sleeps before its step() of `step`
    late = (rank, step, seconds, "nan"): and its gradients are not finite there

Each returns, per rank, {'history': [per step: params, optimizer state], 'stats', 'missed'}.
Both runs call `train` with the same model, data and settings; only the process group differs.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

import thinwire
from thinwire.store import StoreGroup
from thinwire.train.launch import exit_process, start_method

SITES = ["site-a", "site-b"]
KEY, CONFIG = b"the run's key", '{"test": "store optimizers"}'
SETTINGS = {
    # identity transform and fp32 values: what a late site keeps is exact (x - x + x = x)
    "demo": dict(lr=1e-2, topk=4, chunk=8, transform="identity", values="fp32"),
    "demo-bf16": dict(lr=1e-2, topk=4, chunk=8),
    "demo-overlap": dict(lr=1e-2, topk=4, chunk=8, overlap=True),    # two rounds in flight at once
    "sparseloco": dict(sync_every=2, topk=4, chunk=8, values="fp32"),
    "sparseloco-2bit": dict(sync_every=2, topk=4, chunk=8),
    "sparseloco-flat": dict(sync_every=2, topk=4, chunk=8),       # the per-tensor path (grouped False)
    "diloco-bf16": dict(sync_every=2, wire="bf16"),
    "diloco-int8": dict(sync_every=2, wire="int8"),
    "sign-demo": dict(lr=1e-2, topk=4, chunk=8),                     # signs only: M keeps the exact values
}
STEPS = {kind: 4 if kind.startswith(("demo", "sign-demo")) else 6 for kind in SETTINGS}
CLASSES = {"demo": thinwire.DeMo, "sparseloco": thinwire.SparseLoCo, "diloco": thinwire.DiLoCo, "sign": thinwire.SignDeMo}


def make(kind: str, params, group):
    opt = CLASSES[kind.split("-")[0]](params, process_group=group, **SETTINGS[kind])
    if kind.startswith("sparseloco"):
        opt.grouped = not kind.endswith("-flat")
    return opt


def train(rank: int, world_size: int, kind: str, group=None, late=None) -> dict:
    torch.manual_seed(0)                                   # the same initial model on every site
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = make(kind, model.parameters(), group)
    params, history = list(model.parameters()), []
    for step in range(1, STEPS[kind] + 1):
        data = torch.Generator().manual_seed(1000 * rank + step)     # each site its own data
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 8, generator=data)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if late is not None and late[:2] == (rank, step):
            time.sleep(late[2])                            # past the others' round deadline
            if len(late) > 3 and late[3] == "nan":         # and with non-finite gradients
                params[0].grad.fill_(float("nan"))
        opt.step()
        history.append({"params": [p.detach().clone() for p in params],
                        "state": [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                                  for p in params]})
    opt.flush()                                            # overlap: the last step's exchange lands
    missed = None if group is None else group.missed_rounds
    return {"history": history, "stats": opt.comm_stats.as_dict(), "missed": missed}


def run_gloo(kind: str) -> list[dict]:
    from tests.dist import run_workers
    return run_workers(train, world_size=2, args=(kind,))


def _site_main(tmpdir: str, rank: int, kind: str, url: str, round_timeout: float, late, options, patience) -> None:
    torch.set_num_threads(1)
    path = os.path.join(tmpdir, f"result{rank}.pt")
    try:
        group = StoreGroup(url, SITES[rank], SITES, KEY, CONFIG, round_timeout, join_timeout=120.0,
                           poll=(0.01, 0.1), patience=patience, options=options)
        torch.save(("ok", train(rank, len(SITES), kind, group, late)), path)
    except BaseException:
        torch.save(("error", traceback.format_exc()), path)
    exit_process(0)


def run_processes(target, args: list[tuple], timeout: float) -> list[tuple | int]:
    """One process per entry of `args`, `target(tmpdir, i, *args[i])`, which saves its
    (status, value) at tmpdir/result{i}.pt; waited for up to `timeout` in all, the hung ones
    killed. Per process: its (status, value), or its exit code when it saved nothing."""
    ctx = mp.get_context(start_method())
    with tempfile.TemporaryDirectory() as tmpdir:
        procs = [ctx.Process(target=target, daemon=True, args=(tmpdir, i, *a)) for i, a in enumerate(args)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        paths = [os.path.join(tmpdir, f"result{i}.pt") for i in range(len(procs))]
        return [torch.load(path, weights_only=False) if os.path.exists(path) else proc.exitcode
                for path, proc in zip(paths, procs)]


def run_store(kind: str, url: str, round_timeout: float, late=None, options: dict | None = None,
              timeout: float = 180.0, raises: bool = False, patience: int = 2) -> list:
    """One process per site, sharing nothing but the store at `url` (`options`: its S3 settings).
    raises=True: a site that raised gives its traceback (a str) instead of failing the call.
    patience: late rounds before a site is presumed gone (`RoundExchange`)."""
    outcomes = run_processes(_site_main, [(kind, url, round_timeout, late, options or {}, patience)] * len(SITES),
                             timeout)
    results, errors = [], []
    for r, outcome in enumerate(outcomes):
        if not isinstance(outcome, tuple):
            errors.append(f"site {r}: hung or died (exit code {outcome})")
            continue
        status, value = outcome
        if status == "error" and not raises:
            errors.append(f"site {r} raised:\n{value}")
        results.append(value)
    assert not errors, "\n".join(errors)
    return results
