"""EF21-Muon's flat state and batched server step (`thinwire.optim.ef21_flat`,
`thinwire.optim.ef21_lmo`): the batched LMO is the per-tensor one bit for bit on CPU, every
kind of state a view of one flat buffer per (device, dtype), and what load_state_dict puts in
the state is copied into the buffers.

The reference is the per-tensor update rules of `thinwire.ops` (`add_spectral_`,
`add_sign_`, `add_rms_`, each tested against torch's Muon and the definitions), one tensor at
a time in a loop written here.
"""

from __future__ import annotations

import torch

from thinwire.compress.spec import parse_compressor
from thinwire.ops import add_rms_, add_sign_, add_spectral_
from thinwire.optim.base import Member
from thinwire.optim.ef21_flat import families_of
from thinwire.optim.ef21_lmo import LmoPlan
from thinwire.optim.ef21_muon import EF21Muon
from thinwire.wire.spans import spans

SHAPES = {"auto": [(24, 8), (8, 24), (6, 3, 2, 2), (24, 8), (8,), (24,), (8,)],
          "sign": [(8, 24), (5,)], "rms": [(8, 24), (7,), (7,)]}


def _layout(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    groups = [{"lmo": "auto", "lr": 0.02, "weight_decay": 0.1}, {"lmo": "sign", "lr": 0.003, "weight_decay": 0.0},
              {"lmo": "rms", "lr": 0.004, "weight_decay": 0.05}]
    layout = []
    for group in groups:
        for shape in SHAPES[group["lmo"]]:
            p = torch.randn(shape, generator=gen).to(dtype)
            layout.append(Member(group, p, p))
    return layout


def _family(layout, server=True):
    comp = parse_compressor("identity")
    sizes = spans(comp.payload_nbytes(m.param.shape) for m in layout)
    return families_of(layout, server, comp, comp, sizes, sizes)


def _reference(layout, x, g):
    """X ← (1 − tλ) X + t · LMO(G) tensor by tensor, with the ops' per-tensor rules."""
    for m, xi, gi in zip(layout, x, g):
        t, decay = m.group["lr"], m.group["weight_decay"]
        if decay:
            xi.mul_(1.0 - t * decay)
        lmo = m.group["lmo"] if m.group["lmo"] != "auto" else ("spectral" if m.param.dim() >= 2 else "rms")
        {"spectral": add_spectral_, "sign": add_sign_, "rms": add_rms_}[lmo](xi, gi, -t)


def test_the_batched_server_model_step_is_the_per_tensor_one_bit_for_bit():
    for dtype in (torch.float32, torch.bfloat16):
        layout = _layout(dtype)
        (fam,) = _family(layout)
        gen = torch.Generator().manual_seed(1)
        x = [torch.randn(m.param.shape, generator=gen).to(dtype) for m in layout]
        g = [torch.randn(m.param.shape, generator=gen).to(dtype) for m in layout]
        flat_x, flat_g = torch.cat([t.reshape(-1) for t in x]), torch.cat([t.reshape(-1) for t in g])
        LmoPlan(fam, layout).step(flat_x, flat_g, layout)
        _reference(layout, x, g)
        assert torch.equal(flat_x, torch.cat([t.reshape(-1) for t in x])), dtype


def test_the_lmo_plan_batches_by_shape_and_size():
    layout = _layout()
    plan = LmoPlan(_family(layout)[0], layout)
    assert plan.spectral == {(24, 8): [0, 3], (8, 24): [1], (6, 12): [2]}        # stored shapes: tall apart
    assert sorted(len(v) for v in plan.rms.values()) == [1, 1, 2, 2]      # (group, size): auto 8 (2), 24; rms 192, 7 (2)
    assert plan.sign_groups == [1] and plan.single == []


def test_families_by_dtype_and_state_as_views_of_flat_buffers():
    layout = _layout()
    half = [Member(m.group, m.param.bfloat16(), m.param.bfloat16()) for m in layout[:3]]
    fams = _family(layout + half)
    assert [(f.dtype, len(f.members)) for f in fams] == [(torch.float32, 12), (torch.bfloat16, 3)]
    state = {m.key: {} for m in layout + half}
    fams[0].adopt(state, layout + half)
    for j, i in enumerate(fams[0].members):
        st = state[layout[i].key]
        assert set(st) == {"momentum", "estimate", "server_estimate", "server_model"}
        assert st["momentum"].data_ptr() == fams[0].views("momentum")[j].data_ptr()
        assert torch.equal(st["server_model"], layout[i].param) and not st["estimate"].any()
    loaded = torch.full(layout[2].param.shape, 3.0)                               # as load_state_dict leaves it
    state[layout[2].key]["momentum"] = loaded
    fams[0].adopt(state, layout + half)
    assert state[layout[2].key]["momentum"].data_ptr() != loaded.data_ptr()
    assert torch.equal(fams[0].views("momentum")[2], loaded)


def test_gradients_in_one_flat_buffer_missing_ones_zero_and_all_zero_when_flagged():
    layout = _layout()
    (fam,) = _family(layout, server=False)
    for i, m in enumerate(layout):
        m.param.grad = None if i == 4 else torch.full(m.param.shape, float(i + 1))
    flat = fam.take_gradients(layout, None)
    expected = torch.cat([torch.full((m.param.numel(),), 0.0 if i == 4 else float(i + 1)) for i, m in enumerate(layout)])
    assert torch.equal(flat, expected)
    assert not fam.take_gradients(layout, torch.tensor(True)).any()
    assert torch.equal(fam.take_gradients(layout, torch.tensor(False)), expected)


def test_a_loaded_state_is_what_the_next_step_starts_from():
    """load_state_dict puts plain tensors in the state: the next step copies them into the
    flat buffers and steps from them, as an optimizer that never stopped does."""
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
    b = [torch.nn.Parameter(t.detach().clone()) for t in a]
    ours, twin = (EF21Muon(ps, lr=0.05, beta=0.5, uplink="topk:0.3") for ps in (a, b))
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in a]
        if step == 2:
            saved = {k: v for k, v in twin.state_dict().items()}
            twin = EF21Muon(b, lr=0.05, beta=0.5, uplink="topk:0.3")
            twin.load_state_dict(saved)
        for ps, opt in ((a, ours), (b, twin)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_parameters_of_two_dtypes_step_as_two_optimizers_of_one_dtype_each():
    """Each parameter's equations stand alone (Top-K and identity draw nothing): a model of
    float32 and bf16 parameters (two families, their bytes interleaved in one message) takes
    the steps that one optimizer per dtype takes."""
    torch.manual_seed(0)
    values = [torch.randn(8, 6), torch.randn(6).bfloat16(), torch.randn(6, 8).bfloat16(), torch.randn(8)]
    mixed = [torch.nn.Parameter(v.clone()) for v in values]
    apart = [torch.nn.Parameter(v.clone()) for v in values]
    kw = dict(lr=0.05, beta=0.5, weight_decay=0.1, uplink="topk:0.3", downlink="identity+bf16")
    opts = [EF21Muon(mixed, **kw), EF21Muon(apart[0::3], **kw), EF21Muon(apart[1:3], **kw)]
    assert len(opts[0]._plan(opts[0].layout()).families) == 2
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(v.shape, generator=gen).to(v.dtype) for v in values]
        for ps in (mixed, apart):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        for opt in opts:
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(mixed, apart))
