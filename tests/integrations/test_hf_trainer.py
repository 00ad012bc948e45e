"""examples/hf_trainer_train.py, the README's Trainer recipe, under torchrun with 2 gloo processes
(`ThinwireTrainer`, thinwire/integrations/hf_trainer.py), for DeMo and LoRDO:
- every collective counted (`CollectiveCounter`): none in backward, the optimizer's bytes as
  its comm_stats counts them and, for LoRDO, as its wire format gives them by hand; one step()
  per 2 accumulated micro-batches. A plain `Trainer` with the same arguments all-reduces every
  gradient every step, so the 0 is not a counting mistake;
- a run resumed through `trainer.train(resume_from_checkpoint=...)` from Trainer's checkpoint at
  step 10 ends bit for bit where the uninterrupted run ends, on both ranks: LoRDO's
  (resume_from_checkpoint=True) in the directory of a run SIGKILLed there, DeMo's (a path) from
  its uninterrupted run's checkpoint (one launch fewer); each rank's own state is in the
  checkpoint (rank 1's differs from the rank-0 optimizer.pt Trainer loads on every rank);
  replicas identical at the end (LoRDO's 20 steps end on a sync); DeMo runs with overlap=True:
  its step in flight is saved (not flushed) and resumed, and lands at the end of training;
- a bad configuration (ddp_broadcast_buffers left on, Trainer's own optimizer) is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integrations.launch import differs, finish, read_wire, torchrun
from tests.optim.registry import HANDSHAKE, dense_bytes
from tests.train.shared import train_env
from thinwire.optim.checkpoints import INFLIGHT_KEY

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer_train.py"
STEPS, SAVE_AT, SYNC_EVERY = 20, 10, 4          # LoRDO: checkpoint between syncs 8 and 12, the end on one
OPTIMIZERS = ("demo", "lordo")
KILLED = "lordo"                # SIGKILLed at its checkpoint and resumed in its directory; DeMo from its whole run's


def _torchrun(optimizer: str, out: Path, *flags: str) -> subprocess.Popen:
    return torchrun(EXAMPLE, "--optimizer", optimizer, "--steps", str(STEPS), "--out", str(out),
                    *flags, env=train_env(HF_HUB_OFFLINE="1"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{optimizer: {"whole", "resumed" (KILLED's also "killed"): run directories, "checkpoint": the
    one resumed}, KILLED's "left": what its killed run left, "plain": the baseline}: six launches,
    four then two."""
    root = tmp_path_factory.mktemp("hf_trainer")
    dirs = {name: {"whole": root / f"{name}-whole"} for name in OPTIMIZERS}
    dirs["demo"]["resumed"] = root / "demo-resumed"                    # resume_from_checkpoint=<path>
    killed = dirs[KILLED]["killed"] = dirs[KILLED]["resumed"] = root / f"{KILLED}-killed"   # =True, in its own dir
    for d in dirs.values():
        d["checkpoint"] = d.get("killed", d["whole"]) / f"checkpoint-{SAVE_AT}"
    dirs["plain"] = root / "plain"
    first = [(_torchrun(n, dirs[n]["whole"], "--count", "--save-at", str(SAVE_AT)), True) for n in OPTIMIZERS]
    first.append((_torchrun(KILLED, killed, "--save-at", str(SAVE_AT), "--kill-after-save"), False))
    first.append((_torchrun("demo", dirs["plain"], "--plain-ddp", "--count"), True))
    for proc, ok in first:
        finish(proc, ok)
    dirs[KILLED]["left"] = sorted(p.name for p in killed.iterdir())
    dirs[KILLED]["written"] = _written(dirs[KILLED]["checkpoint"])
    second = [_torchrun("demo", dirs["demo"]["resumed"], "--save-at", str(SAVE_AT), "--resume",
                        str(dirs["demo"]["checkpoint"])),
              _torchrun(KILLED, dirs[KILLED]["resumed"], "--save-at", str(SAVE_AT), "--resume", "last")]
    for proc in second:
        finish(proc)
    return dirs


def _written(checkpoint: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in checkpoint.iterdir()}


def _params(directory: Path, rank: int) -> torch.Tensor:
    return torch.load(directory / f"params-rank{rank}.pt")


def test_killed_at_the_trainer_checkpoint_it_is_resumed_from(runs):
    assert runs[KILLED]["left"] == [f"checkpoint-{SAVE_AT}"]           # it died there: no params, no later one


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resumed_from_a_trainer_checkpoint_ends_bit_identical(runs, optimizer):
    d = runs[optimizer]
    for rank in (0, 1):
        assert torch.equal(_params(d["whole"], rank), _params(d["resumed"], rank)), f"rank {rank} resumed elsewhere"
    assert torch.equal(_params(d["whole"], 0), _params(d["whole"], 1))          # replicas identical at the end
    # a run that ignored the checkpoint and trained from step 0 would end the same: it would also
    # write checkpoint-10 again (into DeMo's fresh directory; over the killed run's in LoRDO's)
    if "written" in d:
        assert _written(d["checkpoint"]) == d["written"]
    else:
        assert sorted(p.name for p in d["resumed"].glob("checkpoint-*")) == [f"checkpoint-{STEPS}"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_checkpoint_holds_each_ranks_own_state(runs, optimizer):
    checkpoint = runs[optimizer]["checkpoint"]
    own = [torch.load(checkpoint / f"thinwire-rank{r}.pt", weights_only=True) for r in (0, 1)]
    trainers = torch.load(checkpoint / "optimizer.pt", weights_only=True)      # what Trainer loads on every rank
    assert not differs(trainers["state"], own[0]["optimizer"]["state"])       # it is rank 0's
    assert differs(own[0]["optimizer"]["state"], own[1]["optimizer"]["state"])  # rank 1's is its own
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
    cases = [(TrainingArguments(**base), DeMo(model.parameters(), lr=1e-3), "ddp_broadcast_buffers=False"),
             (TrainingArguments(**base, ddp_broadcast_buffers=False), torch.optim.AdamW(model.parameters()),
              "thinwire optimizer")]
    for args, opt, message in cases:
        with pytest.raises(ValueError, match=message):
            ThinwireTrainer(model=model, args=args, optimizers=(opt, None))


def _example():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import hf_trainer_train
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return hf_trainer_train


def test_a_resume_without_this_ranks_state_is_refused(tmp_path):
    """One process (no DDP): a checkpoint whose thinwire-rank0.pt is gone cannot be resumed
    with rank 0's Trainer optimizer.pt standing in for it."""
    from transformers import TrainingArguments

    from thinwire import DeMo
    from thinwire.integrations.hf_trainer import ThinwireTrainer
    example, model = _example(), _llama()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, save_steps=1,
                             ddp_broadcast_buffers=False, disable_tqdm=True)
    data = example.Windows(torch.arange(8192) % example.VOCAB)
    build = lambda: ThinwireTrainer(model=model, args=args, train_dataset=data,
                                    optimizers=(DeMo(model.parameters(), lr=1e-3, topk=8, chunk=64), None))
    build().train()
    (tmp_path / "checkpoint-1" / "thinwire-rank0.pt").unlink()
    with pytest.raises(ValueError, match="has no thinwire-rank0.pt"):
        build().train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


def _llama():
    return _example().build_model()
