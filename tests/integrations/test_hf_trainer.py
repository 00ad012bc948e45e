"""examples/hf_trainer_train.py, the README's Trainer recipe, under torchrun with 2 gloo processes
(`ThinwireTrainer`, thinwire/integrations/hf_trainer.py), for DeMo and LoRDO:
- every collective counted (`CollectiveCounter`): none in backward, the optimizer's bytes as
  its comm_stats counts them and, for LoRDO, as its wire format gives them by hand; one step()
  per 2 accumulated micro-batches. A plain `Trainer` with the same arguments all-reduces every
  gradient every step, so the 0 is not a counting mistake;
- a run resumed through `trainer.train(resume_from_checkpoint=...)` ends bit for bit where the
  uninterrupted run ends, on both ranks: LoRDO's (resume_from_checkpoint=True) in the directory
  of the run killed mid-save (below), DeMo's (a path) from its uninterrupted run's checkpoint at
  step 10 (one launch fewer); each rank's own state is in the checkpoint, naming its rank and
  run (rank 1's differs from the rank-0 optimizer.pt Trainer loads on every rank);
  replicas identical at the end (LoRDO's 20 steps end on a sync); DeMo runs with overlap=True:
  its step in flight is saved (not flushed) and resumed, and lands at the end of training;
- a run killed while checkpoint 10 is written (rank 1 dies after rank 0 wrote its state there;
  save_total_limit=1), resumed with resume_from_checkpoint=True, skips checkpoint 10 (it says
  why), takes checkpoint 5 (rotation kept it) and ends bit-identical; no FutureWarning in any
  ThinwireTrainer launch's output;
- a bad configuration (ddp_broadcast_buffers or ddp_find_unused_parameters True, Trainer's own
  optimizer) is refused; in one process, an incomplete checkpoint, and a rank file of another
  rank, run or optimizer, are refused naming both."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.integrations.launch import Forked, differs, finish, preloaded, read_wire, torchrun
from tests.optim.registry import HANDSHAKE, dense_bytes
from tests.train.shared import train_env
from thinwire.integrations.commit import MARK
from thinwire.optim.checkpoints import INFLIGHT_KEY

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer_train.py"
STEPS, SAVE_AT, SYNC_EVERY = 20, 10, 4          # LoRDO: checkpoint between syncs 8 and 12, the end on one
EVERY, CUT = 5, 10              # the killed run checkpoints every 5 steps, keeps 1, and dies while writing 10's
OPTIMIZERS = ("demo", "lordo")
KILLED = "lordo"                # killed mid-save and resumed in its directory; DeMo from its whole run's checkpoint


def _torchrun(env: dict, optimizer: str, out: Path, *flags: str) -> Forked:
    return torchrun(EXAMPLE, "--optimizer", optimizer, "--steps", str(STEPS), "--out", str(out), *flags, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with preloaded(EXAMPLE, train_env(HF_HUB_OFFLINE="1")) as env:   # transformers imported once, not by 12 workers
        return _runs(tmp_path_factory, env)


def _runs(tmp_path_factory, env: dict) -> dict:
    """{optimizer: {"whole", "resumed" (KILLED's also "killed"): run directories, "checkpoint":
    the whole run's at SAVE_AT}, KILLED's "left": what its killed run left, "plain": the
    baseline, "output": each thinwire launch's output}: six launches, four then two."""
    root = tmp_path_factory.mktemp("hf_trainer")
    dirs = {name: {"whole": root / f"{name}-whole"} for name in OPTIMIZERS}
    dirs["demo"]["resumed"] = root / "demo-resumed"                    # resume_from_checkpoint=<path>
    killed = dirs[KILLED]["killed"] = dirs[KILLED]["resumed"] = root / f"{KILLED}-killed"   # =True, in its own dir
    for d in dirs.values():
        d["checkpoint"] = d["whole"] / f"checkpoint-{SAVE_AT}"
    dirs["plain"] = root / "plain"
    cut = ("--save-at", str(EVERY), "--save-total-limit", "1")
    first = [(_torchrun(env, n, dirs[n]["whole"], "--count", "--save-at", str(SAVE_AT)), True) for n in OPTIMIZERS]
    first.append((_torchrun(env, KILLED, killed, *cut, "--kill-mid-save", str(CUT)), False))
    first.append((_torchrun(env, "demo", dirs["plain"], "--plain-ddp", "--count"), True))
    dirs["output"] = [finish(proc, ok) for proc, ok in first][:-1]   # not plain Trainer's
    dirs[KILLED]["left"] = {p.name: sorted(f.name for f in p.iterdir()) for p in killed.glob("checkpoint-*")}
    second = [_torchrun(env, "demo", dirs["demo"]["resumed"], "--save-at", str(SAVE_AT), "--resume",
                        str(dirs["demo"]["checkpoint"])),
              _torchrun(env, KILLED, dirs[KILLED]["resumed"], *cut, "--resume", "last")]
    dirs["output"] += [finish(proc) for proc in second]
    return dirs


def _params(directory: Path, rank: int) -> torch.Tensor:
    return torch.load(directory / f"params-rank{rank}.pt")


def test_killed_mid_save_leaves_the_checkpoint_before_it_complete(runs):
    """Rank 1 died at checkpoint-10 after rank 0 wrote its state there, with
    save_total_limit=1: checkpoint-10 has no commit mark, and checkpoint-5 was not rotated away."""
    left = runs[KILLED]["left"]
    assert sorted(left) == [f"checkpoint-{CUT}", f"checkpoint-{EVERY}"]
    assert {MARK, "thinwire-rank0.pt", "thinwire-rank1.pt"} <= set(left[f"checkpoint-{EVERY}"])
    cut = set(left[f"checkpoint-{CUT}"])
    assert "thinwire-rank0.pt" in cut and "thinwire-rank1.pt" not in cut and MARK not in cut


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resumed_from_a_trainer_checkpoint_ends_bit_identical(runs, optimizer):
    d = runs[optimizer]
    for rank in (0, 1):
        assert torch.equal(_params(d["whole"], rank), _params(d["resumed"], rank)), f"rank {rank} resumed elsewhere"
    assert torch.equal(_params(d["whole"], 0), _params(d["whole"], 1))          # replicas identical at the end
    # a run that ignored the checkpoint and trained from step 0 would end the same: it would also
    # write the checkpoint it resumed from again, and say nothing of where it resumed
    if optimizer == KILLED:
        output, killed = runs["output"][-1], d["killed"]
        assert f"thinwire: skipping {killed / f'checkpoint-{CUT}'}: it has no commit mark" in output
        assert f"thinwire: resuming from {killed / f'checkpoint-{EVERY}'}\n" in output
        assert sorted(p.name for p in killed.glob("checkpoint-*")) == [f"checkpoint-{STEPS}"]   # limit 1
        assert (killed / f"checkpoint-{STEPS}" / MARK).is_file()
    else:
        assert sorted(p.name for p in d["resumed"].glob("checkpoint-*")) == [f"checkpoint-{STEPS}"]


def test_no_future_warning_in_a_thinwire_trainer_launch(runs):
    """ddp_broadcast_buffers=False reaches DDP as forward_sync_buffers, not as the deprecated
    broadcast_buffers torch 2.13 warns about (plain Trainer's launch, which passes it, is left out)."""
    assert len(runs["output"]) == 5
    for output in runs["output"]:
        assert "FutureWarning" not in output, output[-3000:]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_checkpoint_holds_each_ranks_own_state(runs, optimizer):
    checkpoint = runs[optimizer]["checkpoint"]
    own = [torch.load(checkpoint / f"thinwire-rank{r}.pt", weights_only=True) for r in (0, 1)]
    trainers = torch.load(checkpoint / "optimizer.pt", weights_only=True)      # what Trainer loads on every rank
    assert not differs(trainers["state"], own[0]["optimizer"]["state"])       # it is rank 0's
    assert differs(own[0]["optimizer"]["state"], own[1]["optimizer"]["state"])  # rank 1's is its own
    mark = json.loads((checkpoint / MARK).read_text())
    for rank, state in enumerate(own):                                         # each names whose it is
        assert {k: state["identity"][k] for k in ("rank", "world", "run", "fingerprint")} == \
            {"rank": rank, "world": 2, "run": mark["run"], "fingerprint": mark["fingerprint"]}
    if optimizer == "lordo":                                                   # between syncs: own replicas
        assert differs(own[0]["params"], own[1]["params"])
    else:                                                                      # overlap: saved in flight, not flushed
        assert all(INFLIGHT_KEY in state["optimizer"] for state in own)
    assert all((checkpoint / f"rng_state_{r}.pth").is_file() for r in (0, 1))  # Trainer's per-rank RNG


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_training_ends_with_the_step_in_flight_landed(runs, optimizer):
    """checkpoint-20 is written before on_train_end: DeMo (overlap=True) still has step 20 in
    flight there, which the flush lands in the final model; LoRDO has none in flight."""
    from safetensors.torch import load_file
    saved = load_file(runs[optimizer]["whole"] / f"checkpoint-{STEPS}" / "model.safetensors")
    at_checkpoint = torch.cat([saved[name].reshape(-1) for name, _ in _llama().named_parameters()])
    assert torch.equal(at_checkpoint, _params(runs[optimizer]["whole"], 0)) == (optimizer == "lordo")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_no_gradient_bytes_and_the_optimizer_sends_its_wire_format(runs, optimizer):
    for rank in (0, 1):
        wire = read_wire(runs[optimizer]["whole"], rank)
        counted = wire["counter"]
        assert "backward" not in counted                                       # not one collective in backward
        assert counted["optimizer_steps"] == STEPS                             # one step() per 2 micro-batches
        optimizer_bytes = sum(op["bytes"] for op in counted["optimizer"].values())
        assert optimizer_bytes == wire["comm_stats"]["totals"]["payload_bytes"]
        if optimizer == "lordo":                                               # the handshake, 5 fp32 syncs
            sizes = [p.numel() for p in _llama().parameters()]
            assert optimizer_bytes == HANDSHAKE + STEPS // SYNC_EVERY * dense_bytes(sizes, 4)


def test_a_plain_trainer_sends_every_gradient_every_step(runs):
    params = sum(p.numel() for p in _llama().parameters())
    for rank in (0, 1):
        counted = read_wire(runs["plain"], rank)["counter"]
        assert sum(op["bytes"] for op in counted["backward"].values()) == STEPS * 4 * params


def test_a_configuration_that_breaks_the_guarantees_is_refused(tmp_path):
    from transformers import TrainingArguments

    from thinwire import DeMo
    from thinwire.integrations.hf_trainer import ThinwireTrainer
    model = _llama()
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    cases = [(TrainingArguments(**base, ddp_broadcast_buffers=True), DeMo(model.parameters(), lr=1e-3),
              "ddp_broadcast_buffers=True"),
             (TrainingArguments(**base, ddp_find_unused_parameters=True), DeMo(model.parameters(), lr=1e-3),
              "ddp_find_unused_parameters=True"),
             (TrainingArguments(**base), torch.optim.AdamW(model.parameters()), "thinwire optimizer")]
    for args, opt, message in cases:
        with pytest.raises(ValueError, match=message):
            ThinwireTrainer(model=model, args=args, optimizers=(opt, None))


def test_left_unset_ddp_settings_are_set_as_thinwire_needs(tmp_path):
    """Trainer's default for a PreTrainedModel (find_unused_parameters True under DDP) is turned
    off, and broadcast_buffers is not passed where DDP has forward_sync_buffers (no FutureWarning;
    keep_gradients_local stops the per-forward sync by that name)."""
    from transformers import TrainingArguments

    from thinwire import DeMo
    from thinwire.integrations.hf_trainer import FORWARD_SYNC, ThinwireTrainer
    model = _llama()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                             ddp_broadcast_buffers=False)
    trainer = ThinwireTrainer(model=model, args=args, optimizers=(DeMo(model.parameters(), lr=1e-3), None))
    handler = trainer.accelerator.ddp_handler
    passed = handler.to_kwargs()                                   # what DDP is built with: the non-defaults
    assert handler.find_unused_parameters is False and "find_unused_parameters" not in passed   # DDP's False
    assert FORWARD_SYNC and "broadcast_buffers" not in passed


def _example():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import hf_trainer_train
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return hf_trainer_train


def _edit(path: Path, **identity) -> None:
    saved = torch.load(path, weights_only=True)
    saved["identity"].update(identity)
    torch.save(saved, path)


def test_an_incomplete_or_foreign_checkpoint_is_refused_and_latest_skips_it(tmp_path, capfd):
    """One process (no DDP), checkpoints 1 and 2: an explicit path to an incomplete checkpoint
    is refused naming the newest complete one; a rank file of another rank, of another run or
    of another optimizer is refused naming both, before Trainer loads anything; `True` skips
    the incomplete checkpoint with one line saying why and resumes from the one before."""
    from transformers import TrainingArguments

    from thinwire import DeMo, LoRDO
    from thinwire.integrations.hf_trainer import ThinwireTrainer
    example, model = _example(), _llama()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, save_steps=1,
                             disable_tqdm=True)
    data = example.Windows(torch.arange(8192) % example.VOCAB)
    demo = lambda: DeMo(model.parameters(), lr=1e-3, topk=8, chunk=64)
    build = lambda make=demo: ThinwireTrainer(model=model, args=args, train_dataset=data, optimizers=(make(), None))
    build().train()
    first, second = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    (second / MARK).unlink()
    with pytest.raises(ValueError, match=rf"{second} is incomplete: .*newest complete checkpoint beside it is {first}"):
        build().train(resume_from_checkpoint=str(second))
    rank_file, run = first / "thinwire-rank0.pt", json.loads((first / MARK).read_text())["run"]
    cases = [(dict(rank=1), r"rank 1 of 1 .*; this is rank 0 of 1 .*another rank's state", demo),
             (dict(run="0123456789abcdef"), rf"run 0123456789abcdef .*this is rank 0 of 1 in run {run}.*another run",
              demo),
             ({}, r"\(DeMo, layout \w+\); this is .*\(LoRDO, layout \w+\).*another optimizer",
              lambda: LoRDO(model.parameters(), lr=1e-3, rank=4))]
    before = torch.load(rank_file, weights_only=True)
    for edit, message, make in cases:
        _edit(rank_file, **edit)
        with pytest.raises(ValueError, match=rf"{rank_file} holds .*{message}"):
            build(make).train(resume_from_checkpoint=str(first))
        torch.save(before, rank_file)
    capfd.readouterr()
    build().train(resume_from_checkpoint=True)
    err = capfd.readouterr().err
    assert f"thinwire: skipping {second}: it has no commit mark" in err
    assert f"thinwire: resuming from {first}\n" in err
    assert (second / MARK).is_file()                                     # written again, complete this time


def _llama():
    return _example().build_model()
