"""EF21-Muon's state laid flat (`thinwire.optim.ef21_muon`): the layout's parameters of one
(device, dtype) form a family whose state of each kind (M_j, G_j, G, X) is one flat buffer;
each parameter's `state[p][kind]` is a view of it, so `state_dict` / `load_state_dict` see the
per-parameter tensors they always did (a tensor put there by `load_state_dict` is copied into
the buffer at the next step, `Family.adopt`). Elementwise equations run once per param group
on its range of the buffer (a param group's parameters of one family lie end to end), and the
links' compressors once per family (`thinwire.compress.ef21_blocks.BlockLink`; a compressor
without a block form on each tensor, `MemberLink`).

Scratch per family: M_j⁺ (`fresh`, the encode's new momenta), the gradients, G⁺ and X⁺ (the
server's candidates, committed when the step is applied), W (the parameters, for X − W) and
two float32 buffers for what is decoded (Σ_j R_j, then R_j; S); each block link keeps its
message's layout (`BlockLink.staging`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..compress.ef21_blocks import BlockLink, groupable
from .ef21_lmo import LmoPlan
from .elastic_rules import check_torch_states, layout_ids
from .flat import spans

WORKER = ("momentum", "estimate")
SERVER = ("server_estimate", "server_model")
UP, DOWN = 1, 0                # the link, in the compressors' seeds
VALUE_STREAM = 0x5BD1E995      # the value stage's draws: a stream apart from the positions'


def mix(*parts: int) -> int:
    """A deterministic 63-bit mix (FNV-style) of integers; every rank computes the same."""
    h = 0xCBF29CE484222325
    for part in parts:
        h = ((h ^ (int(part) & 0xFFFF_FFFF_FFFF_FFFF)) * 0x100000001B3) & 0xFFFF_FFFF_FFFF_FFFF
    return h & 0x7FFF_FFFF_FFFF_FFFF


class Seeds(NamedTuple):
    """The seeds of one link's message in one step: a block link's one stream per sender
    (`index`; its value stage's `index ^ VALUE_STREAM`), a member link's one per tensor
    (`member`, the per-tensor path's seeds). `rank` is None on the downlink."""
    seed: int
    step: int
    link: int

    def index(self, rank: int | None) -> int:
        return mix(self.seed, self.step, self.link) if rank is None else mix(self.seed, self.step, self.link, rank)

    def member(self, index: int, rank: int | None) -> int:
        parts = (self.seed, self.step, index, self.link)
        return mix(*parts) if rank is None else mix(*parts, rank)


class MemberLink:
    """A compressor without a block form (rank-K, DCT-Top-K, 'sign' or '2bit' values): the
    per-tensor compressor on each member, with the per-tensor path's seeds and host checks."""

    def __init__(self, comp, shapes, offsets, indices: list[int]):
        self.comp, self.shapes, self.offsets, self.indices = comp, shapes, offsets, indices
        self.sizes = [comp.payload_nbytes(s) for s in shapes]
        self.starts = [s.start for s in spans(torch.Size(s).numel() for s in shapes)]
        self.nbytes = 0

    def _members(self):
        for shape, at, size, start, index in zip(self.shapes, self.offsets, self.sizes, self.starts, self.indices):
            yield shape, slice(at, at + size), slice(start, start + torch.Size(shape).numel()), index

    def encode(self, x: torch.Tensor, payload: torch.Tensor, seeds: Seeds, rank) -> None:
        for shape, wire, elems, index in self._members():
            self.comp.encode(x[elems].view(shape), payload[wire], seeds.member(index, rank))

    def land(self, rows: torch.Tensor, seeds: Seeds, ranks: list, out: torch.Tensor):
        """out ← Σ_r R_r, rank order; a malformed payload raises ValueError (a host read)."""
        for shape, wire, elems, index in self._members():
            parts = [self.comp.decode(rows[i, wire], shape, seeds.member(index, r)) for i, r in enumerate(ranks)]
            total = parts[0]
            for part in parts[1:]:
                total = total.add_(part)
            out[elems].copy_(total.reshape(-1))
        return None


class Link:
    """A family's link: its block form where the compressor has one (`BlockLink`), else
    `MemberLink`, behind one interface."""

    def __init__(self, comp, shapes, offsets, indices, device):
        self.comp = comp
        self.impl = BlockLink(comp, shapes, offsets, device) if groupable(comp) else \
            MemberLink(comp, shapes, offsets, indices)

    @property
    def lossless(self) -> bool:
        return self.comp.lossless

    @property
    def nbytes(self) -> int:
        return self.impl.nbytes

    def encode(self, x, payload, seeds: Seeds, rank) -> None:
        if isinstance(self.impl, MemberLink):
            return self.impl.encode(x, payload, seeds, rank)
        index = seeds.index(rank)
        self.impl.encode(x, payload, index, index ^ VALUE_STREAM)

    def land(self, rows, seeds: Seeds, ranks: list, out):
        """out ← Σ_r R_r over `rows` (each of `ranks`, None: the downlink); the malformed flag."""
        if isinstance(self.impl, MemberLink):
            return self.impl.land(rows, seeds, ranks, out)
        return self.impl.land(rows, [seeds.index(r) for r in ranks], out)

    def own(self, payload: torch.Tensor, seeds: Seeds, rank: int, out: torch.Tensor) -> None:
        """out ← this rank's R, as the others decode it from `payload` (its last encode's own
        record where the block form kept one: no unpacking)."""
        if not (isinstance(self.impl, BlockLink) and self.impl.sent(out)):
            self.land(payload[None], seeds, [rank], out)

    def forget(self) -> None:
        if isinstance(self.impl, BlockLink):
            self.impl.forget()


class Flats(dict):
    """A family's flat buffers by kind (`WORKER`, `SERVER`, and the scratch: 'fresh', 'grads',
    'next_estimate', 'next_model', 'weights'), each made, zeroed, when first asked for: a
    worker holds no server buffers, a lossless float32 downlink needs no 'weights'."""

    def __init__(self, numel: int, dtype: torch.dtype, device):
        super().__init__()
        self.numel, self.dtype, self.device = numel, dtype, device

    def __missing__(self, kind: str) -> torch.Tensor:
        flat = self[kind] = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return flat


class Family:
    """The layout members (`members`: their indices) of one device and dtype: flat state, its
    views, the links, and each param group's range (`groups`: (group, start, stop))."""

    def __init__(self, layout, members: list[int], server: bool, uplink, downlink, ups, downs):
        first = layout[members[0]].param
        self.members, self.dtype, self.device, self.server = members, first.dtype, first.device, server
        self.shapes = [layout[i].param.shape for i in members]
        self.spans = list(spans(layout[i].param.numel() for i in members))
        n = self.spans[-1].stop
        self.groups = []
        for j, i in enumerate(members):
            group = layout[i].group
            if self.groups and self.groups[-1][0] is group:
                self.groups[-1][2] = self.spans[j].stop
            else:
                self.groups.append([group, self.spans[j].start, self.spans[j].stop])
        self.flats = Flats(n, self.dtype, self.device)
        self.dense = torch.zeros(n, device=self.device)            # Σ_j R_j, then R_j
        self.shift = torch.zeros(n, device=self.device)            # S, decoded
        self.up = Link(uplink, self.shapes, [ups[i].start for i in members], members, self.device)
        self.down = Link(downlink, self.shapes, [downs[i].start for i in members], members, self.device)
        self._views: dict[str, list[torch.Tensor]] = {}

    def views(self, kind: str) -> list[torch.Tensor]:
        """Each member's view of the flat buffer `kind`, in its parameter's shape (made once)."""
        if kind not in self._views:
            flat = getattr(self, kind) if kind in ("dense", "shift") else self.flats[kind]
            self._views[kind] = [flat[s.start: s.stop].view(shape) for s, shape in zip(self.spans, self.shapes)]
        return self._views[kind]

    def adopt(self, state, layout) -> None:
        """Each member's state a view of the flat buffers: created (M_j = G_j = G = 0, X = W)
        where missing, copied in where another tensor holds it (a load, a new layout)."""
        kinds = WORKER + (SERVER if self.server else ())
        for kind in kinds:
            for i, view in zip(self.members, self.views(kind)):
                held = state[layout[i].key].get(kind)
                if held is None:
                    view.copy_(layout[i].param.detach()) if kind == "server_model" else view.zero_()
                elif held.data_ptr() != view.data_ptr() or held.shape != view.shape:
                    view.copy_(held)
                else:
                    continue
                state[layout[i].key][kind] = view

    def take_gradients(self, layout, nonfinite: torch.Tensor | None) -> torch.Tensor:
        """The members' gradients into the flat `grads` (zeros where a rank has none; all
        zeros where `nonfinite`, a 0-dim bool on the device, is set: no host read)."""
        have, grads, missing = [], [], []
        for i, view in zip(self.members, self.views("grads")):
            grad = layout[i].param.grad
            if grad is None:
                missing.append(view)
            else:
                have.append(view)
                grads.append(grad)
        if have:
            torch._foreach_copy_(have, grads)
        if missing:
            torch._foreach_zero_(missing)
        flat = self.flats["grads"]
        if nonfinite is not None:
            flat.masked_fill_(nonfinite, 0.0)
        return flat

    def take_weights(self, layout) -> torch.Tensor:
        """W, the members' parameters, into the flat `weights`."""
        torch._foreach_copy_(self.views("weights"), [layout[i].param.detach() for i in self.members])
        return self.flats["weights"]


def families_of(layout, server: bool, uplink, downlink, ups, downs) -> list[Family]:
    """The layout's families, one per (device, dtype), members in layout order."""
    by_kind: dict[tuple, list[int]] = {}
    for i, m in enumerate(layout):
        by_kind.setdefault((m.param.device, m.param.dtype), []).append(i)
    return [Family(layout, members, server, uplink, downlink, ups, downs) for members in by_kind.values()]


class Plan(NamedTuple):
    """What a layout fixes, made once per layout: its families (flat state, links), their
    LMO plans (where this rank serves), the payload sizes and the description."""
    key: tuple
    families: list[Family]
    lmos: list[LmoPlan]
    up: int
    down: int
    description: str


def plan_key(layout) -> tuple:
    """What a plan depends on: each parameter, its group and lmo, shape, dtype and device."""
    return tuple((id(m.key), id(m.group), m.group["lmo"], m.param.shape, m.param.dtype, m.param.device)
                 for m in layout)


def make_plan(key: tuple, layout, server: bool, uplink, downlink, header: str) -> Plan:
    """The layout's plan; the description is `header`, then each parameter's shape, dtype,
    lmo and its bytes in the uplink and downlink payloads."""
    ups = spans(uplink.payload_nbytes(m.param.shape) for m in layout)
    downs = spans(downlink.payload_nbytes(m.param.shape) for m in layout)
    families = families_of(layout, server, uplink, downlink, ups, downs)
    lines = [header] + [f"{tuple(m.param.shape)} {m.param.dtype} lmo={m.group['lmo']} @{up.start}+{up.size} "
                        f"@{down.start}+{down.size}" for m, up, down in zip(layout, ups, downs)]
    return Plan(key, families, [LmoPlan(fam, layout) for fam in families] if server else [],
                sum(u.size for u in ups), sum(d.size for d in downs), "\n".join(lines))


def commit_momenta_in_flight(opt, state: dict, record: dict) -> dict:
    """An elastic resume's fold of EF21-Muon's step in flight (`ElasticRule._elastic_fold`):
    M_j ← M_j⁺ where this rank had a gradient; G_j is kept, since the server never got R_j (so
    G = mean G_j still holds and R_j is sent again from M_j⁺ − G_j)."""
    check_torch_states(opt, [state])
    per_param = {pid: dict(s) for pid, s in state["state"].items()}
    for k, (pid, m_new) in enumerate(zip(layout_ids(opt), record["algorithm"]["momenta"])):
        if k not in record["absent"]:
            per_param[pid]["momentum"] = m_new.clone()
    return {**state, "state": per_param}
