import pytest

from tests.train.shared import TINY, TINY_OPTIMIZERS, cli_here, compare_here, train_argv


@pytest.fixture(scope="session")
def tiny_compare(tmp_path_factory):
    """The tiny-preset `thinwire compare` that three files check (shared.py), run once, in this
    process (compare_here)."""
    return compare_here(tmp_path_factory.mktemp("tiny_compare"), *TINY, "--optimizers", ",".join(TINY_OPTIMIZERS))


@pytest.fixture(scope="session")
def demo_never_killed(tmp_path_factory):
    """The out directory of shared.run_train's run never interrupted, by `thinwire train`'s main
    in this process (cli_here: the same command, the same launcher and workers' code):
    test_checkpoint.py resumes copies of it, test_faults.py's killed runs must end with its
    parameters. Read only."""
    out = tmp_path_factory.mktemp("demo_never_killed")
    cli_here(*train_argv(out))
    return out
