"""Which sites a round still waits for: a dead site must not cost every later round a deadline.

The rule, per site, from the rounds this site settled (in round order):

    streak(s) = how many of the last settled rounds in a row listed s as late
    s is presumed gone  <=>  streak(s) >= patience
    a manifest that accepts s sets streak(s) = 0: s is present again

A round waits (up to its deadline) for every site not presumed gone; it closes as soon as
those are in. A gone site's message is still taken whenever it is in the round's folder when
the round closes, so a site that comes back is back at the first round it reaches in time.

This only changes when a site stops waiting, never what a round applies: the manifest, written
once by whichever site closed the round, stays the one list every site applies. The rule reads
only manifests, which every site reads alike, so sites that settled the same rounds presume
the same sites gone, and a site knows when the others presume it gone (`own`). A site that
settled fewer rounds (one that joined later) may judge differently for `patience` rounds; it
then waits longer or closes a round sooner than another would have, and the others adopt that
manifest as they adopt any.

A gone site is back only when its message reaches a round before the round closes. The live
sites no longer wait for it, so at the same compute speed it stays behind by the gap it had;
it gets back in by publishing without computing while presumed gone (a zero-gradient step,
`StoreGroup.catching_up`): its message then lands before the live sites' computed ones.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def check_patience(patience) -> int:
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        raise ValueError(f"patience must be an int >= 1 (late rounds before a site is presumed gone), "
                         f"got {patience!r}")
    return patience


class Liveness:
    """One site's view of which other sites are gone (the rule above)."""

    def __init__(self, site: str, sites: tuple[str, ...], patience: int = 2):
        self.site, self.patience = site, check_patience(patience)
        self.streak = {s: 0 for s in sites if s != site}
        self.own = 0                       # this site's own streak, as the others count it
        self.settled = -1                  # the newest round settled: older ones judge nothing new

    @property
    def gone(self) -> tuple[str, ...]:
        """The sites presumed gone, sorted."""
        return tuple(s for s, n in self.streak.items() if n >= self.patience)

    def awaited(self, sites: tuple[str, ...]) -> list[str]:
        """The sites a round waits for: this one and every site not presumed gone."""
        gone = set(self.gone)
        return [s for s in sites if s not in gone]

    def settle(self, round: int, accepted, late) -> None:
        """Count `round`'s manifest (its accepted and late sites); one log line per change."""
        if round <= self.settled:
            return
        self.settled = round
        late = set(late)
        self.own = 0 if self.site in accepted else self.own + (self.site in late)
        for s, n in self.streak.items():
            if s in accepted:
                if n >= self.patience:
                    log.warning("round %d: %s is back (its message is in the manifest)", round, s)
                self.streak[s] = 0
            elif s in late:
                self.streak[s] = n + 1
                if n + 1 == self.patience:
                    log.warning("round %d: %s was late in %d rounds in a row: presumed gone, rounds no longer "
                                "wait for it (its message is still taken when it is there)", round, s, n + 1)
