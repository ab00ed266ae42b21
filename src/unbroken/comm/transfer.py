"""The sync phase's state transfer: incremental, from several donors, resumable.

Every member reports ``(committed step, digest)``; `plan_sync` names the state everyone
must hold and every member holding it is a donor. The state travels as its deterministic
layout (`unbroken.state.layout`: a JSON header and a list of tensors) cut into chunks of
at most ``CHUNK_BYTES`` inside each tensor. Wire order, on the epoch's process group:

1. the source (first donor) sends each receiver ``[header bytes, chunks, chunk bytes]``,
   the header, and one xxh3-64 digest per chunk;
2. the receiver digests the same chunks of what it already holds (its own state, or
   what an earlier attempt fetched of the same state), and asks the donors for the
   chunks that differ, spread over them round robin;
3. each donor sends the chunks asked of it; the receiver checks each against its digest.

So a node back after a short absence, or one whose frozen layers are already right,
receives only what changed; a donor that dies mid-transfer costs only the chunks it did
not deliver (the receiver keeps the rest in its `Partial` and the next epoch's sync phase
asks for what is missing); and the whole state is checked against the winning digest
before it is loaded.

Across zones the epoch's group connects a pair of ranks on its first use, and that first use
waits for the peer's (`Meeting.devices`): the order above cannot wait in a cycle because
every donor serves the receivers in rank order and both ends of a pair post its operations
in the same order (modelled in ``tests/unit/comm/test_transfer.py``; donors each starting
on another receiver hang there).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import xxhash

from unbroken.comm.group import EpochScope, ProcessGroup, run_abortable, wait_work
from unbroken.errors import BadRequest, TransferError
from unbroken.state import layout
from unbroken.state.snapshot import digest_prefix
from unbroken.state.sync import Standing, SyncPlan, abandoned, diverged, floored, plan_sync

CHUNK_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 20
MAX_CHUNKS = 1 << 24
_TAG_META, _TAG_HEADER, _TAG_DIGESTS, _TAG_COUNT, _TAG_WANT = 101, 102, 103, 104, 105
_TAG_CHUNKS = 1000
WINDOW = 4
"""Chunks in flight per donor and receiver: bounds the memory a transfer takes, and what a
donor that dies had on the wire."""


class Replicated(Protocol):
    """What the sync phase compares and moves (a `TrainState`, or part of one)."""

    @property
    def step(self) -> int: ...

    def digest(self) -> str: ...

    def tree(self) -> Any:
        """The state as a tree of tensors and scalars (the tensors themselves, not copies)."""
        ...

    def digest_of(self, tree: Any) -> str:
        """What `digest` would say after `load_tree(tree)`."""
        ...

    def load_tree(self, tree: Any, own: bool = True) -> None:
        """Take ``tree`` as the state: its tensors handed over (``own``), or copied so that
        the tree stays as it is."""
        ...

    def source_only(self) -> tuple[str, ...]:
        """Paths in the tree that the digest does not cover (RNG states, a per-zone
        optimizer): donors with equal digests may hold different bytes there, so those
        chunks come from the source alone."""
        ...


# ---------------------------------------------------------------- chunks


@dataclass(frozen=True)
class Chunk:
    tensor: int
    start: int
    end: int
    """Byte offsets inside the tensor."""


def chunk_table(sizes: Sequence[int], chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Every tensor cut into pieces of at most ``chunk_bytes`` (a chunk never spans two
    tensors, so one frozen layer is whole chunks that match)."""
    return [Chunk(i, a, min(a + chunk_bytes, n)) for i, n in enumerate(sizes) for a in range(0, n, chunk_bytes)]


def chunk_view(tensors: Sequence[torch.Tensor], c: Chunk) -> torch.Tensor:
    return layout.byte_view(tensors[c.tensor])[c.start : c.end]


def chunk_digests(tensors: Sequence[torch.Tensor], table: Sequence[Chunk]) -> torch.Tensor:
    """One xxh3-64 per chunk, as int64 (a fast checksum; the whole state's digest is the proof)."""
    out = torch.empty(len(table), dtype=torch.int64)
    values = out.numpy()
    for i, c in enumerate(table):
        values[i] = _checksum(chunk_view(tensors, c))
    return out


def _own_digests(own: Sequence[torch.Tensor | None], table: Sequence[Chunk]) -> list[int]:
    """`chunk_digests` of what a node holds, a tensor it lacks counted as zeros."""
    zero: dict[int, int] = {}
    out = []
    for c in table:
        t = own[c.tensor]
        if t is None:
            n = c.end - c.start
            if n not in zero:
                zero[n] = _checksum(torch.zeros(n, dtype=torch.uint8))
            out.append(zero[n])
        else:
            out.append(_checksum(layout.byte_view(t)[c.start : c.end]))
    return out


def _checksum(chunk: torch.Tensor) -> int:
    x = xxhash.xxh3_64_intdigest(memoryview(chunk.numpy()))  # type: ignore[arg-type]
    return x - (1 << 64) if x >= 1 << 63 else x


def assign(needed: Sequence[int], donors: Sequence[int], offset: int = 0) -> dict[int, list[int]]:
    """The chunks to ask of each donor: round robin, starting ``offset`` donors along (so
    several receivers do not all start on the same donor)."""
    out: dict[int, list[int]] = {d: [] for d in donors}
    for k, i in enumerate(needed):
        out[donors[(k + offset) % len(donors)]].append(i)
    return out


class Partial:
    """A receiver's copy of the state it is fetching, kept across attempts: chunks that
    arrived before a donor died are not asked for again."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.slots: list[layout.Slot] = []
        self.tensors: list[torch.Tensor] = []
        self.fetched: set[int] = set()
        self.generation = 0
        self.lock = threading.Lock()
        """Held while a chunk is written in: a helper thread of an abandoned attempt never
        writes into a generation that has moved on."""

    def resumes(self, key: tuple[int, int], slots: list[layout.Slot]) -> bool:
        """Whether an earlier attempt was fetching the same state (the same step, digest and
        layout: another source's header may differ in what the digest does not cover, and
        those chunks are compared again like the rest)."""
        return key == self.key and slots == self.slots

    def prepare(
        self,
        key: tuple[int, int],
        slots: list[layout.Slot],
        own: dict[layout.Slot, torch.Tensor],
        useful: set[int] | None = None,
    ) -> None:
        """Start from what this node holds (its tensors by slot; only those numbered in
        ``useful``, if given: the others are fetched whole, and a copy of them would only
        cost the time it takes), unless `resumes`."""
        if self.resumes(key, slots):
            with self.lock:
                self.generation += 1  # the earlier attempt's helper, if still alive, writes no more
            return

        def start(i: int, s: layout.Slot) -> torch.Tensor:
            if useful is not None and i not in useful:
                return torch.empty(s.shape, dtype=s.dtype)
            return own[s].clone() if s in own else torch.zeros(s.shape, dtype=s.dtype)

        tensors = [start(i, s) for i, s in enumerate(slots)]
        with self.lock:
            self.generation += 1
            self.key, self.slots, self.tensors, self.fetched = key, slots, tensors, set()

    def close(self) -> None:
        with self.lock:
            self.generation += 1
            self.key, self.slots, self.tensors, self.fetched = None, [], [], set()


@dataclass(frozen=True)
class SyncResult:
    """What the sync phase did on this rank."""

    role: str
    """``source`` (the first donor), ``donor``, ``receiver``, ``none`` or ``diverged``."""
    step: int
    peers: tuple[int, ...]
    """Receivers (for a donor) or donors (for a receiver)."""
    megabytes: float = 0.0
    """Chunk bytes this rank sent or received."""
    seconds: float = 0.0
    state_megabytes: float = 0.0
    """The size of the whole state (what a full transfer would move)."""
    chunks: int = 0
    """Chunks moved."""
    total_chunks: int = 0
    resumed_chunks: int = 0
    """Chunks an earlier, interrupted attempt had already fetched."""
    load_s: float = 0.0
    """Of ``seconds``, a receiver's checking and loading of what arrived (the rest is the wire)."""
    fetched: Any = None
    """A receiver's fetched tree, where ``sync_state(keep=True)``: the state it holds now,
    in buffers of its own."""
    culprit: int = -1
    """Role ``diverged``: the rank whose replica differs from the majority's (-1: no majority)."""
    reason: str = ""
    compared: bool = False
    """Role ``diverged``: this rank's state was among those compared (at the highest step)."""


# ---------------------------------------------------------------- the sync phase


def gather_digests(
    pg: ProcessGroup, size: int, step: int, digest: str, scope: EpochScope, what: str
) -> list[tuple[int, int]]:
    """Every rank's ``(committed step, digest prefix)``, in rank order (one small all-gather)."""
    return [(s, d) for s, d in _gather(pg, size, [step, digest_prefix(digest)], scope, what)]


def gather_values(
    pg: ProcessGroup, size: int, values: list[int], scope: EpochScope, what: str
) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (int64, the same count on each), in rank order."""
    return _gather(pg, size, values, scope, what)


def _gather(pg: ProcessGroup, size: int, values: list[int], scope: EpochScope, what: str) -> list[tuple[int, ...]]:
    mine = torch.tensor(values, dtype=torch.int64)
    gathered = [torch.zeros(len(values), dtype=torch.int64) for _ in range(size)]
    wait_work(pg.allgather([gathered], [mine]), scope, what)
    return [tuple(int(x) for x in t) for t in gathered]


def layout_id(slots: Sequence[layout.Slot], chunk_bytes: int) -> int:
    """Which tensors a state has, and how they are cut (63 bits): donors whose digests agree
    may still differ here where the digest does not look (a per-zone optimizer that holds
    state for other parameters), and a chunk number means the same bytes only between equals."""
    desc = json.dumps([chunk_bytes, [(s.path, str(s.dtype), s.shape) for s in slots]])
    return xxhash.xxh3_64_intdigest(desc.encode()) >> 1


def sync_state(
    pg: ProcessGroup,
    rank: int,
    size: int,
    state: Replicated,
    scope: EpochScope,
    partial: Partial | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    on_sent: Callable[[int], None] | None = None,
    max_donors: int = 0,
    incremental: bool = True,
    keep: bool = False,
    standing: Standing | None = None,
    refused: Callable[[], None] | None = None,
    claim: int = 0,
    lineage: int = 0,
) -> SyncResult:
    """The sync phase: compare (step, digest) across the group; whoever is behind or
    different fetches the chunks it lacks of the majority's state at the highest step.
    With ``standing`` (audits on) the comparison is an audit too (`state.sync.diverged`,
    `state.sync.floored`), and a verdict moves nothing: role ``diverged``, which every rank
    reaches from the same reports. ``refused`` is called where this rank's state is planned
    as behind for a verdict it missed (it stays so even if the transfer that follows fails).

    ``on_sent(n)`` is called on a donor after its n-th chunk went out (fault injection);
    ``max_donors`` caps the donors a receiver asks (0: all of them); ``incremental=False``
    fetches every chunk, whatever the receiver holds; with ``keep`` a receiver's state loads
    copies of its optimizer's part (the model's is copied anyway) and the fetched tree comes
    back in `SyncResult.fetched`: a copy of the state for half the allocation of a fresh one
    (400 MB fresh took 1.5 s on a busy 2-core machine). ``claim`` (fault injection): the
    number of chunks a receiver tells each donor it wants, whatever it wants (0: the truth).
    ``lineage``: the history the state is of (`TrainState.lineage`): the newest history's
    highest step wins, whatever the step of a state the group went back from (`abandoned`).
    A donor asked for chunks the state does not have raises `BadRequest` naming the receiver."""
    header, tensors = layout.split(state.tree())
    own_slots = layout.slots(header)
    st = standing or Standing()
    step = -1 if st.behind else state.step
    values = [step, digest_prefix(state.digest()), layout_id(own_slots, chunk_bytes), lineage]
    values += [st.committed_epoch, st.floor, st.floor_epoch, st.synced_epoch]
    reports = _gather(pg, size, values, scope, "sync exchange")
    steps = ours = abandoned([r[0] for r in reports], [r[3] for r in reports])
    if standing is not None:
        standings = [Standing(s < 0, *r[4:]) for s, r in zip(ours, reports, strict=True)]
        steps = floored(ours, standings)
        if steps[rank] < 0 <= ours[rank] and refused is not None:
            refused()
    held = [(s, r[1]) for s, r in zip(steps, reports, strict=True)]
    plan = plan_sync(held)
    if standing is not None:
        verdict = diverged(held, [s.committed_epoch for s in standings])
        if verdict is not None:
            compared = steps[rank] == plan.step
            return SyncResult("diverged", plan.step, (), culprit=verdict[0], reason=verdict[1], compared=compared)
    if not plan.receivers:
        return SyncResult("none", plan.step, ())
    plan = replace(plan, donors=tuple(r for r in plan.donors if reports[r][2] == reports[plan.source][2]))
    start = time.monotonic()
    if rank in plan.donors:
        head = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
        table = chunk_table([layout.byte_view(t).numel() for t in tensors], chunk_bytes)
        digests = chunk_digests(tensors, table) if rank == plan.source else None
        sent = run_abortable(
            lambda: _serve(pg, plan, head, tensors, table, chunk_bytes, digests, on_sent),
            scope, "state transfer (sending)",
        )  # fmt: skip
        role = "source" if rank == plan.source else "donor"
        total = sum(c.end - c.start for c in table)
        return SyncResult(role, plan.step, plan.receivers, sent / 1e6, time.monotonic() - start, total / 1e6)
    if rank not in plan.receivers:
        return SyncResult("none", plan.step, ())
    if partial is None or not incremental:
        partial = Partial()
    own = dict(zip(own_slots, tensors, strict=True))
    return _fetch(pg, rank, plan, state, own, partial, scope, max_donors, incremental, start, keep, claim)


def _serve(
    pg: ProcessGroup,
    plan: SyncPlan,
    head: bytes,
    tensors: list[torch.Tensor],
    table: list[Chunk],
    chunk_bytes: int,
    digests: torch.Tensor | None,
    on_sent: Callable[[int], None] | None,
) -> int:
    works = []
    if digests is not None:  # the source describes the state to every receiver
        meta = torch.tensor([len(head), len(table), chunk_bytes])
        blob = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        for r in plan.receivers:
            works += [pg.send([meta], r, _TAG_META), pg.send([blob], r, _TAG_HEADER)]
            works.append(pg.send([digests], r, _TAG_DIGESTS))
    counts = {r: torch.zeros(1, dtype=torch.int64) for r in plan.receivers}
    for w in [pg.recv([counts[r]], r, _TAG_COUNT) for r in plan.receivers]:
        w.wait()
    for r, n in counts.items():
        if not 0 <= int(n) <= len(table):
            raise BadRequest(r, f"rank {r} asked for {int(n):,} chunks of a state of {len(table):,}")
    wants = {r: torch.zeros(int(n), dtype=torch.int64) for r, n in counts.items()}
    for w in [pg.recv([wants[r]], r, _TAG_WANT) for r in plan.receivers if wants[r].numel()]:
        w.wait()
    order = []
    for r, want in wants.items():
        for i in want.tolist():
            if not 0 <= i < len(table):
                raise BadRequest(r, f"rank {r} asked for chunk {i} of a state of {len(table):,}")
            order.append((r, i))
    sent, done, inflight = 0, 0, deque[tuple[Any, Chunk]]()

    def finish_one() -> None:
        nonlocal sent, done
        w, c = inflight.popleft()
        w.wait()
        sent, done = sent + c.end - c.start, done + 1
        if on_sent is not None:
            on_sent(done)

    for r, i in order:
        inflight.append((pg.send([chunk_view(tensors, table[i])], r, _TAG_CHUNKS + i), table[i]))
        if len(inflight) >= WINDOW:
            finish_one()
    while inflight:
        finish_one()
    for w in works:
        w.wait()
    return sent


def _fetch(
    pg: ProcessGroup,
    rank: int,
    plan: SyncPlan,
    state: Replicated,
    own: dict[layout.Slot, torch.Tensor],
    partial: Partial,
    scope: EpochScope,
    max_donors: int,
    incremental: bool,
    start: float,
    keep: bool,
    claim: int = 0,
) -> SyncResult:
    src = plan.source
    head, digests, chunk_bytes = run_abortable(
        lambda: _recv_description(pg, src), scope, f"state description from rank {src}"
    )
    try:
        header = json.loads(head)
        slots = layout.slots(header)
    except (ValueError, TransferError) as exc:
        raise TransferError(f"state header from rank {src} is malformed: {exc}") from None
    table = chunk_table([s.nbytes for s in slots], chunk_bytes)
    if len(table) != digests.numel():
        raise TransferError(f"rank {src} described {digests.numel()} chunks, its header makes {len(table)}")
    key = (plan.step, plan.digest)
    if partial.resumes(key, slots):
        partial.prepare(key, slots, own)
        with partial.lock:
            held = [int(x) for x in chunk_digests(partial.tensors, table)]
    else:  # what this node holds, digested where it is: tensors with no chunk to keep are not copied
        held = _own_digests([own.get(s) for s in slots], table)
        useful = {table[i].tensor for i in range(len(table)) if incremental and held[i] == int(digests[i])}
        partial.prepare(key, slots, own, useful)
    with partial.lock:
        tensors, fetched, generation = partial.tensors, partial.fetched, partial.generation
    needed = [i for i in range(len(table)) if held[i] != int(digests[i]) or not incremental]
    resumed = len(fetched - set(needed))
    donors = list(plan.donors[:max_donors] if max_donors > 0 else plan.donors)
    # Every donor hears how many chunks it is to send, none included.
    private = state.source_only()
    from_source = {i for i in needed if private and slots[table[i].tensor].path.startswith(private)}
    asks: dict[int, list[int]] = {d: [] for d in plan.donors}
    asks |= assign([i for i in needed if i not in from_source], donors, offset=plan.receivers.index(rank))
    asks[plan.source] = sorted(asks[plan.source] + list(from_source))
    run_abortable(
        lambda: _recv_chunks(pg, partial, generation, tensors, fetched, table, digests, asks, claim),
        scope, f"state transfer from ranks {donors}",
    )  # fmt: skip
    with partial.lock:
        partial.generation += 1  # nothing of this attempt writes into these tensors any more
    arrived = time.monotonic()
    tree = layout.join(header, tensors)
    good = digest_prefix(state.digest_of(tree)) == plan.digest
    partial.close()
    if not good:
        raise TransferError(f"the state fetched from ranks {donors} does not match its digest; starting over")
    state.load_tree(tree, own=not keep)
    moved = sum(table[i].end - table[i].start for i in needed)
    return SyncResult(
        "receiver", plan.step, tuple(d for d in donors if asks[d]), moved / 1e6, time.monotonic() - start,
        sum(s.nbytes for s in slots) / 1e6, len(needed), len(table), resumed,
        load_s=time.monotonic() - arrived, fetched=tree if keep else None,
    )  # fmt: skip


def _recv_description(pg: ProcessGroup, src: int) -> tuple[bytes, torch.Tensor, int]:
    meta = torch.zeros(3, dtype=torch.int64)
    pg.recv([meta], src, _TAG_META).wait()
    head_len, num_chunks, chunk_bytes = (int(x) for x in meta)
    if not (0 < head_len <= MAX_HEADER_BYTES and 0 <= num_chunks <= MAX_CHUNKS and chunk_bytes > 0):
        raise TransferError(f"state description from rank {src} is inconsistent: {meta.tolist()}")
    blob = torch.empty(head_len, dtype=torch.uint8)
    digests = torch.empty(num_chunks, dtype=torch.int64)
    works = [pg.recv([blob], src, _TAG_HEADER), pg.recv([digests], src, _TAG_DIGESTS)]
    for w in works:
        w.wait()
    return blob.numpy().tobytes(), digests, chunk_bytes


def _recv_chunks(
    pg: ProcessGroup,
    partial: Partial,
    generation: int,
    tensors: list[torch.Tensor],
    fetched: set[int],
    table: list[Chunk],
    digests: torch.Tensor,
    asks: dict[int, list[int]],
    claim: int = 0,
) -> None:
    works = []
    for d, want in asks.items():
        works.append(pg.send([torch.tensor([claim or len(want)], dtype=torch.int64)], d, _TAG_COUNT))
        if want:
            works.append(pg.send([torch.tensor(want, dtype=torch.int64)], d, _TAG_WANT))
    queues = {d: deque(want) for d, want in asks.items()}
    inflight = deque[tuple[int, int, torch.Tensor, torch.Tensor, Any]]()

    def post(d: int, base: torch.Tensor | None = None) -> None:
        """The next chunk asked of ``d``, into ``base`` once a chunk landed there (fresh pages
        at the transfer's rate were as dear as the copy on a busy machine); never into one
        whose receive may still be in flight."""
        if queues[d]:
            i = queues[d].popleft()
            n = table[i].end - table[i].start
            if base is None or base.numel() < n:
                base = torch.empty(n, dtype=torch.uint8)
            buf = base[:n]
            inflight.append((d, i, base, buf, pg.recv([buf], d, _TAG_CHUNKS + i)))

    for d in queues:
        for _ in range(WINDOW):
            post(d)
    # A donor that fails (it died) does not stop the others: what they deliver until the
    # epoch ends is kept for the next attempt. The first failure is raised at the end.
    failed: dict[int, BaseException] = {}
    while inflight:
        d, i, base, buf, w = inflight.popleft()
        if d in failed:
            continue
        try:
            w.wait()
            if _checksum(buf) != int(digests[i]):
                raise TransferError(f"state chunk {i} from rank {d} failed its checksum")
        except (RuntimeError, TransferError) as exc:
            failed[d] = exc
            queues[d].clear()
            continue
        with partial.lock:
            if partial.generation != generation:
                raise TransferError("an abandoned fetch: a later attempt took over its copy")
            chunk_view(tensors, table[i]).copy_(buf)
            fetched.add(i)
        post(d, base)
    if failed:
        raise next(iter(failed.values()))
    for w in works:
        w.wait()
