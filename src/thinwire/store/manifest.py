"""A round's manifest: the one list of messages every site applies for that round.

Each round has its own folder in the location:

    rounds/0000000007/sites/<site>    each site's signed message, written once by that site
    rounds/0000000007/manifest        the round's manifest, written once by whichever site
                                      closed the round first (a conditional create)

Round numbers are zero-padded so that a listing sorts them. The manifest names each
accepted message by the SHA-256 of its object, so a site that read a message before the
round closed knows it holds exactly the bytes the manifest means; it also records which
expected sites were late, and which objects were rejected and why (for every site's log).
It travels in the same signed envelope as the messages, with the closing site as sender.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

_SITE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
FORMAT = "thinwire-round-manifest/1"


def check_site(site: str) -> str:
    """`site` if it can be an object key segment, else ValueError."""
    if not isinstance(site, str) or not _SITE.fullmatch(site):
        raise ValueError(f"invalid site id {site!r}: 1 to 64 of [A-Za-z0-9._-], not starting with '.'")
    return site


def round_folder(round: int) -> str:
    if not 0 <= round < 10**10:
        raise ValueError(f"round {round} is outside 0 .. 9999999999")
    return f"rounds/{round:010d}"


def message_key(round: int, site: str) -> str:
    return f"{round_folder(round)}/sites/{site}"


def manifest_key(round: int) -> str:
    return f"{round_folder(round)}/manifest"


def digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """What a round applies. accepted: site -> SHA-256 (hex) of its message object;
    rejected: site -> reason ('garbled', 'forged', 'replayed', 'misplaced', 'stranger');
    late: expected sites with no object when the round closed."""

    round: int
    closed_by: str
    accepted: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    late: tuple[str, ...] = ()

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "round": self.round, "closed_by": self.closed_by,
                           "accepted": self.accepted, "rejected": self.rejected, "late": list(self.late)},
                          sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """The manifest in `data` (already verified as a signed envelope's payload)."""
        fields = json.loads(data)
        if fields.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest: {fields.get('format')!r}")
        return cls(round=int(fields["round"]), closed_by=str(fields["closed_by"]),
                   accepted={str(s): str(d) for s, d in fields["accepted"].items()},
                   rejected={str(s): str(r) for s, r in fields["rejected"].items()},
                   late=tuple(str(s) for s in fields["late"]))


def newest_closed_round(location) -> int | None:
    """The newest round of `location` that has a manifest, None when none has: where a site
    joining a run already going finds how far the run is."""
    closed = [k for k in location.list("rounds") if k.endswith("/manifest")]
    return max((int(k.split("/")[1]) for k in closed), default=None)
