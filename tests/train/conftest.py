import pytest

from tests.train.shared import TINY, TINY_OPTIMIZERS, run_compare, run_train


@pytest.fixture(scope="session")
def tiny_compare(tmp_path_factory):
    """The tiny-preset `thinwire compare` that three files check (shared.py), run once."""
    return run_compare(tmp_path_factory.mktemp("tiny_compare"), *TINY, "--optimizers", ",".join(TINY_OPTIMIZERS))


@pytest.fixture(scope="session")
def demo_never_killed(tmp_path_factory):
    """The out directory of shared.run_train never interrupted: test_checkpoint.py resumes
    copies of it, test_faults.py's killed runs must end with its parameters. Read only."""
    out = tmp_path_factory.mktemp("demo_never_killed")
    done = run_train(out)
    assert done.returncode == 0, done.stdout[-3000:]
    return out
