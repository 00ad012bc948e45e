"""DeMo's public surface in one process: arguments, state, error feedback, no process group."""

import pytest
import torch

import thinwire


def _param(shape=(64, 64)):
    return torch.nn.Parameter(torch.randn(shape))


@pytest.mark.parametrize("kwargs, name", [
    ({"topk": 0}, "topk"), ({"topk": 2.5}, "topk"), ({"chunk": 0}, "chunk"),
    ({"beta": 1.0}, "beta"), ({"beta": -0.1}, "beta"), ({"alpha": 0.0}, "alpha"), ({"alpha": 1.5}, "alpha"),
    ({"transform": "fft"}, "transform"), ({"base": "adam"}, "base"), ({"values": "fp8"}, "values"),
    ({"lr": -1.0}, "lr"), ({"weight_decay": -1.0}, "weight_decay"),
    ({"aggregate": "median"}, "aggregate"), ({"momentum_domain": "fft"}, "momentum_domain"),
    ({"momentum_domain": "transform", "transform": "random"}, "momentum_domain"), ({"nonfinite": "ignore"}, "nonfinite"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        thinwire.DeMo([_param()], **kwargs)


def test_bad_param_group_raises():
    opt = thinwire.DeMo([_param()])
    with pytest.raises(ValueError, match="topk"):
        opt.add_param_group({"params": [_param()], "topk": -3})


@pytest.mark.parametrize("domain, transform, shape", [
    ("param", "dct", (96, 128)), ("auto", "random", (96, 128)),          # M shaped like the parameter
    ("auto", "dct", (96, 128)), ("transform", "identity", (96, 128)),    # M = T(M) in image layout
    ("auto", "dct", (130, 100)),                                         # padded: 130 -> 192 rows
])
def test_state_is_one_momentum_buffer_per_parameter(domain, transform, shape):
    p = _param(shape)
    opt = thinwire.DeMo([p], lr=0.01, momentum_domain=domain, transform=transform)
    p.grad = torch.randn_like(p)
    opt.step()
    tensors = {k: v for k, v in opt.state[p].items() if torch.is_tensor(v)}
    in_param_shape = domain == "param" or transform == "random"
    # 96 = 2 x 48, 128 = 2 x 64: no padding; 130 has no divisor in [32, 64]: 3 x 64; 100 = 2 x 50
    padded = {(96, 128): (96, 128), (130, 100): (192, 100)}[shape]
    assert list(tensors) == ["momentum"]
    assert tensors["momentum"].shape == (p.shape if in_param_shape else padded)


@pytest.mark.parametrize("values", ["fp32", "bf16", "int8", "sign"])
@pytest.mark.parametrize("domain, transform", [("param", "dct"), ("transform", "identity")])
def test_error_feedback_keeps_what_was_not_delivered(values, domain, transform):
    """After a step, momentum == beta*m + (1 - beta)*g - (what the wire delivered): nothing is lost,
    value quantisation included. Checked with alpha=1 and one worker, where the delivered
    tensor is exactly the update direction before sign(). (With the identity transform the
    transform-domain momentum is the parameter-shaped one: 64 x 128 needs no padding.)"""
    torch.manual_seed(1)
    p = _param((64, 128))
    opt = thinwire.DeMo([p], lr=0.5, beta=0.9, topk=16, values=values, base="sgd", transform=transform,
                        momentum_domain=domain)
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    opt.step()
    delivered = (before - p.detach()) / 0.5      # base='sgd': p -= lr * delivered
    m = opt.state[p]["momentum"]
    assert m.shape == p.shape
    assert torch.allclose(m + delivered, (1 - 0.9) * p.grad, atol=1e-5)
    assert delivered.abs().sum() > 0


def test_single_process_without_process_group_counts_bytes():
    p = _param((64, 64))
    opt = thinwire.DeMo([p], topk=32, values="bf16")
    p.grad = torch.randn_like(p)
    opt.step()
    # header 8 + 1 presence byte + one 64x64 chunk: 32 indices of 12 bits + 32 bf16 values
    assert opt.comm_stats.last_step.payload_bytes == 8 + 1 + 48 + 64
    assert opt.comm_stats.link_bytes_sent == 0


def test_lr_scheduler_drives_the_step_size():
    p = _param((8, 8))
    opt = thinwire.DeMo([p], lr=1.0, topk=64, base="signum")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    opt.step()
    sched.step()
    assert torch.allclose(before - p.detach(), torch.full_like(before, 0.5))


def test_nonfinite_gradient_raises_and_leaves_params_untouched():
    p = _param((8, 8))
    opt = thinwire.DeMo([p])
    p.grad = torch.full_like(p, float("nan"))
    before = p.detach().clone()
    with pytest.raises(thinwire.NonFiniteGradientError):
        opt.step()
    assert torch.equal(p.detach(), before)
    assert not opt.state[p]["momentum"].any()


def test_momentum_in_another_layout_is_rejected_on_the_next_step():
    """load_state_dict restores the saved group settings; a momentum that does not fit the
    group's layout (a group changed after loading, or an older chunk-major checkpoint)
    must raise, not be misread."""
    p = _param((64, 130))                                   # transform-domain M is padded to 64 x 192
    opt = thinwire.DeMo([p], momentum_domain="param")
    p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0]["momentum_domain"] = "transform"
    before = p.detach().clone()
    with pytest.raises(ValueError, match="momentum of a \\(64, 130\\) parameter has shape"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("values", ["fp32", "int8"])
def test_transform_domain_follows_the_param_domain_on_padded_shapes(values):
    """T is linear, so keeping T(M) is the param-domain algorithm, provided the padding the
    param domain crops away is dropped in the transform domain too (zero_padding_)."""
    torch.manual_seed(2)
    shapes = [(37, 24), (10, 37), (130,), (20, 23)]        # chunk 16: rows, cols, both padded
    runs = {}
    for domain in ("param", "transform"):
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
                  for i, s in enumerate(shapes)]
        opt = thinwire.DeMo(params, lr=0.01, beta=0.9, topk=5, chunk=16, values=values, momentum_domain=domain)
        gen = torch.Generator().manual_seed(3)
        for _ in range(15):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs[domain] = (params, opt)
    for (p, q) in zip(runs["param"][0], runs["transform"][0]):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
        plan = runs["transform"][1].compressor(runs["transform"][1].param_groups[0]).plan(p.shape)
        m_param = runs["param"][1].state[p]["momentum"]
        m_image = runs["transform"][1].state[q]["momentum"].clone()
        back = thinwire.compress.ChunkTransform("dct").inverse_image(m_image, plan)
        assert torch.allclose(back, plan.padded_matrix(m_param), atol=1e-5)   # padding holds nothing
