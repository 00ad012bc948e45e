"""DeMo's per-tensor path: one parameter's encode and the subtraction of what it sent, as free
functions over the optimizer's state. Parameters that cannot join a group take it (their chunk
shape pads columns, their payload splits off byte bounds: `compress.chunk_group.groupable`), and
it is the reference the groups (`demo_groups`) are tested against."""

from __future__ import annotations

import torch

from ..compress import ChunkedTopK, Payload
from .demo_rules import gradient_weight, momentum_in_transform
from .demo_slots import Slot
from .elastic_rules import check_torch_states, layout_ids
from .protocol import prefix_nbytes


def encode_slot(state: dict, step: int, slot: Slot, payload: torch.Tensor, scratch,
                aheads: dict | None = None) -> None:
    """DeMo's encode for one parameter (`DeMo._encode`): M ← βM + w·g, its top-k payload into
    `payload`, then M ← M − α·T⁻¹(Q̂_i). `aheads` (lookahead='momentum'): where M before the
    subtraction is kept, by the parameter's key."""
    group, p, comp, offset, n, key = slot
    a, b = scratch
    m, plan, out = state[key]["momentum"], comp.plan(p.shape), payload[offset: offset + n]
    beta, weight = group["beta"], gradient_weight(group)
    if momentum_in_transform(group):                # T is linear: T(βM + wg) = βT(M) + wT(g)
        if p.grad is None:
            m.mul_(beta)
        else:                                       # one batched GEMM does the decay and the add
            comp.transform.forward_image(plan.transform_input(p.grad, a), plan, step, out=m, scratch=b,
                                         beta=beta, alpha=weight)
        sent = comp.select(m, p.shape, scratch=a)
    else:
        m.mul_(beta)                                # M ← βM + w·g
        if p.grad is not None:
            m.add_(p.grad, alpha=weight)
        image = comp.transform.forward_image(plan.transform_input(m, a), plan, step, out=plan.matrix_in(a),
                                             scratch=b)
        sent = comp.select(image, p.shape, scratch=b)
    values = comp.write(sent, p.shape, out=out).parts["values"]
    if aheads is not None:
        keep_ahead(aheads, key, m)
    own = (sent[0], comp.codec.decode(values, *sent[1].shape))    # Q̂_i: the values as the wire has them
    subtract_sent(step, group, p, comp, m, own, -group["alpha"], scratch)


def keep_ahead(aheads: dict, key: torch.Tensor, m: torch.Tensor) -> None:
    """lookahead='momentum': M_i before the subtraction, copied while encoding where it is at
    hand (the sent part need not be read back and re-added later); its inverse transform
    waits for `DeMo._estimate`, after the message has left."""
    ahead = aheads.get(key)
    if ahead is None or ahead.shape != m.shape or ahead.device != m.device:
        ahead = aheads[key] = torch.empty(m.shape, device=m.device)   # float32, like Δ
    ahead.copy_(m)


def subtract_sent(step: int, group: dict, p, comp: ChunkedTopK, m: torch.Tensor, own: tuple,
                  alpha: float, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """M ← M + alpha·T⁻¹(Q̂_i), Q̂_i = `own`: (indices, values) of this rank's message."""
    if momentum_in_transform(group):                    # sparse: no transform needed
        comp.scatter(m, own, p.shape, alpha=alpha)
        plan = comp.plan(p.shape)
        if plan.padded:                   # what the message puts in the padding is dropped, as the param domain crops it
            comp.transform.zero_padding_(m, plan, step)
    else:
        a, b = scratch
        m.add_(comp.aggregate([own], p.shape, step, out=a, scratch=b), alpha=alpha)


def fold_sent_back(opt, state: dict, record: dict) -> dict:
    """An elastic resume's fold of DeMo's step in flight (`ElasticRule._elastic_fold`): what this
    rank sent returns to its momentum, M ← M + α T⁻¹(Q̂_i), as for a flagged step."""
    check_torch_states(opt, [state])
    layout = opt.layout()
    slots = opt._slots(layout)
    payload, scratch = record["message"][0][prefix_nbytes(len(layout)):], opt._scratch(slots)
    per_param = {pid: dict(s) for pid, s in state["state"].items()}
    for (group, p, comp, offset, n, _), pid in zip(slots, layout_ids(opt)):
        own = comp.read(Payload.from_buffer(payload[offset: offset + n], comp.payload_spec(p.shape)), p.shape)
        m = per_param[pid]["momentum"].clone()
        subtract_sent(record["step"], group, p, comp, m, own, group["alpha"], scratch)
        per_param[pid]["momentum"] = m
    return {**state, "state": per_param}
