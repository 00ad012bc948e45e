"""exit_guard: a normal exit waits until the thread that holds a collective's tensors (gloo's, in
a real run) has let go of them. A view of the tensor stands in for gloo's work: it holds the
tensor's C++ impl, which is what `Tensor._use_count()` counts, and dropping it on another thread
takes the GIL as gloo's thread does."""

import threading
import time

import pytest
import torch

from thinwire.comm import exit_guard


class _Work:
    """A stand-in for torch.distributed's work handle (weak references, nothing else)."""


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(exit_guard, "_handed", [])
    monkeypatch.setattr(exit_guard, "_registered", True)     # no atexit handler from the tests


def _hand(tensor):
    """Issue a fake collective on `tensor`: returns (work, owner), owner a C++ holder of tensor."""
    owner = []

    def collective(t):
        owner.append(t.view(-1))
        return _Work()
    return exit_guard.issue([tensor], collective, tensor), owner


def test_waits_until_the_other_thread_lets_go():
    t = torch.zeros(4)
    work, owner = _hand(t)
    assert t._use_count() > 1
    del work                                             # Python dropped its handle; the owner has not
    releaser = threading.Timer(0.2, owner.clear)        # the owner lets go on its own thread, later
    start = time.monotonic()
    releaser.start()
    assert exit_guard.wait_released(limit_s=5.0)
    assert time.monotonic() - start >= 0.15
    assert t._use_count() == 1
    releaser.join()


def test_a_work_python_still_holds_is_left_to_python():
    t = torch.zeros(4)
    work, owner = _hand(t)                               # a step left in flight: Python frees it
    start = time.monotonic()
    assert exit_guard.wait_released(limit_s=5.0)
    assert time.monotonic() - start < 1.0
    assert work is not None and owner is not None


def test_gives_up_after_the_limit():
    t = torch.zeros(4)
    work, owner = _hand(t)
    del work                                             # the owner never lets go (a stuck collective)
    assert not exit_guard.wait_released(limit_s=0.05)
    assert owner and t._use_count() > 1


def test_released_entries_are_dropped_at_the_next_collective():
    t, u = torch.zeros(4), torch.zeros(4)
    work, owner = _hand(t)
    del work, owner
    _hand(u)
    assert [counts[0][0] is u for _, counts in exit_guard._handed] == [True]
