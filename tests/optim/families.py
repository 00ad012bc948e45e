"""The contract on transformers architectures, run inside real gloo workers: every
`registry.REGISTRY` configuration on a tiny Llama (GQA with one k/v head, SwiGLU, RMSNorm,
untied head) and a tiny GPT-2 (Conv1D [in, out] weights, 1-D biases, LayerNorm, learned
positions, tied head), built by the harness's own `thinwire.train.model.build_model`.

`run_families(rank, world, pairs)` trains every (family, name) flat at world 2;
`run_families_two_tier(rank, world, names)` trains the Llama on 2 sites x 2 ranks, each
decoder layer its own FSDP2 unit, then the root (`thinwire.train.sites.shard_model`, as the
harness does). Both return {key: result or {"error": traceback}}; test_families.py and
test_families_sharded.py assert.

The data: every sequence follows one fixed random permutation of the vocabulary from a
random start token (x[t+1] = PERM[x[t]]), so next-token cross-entropy has something to learn
from ln(V) toward 0, while each (rank, step) still draws its own batch.
"""

from __future__ import annotations

import io
import traceback

import torch
import torch.nn.functional as F

from tests.dist import run_workers
from tests.optim.registry import REGISTRY
from tests.optim.sharded import SITES, flat_full, flat_local, local

FAMILIES = ("llama", "gpt2")
VOCAB, CONTEXT, BATCH, EVAL_BATCH = 64, 16, 8, 32
# 8 steps: LoRDO / DiLoCo sync at steps 3 and 7 (registry.SYNC_EVERY = 4), so the run ends on a
# sync, where their replicas are bit-identical; APMSqueeze's registry warmup (APM_WARMUP = 5
# dense steps, 0-4) leaves steps 5-7 in the 1-bit phase. The checkpoint at 6 is taken mid-interval
# for LoRDO / DiLoCo (local state that no sync has averaged yet) and inside APMSqueeze's 1-bit
# phase (its two-level error feedback and frozen v̂), which a resume at a sync or in warmup would miss.
STEPS, RESUME_AT = 8, 6


def config(family: str, seed: int = 0):
    from thinwire.train.config import get_preset
    return get_preset("tiny", model=family, n_layer=1, n_embd=32, n_head=4, context=CONTEXT, vocab_size=VOCAB,
                      seed=seed)


def make_model(family: str, seed: int = 0) -> torch.nn.Module:
    """llama: k_proj / v_proj [8, 32] (one k/v head of 8 for 4 query heads), gate / up [88, 32],
    down [32, 88], RMSNorm gains [32], embedding and head [64, 32] apart. gpt2: c_attn [32, 96],
    c_fc [32, 128], c_proj [128, 32] and [32, 32] (Conv1D, [in, out]), biases and LayerNorm
    gains and biases, wpe [16, 32], the head tied to wte [64, 32]."""
    from thinwire.train.model import build_model
    return build_model(config(family, seed))


_PERM = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4321))


def tokens(seed: int, rows: int) -> torch.Tensor:
    """[rows, CONTEXT + 1] token ids: random starts, then the permutation chain."""
    x = torch.empty(rows, CONTEXT + 1, dtype=torch.long)
    x[:, 0] = torch.randint(VOCAB, (rows,), generator=torch.Generator().manual_seed(seed))
    for t in range(CONTEXT):
        x[:, t + 1] = _PERM[x[:, t]]
    return x


def batch(rank: int, step: int) -> torch.Tensor:
    return tokens(10_000 * rank + step, BATCH)


def loss_on(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def eval_loss(model) -> float:
    """On a fixed held-out batch (every rank of an FSDP2 site must call it: its forward
    all-gathers; after it, every unit is resharded, as FSDP2 leaves them gathered after a
    forward without backward when reshard_after_forward=False)."""
    with torch.no_grad():
        loss = float(loss_on(model, tokens(999_999, EVAL_BATCH)))
    for m in model.modules():
        if hasattr(m, "reshard"):
            m.reshard()
    return loss


def train(opt, model, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        loss_on(model, batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    if stop == STEPS:
        opt.flush()                    # overlap: the last exchange lands (LoRDO / DiLoCo: the last sync)


def round_trip(obj):
    """What a checkpoint on disk gives back: copies, nothing shared with the live run."""
    blob = io.BytesIO()
    torch.save(obj, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=False)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def case_flat(family: str, name: str, rank: int) -> dict:
    """One run of STEPS, checkpointed (model and optimizer state_dict, through torch.save) at
    RESUME_AT and going on; a FRESH model (another init seed) and optimizer loaded from that
    checkpoint run the rest. state_dict() only observes (test_suite.py checks that), so the
    run that took it is the uninterrupted run."""
    build = REGISTRY[name].build
    model = make_model(family)
    named = list(model.named_parameters())
    start = [p.detach().clone() for _, p in named]
    opt = build([p for _, p in named])
    before = eval_loss(model)
    train(opt, model, rank, 0, RESUME_AT)
    saved = round_trip({"model": model.state_dict(), "opt": opt.state_dict()})
    train(opt, model, rank, RESUME_AT, STEPS)
    fresh = make_model(family, seed=77)
    fresh.load_state_dict(saved["model"])
    fresh_opt = build(list(fresh.parameters()))
    fresh_opt.load_state_dict(saved["opt"])
    train(fresh_opt, fresh, rank, RESUME_AT, STEPS)
    return {"params": flat(model), "resumed": flat(fresh), "loss_before": before, "loss_after": eval_loss(model),
            "finite": bool(torch.isfinite(flat(model)).all()),
            "unmoved": [f"{n} {tuple(p.shape)}" for (n, p), s in zip(named, start) if torch.equal(p.detach(), s)]}


def spawn(fn, world: int, keys):
    """[fn(rank, world, keys) per rank] from one spawn of `world` gloo workers, or the exception
    that spawn raised (a module fixture keeps it: every test fails with it, none spawns again)."""
    try:
        return run_workers(fn, world, args=(keys,), timeout=600)
    except Exception as exc:
        return exc


def ranks_of(runs, key, what: str) -> list:
    """Every rank's result for `key`; the test fails with the first rank's traceback, if any."""
    import pytest
    if isinstance(runs, Exception):
        pytest.fail(f"{what} failed: {runs}", pytrace=False)
    ranks = [r[key] for r in runs]
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, errors[0]
    return ranks


def _cases(keys, fn) -> dict:
    results = {}
    for key in keys:
        try:
            results[key] = fn(*key) if isinstance(key, tuple) else fn(key)
        except Exception:  # one failing case must not hide the others' results
            results[key] = {"error": traceback.format_exc()}
    return results


def run_families(rank: int, world: int, pairs) -> dict:
    return _cases(pairs, lambda family, name: case_flat(family, name, rank))


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter (a DTensor gathered over the site: every rank of the site calls it)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def sharded_llama(mesh, seed: int = 0) -> torch.nn.Module:
    from thinwire.train.sites import shard_model
    return shard_model(make_model("llama", seed), mesh["shard"])


def case_two_tier(name: str, rank: int, mesh) -> dict:
    """tests/optim/sharded.py's case_two_tier on the sharded Llama: this rank's shards and
    optimizer state checkpointed at RESUME_AT, resumed into a fresh model and optimizer."""
    build, group = REGISTRY[name].build, mesh["site"].get_group()
    model = sharded_llama(mesh)
    opt = build(list(model.parameters()), process_group=group)
    named = list(model.named_parameters())
    start = [full(p) for _, p in named]
    before = eval_loss(model)
    train(opt, model, rank, 0, RESUME_AT)
    saved = round_trip({"params": [local(p.detach()) for p in model.parameters()], "opt": opt.state_dict()})
    train(opt, model, rank, RESUME_AT, STEPS)
    fresh = sharded_llama(mesh, seed=77)
    with torch.no_grad():
        for p, value in zip(fresh.parameters(), saved["params"]):
            local(p).copy_(value)
    fresh_opt = build(list(fresh.parameters()), process_group=group)
    fresh_opt.load_state_dict(saved["opt"])
    train(fresh_opt, fresh, rank, RESUME_AT, STEPS)
    unmoved = [f"{n} {tuple(p.shape)}" for (n, p), s in zip(named, start) if torch.equal(full(p), s)]
    whole = flat_full(model)
    return {"local": flat_local(model), "full": whole, "resumed": flat_local(fresh), "unmoved": unmoved,
            "loss_before": before, "loss_after": eval_loss(model), "finite": bool(torch.isfinite(whole).all())}


def run_families_two_tier(rank: int, world: int, names) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (SITES, world // SITES), mesh_dim_names=("site", "shard"))
    return _cases(names, lambda name: case_two_tier(name, rank, mesh))
