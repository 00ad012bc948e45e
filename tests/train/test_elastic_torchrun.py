"""torchrun's elastic rendezvous on localhost (issue 27), with real agents: benchmarks/
elastic_torchrun.py's scenario at one worker per agent. Agents A and B (`torchrun --nnodes 1:2
--rdzv-backend c10d`) start a 2-worker DeMo run; B's process group is SIGKILLed once the log
shows step KILL_AT; A's worker fails (PeerFailure), A's agent re-rendezvouses alone and its
worker resumes on 1 worker from the latest complete checkpoint; agent C starts; A's agent
restarts the group with C on 2 workers, which resume from the latest checkpoint again and finish.

What the log (<out>/demo.jsonl, rank 0's) holds across the restarts: every group's rank 0
rewrites it when it resumes at step S, keeping the records of steps <= S (the resume records
of earlier resumes included) and dropping later ones and any final record; so at the end it
holds steps 1..STEPS once each, in order, with a resume record (S, old world, new world)
between step S and step S + 1 for each resume, and one final record.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("elastic_torchrun", ROOT / "benchmarks" / "elastic_torchrun.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# 60 paced steps: the 1-worker phase outlasts agent C's start (~7 s here) with room to spare
STEPS, EVERY, KILL_AT = 60, 5, 8
TRAIN = ["--preset", "tiny", "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--eval-rows", "16",
         "--peer-timeout", "20", "--quiet"]


def test_a_node_leaves_then_one_joins_and_the_run_finishes_once(tmp_path):
    ev = bench.scenario(tmp_path, "demo", 1, TRAIN, kill_at=KILL_AT, join_after=0.0, step_sleep=0.2, timeout=120)
    said = "\n".join(ev["agents"].values())
    assert ev["a_exit"] == 0 and ev["c_exit"] == 0, said[-5000:]
    assert ev["b_exit"] == -signal.SIGKILL
    assert re.search(r"thinwire: error: rank [01] of 2: step \d+: a peer died", ev["agents"]["A"]), said[-5000:]

    recs = ev["records"]
    resumes = [r for r in recs if r["kind"] == "resume"]
    assert [(r["old_world"], r["world"]) for r in resumes] == [(2, 1), (1, 2)], resumes
    first, second = (r["step"] for r in resumes)
    assert 0 < first < second < STEPS and first % EVERY == 0 and second % EVERY == 0
    assert first <= ev["killed_after_step"] < second
    for r in resumes:
        assert r["checkpoint"] == f"step-{r['step']:06d}" and r["time_to_recover_s"] > 0
        assert f"thinwire: resuming {r['checkpoint']} of a {r['old_world']}-worker demo run on {r['world']} " \
               f"workers" in said
    assert ev["shrunk"]["first_step_at"] - ev["kill"] < 60       # kill -> first step on the smaller world

    kinds = [(r["kind"], r.get("step")) for r in recs if r["kind"] in ("step", "resume", "final")]
    expected = [("step", s) for s in range(1, first + 1)] + [("resume", first)] + \
               [("step", s) for s in range(first + 1, second + 1)] + [("resume", second)] + \
               [("step", s) for s in range(second + 1, STEPS + 1)] + [("final", None)]
    assert kinds == expected
    assert recs[-1]["kind"] == "final" and recs[-1]["replicas_identical"] is True
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["old_world"], r["world"]) for r in summary["runs"][0]["resumes"]] == [(2, 1), (1, 2)]


def _prefixes(store, world: int) -> list[str]:
    """Every rank's fresh_prefix, each rank a thread with its own client of `store`."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch.distributed as dist
    from thinwire.train.launch import fresh_prefix

    def one(rank):
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=20))
        return fresh_prefix(client, rank, world, 20)
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world)))


def test_every_rank_of_a_group_gets_one_prefix_no_earlier_group_used():
    """torchrun's agent store outlives groups: a group's ranks must agree on a prefix that no
    earlier group's keys (its ranks' requests included) can answer; a rank killed before it
    confirmed (a rank 2 that asked, then died) must not count."""
    from datetime import timedelta

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20))
    store.set("thinwire/ask/2", str(store.add("thinwire/tokens", 1)))        # a dead rank's request
    seen = []
    for world in (3, 2, 1, 4):
        prefixes = _prefixes(store, world)
        assert len(set(prefixes)) == 1, prefixes
        assert prefixes[0] not in seen
        seen.append(prefixes[0])
