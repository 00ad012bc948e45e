"""The store exchange as an optimizer's process group: DeMo, SparseLoCo and DiLoCo (wire 'bf16'
or 'int8') across sites that reach each other only through an object store.

    from thinwire.store import StoreGroup

    sites = StoreGroup("file:///shared/run-42", site="site-a", sites=["site-a", "site-b"],
                       key=run_key, fingerprint=run_config_json, round_timeout=90.0)
    opt = thinwire.DeMo(model.parameters(), lr=3e-4, process_group=sites)

Where an optimizer takes a torch.distributed group it takes a `StoreGroup`: the site is its
rank (sites sorted by id), the sites its world. Each `all_gather` its exchange issues is one
agreed round (`RoundExchange`): this site's uint8 message written once, the manifest's
messages back in rank order. What a round leaves out (a late site, a rejected object) comes
back as `RoundPending.absent`, so the exchange delivers only the rows the manifest holds and
every site applies the same ones; a site whose own message missed keeps it (the optimizer's
`_keep_own`). Only optimizers whose every exchange is one all_gather and whose error feedback
can hold a message that missed take it (`STORE_EXCHANGE`); the others refuse it at
construction (docs/design.md, "The store exchange").

Rounds are numbered by the order of the collectives, which every site issues alike: round 0
is the first handshake. It waits `join_timeout` for every site (sites start at different
times) and closes without the ones still missing: they join later. The sites it holds compare
their descriptions as over torch.distributed (PeerMismatchError on each); each also records
its layout's fingerprint once in the store (`DESCRIPTION_KEY`, signed, the first writer's
kept). Every later handshake (a site joining a run already going with `first_round` after
the newest closed round, a site restarted from a checkpoint, a load_state_dict) takes no
round, which would take a number the others use for data: it compares this site's layout
fingerprint with the recorded one (`StoreCommunicator.recorded_description`), and a site
that missed round 0 compares with the messages round 0 agreed.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..comm import Communicator
from ..comm.stats import CommStats
from .envelope import RejectedMessage, open_envelope
from .manifest import manifest_key
from .rounds import ExchangeError, RoundExchange, RoundResult

HANDSHAKE_TAG = "handshake"
DESCRIPTION_KEY = "run/description"      # the layout fingerprint of the run's first handshake


class StoreGroup:
    """The sites of a run and this site's end of their store (`RoundExchange`'s arguments,
    plus `join_timeout`: how long the first handshake round waits for every site, and
    `first_round`: the round the first collective uses: after the newest closed round
    (`newest_closed_round`) for a site joining a run already going, or after the round of the
    snapshot it starts from (`snapshots.latest_snapshot`); the rounds between return at once
    from their manifests)."""

    def __init__(self, location, site: str, sites, key, fingerprint, round_timeout: float = 90.0, *,
                 join_timeout: float = 600.0, first_round: int = 0, **options):
        self.rounds = RoundExchange(location, site, sites, key, fingerprint, round_timeout, **options)
        self.join_timeout = float(join_timeout)
        if isinstance(first_round, bool) or not isinstance(first_round, int) or first_round < 0:
            raise ValueError(f"first_round must be an int >= 0, got {first_round!r}")
        self.next_round = int(first_round)
        self.results: list[RoundResult] = []          # every round this site took part in, in order
        self.snapshot_round: int | None = None          # the newest snapshot this site wrote (`snapshots`)

    @property
    def rank(self) -> int:
        return self.rounds.sites.index(self.rounds.site)

    @property
    def world_size(self) -> int:
        return len(self.rounds.sites)

    @property
    def missed_rounds(self) -> list[int]:
        """The rounds whose manifest left this site's message out."""
        return [r.round for r in self.results if not r.included]

    @property
    def presumed_gone(self) -> bool:
        """This site's message was late in the last `patience` rounds it settled: the others,
        reading the same manifests, no longer wait for it (`liveness.py`)."""
        live = self.rounds.liveness
        return live.own >= live.patience

    def behind(self) -> bool:
        """The round the next collective takes has closed already: this site is catching up
        (a joiner after its snapshot's round, a straggler), its message will miss it."""
        return self.rounds.location.get(manifest_key(self.next_round)) is not None

    def catching_up(self) -> bool:
        """Whether a training loop should skip this step's forward and backward and step with
        zero gradients: behind (its message misses the round anyway, so the round costs one
        read, not a step's compute), or presumed gone (the others do not wait for it: it gets
        back in only by publishing before they close, so it sends without computing)."""
        return self.presumed_gone or self.behind()

    def communicator(self) -> StoreCommunicator:
        return StoreCommunicator(self)


class RoundPending:
    """One round in flight; `wait()` returns the [world, nbytes] rows, and sets `absent`: the
    ranks whose message the manifest does not hold (their rows are left as they were).
    `observer` (the blocked-time observer when the round was issued, or None) is called with
    ('all_gather', seconds) once the first `wait()` returns, as `comm.Pending`'s is."""

    absent: tuple[int, ...] = ()

    def __init__(self, comm: StoreCommunicator, future, out: torch.Tensor, tag: str, nbytes: int, observer=None):
        self._comm, self._future, self._out, self._tag, self._nbytes = comm, future, out, tag, nbytes
        self._observer = observer

    def wait(self) -> torch.Tensor:
        if self._future is not None:
            start = time.perf_counter()
            result, self._future = self._future.result(), None
            self.absent = self._comm._land(result, self._out, self._tag, self._nbytes)
            if self._observer is not None:
                self._observer("all_gather", time.perf_counter() - start)
        return self._out


class StoreCommunicator:
    """What `GatherAll` needs of a `Communicator`, over a `StoreGroup`: `all_gather` of a
    uint8 buffer as one round, run on a thread so that `async_op` overlaps compute as a
    torch.distributed collective does. Every other collective raises: the optimizers that
    need one refuse the store before a step (`CommunicatingOptimizer._init_comm`).

    `stats` counts a round as one collective: payload bytes (the buffer), link bytes sent and
    received (the objects this site wrote and read, envelopes and manifest included);
    `traffic` has the store's requests (puts, gets, lists)."""

    WHOLE_MESSAGES = True            # one round per message: `GatherAll` does not split it

    def __init__(self, group: StoreGroup):
        self.store, self.stats, self.group = group, CommStats(), None
        self.rank, self.world_size = group.rank, group.world_size
        self._worker: ThreadPoolExecutor | None = None      # one thread: rounds run in the order issued

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def traffic(self):
        return self.store.rounds.location.traffic

    def all_gather(self, buf: torch.Tensor, *, tag: str = "payload", out: torch.Tensor | None = None,
                   async_op: bool = False):
        """Every site's `buf` (uint8, 1-D) in rank order, [world_size, numel], through one round.
        Its blocked time goes to `Communicator.blocked_observer()` by `set_blocked_observer`'s
        rules (issue to completion; async: the issue, then the first wait), so a training loop
        counts a store round as it counts a torch.distributed all_gather."""
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"the store exchange carries 1-D uint8 messages, got {buf.dtype} {tuple(buf.shape)}")
        shape = (self.world_size, buf.numel())
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8, device=buf.device)
        elif tuple(out.shape) != shape or out.dtype != buf.dtype:
            raise ValueError(f"out must have shape {shape} and dtype {buf.dtype}")
        observer, start = Communicator.blocked_observer(), time.perf_counter()
        payload = buf.detach().cpu().numpy().tobytes()      # the message as it is now: the caller may reuse buf
        round_, self.store.next_round = self.store.next_round, self.store.next_round + 1
        timeout = self.store.join_timeout if tag == HANDSHAKE_TAG else None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="thinwire-store")
        future = self._worker.submit(self.store.rounds.exchange, round_, payload, timeout)
        pending = RoundPending(self, future, out, tag, buf.nbytes, observer if async_op else None)
        if async_op:
            if observer is not None:
                observer("all_gather", time.perf_counter() - start)
            return pending
        pending.wait()
        if tag == HANDSHAKE_TAG:            # absent sites join later and compare then: rows as this site's
            out[list(pending.absent)] = buf.to(out.device)
        if observer is not None:
            observer("all_gather", time.perf_counter() - start)
        return out

    def recorded_description(self, mine: torch.Tensor) -> torch.Tensor | None:
        """The handshake hook (`optim.protocol.handshake`): None when this handshake is the run's
        first (round 0, or the first collective in a location with no recorded description):
        then it takes a round, and `mine` (this site's layout fingerprint) is recorded for the
        sites that join later. Otherwise the recorded fingerprint, to compare with, and no round."""
        rounds = self.store.rounds
        blob = None if self.store.next_round == 0 else rounds.location.get(DESCRIPTION_KEY)
        if blob is None:
            rounds.location.put_once(DESCRIPTION_KEY, rounds._seal(0, mine.cpu().numpy().tobytes()))
            return None
        try:
            message = open_envelope(blob, key=rounds.key, fingerprint=rounds.fingerprint, round=0)
        except RejectedMessage as err:
            raise ExchangeError(f"{DESCRIPTION_KEY} in the store is not this run's: {err}") from err
        return torch.frombuffer(bytearray(message.payload), dtype=torch.uint8)

    def _land(self, result: RoundResult, out: torch.Tensor, tag: str, nbytes: int) -> tuple[int, ...]:
        """The round's messages into their rows of `out`; counted; the absent ranks returned."""
        self.store.results.append(result)
        sites = self.store.rounds.sites
        for site, message in result.messages.items():
            if len(message) != nbytes:         # every site derives the size from the agreed layout
                raise ExchangeError(f"round {result.round}: {site}'s message has {len(message)} bytes, "
                                    f"this site's {nbytes}: the sites do not share one layout")
            row = torch.from_numpy(np.frombuffer(message, dtype=np.uint8).copy())
            out[sites.index(site)].copy_(row)
        traffic = result.traffic
        self.stats.record(tag, nbytes, traffic.bytes_written, traffic.bytes_read)
        return tuple(r for r, site in enumerate(sites) if site not in result.messages)

    def _refuse(self, op: str):
        raise ValueError(f"the store exchange carries one all_gather per round, not {op}")

    def all_reduce(self, *args, **kwargs):
        self._refuse("all_reduce")

    def all_to_all(self, *args, **kwargs):
        self._refuse("all_to_all")

    def gather(self, *args, **kwargs):
        self._refuse("gather")

    def broadcast(self, *args, **kwargs):
        self._refuse("broadcast")
