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
(`thinwire.optim.exchange.ServerRelay`). 'replicated' — one `all_gather` (`GatherAll`);
every rank runs the server step identically (deterministic, rank order) and applies S
itself, so there is no downlink traffic but W still moves only by C(X − W). Both give the
same W bit for bit. Comm stats tag the uplink 'payload' and the downlink 'downlink'.

The step envelope (`thinwire.optim.base`) owns the rest: each message starts with the
protocol prefix (8-byte header, then a presence bitmap of one bit per parameter), non-finite
gradients and bad peers fail (or skip) on every rank together, and the step counter seeds
the randomised compressors (Rand-K, natural): seeds derive from (seed, step, parameter
index, link, sender rank), so receivers regenerate the same indices. The new momenta are
computed when the message is encoded but committed (M_j, G_j ← G_j + R_j) only when the
step is applied, so a flagged step changes no state. A parameter with a gradient on no rank
does not move and keeps its state; one with a gradient on some ranks only counts ∇f_j = 0
on the others.

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
from ..ops import add_rms_, add_sign_, add_spectral_
from .base import CommunicatingOptimizer, Member
from .exchange import GatherAll
from .relay import ServerRelay
from .flat import spans
from .shards import is_sharded, own_rows, whole

LMOS = ("auto", "spectral", "sign", "rms")
TOPOLOGIES = ("server", "replicated")
UP, DOWN = 1, 0                # the link, in the compressors' seeds


class Entry(NamedTuple):
    """One layout parameter's place in the messages: its group, tensor, index in the layout
    (for the seeds) and its bytes in the uplink and downlink payloads."""
    group: dict
    param: torch.Tensor
    index: int
    up: slice
    down: slice
    key: torch.Tensor                 # the parameter itself (param: its shard under FSDP2)


class Sent(NamedTuple):
    """What this rank's encode leaves for the apply: the step, its entries, and the new
    momenta M_j⁺ (one per entry), committed only if the step goes through."""
    step: int
    entries: list[Entry]
    momenta: list[torch.Tensor]


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


def _seed(*parts: int) -> int:
    """A deterministic 63-bit mix (FNV-style) of integers; every rank computes the same."""
    h = 0xCBF29CE484222325
    for part in parts:
        h = ((h ^ (int(part) & 0xFFFF_FFFF_FFFF_FFFF)) * 0x100000001B3) & 0xFFFF_FFFF_FFFF_FFFF
    return h & 0x7FFF_FFFF_FFFF_FFFF


# ---- the equations, one per function -------------------------------------------------------
def new_momentum(m: torch.Tensor, grad: torch.Tensor | None, beta: float) -> torch.Tensor:
    """M_j⁺ = (1 − β) M_j + β ∇f_j(W), a new tensor (M_j itself changes at commit);
    a rank without a gradient counts ∇f_j = 0."""
    # M_j⁺ = M_j + β (∇f_j − M_j)          (lerp, as torch.optim.Muon's buffer)
    return m.lerp(grad if grad is not None else torch.zeros_like(m), beta)


def uplink_message(m_new: torch.Tensor, g: torch.Tensor, lossless: bool) -> torch.Tensor:
    """What worker j compresses: M_j⁺ − G_j (so R_j = C_j(M_j⁺ − G_j)), or M_j⁺ itself
    on a lossless link."""
    return m_new if lossless else m_new - g


def commit_worker_(m: torch.Tensor, g: torch.Tensor, m_new: torch.Tensor, r: torch.Tensor, lossless: bool) -> None:
    """M_j ← M_j⁺;  G_j ← G_j + R_j (lossless: G_j ← M_j⁺). `r` is what the wire delivered."""
    # M_j ← M_j⁺
    m.copy_(m_new)
    if lossless:
        # G_j ← M_j⁺
        g.copy_(m_new)
    else:
        # G_j ← G_j + R_j
        g.add_(r.to(g.dtype))


def mean_over_ranks(parts: list[torch.Tensor]) -> torch.Tensor:
    """(1/n) Σ_j parts[j], summed in rank order (the same bits wherever it is computed), into
    parts[0] (freshly decoded tensors, not state)."""
    total = parts[0]
    for part in parts[1:]:
        # Σ ← Σ + part_j
        total = total.add_(part)
    # (1/n) Σ
    return total.div_(len(parts))


def server_estimate_(g: torch.Tensor, mean: torch.Tensor, lossless: bool) -> None:
    """G ← G + (1/n) Σ_j R_j;  lossless uplink: G ← (1/n) Σ_j M_j."""
    if lossless:
        # G ← (1/n) Σ_j M_j
        g.copy_(mean)
    else:
        # G ← G + (1/n) Σ_j R_j
        g.add_(mean.to(g.dtype))


def lmo_of(group: dict, p: torch.Tensor) -> str:
    """The group's LMO for p ('auto': spectral for ≥2-D tensors, rms otherwise)."""
    lmo = group["lmo"]
    if lmo == "auto":
        return "spectral" if p.dim() >= 2 else "rms"
    return lmo


def add_lmo_(x: torch.Tensor, g: torch.Tensor, t: float, lmo: str, key: torch.Tensor) -> None:
    """X ← X + t · LMO(G), the LMO of the ball of radius t in the chosen norm. Under FSDP2
    x and g are this rank's rows of parameter `key`: sign is elementwise, on the shard;
    spectral and rms are defined on the whole G, gathered over the site, and x takes its rows."""
    if is_sharded(key) and lmo != "sign":
        step = torch.zeros(key.shape, dtype=x.dtype, device=x.device)
        add_lmo_(step, whole(key, g), t, lmo, step)                # X_whole − X_whole: t · LMO(G)
        x.add_(own_rows(key, step))
        return
    if lmo == "spectral":
        # X ← X − t √max(1, rows/cols) NS(G)
        add_spectral_(x, g, -t)
    elif lmo == "sign":
        # X ← X − t sign(G)
        add_sign_(x, g, -t)
    else:
        # X ← X − t √d G / ‖G‖₂
        add_rms_(x, g, -t)


def server_model_(x: torch.Tensor, g: torch.Tensor, group: dict, lmo: str, key: torch.Tensor) -> None:
    """X ← (1 − tλ) X + t · LMO(G) (`key`: the parameter, see add_lmo_)."""
    t, decay = group["lr"], group["weight_decay"]
    if decay:
        # X ← (1 − tλ) X
        x.mul_(1.0 - t * decay)
    # X ← X + t · LMO(G)
    add_lmo_(x, g, t, lmo, key)


def model_shift(x: torch.Tensor, w: torch.Tensor, lossless: bool) -> torch.Tensor:
    """What the server compresses: X − W (so S = C(X − W)), or X itself on a lossless link."""
    return x if lossless else x - w


def apply_shift_(w: torch.Tensor, s: torch.Tensor, lossless: bool) -> None:
    """W ← W + S;  lossless downlink (S carries X): W ← X."""
    if lossless:
        # W ← X
        w.copy_(s)
    else:
        # W ← W + S
        w.add_(s.to(w.dtype))


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
    server_estimate (G) and server_model (X). Resume with the same topology (under 'server'
    only rank 0 holds G and X). Parameters should be float32 (keep fp32 master weights under
    mixed precision): W += S accumulates in the parameter's dtype.
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
            self._link = ServerRelay(self.comm, self._serve_relayed)
        self._down: torch.Tensor | None = None        # replicated: the downlink, computed locally
        self._sent: Sent | None = None

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_group({**self.defaults, **param_group, "params": params})
        super().add_param_group({**param_group, "params": params})

    @property
    def is_server(self) -> bool:
        """Whether this rank runs the server step (and holds G and X)."""
        return self.topology == "replicated" or self.comm.rank == 0

    def _entries(self, layout: list[Member]) -> tuple[list[Entry], int, int]:
        """Each parameter's entry, and the uplink and downlink payload sizes."""
        ups = spans(self.uplink.payload_nbytes(m.param.shape) for m in layout)
        downs = spans(self.downlink.payload_nbytes(m.param.shape) for m in layout)
        entries = [Entry(group, p, index, slice(up.start, up.stop), slice(down.start, down.stop), key)
                   for index, ((group, p, key), up, down) in enumerate(zip(layout, ups, downs))]
        return entries, sum(up.size for up in ups), sum(down.size for down in downs)

    # ---- the envelope's hooks ----------------------------------------------------------------
    def _describe(self, layout: list[Member]) -> str:
        entries, _, _ = self._entries(layout)
        lines = [f"ef21-muon world_size={self.comm.world_size} topology={self.topology} seed={self.seed} "
                 f"uplink={self.uplink.name} downlink={self.downlink.name}"]
        lines += [f"{tuple(e.param.shape)} {e.param.dtype} lmo={e.group['lmo']} "
                  f"@{e.up.start}+{e.up.stop - e.up.start} @{e.down.start}+{e.down.stop - e.down.start}"
                  for e in entries]
        return "\n".join(lines)

    def _exchange(self, step: int, layout: list[Member]):
        self._sent = None
        if not layout:                                   # nothing to train: a local no-op step
            return None
        _, up, down = self._entries(layout)
        device = layout[0].param.device
        if self.topology == "replicated":
            self._link.resize(len(layout), up, device)
            if self._down is None or self._down.numel() != down or self._down.device != device:
                self._down = torch.empty(down, dtype=torch.uint8, device=device)
        else:
            self._link.resize(len(layout), up, down, device)
        return self._link

    def _prepare(self, step: int, layout: list[Member]) -> None:
        for _, p, key in layout:
            state = self.state[key]
            if "momentum" not in state:                  # M_j = G_j = 0
                state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["estimate"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.is_server and "server_model" not in state:   # G = 0, X = W
                state["server_estimate"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["server_model"] = p.detach().clone(memory_format=torch.preserve_format)

    def _encode(self, step: int, layout: list[Member], exchange) -> None:
        """M_j⁺ for every parameter (kept for the apply) and R_j = C_j(M_j⁺ − G_j) into the uplink."""
        if exchange is None:
            return
        entries, _, _ = self._entries(layout)
        payload, rank, momenta = exchange.payload, self.comm.rank, []
        for e in entries:
            state = self.state[e.key]
            m_new = new_momentum(state["momentum"], e.param.grad, e.group["beta"])
            message = uplink_message(m_new, state["estimate"], self.uplink.lossless)
            self.uplink.encode(message, payload[e.up], _seed(self.seed, step, e.index, UP, rank))
            momenta.append(m_new)
        self._sent = Sent(step, entries, momenta)

    def _serve_relayed(self, uplinks: torch.Tensor, present: torch.Tensor, down: torch.Tensor) -> None:
        """ServerRelay's server step, on rank 0: `uplinks` is every rank's uplink payload."""
        self._serve(self._sent, uplinks, present, down)

    def _serve(self, sent: Sent, uplinks: torch.Tensor, present: torch.Tensor, down: torch.Tensor) -> None:
        """The server step for every parameter with a gradient somewhere: G, X, and
        S = C(X − W) into `down` (zeros for the others, which nobody applies).
        `uplinks` is [world, uplink payload]."""
        for e, anywhere in zip(sent.entries, present.tolist()):
            if not anywhere:
                down[e.down].zero_()
                continue
            p, state = e.param, self.state[e.key]
            parts = [self.uplink.decode(uplinks[r, e.up], p.shape, _seed(self.seed, sent.step, e.index, UP, r))
                     for r in range(uplinks.shape[0])]
            server_estimate_(state["server_estimate"], mean_over_ranks(parts).to(p.dtype), self.uplink.lossless)
            server_model_(state["server_model"], state["server_estimate"], e.group, lmo_of(e.group, p), e.key)
            shift = model_shift(state["server_model"], p, self.downlink.lossless)
            self.downlink.encode(shift, down[e.down], _seed(self.seed, sent.step, e.index, DOWN))

    def _pending_state(self, record) -> dict:
        """A checkpoint with this step in flight keeps the new momenta M_j⁺ its apply commits."""
        return {"momenta": [m.clone() for m in self._sent.momenta]}

    def _load_pending_state(self, record, saved: dict) -> None:
        entries, _, _ = self._entries(record.layout)
        self._sent = Sent(record.step, entries, [m.to(e.param.device).clone() for m, e in zip(saved["momenta"], entries)])

    def _apply(self, step: int, layout: list[Member], delivery) -> None:
        """Commit M_j and G_j, then W ← W + S, for every parameter with a gradient somewhere."""
        sent, self._sent = self._sent, None
        if self.topology == "replicated":               # every rank is the server: S computed here
            self._serve(sent, delivery.data, delivery.present, self._down)
            down = self._down
        else:                                           # S as rank 0 broadcast it
            down = delivery.data
        own, rank = self._link.payload, self.comm.rank
        for e, m_new, anywhere in zip(sent.entries, sent.momenta, delivery.present.tolist()):
            if not anywhere:
                continue
            p, state = e.param, self.state[e.key]
            r = None if self.uplink.lossless else \
                self.uplink.decode(own[e.up], p.shape, _seed(self.seed, step, e.index, UP, rank))
            commit_worker_(state["momentum"], state["estimate"], m_new, r, self.uplink.lossless)
            s = self.downlink.decode(down[e.down], p.shape, _seed(self.seed, step, e.index, DOWN))
            apply_shift_(p, s, self.downlink.lossless)
