"""thinwire.train.probe: dense AdamW's step timed on a copy of the model leaves the model and
the RNG as they were, the calibration record keeps the smaller of its two timings, and the
samples taken at evaluations count up to the run's target step, averaged."""

import pytest
import torch

from thinwire.train.probe import AdamWProbe, calibrate, step_during


def test_the_adamw_probe_touches_neither_the_model_nor_the_rng():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 16))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    batches = lambda i: (torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(i)),) * 2  # noqa: E731
    seconds = AdamWProbe(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2), batches).median_s(3)
    assert seconds > 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)              # dropout drew inside a forked RNG


def test_calibration_keeps_the_smaller_timing():
    assert calibrate(0.043, 0.034) == {"before_s": 0.043, "after_s": 0.034, "step_s": 0.034}
    assert calibrate(None, 0.05)["step_s"] == 0.05 and calibrate(None, None)["step_s"] is None


def test_sampling_through_the_run_touches_neither_the_model_nor_the_rng():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 16))
    before = [p.detach().clone() for p in model.parameters()]
    batches = lambda i: (torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(i)),) * 2  # noqa: E731
    probe = AdamWProbe(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2), batches)
    rng = torch.get_rng_state()
    first = [p.detach().clone() for p in probe.replica.parameters()]
    times = probe.sample(4)
    assert len(times) == 4 and min(times) > 0
    assert probe.median_s(3) > 0
    assert not torch.equal(next(probe.replica.parameters()), first[0])    # the copy trained: real AdamW steps
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_samples_count_up_to_the_target_step():
    evals = [{"step": 0, "val_loss": 4.0}, {"step": 5, "val_loss": 3.0, "adamw_probe_s": [0.4, 0.1]},
             {"step": 10, "val_loss": 2.0, "adamw_probe_s": [0.2, 0.3]}, {"step": 15, "adamw_probe_s": [5.0]}]
    assert step_during(evals, 10) == pytest.approx(0.25)      # (0.4 + 0.1 + 0.2 + 0.3) / 4
    assert step_during(evals, None) == pytest.approx(1.2)     # every sample: (1.0 + 5.0) / 5, the slow one counted
    assert step_during(evals, 4) is None and step_during(evals[:1], None) is None
