"""APMSqueeze's error-feedback buffers in its state_dict (under ERRORS_KEY) and their elastic
remap (`thinwire.optim.elastic`): each rank's worker error δ_i is a per-rank quantity, mixed by
the interval rule on the parameters' elements; the server error δ̄ is one error of one vector
partitioned over the ranks (rank c holds chunk c, padded to a multiple of 8W), so it is
concatenated, cut to the parameters' length and re-split for W': exact, not mixed.
"""

from __future__ import annotations

import torch

from ..comm.collectives import padded_numel
from .elastic_rules import expect_keys, mix, replicated, repartition

ERRORS_KEY = "apmsqueeze"


def remap_errors(optimizer, states: list[dict], row, rank: int) -> dict:
    """δ_i by the interval rule (cut to the parameters, re-padded for W'); δ̄ re-partitioned."""
    expect_keys(states, ERRORS_KEY)
    saved = [s[ERRORS_KEY] for s in states]
    for what in ("warmup_steps", "phase"):
        replicated([e[what] for e in saved], f"APMSqueeze {what}")
    if saved[0]["warmup_steps"] != optimizer.warmup_steps:
        raise ValueError(f"warmup_steps: the state has {saved[0]['warmup_steps']}, this APMSqueeze "
                         f"{optimizer.warmup_steps}")
    new = optimizer.comm.world_size
    out = {"world_size": new, "rank": rank, "phase": saved[0]["phase"], "warmup_steps": optimizer.warmup_steps,
           "worker_error": None, "server_error": None}
    if all(e["worker_error"] is None for e in saved):
        return out                                                   # warmup: no errors yet
    numel, old = sum(m.param.numel() for m in optimizer.layout()), len(saved)
    for i, e in enumerate(saved):
        if e["worker_error"] is None or (e["world_size"], e["rank"]) != (old, i) \
                or e["worker_error"].numel() != padded_numel(numel, old):
            raise ValueError(f"states[{i}]: APMSqueeze errors of rank {e['rank']} of {e['world_size']} for "
                             f"{None if e['worker_error'] is None else e['worker_error'].numel()} elements; "
                             f"expected rank {i} of {old} for {numel} parameters' elements, padded")
    # δ'_j = Σ_i A[j, i] δ_i on the parameters' elements; the padding restarts at 0
    worker = torch.zeros(padded_numel(numel, new), dtype=torch.float32, device=saved[0]["worker_error"].device)
    worker[:numel] = mix([e["worker_error"][:numel] for e in saved], row, "APMSqueeze worker_error")
    out["worker_error"] = worker
    out["server_error"] = repartition([e["server_error"] for e in saved], numel, new, rank)
    return out
