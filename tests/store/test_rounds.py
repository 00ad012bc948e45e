"""Agreed rounds between sites that are separate OS processes and share nothing but the
store: a real temporary folder (file://) and a real S3-API server on localhost (s3://).

Each scenario runs its processes once per kind of location (a module-scoped fixture); the
tests read what every site got."""

from __future__ import annotations

import pytest

from thinwire.store import open_location, run_fingerprint, seal
from thinwire.store.manifest import manifest_key, message_key

from .conftest import CREDENTIALS, make_bucket
from .sites import CONFIG, KEY, payload_for, run_sites

TIMEOUT = 2.0           # round_timeout, seconds
LATE = 3.0              # how long the late site sleeps before its round: past the others' deadline
RUN = run_fingerprint(CONFIG)


@pytest.fixture(scope="module", params=["file", "s3"])
def new_location(request, tmp_path_factory):
    """A function that returns the (url, options) of a fresh, empty location."""
    if request.param == "file":
        return lambda: (tmp_path_factory.mktemp("store").as_uri(), {})
    endpoint = request.getfixturevalue("s3_endpoint")
    return lambda: (f"s3://{make_bucket(endpoint)}/run-1", {"endpoint": endpoint, **CREDENTIALS})


def envelope(site: str, round: int, payload: bytes | None = None, key: bytes = KEY) -> bytes:
    payload = payload_for(site, round) if payload is None else payload
    return seal(payload, key=key, fingerprint=RUN, round=round, site=site)


def agreement(result) -> tuple:
    """What every site must agree on for a round."""
    return result.messages, result.late, result.rejected, result.closed_by


def manifests_in_store(url: str, options: dict) -> list[str]:
    keys = open_location(url, **options).list("rounds")
    return [k for k in keys if k.endswith("/manifest")]


# ---- all on time, then one site late, then the late site back in step ----

@pytest.fixture(scope="module")
def late_run(new_location):
    url, options = new_location()
    on_time = [(0, "exchange", 0.0), (1, "exchange", 0.0), (2, "exchange", 0.0)]
    late_in_round_1 = [(0, "exchange", 0.0), (1, "exchange", LATE), (2, "exchange", 0.0)]
    plans = {"site-a": on_time, "site-b": on_time, "site-c": late_in_round_1}
    return url, options, run_sites(url, options, plans, sites=list(plans), round_timeout=TIMEOUT)


def test_on_time_sites_all_get_all_messages(late_run):
    url, options, results = late_run
    round0 = [results[s][0] for s in ("site-a", "site-b", "site-c")]
    expected = {s: payload_for(s, 0) for s in ("site-a", "site-b", "site-c")}
    for result in round0:
        assert result.messages == expected and result.included
        assert (result.late, result.rejected) == ((), {})
    assert len({repr(agreement(r)) for r in round0}) == 1
    assert sum(r.closed_here for r in round0) == 1
    assert all(r.waited_s < TIMEOUT for r in round0)       # nobody waited for a deadline
    assert manifests_in_store(url, options) == [manifest_key(r) for r in range(3)]


def test_traffic_of_the_closing_site_is_exact(late_run):
    _, _, results = late_run
    closer = next(results[s][0] for s in results if results[s][0].closed_here)
    others = [s for s in results if s != closer.site]
    traffic = closer.traffic
    assert (traffic.puts, traffic.gets) == (2, len(others))     # its message, the manifest; the others'
    assert traffic.bytes_read == sum(len(envelope(s, 0)) for s in others)
    assert traffic.bytes_written > len(envelope(closer.site, 0))
    assert traffic.requests == traffic.puts + traffic.gets + traffic.lists


def test_a_late_site_is_left_out_and_told(late_run):
    _, _, results = late_run
    a, b, c = (results[s][1] for s in ("site-a", "site-b", "site-c"))
    expected = {s: payload_for(s, 1) for s in ("site-a", "site-b")}
    for result in (a, b, c):
        assert result.messages == expected and result.late == ("site-c",)
    assert agreement(a) == agreement(b) == agreement(c)
    assert a.included and b.included and (a.closed_here or b.closed_here)
    assert not c.included and c.missed_because == "late" and not c.closed_here
    assert c.waited_s < TIMEOUT / 2          # the manifest was there: the straggler did not wait
    assert (a if a.closed_here else b).waited_s >= TIMEOUT    # the closer waited out its deadline


def test_the_late_site_is_back_in_the_next_round(late_run):
    _, _, results = late_run
    round2 = [results[s][2] for s in ("site-a", "site-b", "site-c")]
    assert all(r.included and r.late == () for r in round2)
    assert round2[2].messages == {s: payload_for(s, 2) for s in ("site-a", "site-b", "site-c")}
    assert len({repr(agreement(r)) for r in round2}) == 1


def test_a_straggler_reads_the_rounds_it_missed(late_run):
    url, options, results = late_run
    from thinwire.store import RoundExchange
    catch_up = RoundExchange(open_location(url, **options), "site-c", list(results), KEY, CONFIG, TIMEOUT)
    for round in range(3):
        assert agreement(catch_up.read_round(round)) == agreement(results["site-a"][round])
    assert catch_up.read_round(3) is None


def test_a_site_that_finds_the_round_closed_reads_only_the_others(new_location):
    """site-c wrote its message, then site-a closed the round with it before site-c's first
    listing: site-c adopts the manifest and reads the others' messages, never its own (it
    holds the bytes it wrote and checks them against the manifest's SHA-256)."""
    from thinwire.store import RoundExchange
    url, options = new_location()
    sites = ["site-a", "site-b", "site-c"]
    a, b, c = (RoundExchange(open_location(url, **options), s, sites, KEY, CONFIG, TIMEOUT) for s in sites)
    assert b.publish(0, payload_for("site-b", 0)) and c.publish(0, payload_for("site-c", 0))
    closed = a.exchange(0, payload_for("site-a", 0))        # every message is in: a closes at once
    assert closed.closed_here and closed.late == ()
    late = c.exchange(0, payload_for("site-c", 0))          # its first listing shows the manifest
    assert agreement(late) == agreement(closed) and late.included and not late.closed_here
    manifest = open_location(url, **options).get(manifest_key(0))
    assert (late.traffic.puts, late.traffic.gets, late.traffic.lists) == (0, 3, 1)   # manifest, a's, b's
    assert late.traffic.bytes_read == len(manifest) + len(envelope("site-a", 0)) + len(envelope("site-b", 0))


# ---- objects that do not belong: forged, replayed, garbled, misplaced, a stranger's ----

def plant_intruders(url: str, options: dict) -> None:
    """What the two honest sites (a, b) find besides each other's messages.

    Round 0: c's key holds a message signed with another key (forged), d's a genuine one,
    e's a genuine one with a byte flipped (garbled), and a site that is not in the run left
    one. Round 1: a's own key and d's key hold copies of genuine round-0 messages (replayed:
    a's message cannot enter the round), e's key holds a's genuine round-1 message (misplaced).
    """
    location = open_location(url, **options)
    garbled = bytearray(envelope("site-e", 0))
    garbled[60] ^= 0x01
    planted = {message_key(0, "site-c"): envelope("site-c", 0, key=b"not the run key"),
               message_key(0, "site-d"): envelope("site-d", 0),
               message_key(0, "site-e"): bytes(garbled),
               message_key(0, "mallory"): envelope("mallory", 0),
               message_key(1, "site-a"): envelope("site-a", 0),
               message_key(1, "site-d"): envelope("site-d", 0),
               message_key(1, "site-e"): envelope("site-a", 1)}
    for key, blob in planted.items():
        assert location.put_once(key, blob)


@pytest.fixture(scope="module")
def intruded_run(new_location):
    url, options = new_location()
    plant_intruders(url, options)
    plan = [(0, "exchange", 0.0), (1, "exchange", 0.0)]
    sites = ["site-a", "site-b", "site-c", "site-d", "site-e"]
    return run_sites(url, options, {"site-a": plan, "site-b": plan}, sites=sites, round_timeout=TIMEOUT)


def test_forged_garbled_and_strangers_are_rejected_and_named(intruded_run):
    a, b = intruded_run["site-a"][0], intruded_run["site-b"][0]
    assert agreement(a) == agreement(b)
    assert a.messages == {s: payload_for(s, 0) for s in ("site-a", "site-b", "site-d")}
    assert a.rejected == {"site-c": "forged", "site-e": "garbled", "mallory": "stranger"}
    assert a.late == () and a.included and b.included


def test_replayed_and_misplaced_are_rejected_and_the_squatted_site_told(intruded_run):
    a, b = intruded_run["site-a"][1], intruded_run["site-b"][1]
    assert agreement(a) == agreement(b)
    assert a.messages == {"site-b": payload_for("site-b", 1)}
    assert a.rejected == {"site-a": "replayed", "site-d": "replayed", "site-e": "misplaced"}
    assert a.late == ("site-c",)
    assert not a.included and a.missed_because == "replayed"     # a keeps its message for later
    assert b.included


# ---- two sites closing the same round at the same moment ----

@pytest.fixture(scope="module")
def race_run(new_location):
    url, options = new_location()
    plan = [(r, "race", 0.0) for r in range(4)]
    # site-c never comes, so neither site could close by completeness; both close at once
    results = run_sites(url, options, {"site-a": plan, "site-b": plan},
                        sites=["site-a", "site-b", "site-c"], round_timeout=TIMEOUT)
    return url, options, results


def test_racing_sites_write_one_manifest_and_both_use_it(race_run):
    url, options, results = race_run
    both_tried = 0
    for round in range(4):
        a, b = results["site-a"][round], results["site-b"][round]
        both_tried += a.traffic.puts == b.traffic.puts == 1     # both tried the conditional create
        assert a.closed_here + b.closed_here == 1               # exactly one succeeded
        assert agreement(a) == agreement(b)
        assert a.closed_by == ("site-a" if a.closed_here else "site-b")
        assert a.messages == {s: payload_for(s, round) for s in ("site-a", "site-b")}
        assert a.late == ("site-c",)
    assert manifests_in_store(url, options) == [manifest_key(r) for r in range(4)]
    assert both_tried >= 1      # a real race (the pause makes it every round unless a process stalls)
