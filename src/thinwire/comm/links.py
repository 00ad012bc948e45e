"""Bytes a rank moves over its link for one collective, by the standard algorithms.

One table, used by the communicator's accounting and by any modelled link time, so
every figure in thinwire comes from the same formulas (see docs/design.md, "Accounting conventions"):

| collective  | n means                    | sent per rank         | received per rank     |
|-------------|----------------------------|-----------------------|-----------------------|
| all_reduce  | buffer size                | 2n(W-1)/W  (ring)     | 2n(W-1)/W             |
| all_gather  | this rank's contribution   | n(W-1)     (ring)     | n(W-1)                |
| all_to_all  | this rank's whole buffer   | n(W-1)/W              | n(W-1)/W              |
| gather      | this rank's contribution   | n (0 on the root)     | n(W-1) on the root, 0 |
| broadcast   | buffer size                | n(W-1) on the source  | n (0 on the source)   |

Broadcast is modelled as a star (the source sends a copy to every peer), which is what a
parameter server does. Fractions are rounded down to whole bytes. W = 1 moves nothing.
"""

from __future__ import annotations

COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "gather", "broadcast")


def link_bytes(op: str, nbytes: int, world_size: int, *, is_root: bool = False) -> tuple[int, int]:
    """(sent, received) bytes for one rank taking part in collective `op`.

    `is_root` marks the gather destination or the broadcast source; other ops ignore it.
    """
    if op not in COLLECTIVES:
        raise ValueError(f"op must be one of {COLLECTIVES}, got {op!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n, w = nbytes, world_size
    if w == 1:
        return 0, 0
    if op == "all_reduce":
        each = 2 * n * (w - 1) // w
        return each, each
    if op == "all_gather":
        return n * (w - 1), n * (w - 1)
    if op == "all_to_all":
        each = n * (w - 1) // w
        return each, each
    if op == "gather":
        return (0, n * (w - 1)) if is_root else (n, 0)
    # broadcast
    return (n * (w - 1), 0) if is_root else (0, n)
