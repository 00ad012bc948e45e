"""--snapshot-every and --join refuse what they cannot run, before any worker starts."""

from __future__ import annotations

import pytest

from thinwire.train.config import RunOptions
from thinwire.train.site_join import check_join

URL = "file:///tmp/thinwire-never-written"


@pytest.mark.parametrize("fields, optimizers, message", [
    (dict(snapshot_every=-1, exchange=URL), ["demo"], r"--snapshot-every must be an int >= 0"),
    (dict(snapshot_every=True, exchange=URL), ["demo"], r"--snapshot-every must be an int >= 0"),
    (dict(snapshot_every=5), ["demo"], r"--snapshot-every writes snapshots to the store: give --exchange"),
    (dict(join=True, exchange=URL), ["demo"], r"--join .* give --exchange URL and --site"),
    (dict(join_timeout=0.0, exchange=URL), ["demo"], r"--join-timeout must be > 0"),
    (dict(snapshot_every=5, exchange=URL), ["demo", "demo-overlap"], r"demo-overlap keeps a step's exchange"),
])
def test_bad_snapshot_and_join_options_are_refused(fields, optimizers, message):
    with pytest.raises(ValueError, match=message):
        check_join(RunOptions(**fields), optimizers)


def test_snapshots_and_joining_pass_the_check_where_they_can_run():
    check_join(RunOptions(exchange=URL, snapshot_every=5), ["demo", "sparseloco"])
    check_join(RunOptions(exchange=URL, site="c", peers=("a", "b", "c"), join=True), ["demo"])
    check_join(RunOptions(), ["adamw"])
