"""thinwire.train.probe: dense AdamW's step timed on a copy of the model leaves the model and
the RNG as they were, and the calibration record keeps the smaller of its two timings."""

import torch

from thinwire.train.probe import adamw_step_s, calibrate


def test_the_adamw_probe_touches_neither_the_model_nor_the_rng():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 16))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    batches = lambda i: (torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(i)),) * 2  # noqa: E731
    seconds = adamw_step_s(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2), batches, steps=3)
    assert seconds > 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)              # dropout drew inside a forked RNG


def test_calibration_keeps_the_smaller_timing():
    assert calibrate(0.043, 0.034) == {"before_s": 0.043, "after_s": 0.034, "step_s": 0.034}
    assert calibrate(None, 0.05)["step_s"] == 0.05 and calibrate(None, None)["step_s"] is None
