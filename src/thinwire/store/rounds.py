"""Agreed rounds: every site applies the same messages each round, whoever was late.

Sites that cannot reach each other agree through the store alone. For round r, each site:

1. writes its signed message once (`publish`);
2. polls the round's folder, with backoff, until every expected site's object is there, a
   manifest is there, or its own deadline (`round_timeout` after it published) has passed;
3. if no manifest is there, closes the round: reads and verifies the objects it found and
   writes the manifest with a conditional create. Exactly one site's create succeeds; the
   others' fail and they read the winner's manifest instead;
4. returns the manifest's messages, verified and matched to the manifest's SHA-256 of each
   object, with the names of the late sites and of the rejected objects and why.

A site whose message is not in the manifest (late, or its key held something else) is told
so (`included` is False): it must keep what it computed and fold it into a later message,
so nothing is lost and every replica still applies the same set. A straggler that arrives
after the manifest finds it on its first poll and gets the same answer, without waiting.

A site late in `patience` rounds in a row is presumed gone (`liveness.py`): rounds stop
waiting for it, and take its message again whenever it is there when they close.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .liveness import Liveness
from .envelope import FINGERPRINT_NBYTES, RejectedMessage, open_envelope, run_fingerprint, seal
from .locations import Location, StoreTraffic
from .urls import open_location
from .manifest import Manifest, check_site, digest, manifest_key, message_key, round_folder

log = logging.getLogger(__name__)


class ExchangeError(RuntimeError):
    """The store contradicts the agreement: a manifest not signed for this run and round, or
    one that names a message the store does not hold with the bytes it names. Raised rather
    than guessed around, since sites that guessed differently would drift apart."""


@dataclass
class RoundResult:
    """What one site learned from one round.

    messages: site -> verified payload, exactly the manifest's, sorted by site (this site's
        own included when the manifest has it); apply these and nothing else.
    included: this site's message is in the manifest. When False, keep what it carried.
    late / rejected: expected sites that had no object when the round closed; objects that
        failed verification, site -> reason ('garbled', 'forged', 'replayed', 'misplaced',
        'stranger' for a site that is not in the run).
    closed_by / closed_here: the site whose manifest won; whether that was this site.
    waited_s: seconds from this site's exchange call to its answer.
    traffic: this round's requests and bytes at this site's location (this call's only).
    gone: the sites this site presumed gone once this round settled (`Liveness`).
    """

    round: int
    site: str
    messages: dict[str, bytes]
    included: bool
    late: tuple[str, ...]
    rejected: dict[str, str]
    closed_by: str
    closed_here: bool
    waited_s: float
    traffic: StoreTraffic
    gone: tuple[str, ...] = ()

    @property
    def missed_because(self) -> str | None:
        """None when this site's message is in the round, else 'late' or the rejection reason."""
        return None if self.included else self.rejected.get(self.site, "late")


class RoundExchange:
    """One site's end of the store exchange.

    location: a URL ('file:///shared/dir', 's3://bucket/prefix') or an open Location;
        `options` go to open_location (the S3 endpoint and credentials).
    site / sites: this site's id and every site of the run (this one included).
    key: the run's HMAC key; fingerprint: 32 bytes (`run_fingerprint`) or the run's
        configuration as a string, hashed here.
    round_timeout: seconds a site waits for the others after publishing before it closes
        the round with whoever arrived.
    poll: (first, longest) wait between listings; each wait doubles up to the longest.
    readers: messages read in parallel.
    patience: late rounds in a row after which a site is presumed gone and rounds stop
        waiting for it (`liveness.py`).
    """

    def __init__(self, location: str | Location, site: str, sites, key: str | bytes,
                 fingerprint: str | bytes, round_timeout: float = 90.0, *,
                 poll: tuple[float, float] = (0.05, 1.0), readers: int = 8, patience: int = 2,
                 options: dict | None = None):
        self.location = location if isinstance(location, Location) else open_location(location, **(options or {}))
        self.site = check_site(site)
        self.sites = tuple(sorted({check_site(s) for s in sites}))
        if self.site not in self.sites:
            raise ValueError(f"site {site!r} is not one of the run's sites {self.sites}")
        self.key = key
        raw = isinstance(fingerprint, bytes) and len(fingerprint) == FINGERPRINT_NBYTES
        self.fingerprint = fingerprint if raw else run_fingerprint(fingerprint)
        self.round_timeout, self.poll, self.readers = float(round_timeout), poll, readers
        self.liveness = Liveness(self.site, self.sites, patience)
        self._published: tuple[int, bytes] | None = None    # (round, object): no need to read it back

    def exchange(self, round: int, payload: bytes, timeout: float | None = None) -> RoundResult:
        """Publish this site's `payload` for `round`, wait for the others up to the deadline
        (`timeout`, default `round_timeout`), and return the round's agreed messages."""
        start, before = time.monotonic(), self.location.traffic.copy()
        self.publish(round, payload)
        keys = self._wait(round, time.monotonic() + (self.round_timeout if timeout is None else float(timeout)))
        return self._agree(round, keys, start, before)

    def publish(self, round: int, payload: bytes) -> bool:
        """Write this site's signed message for `round` once. False when its key already
        holds another object (then this site's message cannot enter the round). Publishing
        what this site already wrote for `round` takes no request (the key is write-once)."""
        blob = self._seal(round, payload)
        if self._published == (round, blob):
            return True
        key = message_key(round, self.site)
        if self.location.put_once(key, blob) or self.location.get(key) == blob:   # or a retry of this round
            self._published = (round, blob)
            return True
        log.warning("round %d: %s already holds another object; %s's message cannot enter this round",
                    round, key, self.site)
        return False

    def close(self, round: int) -> RoundResult:
        """Close `round` now with the messages that are there (or read its manifest)."""
        start, before = time.monotonic(), self.location.traffic.copy()
        return self._agree(round, self.location.list(round_folder(round)), start, before)

    def read_round(self, round: int) -> RoundResult | None:
        """The agreed result of a round that has closed, None if it has not: how a site that
        fell behind catches up on the manifests it missed."""
        start, before = time.monotonic(), self.location.traffic.copy()
        manifest = self._read_manifest(round)
        return None if manifest is None else self._result(round, manifest, {}, False, start, before)

    def _seal(self, round: int, payload: bytes) -> bytes:
        return seal(payload, key=self.key, fingerprint=self.fingerprint, round=round, site=self.site)

    def _wait(self, round: int, deadline: float) -> list[str]:
        """The round folder's keys once every awaited site is in (all but those presumed
        gone) or the round is closed, or at the deadline."""
        delay, wanted = self.poll[0], {message_key(round, s) for s in self.liveness.awaited(self.sites)}
        while True:
            keys = self.location.list(round_folder(round))
            if manifest_key(round) in keys or wanted <= set(keys):
                return keys
            left = deadline - time.monotonic()
            if left <= 0:
                return keys
            time.sleep(min(delay, left))
            delay = min(2 * delay, self.poll[1])

    def _agree(self, round: int, keys: list[str], start: float, before: StoreTraffic) -> RoundResult:
        """Settle `round` from a listing of its folder: adopt its manifest, or write one."""
        if manifest_key(round) not in keys:
            verified, proposal = self._judge(round, keys)
            if self.location.put_once(manifest_key(round), self._seal(round, proposal.to_json())):
                return self._result(round, proposal, verified, True, start, before)
        else:
            verified = {}
        manifest = self._read_manifest(round)
        if manifest is None:
            raise ExchangeError(f"round {round}: the manifest's conditional create failed, yet there is no manifest")
        return self._result(round, manifest, verified, False, start, before)

    def _result(self, round: int, manifest: Manifest, verified: dict[str, tuple[str, bytes]],
                closed_here: bool, start: float, before: StoreTraffic) -> RoundResult:
        messages = self._settle(round, manifest, verified)
        self.liveness.settle(round, manifest.accepted, manifest.late)
        included = self.site in manifest.accepted
        if not included:
            log.warning("round %d: %s's message is not in the manifest (%s); keep it for a later round",
                        round, self.site, manifest.rejected.get(self.site, "late"))
        return RoundResult(round, self.site, messages, included, manifest.late, dict(manifest.rejected),
                           manifest.closed_by, closed_here, time.monotonic() - start,
                           self.location.traffic.minus(before), self.liveness.gone)

    def _judge(self, round: int, keys: list[str]) -> tuple[dict[str, tuple[str, bytes]], Manifest]:
        """Verify every message in `keys`: (site -> (digest, payload) of the genuine ones,
        the manifest this site proposes)."""
        folder = message_key(round, "")
        found = [k[len(folder):] for k in keys if k.startswith(folder)]
        rejected = {s: "stranger" for s in found if s not in self.sites}
        for stranger in rejected:
            log.warning("round %d: rejected an object from %r, which is not a site of this run", round, stranger)
        expected = [s for s in found if s in self.sites]
        verified = {}
        for site, blob in zip(expected, self._read_all_but_own(round, expected)):
            if blob is None:
                continue
            try:
                message = open_envelope(blob, key=self.key, fingerprint=self.fingerprint, round=round, site=site)
            except RejectedMessage as err:
                log.warning("round %d: rejected %s's message: %s", round, site, err)
                rejected[site] = err.reason
                continue
            verified[site] = (digest(blob), message.payload)
        late = tuple(s for s in self.sites if s not in verified and s not in rejected)
        accepted = {s: d for s, (d, _) in sorted(verified.items())}
        return verified, Manifest(round, self.site, accepted, dict(sorted(rejected.items())), late)

    def _settle(self, round: int, manifest: Manifest, verified: dict[str, tuple[str, bytes]]) -> dict[str, bytes]:
        """The manifest's payloads: those this site verified with the same bytes, the rest
        read and verified now (they arrived after this site's listing, or the manifest was
        there first). This site's own is never read back: the bytes it wrote are held, and
        checked against the manifest's SHA-256 like any other."""
        payloads = {s: p for s, (d, p) in verified.items() if manifest.accepted.get(s) == d}
        missing = [s for s in manifest.accepted if s not in payloads]
        for site, blob in zip(missing, self._read_all_but_own(round, missing)):
            if blob is None or digest(blob) != manifest.accepted[site]:
                raise ExchangeError(f"round {round}: the manifest names {site}'s message with SHA-256 "
                                    f"{manifest.accepted[site][:12]}, the store holds another or none")
            try:
                message = open_envelope(blob, key=self.key, fingerprint=self.fingerprint, round=round, site=site)
            except RejectedMessage as err:
                raise ExchangeError(f"round {round}: the manifest accepted {site}'s message, which is {err}") from err
            payloads[site] = message.payload
        return {s: payloads[s] for s in sorted(manifest.accepted)}

    def _read_manifest(self, round: int) -> Manifest | None:
        """The round's manifest, verified; None while the round is open."""
        blob = self.location.get(manifest_key(round))
        if blob is None:
            return None
        try:
            message = open_envelope(blob, key=self.key, fingerprint=self.fingerprint, round=round)
            manifest = Manifest.from_json(message.payload)
        except (ValueError, KeyError, TypeError) as err:     # RejectedMessage is a ValueError
            raise ExchangeError(f"round {round}: the manifest in the store is not this run's: {err}") from err
        if manifest.round != round or manifest.closed_by != message.site or message.site not in self.sites:
            raise ExchangeError(f"round {round}: the manifest's round or closing site does not match its envelope")
        return manifest

    def _read_all_but_own(self, round: int, sites: list[str]) -> list[bytes | None]:
        """The messages of `sites` for `round`; this site's own from memory when it wrote it."""
        own = self._published[1] if self._published and self._published[0] == round else None
        others = iter(self._read_all([message_key(round, s) for s in sites if s != self.site or own is None]))
        return [own if s == self.site and own is not None else next(others) for s in sites]

    def _read_all(self, keys: list[str]) -> list[bytes | None]:
        """The objects at `keys`, read in parallel (a round's latency is one read, not n)."""
        if len(keys) <= 1:
            return [self.location.get(k) for k in keys]
        with ThreadPoolExecutor(max_workers=min(self.readers, len(keys))) as pool:
            return list(pool.map(self.location.get, keys))
