"""Peer-to-peer state transfer over an epoch's process group: chunked and checksummed.

Wire order on one (source, receiver) pair: a header ``[num_bytes, chunk_bytes, num_chunks]``,
then one CRC32 per chunk, then the chunks. All chunks are posted at once so gloo can
stream them; the receiver checks every chunk before the state is loaded.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from unbroken.comm.group import AbortCheck, run_abortable, wait_work
from unbroken.errors import TransferError
from unbroken.state.snapshot import digest_prefix
from unbroken.train.sync import plan_sync

CHUNK_BYTES = 8 << 20
_TAG_HEADER, _TAG_CHECKS, _TAG_CHUNKS = 101, 102, 1000


def checksums(buf: torch.Tensor, chunk: int) -> list[int]:
    view = memoryview(buf.numpy())  # type: ignore[arg-type]
    return [zlib.crc32(view[i : i + chunk]) for i in range(0, len(view), chunk)]


def _send(pg: Any, dst: int, payload: torch.Tensor, chunk: int) -> None:
    checks = checksums(payload, chunk)
    header = torch.tensor([payload.numel(), chunk, len(checks)], dtype=torch.int64)
    works = [pg.send([header], dst, _TAG_HEADER), pg.send([torch.tensor(checks, dtype=torch.int64)], dst, _TAG_CHECKS)]
    for i, start in enumerate(range(0, payload.numel(), chunk)):
        works.append(pg.send([payload[start : start + chunk]], dst, _TAG_CHUNKS + i))
    for w in works:
        w.wait()


def _recv(pg: Any, src: int) -> torch.Tensor:
    header = torch.zeros(3, dtype=torch.int64)
    pg.recv([header], src, _TAG_HEADER).wait()
    num_bytes, chunk, num_chunks = (int(x) for x in header)
    if num_bytes < 0 or chunk <= 0 or num_chunks != -(-num_bytes // chunk):
        raise TransferError(f"state header from rank {src} is inconsistent: {header.tolist()}")
    checks = torch.zeros(num_chunks, dtype=torch.int64)
    payload = torch.empty(num_bytes, dtype=torch.uint8)
    works = [pg.recv([checks], src, _TAG_CHECKS)]
    for i, start in enumerate(range(0, num_bytes, chunk)):
        works.append(pg.recv([payload[start : start + chunk]], src, _TAG_CHUNKS + i))
    for w in works:
        w.wait()
    for i, (want, have) in enumerate(zip(checks.tolist(), checksums(payload, chunk), strict=True)):
        if want != have:
            raise TransferError(f"state chunk {i} from rank {src} failed its checksum ({have:#x} != {want:#x})")
    return payload


def send_state(
    pg: Any,
    dst: int,
    payload: torch.Tensor,
    wake: threading.Event,
    should_abort: AbortCheck,
    deadline_s: float,
    chunk: int = CHUNK_BYTES,
) -> None:
    """Send a uint8 tensor to rank ``dst``; abandoned at once if the epoch ends."""
    run_abortable(
        lambda: _send(pg, dst, payload, chunk), wake, should_abort, deadline_s, f"state transfer to rank {dst}"
    )


def recv_state(pg: Any, src: int, wake: threading.Event, should_abort: AbortCheck, deadline_s: float) -> torch.Tensor:
    """Receive a uint8 tensor from rank ``src`` and verify every chunk's checksum."""
    return run_abortable(lambda: _recv(pg, src), wake, should_abort, deadline_s, f"state transfer from rank {src}")


@dataclass(frozen=True)
class SyncResult:
    """What the sync phase did on this rank."""

    role: str
    """``source``, ``receiver`` or ``none``."""
    step: int
    peers: tuple[int, ...]
    """Receivers (for the source) or the source (for a receiver)."""
    megabytes: float = 0.0
    seconds: float = 0.0


class Replicated(Protocol):
    """What the sync phase compares and moves (a `TrainState`, or part of one)."""

    @property
    def step(self) -> int: ...

    def digest(self) -> str: ...

    def to_bytes(self) -> torch.Tensor: ...

    def load_bytes(self, payload: torch.Tensor) -> None: ...


def gather_digests(
    pg: Any, size: int, step: int, digest: str, wake: threading.Event, abort: AbortCheck, deadline_s: float, what: str
) -> list[tuple[int, int]]:
    """Every rank's ``(committed step, digest prefix)``, in rank order (one small all-gather)."""
    mine = torch.tensor([step, digest_prefix(digest)], dtype=torch.int64)
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    wait_work(pg.allgather([gathered], [mine]), wake, abort, deadline_s, what)
    return [(int(t[0]), int(t[1])) for t in gathered]


def sync_state(
    pg: Any, rank: int, size: int, state: Replicated, wake: threading.Event, abort: AbortCheck, deadline_s: float
) -> SyncResult:
    """The sync phase: compare (step, digest) across the group; whoever is behind or
    different receives the state of the majority at the highest step (`plan_sync`)."""
    reports = gather_digests(pg, size, state.step, state.digest(), wake, abort, deadline_s, "sync exchange")
    plan = plan_sync(reports)
    start = time.monotonic()
    if rank == plan.source and plan.receivers:
        payload = state.to_bytes()
        for r in plan.receivers:
            send_state(pg, r, payload, wake, abort, deadline_s)
        mb = payload.numel() / 1e6
        return SyncResult("source", plan.step, plan.receivers, mb, time.monotonic() - start)
    if rank in plan.receivers:
        payload = recv_state(pg, plan.source, wake, abort, deadline_s)
        state.load_bytes(payload)
        return SyncResult("receiver", plan.step, (plan.source,), payload.numel() / 1e6, time.monotonic() - start)
    return SyncResult("none", plan.step, ())
