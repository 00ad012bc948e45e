"""Elastic resume of a two-tier run (issue 27): a `--sites` checkpoint resumes at another
number of sites with the same ranks per site. Real gloo processes through `thinwire train`:
DeMo written by 2 sites x 2 ranks resumed by 1 site x 2 ranks (each shard's momentum the mean
of the two sites'), LoRDO written by 1 site x 2 ranks resumed by 2 x 2 (each shard's state and
replica copied to both sites). Each resumed run finishes and announces both layouts in one
line; each new rank's loaded state is the interval rule over sites applied, shard position by
shard position, to the old ranks' saved blobs, computed here from the checkpoint's own bytes.
Another number of ranks per site is refused before any worker starts, naming both."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.dist import run_workers
from tests.train.shared import Forked, start, wait
from tests.train.test_elastic_resume import _mixed, _old_blobs, _weights
from thinwire.train.checkpoint import checkpoint_root, latest
from thinwire.train.config import get_preset

STEPS, P = 4, 2                                      # checkpoints at steps 2 and 4; killed as step 3 starts
FLAGS = ["--preset", "tiny", "--steps", str(STEPS), "--eval-every", "2", "--eval-rows", "16", "--sync-every", "3",
         "--checkpoint-every", "2", "--quiet"]
CASES = {"demo": (2, 1), "lordo": (1, 2)}            # optimizer: (old sites, new sites), P ranks per site


def _argv(name: str, sites: int, out: Path) -> list[str]:
    return ["train", "--optimizer", name, *FLAGS, "--workers", str(sites * P), "--sites", str(sites), "--out", str(out)]


def _train(out: Path, name: str, sites: int, die: str | None = None) -> Forked:
    return start([sys.executable, "-m", "thinwire", *_argv(name, sites, out)], die)


def _load_on_new_layout(rank: int, world: int, path: str, name: str) -> dict:
    """What the harness's worker does before its first step after the resume: FSDP2 in each
    site, the optimizer across sites (train/sites.setup), then checkpoint.load."""
    from thinwire.train.checkpoint import load
    from thinwire.train.model import build_model
    from thinwire.train.optimizers import get_optimizer
    from thinwire.train.sites import Tiers, setup
    from thinwire.train.worker import lr_factor
    cfg = get_preset("tiny", steps=STEPS, eval_every=2, eval_rows=16, workers=world, sites=world // P, sync_every=3)
    spec = get_optimizer(name)
    model, built, _, _ = setup(Tiers.of(cfg, world), build_model(cfg), spec, cfg, spec.lr_for("tiny"),
                            torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(built.optimizer, lambda s: lr_factor(s, cfg))
    step = load(path, model, built, sched, rank)
    return {"step": step, "epoch": sched.last_epoch, "rng": torch.get_rng_state(),
            "optimizer": built.optimizer.state_dict(),
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def _load_then_write(rank: int, world: int, path: str, name: str, write: str, out: str) -> dict:
    """One launch of 2 x 2 ranks does two things (every launch of 4 processes on 2 cores costs
    seconds): optimizer `name`'s checkpoint `path` loaded on this layout, then optimizer `write`'s
    whole run written to `out` as `thinwire train` would (its CLI flags, one worker each)."""
    from thinwire.train.cli import build_parser, config_from_args, options_from_args
    from thinwire.train.run import learning_rate, prepare
    from thinwire.train.worker import train_worker
    loaded = _load_on_new_layout(rank, world, path, name)
    args = build_parser().parse_args(_argv(write, world // P, Path(out)))
    cfg, opts = prepare(config_from_args(args), options_from_args(args), announce=False)
    train_worker(rank, world, cfg, write, learning_rate(cfg, write, opts.lrs), str(Path(out, f"{write}.jsonl")), opts)
    return loaded


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per optimizer: (its output resumed on the new layout, the resumed command's output, a
    copy of the step-2 checkpoint written by the old layout, what each new rank loads from it).
    Five launches: LoRDO on 1 x 2 killed as step 3 starts; on 2 x 2, LoRDO's step 2 loaded and
    DeMo's whole run written (its step-4 checkpoint then removed); DeMo resumed on 1 x 2 and
    LoRDO on 2 x 2 by `thinwire train`, side by side with DeMo's step 2 loaded on 1 x 2."""
    root, saved, loaded, text = tmp_path_factory.mktemp("elastic_sites"), {}, {}, {}
    first = wait(_train(root / "lordo", "lordo", 1, die="0:3"))
    assert first.returncode == 1 and latest(checkpoint_root(root / "lordo")).name == "step-000002", first.stdout[-3000:]
    for name in CASES:
        saved[name] = root / f"{name}-step-000002"
    shutil.copytree(checkpoint_root(root / "lordo") / "step-000002", saved["lordo"])
    (root / "demo").mkdir()
    loaded["lordo"] = run_workers(_load_then_write, 2 * P, args=(str(saved["lordo"]), "lordo", "demo",
                                                                  str(root / "demo")))
    shutil.copytree(checkpoint_root(root / "demo") / "step-000002", saved["demo"])
    shutil.rmtree(checkpoint_root(root / "demo") / f"step-{STEPS:06d}")
    again = {name: _train(root / name, name, new) for name, (_, new) in CASES.items()}   # side by side
    loaded["demo"] = run_workers(_load_on_new_layout, P, args=(str(saved["demo"]), "demo"))
    for name, proc in again.items():
        done = wait(proc)
        assert done.returncode == 0, done.stdout[-3000:]
        text[name] = done.stdout
    return {name: (root / name, text[name], saved[name], loaded[name]) for name in CASES}


def _layout(sites: int) -> str:
    return f"{sites} site{'s' * (sites > 1)} x {P} ranks"


@pytest.mark.parametrize("name", CASES)
def test_resumed_run_finishes_and_announces_both_layouts(name, runs):
    old, new = CASES[name]
    run, text, _, _ = runs[name]
    assert latest(checkpoint_root(run)).name == f"step-{STEPS:06d}"
    recs = [json.loads(line) for line in (run / f"{name}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "step"] == list(range(1, STEPS + 1))
    a = "[[0.5, 0.5]]" if (old, new) == (2, 1) else "[[1], [1]]"
    assert (f"thinwire: resuming {name}'s step-000002, {_layout(old)} -> {_layout(new)}: per-rank optimizer state "
            f"mapped across sites, shard by shard, by the interval rule") in text and f"A = {a}" in text, text
    (rec,) = [r for r in recs if r["kind"] == "resume"]
    assert (rec["step"], rec["old_world"], rec["world"], rec["old_sites"], rec["sites"]) == (2, old * P, new * P,
                                                                                             old, new)
    assert 0 < rec["load_s"] < rec["time_to_recover_s"] < 240
    final = recs[-1]
    assert final["kind"] == "final" and (final["tiers"]["sites"], final["tiers"]["ranks_per_site"]) == (new, P)
    assert len(final["tiers"]["site"]["payload_bytes"]) == STEPS      # a new site's history: zeros before it


@pytest.mark.parametrize("name", CASES)
def test_each_new_rank_loads_the_rule_over_sites_of_the_ranks_that_held_its_shard(name, runs, tmp_path):
    old, new = CASES[name]
    _, _, saved, loaded = runs[name]
    blobs = _old_blobs(saved, tmp_path)
    assert len(blobs) == old * P and len(loaded) == new * P
    weights = _weights(old, new)
    seed = get_preset("tiny").seed
    for r, got in enumerate(loaded):
        site, shard = divmod(r, P)
        mine = [blobs[i * P + shard] for i in range(old)]                # old site i's rank holding shard s
        assert got["step"] == 2 and got["epoch"] == 2
        want_rng = (blobs[r]["rng"]["cpu"] if r < old * P
                    else torch.Generator().manual_seed((seed * 1_000_003 + 2) * 65_537 + r).get_state())
        assert torch.equal(got["rng"], want_rng)
        if name == "demo":                             # each shard's momentum: the mean of the two sites'
            assert weights[site] == [0.5, 0.5]
            for k, state in got["optimizer"]["state"].items():
                values = [b["optimizer"]["state"][k]["momentum"] for b in mine]
                assert not torch.equal(values[0], values[1])            # the sites' error feedback differs
                torch.testing.assert_close(state["momentum"], _mixed(values, weights[site]), rtol=1e-6, atol=1e-7)
        else:                                          # one old site: both new sites copy it, exactly
            (only,) = mine
            assert weights[site] == [1]
            for n, p in got["params"].items():
                assert torch.equal(p, only["params"][n])
            for k, state in got["optimizer"]["state"].items():
                for key, value in state.items():
                    want = only["optimizer"]["state"][k][key]
                    assert torch.equal(value, want) if torch.is_tensor(value) else value == want
    if name == "lordo":                                # the shards differ: each rank got its own position's
        assert not torch.equal(loaded[0]["params"]["blocks.0.qkv.weight"],
                               loaded[1]["params"]["blocks.0.qkv.weight"])


def test_another_number_of_ranks_per_site_is_refused_naming_both(runs, tmp_path, capsys):
    from thinwire.train.cli import main
    out = tmp_path / "run"
    shutil.copytree(runs["lordo"][0], out)                          # its latest: 2 sites x 2 ranks, at the end
    with pytest.raises(SystemExit) as exc:
        main(["train", "--optimizer", "lordo", *FLAGS, "--workers", "3", "--sites", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert ("ranks per site: checkpoint 2 (2 sites x 2 ranks), this run 3 (1 site x 3 ranks); a --sites run resumes "
            "at another number of sites with the same ranks per site only") in err, err
    assert "resuming" not in err
