"""Measuring the links between zone leaders, when an epoch order asks (``probe_links``).

In round k (1 .. L-1) every leader sends `PROBE_BYTES` (`TRIES` times) to the k-th leader
after it and receives as many from the k-th before it, so each link carries one payload at
a time and every ordered pair is measured. A small exchange first lines the two ends of
each transfer up, so the timed receive measures the transfer, not the other end's lateness. Each
leader reports what it received from each zone (MB/s); the coordinator orders the ring
(`sched.links`). An emulated link (`LinkEmulation`) is honoured as the exchange honours it.
"""

from __future__ import annotations

import time

import torch

from unbroken.comm.group import EpochScope, ProcessGroup, run_abortable
from unbroken.comm.reduce import LinkEmulation

PROBE_BYTES = 1 << 20
"""Enough to fill a window of a fast link's first round trips, little for a slow one (80 ms at 100 Mbit/s)."""
TRIES = 2
"""Transfers per pair; the fastest counts."""


def probe(
    pg: ProcessGroup,
    rank: int,
    zones: list[str],
    link: LinkEmulation,
    scope: EpochScope,
) -> dict[str, float]:
    """MB/s this leader (``rank`` of ``pg``, whose ranks lead ``zones`` in order) received
    from each other leader's zone (abortable: gloo's send and receive have no future)."""
    return run_abortable(lambda: _rounds(pg, rank, zones, link), scope, "link probe")


def _rounds(pg: ProcessGroup, rank: int, zones: list[str], link: LinkEmulation) -> dict[str, float]:
    size = len(zones)
    payload = torch.zeros(PROBE_BYTES // 4, dtype=torch.float32)
    got = torch.empty_like(payload)
    ping, pong = torch.zeros(1), torch.empty(1)
    out: dict[str, float] = {}
    for k in range(1, size):
        dst, src = (rank + k) % size, (rank - k) % size
        for attempt in range(TRIES):  # the fastest of a few: a hiccup only ever slows one
            tag = 2 * (k * TRIES + attempt)
            for work in (pg.send([ping], dst, tag), pg.recv([pong], src, tag)):
                work.wait()
            start = time.monotonic()
            recv = pg.recv([got], src, tag + 1)
            send = pg.send([payload], dst, tag + 1)
            recv.wait()
            time.sleep(max(0.0, start + link.delay(PROBE_BYTES, 1, zones[src]) - time.monotonic()))
            rate = PROBE_BYTES / max(time.monotonic() - start, 1e-6) / 1e6
            out[zones[src]] = max(out.get(zones[src], 0.0), rate)
            send.wait()
    return out
