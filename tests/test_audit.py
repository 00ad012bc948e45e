"""thinwire.audit.StepAudit counts what a GPU would pay for: each kind of operator it is
documented to count, checked on the operator itself, and torch's own AdamW as a yardstick
whose launch counts are known from its implementation (one `_foreach_*` call per formula
term, none per tensor; fused: one kernel)."""

from __future__ import annotations

import torch

from thinwire.audit import StepAudit


def _audit(fn, **kw) -> StepAudit:
    audit = StepAudit(**kw)
    with audit:
        fn()
    return audit


def test_reads_of_a_device_value_are_host_reads():
    x = torch.randn(8)
    reads = {"item": lambda: x.sum().item(), "bool": lambda: bool(x.sum() > 0), "float": lambda: float(x[0]),
             "tolist": lambda: x.tolist(), "numpy": lambda: x.numpy(), "nonzero": lambda: x.nonzero(),
             "mask index": lambda: x[x > 0], "masked_select": lambda: x.masked_select(x > 0),
             "unique": lambda: x.unique(), "equal": lambda: torch.equal(x, x)}
    for name, fn in reads.items():
        assert _audit(fn).host_reads == 1, name


def test_computing_on_the_device_is_launches_and_no_host_read():
    x, i = torch.randn(8), torch.arange(4)
    audit = _audit(lambda: (x * 2 + 1, x[i], torch.where(x > 0, x, 0.0), x.topk(3)))
    assert audit.host_reads == 0
    assert audit.counts["launch"] == {"mul": 1, "add": 1, "index": 1, "gt": 1, "where": 1, "topk": 1}


def test_views_and_allocations_launch_nothing():
    x = torch.randn(4, 6)
    audit = _audit(lambda: (x.view(24), x[1:3], x.t(), x.reshape(6, 4), x.unsqueeze(0), torch.empty(5),
                            torch.empty_like(x), x.split(2)))
    assert audit.launches == 0 and audit.host_reads == 0


def test_a_foreach_call_is_one_launch_whatever_the_tensor_count():
    xs = [torch.randn(3) for _ in range(50)]
    assert _audit(lambda: torch._foreach_mul_(xs, 2.0)).launches == 1


def test_a_foreach_call_over_mixed_dtypes_is_one_launch_per_tensor():
    """torch cannot fuse lists of mixed dtypes and loops over them: so does the count."""
    xs = [torch.randn(3, dtype=torch.bfloat16) for _ in range(50)]
    same = [torch.randn(3, dtype=torch.bfloat16) for _ in range(50)]
    wider = [torch.randn(3) for _ in range(50)]
    assert _audit(lambda: torch._foreach_add_(xs, same)).launches == 1
    assert _audit(lambda: torch._foreach_add_(xs, wider)).launches == 50
    assert _audit(lambda: torch._foreach_copy_(xs, wider)).launches == 50


def test_a_cat_into_another_dtype_is_one_launch_per_input():
    """CUDA's batched cat needs every input in the output's dtype; else it copies one by one."""
    xs = [torch.randn(3, dtype=torch.bfloat16) for _ in range(20)]
    assert _audit(lambda: torch.cat(xs)).launches == 1
    assert _audit(lambda: torch.cat(xs, out=torch.empty(60, dtype=torch.bfloat16))).launches == 1
    assert _audit(lambda: torch.cat(xs, out=torch.empty(60))).launches == 20
    mixed = xs + [torch.randn(3)]
    assert _audit(lambda: torch.cat(mixed)).launches == 21


def test_a_tensor_made_from_python_data_is_a_host_value():
    audit = _audit(lambda: torch.tensor([1, 2, 3]))
    assert audit.host_values == 1 and audit.launches == 0


def test_the_patched_methods_are_put_back():
    tolist = torch.Tensor.tolist
    _audit(lambda: torch.ones(2).tolist())
    assert torch.Tensor.tolist is tolist
    assert _audit(lambda: None).host_reads == 0


def test_torch_adamw_foreach_launches_per_term_not_per_tensor_and_reads_nothing_on_the_device():
    for n in (4, 40):
        params = [torch.nn.Parameter(torch.randn(5)) for _ in range(n)]
        for p in params:
            p.grad = torch.randn(5)
        opt = torch.optim.AdamW(params, foreach=True)
        opt.step()                                          # state made
        audit = _audit(opt.step, host_tensors=StepAudit.host_steps(opt))
        assert audit.host_reads == 0
        assert audit.counts["launch"] and all(name.startswith("_foreach_") for name in audit.counts["launch"])
        assert audit.launches <= 12


def test_the_step_counters_torch_keeps_on_the_host_are_found_inside_a_wrapper():
    import thinwire
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(5)
    opt = thinwire.DenseAllReduce(torch.optim.AdamW(params, foreach=True))
    opt.step()
    assert len(StepAudit.host_steps(opt)) == 3
