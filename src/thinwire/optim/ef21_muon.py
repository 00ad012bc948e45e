"""EF21-Muon: Muon with EF21 error feedback on both links (Gruntkowska et al., arXiv 2510.00643).

Per parameter, each step, with W the parameter itself, n ranks, t = lr, C_j = `uplink`,
C = `downlink`, the LMO chosen by the param group's `lmo`:

    worker j:  M_j ← (1 − β) M_j + β ∇f_j(W)          (M_j.lerp_(grad, β), as torch's Muon)
               R_j = C_j(M_j − G_j);   G_j ← G_j + R_j   (the R_j the wire delivers)
    server:    G ← G + (1/n) Σ_j R_j                    (summed in rank order)
               X ← (1 − tλ) X + t · LMO(G)              (λ = weight_decay, decoupled)
               S = C(X − W)
    everyone:  W ← W + S

LMOs (radius t is the group's lr): 'spectral' (Muon) LMO(G) = −√max(1, rows/cols) ·
NS(G), NS = 5 quintic Newton–Schulz steps (`thinwire.ops.add_spectral_`, conv weights
flattened to out × in·kh·kw); 'sign' (ℓ∞ ball, Scion/Gluon's choice for embeddings and
the output head) −sign(G); 'rms' (RMS-norm ball, their choice for biases and gains)
−√d · G / ‖G‖₂; 'auto' (default) is spectral for ≥2-D tensors and rms otherwise.

Initialisation (the first-step convention): M_j = G_j = G = 0 and X = W = the initial
parameters. The paper's iteration starts with X¹ = LMO step from G⁰; with G⁰ = 0 that step
moves nothing, so each `step()` is the worker half with the gradient at the current W
followed by the server half. Then M¹ = β∇f(W⁰), exactly torch.optim.Muon's zero-initialised
buffer after `buf.lerp_(grad, 1 − momentum)`, which is what makes the identity case Muon.

Lossless links (the 'identity' compressor in fp32) send the new state itself instead of
the difference: M_j up (so G_j ← M_j, G ← (1/n) Σ_j M_j) and X down (W ← X). In exact
arithmetic that is the same as adding R_j and S; in floating point it avoids
(M − G) + G ≠ M, so with one rank EF21Muon(lr=t, beta=b, uplink='identity',
downlink='identity') reproduces torch.optim.Muon(lr=t, momentum=1 − b, nesterov=False,
adjust_lr_fn='original') bit for bit (whenever 1 − (1 − b) == b in floating point).

Topologies: 'server' — rank 0 is also the server: one `gather` of the uplink messages to
rank 0, which alone holds G and X, and one `broadcast` of the compressed S
(`thinwire.optim.ef21_relay.DeviceRelay`: ServerRelay judging on the device). 'replicated' — one `all_gather` (`GatherAll`);
every rank runs the server step identically (deterministic, rank order) and applies S
itself, so there is no downlink traffic but W still moves only by C(X − W). Both give the
same W bit for bit. Comm stats tag the uplink 'payload' and the downlink 'downlink'.

The step envelope (`thinwire.optim.base`) owns the rest: each message starts with the
protocol prefix (8-byte header, then a presence bitmap of one bit per parameter), non-finite
gradients and bad peers fail (or skip) on every rank together, and the step counter seeds
the randomised compressors (Rand-K, natural): seeds derive from (seed, step, link, sender
rank), so receivers regenerate the same positions (a compressor without a block form, below:
(seed, step, parameter index, link, sender rank), as before). The new momenta are computed
when the message is encoded, and the server's new G and X when it serves, but they are
committed (M_j, G_j ← G_j + R_j; G, X) only when the step is applied, so a flagged step
changes no state. A parameter with a gradient on no rank does not move and keeps its state
(the envelope puts back what the step computed for it); one with a gradient on some ranks
only counts ∇f_j = 0 on the others.

What a step costs a GPU (docs/design.md): no host read but the envelope's one after the
exchange (`nonfinite='raise'`), none with nonfinite='skip' (every commit takes the device's
verdict, `torch.where` or an added −0, and under topology='server' the answer's prefix is
judged on the device, `DeviceRelay`; a skip is reported at the next call), and launches
that do not grow with the number of tensors.
The state of each kind is one flat buffer per (device, dtype) (`thinwire.optim.ef21_flat`;
`state[p]` holds views), the equations run once per param group on its range, the links'
compressors once per block of same-size tensors (`thinwire.compress.ef21_blocks`: Top-K by
`topk`, never `nonzero`; Rand-K's and natural rounding's draws on the device), the LMO once
per matrix shape (`thinwire.optim.ef21_lmo`: Newton–Schulz batched), and under
topology='server' rank 0 judges the messages on the device (`thinwire.optim.ef21_relay`).
This rank's non-finite gradients are taken as zeros on the device and flagged in its
message. Same arithmetic as the per-tensor equations, bit for bit on CPU (the sum over
ranks but for the sign of a zero); on a GPU a batched GEMM or top-k may sum or break ties
otherwise. The random streams are the device's, one per link, step and sender (not one per
tensor): Rand-K's positions and natural rounding are drawn otherwise than before, with the
same distributions. Compressors without a block form (rank-K, DCT-Top-K, the 'sign' and
'2bit' value stages) run tensor by tensor, as before, and their checks read the host.

Two tiers (FSDP2 shards, `process_group` = the group across sites): M_j, G_j, G, X, the
compressors and W ← W + S run on this rank's shard; the LMO is defined on the whole matrix,
so 'spectral' and 'rms' gather G over the site and X takes its rows of the result ('sign' is
elementwise, on the shard). Under topology='server' the ranks of site 0 are the servers of
their shards.

    opt = EF21Muon(model.parameters(), lr=0.02, beta=0.05, uplink="topk:0.05+natural")
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..compress import EF21Compressor
from ..compress.spec import parse_compressor
from ..wire import checks
from .base import CommunicatingOptimizer, Member
from .ef21_flat import DOWN, UP, Family, Plan, Seeds, commit_momenta_in_flight, make_plan, plan_key
from .ef21_lmo import LmoPlan, add_lmo_, lmo_of  # noqa: F401  (the per-tensor LMO, importable from here)
from .ef21_relay import DeviceRelay
from .elastic_rules import PER_RANK, SERVER, check_torch_states, torch_state
from .exchange import GatherAll

LMOS = ("auto", "spectral", "sign", "rms")
TOPOLOGIES = ("server", "replicated")


class Sent(NamedTuple):
    """What this rank's encode leaves for the apply: the step, its layout and plan, whose
    families hold the new momenta M_j⁺ (`fresh`), committed only if the step goes through."""
    step: int
    layout: list[Member]
    plan: Plan


def _check_group(g: dict) -> None:
    if not g["lr"] >= 0.0:
        raise ValueError(f"lr must be >= 0, got {g['lr']}")
    if not 0.0 < g["beta"] <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {g['beta']}")
    if g["lmo"] not in LMOS:
        raise ValueError(f"lmo must be one of {LMOS}, got {g['lmo']!r}")
    if not g["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {g['weight_decay']}")
    for p in g.get("params", []):
        if g["lmo"] == "spectral" and p.dim() < 2:
            raise ValueError(f"lmo='spectral' needs >=2-D parameters, got shape {tuple(p.shape)}; put "
                             "biases and gains in a param group with lmo='rms' or 'sign' (or use 'auto')")


# ---- the equations, one per function, on one family's flat buffers (`ef21_flat.Family`) ------
def new_momenta(fam: Family, grads: torch.Tensor) -> torch.Tensor:
    """M_j⁺ = (1 − β) M_j + β ∇f_j(W) into `fresh` (M_j itself changes at commit), each param
    group with its β; a rank without a gradient counts ∇f_j = 0 (zeros in `grads`)."""
    fresh, m = fam.flats["fresh"], fam.flats["momentum"]
    for group, lo, hi in fam.groups:
        # M_j⁺ = M_j + β (∇f_j − M_j)          (lerp, as torch.optim.Muon's buffer)
        torch.lerp(m[lo:hi], grads[lo:hi], group["beta"], out=fresh[lo:hi])
    return fresh


def uplink_message(fam: Family, lossless: bool) -> torch.Tensor:
    """What worker j compresses: M_j⁺ − G_j (so R_j = C_j(M_j⁺ − G_j)), into the gradients'
    buffer (read already), or M_j⁺ itself on a lossless link."""
    fresh = fam.flats["fresh"]
    return fresh if lossless else torch.sub(fresh, fam.flats["estimate"], out=fam.flats["grads"])


def _commit(dst: torch.Tensor, src: torch.Tensor, skip: torch.Tensor | None) -> None:
    """dst ← src; where `skip` (0-dim bool on the device) is set, dst kept as it is."""
    if skip is None:
        dst.copy_(src)
    else:
        torch.where(skip, dst, src, out=dst)


def commit_worker(fam: Family, r: torch.Tensor | None, lossless: bool, skip: torch.Tensor | None = None) -> None:
    """M_j ← M_j⁺;  G_j ← G_j + R_j (lossless: G_j ← M_j⁺). `r`: R_j as the wire delivers it.
    `skip` (0-dim bool on the device): where set, M_j and G_j stay exactly as they are."""
    # M_j ← M_j⁺
    _commit(fam.flats["momentum"], fam.flats["fresh"], skip)
    if lossless:
        # G_j ← M_j⁺
        _commit(fam.flats["estimate"], fam.flats["fresh"], skip)
    else:
        if skip is not None:                             # G_j + (−0) = G_j, −0.0 included
            r.masked_fill_(skip, -0.0)
        # G_j ← G_j + R_j
        fam.flats["estimate"].add_(r.to(fam.dtype))


def server_estimate(fam: Family, mean: torch.Tensor, lossless: bool) -> torch.Tensor:
    """G⁺ = G + (1/n) Σ_j R_j;  lossless uplink: G⁺ = (1/n) Σ_j M_j (into `next_estimate`)."""
    out = fam.flats["next_estimate"]
    if lossless:
        # G⁺ = (1/n) Σ_j M_j
        return out.copy_(mean)
    # G⁺ = G + (1/n) Σ_j R_j
    return torch.add(fam.flats["server_estimate"], mean.to(fam.dtype), out=out)


def server_model(fam: Family, lmo: LmoPlan, layout: list[Member]) -> torch.Tensor:
    """X⁺ = (1 − tλ) X + t · LMO(G⁺) (into `next_model`; `ef21_lmo`)."""
    out = fam.flats["next_model"].copy_(fam.flats["server_model"])
    lmo.step(out, fam.flats["next_estimate"], layout)
    return out


def commit_server(fam: Family, skip: torch.Tensor | None = None) -> None:
    """G ← G⁺;  X ← X⁺ (where `skip` is set, both kept)."""
    _commit(fam.flats["server_estimate"], fam.flats["next_estimate"], skip)
    _commit(fam.flats["server_model"], fam.flats["next_model"], skip)


def model_shift(fam: Family, layout: list[Member], lossless: bool) -> torch.Tensor:
    """What the server compresses: X⁺ − W (so S = C(X⁺ − W)), or X⁺ itself on a lossless link."""
    x = fam.flats["next_model"]
    return x if lossless else torch.sub(x, fam.take_weights(layout), out=fam.flats["weights"])


def apply_shift(fam: Family, layout: list[Member], s: torch.Tensor, lossless: bool,
                skip: torch.Tensor | None = None) -> None:
    """W ← W + S;  lossless downlink (S carries X): W ← X. `s`: S decoded, float32. Where
    `skip` (0-dim bool on the device) is set, W stays exactly as it is: S ← −0 (lossless:
    S ← W, widened exactly and rounded back)."""
    if skip is not None and lossless:
        torch.where(skip, fam.take_weights(layout).to(s.dtype), s, out=s)
    elif skip is not None:
        s.masked_fill_(skip, -0.0)
    if s.dtype == fam.dtype:
        shifts = fam.views("shift")
    else:                                                   # one rounding copy: foreach ops want one dtype
        fam.flats["weights"].copy_(s)
        shifts = fam.views("weights")
    params = [layout[i].param for i in fam.members]
    if lossless:
        # W ← X
        torch._foreach_copy_(params, shifts)
    else:
        # W ← W + S
        torch._foreach_add_(params, shifts)


# ---- the optimizer -------------------------------------------------------------------------
class EF21Muon(CommunicatingOptimizer):
    """EF21-Muon; see the module docstring for the equations, topologies and conventions.

    Args:
        lr: step size (LMO radius) t >= 0. beta: momentum weight β in (0, 1] (paper's
            convention; β = 1 − Muon's momentum, 0.05 matches Muon's 0.95).
        lmo: 'auto' | 'spectral' | 'sign' | 'rms', per param group. weight_decay: decoupled λ on X.
        uplink, downlink: compressor object or spec string ('identity', 'topk:0.05',
            'randk:0.05', 'natural', 'rank:4', 'dct-topk:32', 'topk:0.05+natural', ...;
            grammar in `thinwire.compress.spec`) for the worker → server and server →
            worker messages. topology: 'server' | 'replicated'. seed: randomised compressors.
        nonfinite: 'raise' (default) or 'skip' when any rank's gradients are not finite; no
            state changes on any rank in that step either way.
        overlap: False (default) blocks in step() until the exchange completes; True leaves it
            in flight until the next step() (one step of staleness; `thinwire.optim.base`).
        process_group: torch.distributed group (default: world; none needed for one process).
    State per parameter: momentum (M_j), estimate (G_j); where the server runs,
    server_estimate (G) and server_model (X): views of flat buffers (`ef21_flat`). Resume
    with the same topology (under 'server' only rank 0 holds G and X). Parameters should be
    float32 (keep fp32 master weights under mixed precision): the state is kept in the
    parameters' dtype and W += S accumulates in it.
    'sign' and 'rms' move each element by about lr per step, like Adam's early updates, so
    such groups take an AdamW-sized lr (e.g. 3e-3), not Muon's 0.02.
    """

    def __init__(self, params, lr: float = 0.02, beta: float = 0.05, lmo: str = "auto", weight_decay: float = 0.0,
                 uplink="topk:0.05", downlink="identity", topology: str = "server", seed: int = 0,
                 nonfinite: str = "raise", process_group=None, overlap: bool = False):
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.uplink: EF21Compressor = parse_compressor(uplink, "uplink")
        self.downlink: EF21Compressor = parse_compressor(downlink, "downlink")
        self.topology, self.seed = topology, seed
        defaults = dict(lr=lr, beta=beta, lmo=lmo, weight_decay=weight_decay)
        _check_group(defaults)
        super().__init__(params, defaults)
        self._init_comm(process_group, nonfinite, overlap)
        if topology == "replicated":
            self._link = GatherAll(self.comm)
        else:
            self._link = DeviceRelay(self.comm, lambda uplinks, down, step: self._serve(step, uplinks, down))
        self._down: torch.Tensor | None = None        # replicated: the downlink, computed locally
        self._sent: Sent | None = None
        self._plan_made: Plan | None = None

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_group({**self.defaults, **param_group, "params": params})
        super().add_param_group({**param_group, "params": params})

    @property
    def is_server(self) -> bool:
        """Whether this rank runs the server step (and holds G and X)."""
        return self.topology == "replicated" or self.comm.rank == 0

    # M_j, G_j: each rank's own; G, X: where the server runs (topology='replicated': every rank)
    ELASTIC_KINDS = {"momentum": PER_RANK, "estimate": PER_RANK, "server_estimate": SERVER, "server_model": SERVER}

    def _elastic_state(self, states: list[dict], row: torch.Tensor, rank: int) -> dict:
        check_torch_states(self, states)
        return torch_state(self, states, row, self.ELASTIC_KINDS, self.is_server, "state")

    def _elastic_fold(self, state: dict, record: dict, refuse: str) -> dict:
        return commit_momenta_in_flight(self, state, record)

    def _plan(self, layout: list[Member]) -> Plan:
        """The layout's plan, made again only when the layout (or a group's lmo) changes."""
        key = plan_key(layout)
        if self._plan_made is None or self._plan_made.key != key:
            header = (f"ef21-muon world_size={self.comm.world_size} topology={self.topology} seed={self.seed} "
                      f"uplink={self.uplink.name} downlink={self.downlink.name}")
            self._plan_made = make_plan(key, layout, self.is_server, self.uplink, self.downlink, header)
        return self._plan_made

    # ---- the envelope's hooks ----------------------------------------------------------------
    def _describe(self, layout: list[Member]) -> str:
        return self._plan(layout).description

    def _masks_nonfinite(self, layout: list[Member]) -> bool:
        return True                      # `Family.take_gradients` takes them as zeros; M_j⁺ is kept apart

    def _exchange(self, step: int, layout: list[Member]):
        self._sent = None
        if not layout:                                   # nothing to train: a local no-op step
            return None
        plan, device = self._plan(layout), layout[0].param.device
        if self.topology == "replicated":
            self._link.resize(len(layout), plan.up, device)
            if self._down is None or self._down.numel() != plan.down or self._down.device != device:
                self._down = torch.empty(plan.down, dtype=torch.uint8, device=device)
        else:
            self._link.resize(len(layout), plan.up, plan.down, device)
        return self._link

    def _prepare(self, step: int, layout: list[Member]) -> None:
        for fam in self._plan(layout).families:
            fam.adopt(self.state, layout)

    def _encode(self, step: int, layout: list[Member], exchange) -> None:
        """M_j⁺ for every parameter (kept for the apply) and R_j = C_j(M_j⁺ − G_j) into the uplink."""
        if exchange is None:
            return
        plan, seeds = self._plan(layout), Seeds(self.seed, step, UP)
        for fam in plan.families:
            new_momenta(fam, fam.take_gradients(layout, self.gradients_nonfinite))
            fam.up.encode(uplink_message(fam, self.uplink.lossless), exchange.payload, seeds, self.comm.rank)
        self._sent = Sent(step, layout, plan)

    def _serve(self, step: int, uplinks: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
        """The server step: G⁺, X⁺ and S = C(X⁺ − W) into `down`, for every parameter (one with
        a gradient on no rank is put back by the envelope). `uplinks`: [world, uplink payload].
        Returns the malformed flag of what arrived (0-dim bool on the device) or None."""
        sent, world = self._sent, uplinks.shape[0]
        up, flags = Seeds(self.seed, step, UP), []
        for fam, lmo in zip(sent.plan.families, sent.plan.lmos):
            flags.append(fam.up.land(uplinks, up, list(range(world)), fam.dense))
            server_estimate(fam, fam.dense.div_(world), self.uplink.lossless)       # (1/n) Σ_j, rank order
            server_model(fam, lmo, sent.layout)
            shift = model_shift(fam, sent.layout, self.downlink.lossless)
            fam.down.encode(shift, down, Seeds(self.seed, step, DOWN), None)
        return checks.any_of([f for f in flags if f is not None])

    def _arrival(self, step: int, layout: list[Member], delivery) -> list[torch.Tensor]:
        """Before the step's one host read: the server step where every rank serves, and S
        decoded; their malformed flags (what came from peers) are read with the verdict."""
        sent, flags = self._sent, []
        if sent is None:
            return flags
        if self.topology == "replicated":                # every rank is the server: S computed here
            flags.append(self._serve(step, delivery.data, self._down))
            down = self._down
        else:                                            # S as rank 0 broadcast it
            down = delivery.data
        for fam in sent.plan.families:
            landed = fam.down.land(down[None], Seeds(self.seed, step, DOWN), [None], fam.shift)
            if self.topology == "server":
                flags.append(landed)
        return [f for f in flags if f is not None]

    def _pending_state(self, record) -> dict:
        """A checkpoint with this step in flight keeps the new momenta M_j⁺ its apply commits."""
        momenta = [None] * len(self._sent.layout)
        for fam in self._sent.plan.families:
            for i, view in zip(fam.members, fam.views("fresh")):
                momenta[i] = view.clone()
        return {"momenta": momenta}

    def _load_pending_state(self, record, saved: dict) -> None:
        plan = self._plan(record.layout)
        for fam in plan.families:
            fam.adopt(self.state, record.layout)             # the loaded state, before the step lands
            fam.up.forget()                                   # R_j: from the re-sent payload
            for i, view in zip(fam.members, fam.views("fresh")):
                view.copy_(saved["momenta"][i])
        self._sent = Sent(record.step, record.layout, plan)

    def _apply(self, step: int, layout: list[Member], delivery, skip: torch.Tensor | None = None) -> None:
        """Commit M_j and G_j (and G, X where this rank serves), then W ← W + S; where `skip`
        is set (nonfinite='skip', `_apply_masked`) nothing moves."""
        sent, self._sent = self._sent, None
        own, up = self._link.payload, Seeds(self.seed, step, UP)
        for fam in sent.plan.families:
            r = None
            if not self.uplink.lossless:                 # R_j as the server decoded it
                fam.up.own(own, up, self.comm.rank, fam.dense)
                r = fam.dense
            commit_worker(fam, r, self.uplink.lossless, skip)
            if fam.server:
                commit_server(fam, skip)
            apply_shift(fam, sent.layout, fam.shift, self.downlink.lossless, skip)

    def _applies_masked(self, layout: list[Member]) -> bool:
        """nonfinite='skip': every commit takes the device's verdict (`_apply`), no host read."""
        return True

    def _apply_masked(self, step: int, layout: list[Member], delivery, skip: torch.Tensor) -> None:
        self._apply(step, layout, delivery, skip)
