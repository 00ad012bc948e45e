"""The store exchange: sites that cannot reach each other exchange messages through an object store.

Each site writes its message for a round as one signed object, written once, and reads the
others' back; the first site to close a round writes the round's manifest with a conditional
create, and every site applies exactly the manifest's messages (docs/design.md, "The store
exchange"). Locations are URLs: `file:///shared/dir` (any real filesystem, no extra install)
and `s3://bucket/prefix` (S3, R2, MinIO, ...; `pip install thinwire[store]`).

    from thinwire.store import RoundExchange

    exchange = RoundExchange("s3://run-bucket/run-42", site="site-a",
                             sites=["site-a", "site-b"], key=run_key,
                             fingerprint=run_config_json, round_timeout=90.0,
                             options={"endpoint": "https://<account>.r2.cloudflarestorage.com"})
    for step in range(steps):
        message = optimizer_message(step)                       # bytes (a thinwire uint8 buffer)
        result = exchange.exchange(step, message)
        apply(result.messages)                                  # site -> payload, the manifest's
        if not result.included:                                 # late or rejected: nothing applied it,
            carry_over(message)                                 # so keep it for the next round
        log(result.late, result.rejected, result.traffic.as_dict())

An optimizer exchanges through the store where it takes a process group (`StoreGroup`:
DeMo, SparseLoCo, DiLoCo with a lossy wire; the others refuse it):

    opt = thinwire.DeMo(params, process_group=StoreGroup(url, site, sites, key, fingerprint))

A site that fell behind reads the rounds it missed with `exchange.read_round(r)` (None while
round r is open). A site late in `patience` rounds in a row (default 2) is presumed gone:
rounds stop waiting for it and take it again when its message is there (`liveness.py`).
Sites may die, join later or restart: live sites publish snapshots, a joiner starts from
the latest and catches up (docs/design.md, "Sites that die, join later and come back"):

    publish_snapshot(group, model, opt, every=20)           # live sites, after each step
    round, state = latest_snapshot(url, key, fingerprint)   # the joiner (None: no snapshot yet)
    model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])
    group = StoreGroup(url, site, sites, key, fingerprint, first_round=round + 1)
    ...
    if group.catching_up():       # behind, or presumed gone: step with zero gradients
        zero_gradients(model)
    else:
        loss.backward()
    opt.step()

(The joiner's optimizer is built on its `group` before the load.) Nothing runs at import;
obstore is imported when an s3:// location opens.
"""

from .envelope import REASONS, RejectedMessage, SignedMessage, open_envelope, run_fingerprint, seal
from .locations import FileLocation, Location, LocationError, StoreTraffic
from .manifest import Manifest, newest_closed_round
from .liveness import Liveness
from .rounds import ExchangeError, RoundExchange, RoundResult
from .communicator import StoreCommunicator, StoreGroup
from .snapshots import joiner_state, latest_snapshot, load_local, local_tensors, publish_snapshot
from .urls import open_location

__all__ = ["REASONS", "ExchangeError", "FileLocation", "Liveness", "Location", "LocationError", "Manifest",
           "RejectedMessage", "RoundExchange", "RoundResult", "SignedMessage", "StoreCommunicator", "StoreGroup",
           "StoreTraffic", "joiner_state", "latest_snapshot", "load_local", "local_tensors", "newest_closed_round",
           "open_envelope", "open_location", "publish_snapshot", "run_fingerprint", "seal"]
