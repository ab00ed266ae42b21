"""The transfers of a sharded zone's re-shard (`ShardedModel.reshard`): what this member
sends of the ranges it holds (values, per-element optimizer state, and whether and how far
the optimizer has stepped) and what it receives, over the survivors' group; and how the
ranges are laid out again from such pieces (`load_ranges`), on another device too."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from unbroken.comm.blocks import Holding, Piece, as_flat, free, move_model, per_element
from unbroken.comm.group import EpochScope, ProcessGroup, posted, run_abortable, wait_all
from unbroken.comm.placement import CPU
from unbroken.errors import TransferError
from unbroken.state.shards import Layout, Plan, Purpose

if TYPE_CHECKING:
    from unbroken.comm.placement import Placement
    from unbroken.comm.sharded import ShardedModel

Pieces = list[tuple[int, int, dict[str, torch.Tensor]]]

RESHARDING = "re-sharding the zone's state"


def exchange_ranges(
    zone: ShardedModel, plan: Plan, me: str, ranks: Mapping[str, int], group: ProcessGroup, scope: EpochScope
) -> tuple[Pieces, dict[str, Any] | None]:
    """Carry out ``plan``'s transfers for ``me``: the pieces it will hold (received, and
    what it keeps of its own) and the optimizer's shared state (None: never stepped). The
    step in flight is abandoned first (`ShardedModel.abandon`).

    Raises:
        TransferError: ranges both of whose holders died (``plan.missing``), or a transfer
            that failed.
    """
    if plan.missing:
        lost = ", ".join(f"[{x.start}, {x.end})" for x in plan.missing)
        raise TransferError(f"ranges {lost} lost both holders: they must come from another zone or a checkpoint")
    elements, scalars = zone.state_layout()
    stepped = zone.stepped()
    names = ["values", *elements, "scalars"]
    sends, receives = [], []
    incoming: list[tuple[int, int, dict[str, torch.Tensor]]] = []
    for tag, t in enumerate(plan.transfers):
        n = t.end - t.start
        if t.source == me:
            part = zone.export(t.start, t.end)
            st = part["state"]
            tensors = [part["values"], *(as_flat(st.get(k), n) for k in elements)]
            # First whether the optimizer has stepped (SGD's momentum has no count to say so).
            flags = [1.0 if stepped else 0.0, *(float(st[k]) if stepped else 0.0 for k in scalars)]
            tensors.append(torch.tensor(flags, dtype=torch.float64))
            for i, x in enumerate(tensors):
                send = functools.partial(group.send, [x.contiguous()], ranks[t.destination], tag * 16 + i)
                sends.append(posted(send, scope, RESHARDING))
        if t.destination == me:
            bufs = {k: torch.empty(n) for k in ["values", *elements]}
            bufs["scalars"] = torch.empty(1 + len(scalars), dtype=torch.float64)
            for i, k in enumerate(names):
                recv = functools.partial(group.recv, [bufs[k]], ranks[t.source], tag * 16 + i)
                receives.append(posted(recv, scope, RESHARDING))
            incoming.append((t.start, t.end, bufs))
    zone.abandon()
    works = sends + receives  # gloo's point-to-point works have no future: waited on a thread
    run_abortable(lambda: [w.wait() for w in works], scope, RESHARDING)
    counts: dict[str, Any] | None = None
    if stepped:
        counts = zone.shared_state()
    elif incoming and float(incoming[0][2]["scalars"][0]) > 0:
        values = incoming[0][2]["scalars"].tolist()[1:]
        counts = {k: torch.tensor(float(v)) for k, v in zip(scalars, values, strict=True)}
    incoming += held_pieces(zone, elements)
    return incoming, counts


def held_pieces(zone: ShardedModel, elements: Sequence[str]) -> Pieces:
    """What ``zone`` holds, as pieces for `load_ranges`: its own tensors (values and
    per-element optimizer state), read there, not copied out first (`load_ranges` copies
    what it keeps; a member holding half a model of 5M parameters copied 40 MB more)."""
    out: Pieces = []
    for piece in (p for h in zone.holdings for p in h.pieces):
        state = zone.optimizer.state.get(piece.tensor, {})
        n = piece.end - piece.start
        moments = {k: as_flat(state.get(k), n) for k in elements}
        out.append((piece.start, piece.end, {"values": piece.tensor.detach(), **moments}))
    return out


def state_layout(
    make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], settings: Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """The optimizer's state keys, per element (Adam's moments) and shared (its step count),
    found by stepping a fresh one with ``settings`` on a probe: every member finds the same,
    whatever it holds (a spare holds nothing to look at)."""
    probe = torch.zeros(2, requires_grad=False)
    probe.grad = torch.ones(2)
    opt = make_optimizer([dict(settings, params=[probe])])
    opt.step()
    state = opt.state[probe]
    elements = sorted(k for k, v in state.items() if per_element(v, probe))
    scalars = sorted(k for k, v in state.items() if not per_element(v, probe))
    return elements, scalars


def shared_state(optimizer: torch.optim.Optimizer, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The optimizer's state shared by every element (Adam's step count), from the first of
    ``tensors`` it holds state for; empty where it holds none."""
    for tensor in tensors:
        entry = optimizer.state.get(tensor)
        if entry:
            return {
                k: (v.clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v)))
                for k, v in entry.items()
                if not per_element(v, tensor)
            }
    return {}


def digest_of(values: torch.Tensor, state: Mapping[str, Any]) -> str:
    """The digest of a range's values and optimizer state (`ShardedModel.export`'s form):
    what its holders compare, and what a shard file is checked against when read."""
    h = xxhash.xxh3_128()
    h.update(values.numpy().tobytes())
    for key in sorted(state):
        value = state[key]
        h.update(key.encode())
        h.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def range_digest(zone: ShardedModel, start: int, end: int) -> str:
    """`digest_of` the `ShardedModel.export` of ``[start, end)``, hashed where the pieces lie:
    a member's report digests all it holds at every sync phase, and the export's copies (one
    a tensor of the range, each into fresh memory) cost it 8 times the hashing.

    Raises:
        TransferError: ``zone`` holds only part of the range."""
    found = [
        (piece, max(piece.start, start), min(piece.end, end))
        for h in zone.holdings
        for piece in h.pieces
        if max(piece.start, start) < min(piece.end, end)
    ]  # in the export's order: its shared state is the first piece's
    if (covered := sum(b - a for _, a, b in found)) != end - start:
        raise TransferError(f"{zone.me} holds {covered:,} of the {end - start:,} elements of [{start}, {end})")
    ordered = sorted(found, key=lambda f: f[1])
    h = xxhash.xxh3_128()

    def add(tensor: torch.Tensor) -> None:  # as the export holds it: float32, on the CPU
        h.update(tensor.detach().to(CPU, torch.float32).contiguous().numpy())  # type: ignore[arg-type]

    for piece, a, b in ordered:
        add(piece.tensor[a - piece.start : b - piece.start])
    states = [(piece, zone.optimizer.state.get(piece.tensor, {})) for piece, _, _ in found]
    for key in sorted({k for _, st in states for k in st}):
        h.update(key.encode())
        piece, st = next((p, st) for p, st in states if key in st)
        value = st[key]
        if not per_element(value, piece.tensor):
            h.update(value.cpu().numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
            continue
        for piece, a, b in ordered:  # where a piece has none, the export's NaN
            v = zone.optimizer.state.get(piece.tensor, {}).get(key)
            add(v[a - piece.start : b - piece.start] if v is not None else torch.full((b - a,), float("nan")))
    return h.hexdigest()


def load_ranges(
    zone: ShardedModel,
    layout: Layout,
    me: str,
    pieces: Sequence[tuple[int, int, Mapping[str, torch.Tensor]]],
    counts: Mapping[str, torch.Tensor] | None,
    spans: Sequence[tuple[int, int, Purpose]] | None = None,
) -> None:
    """`ShardedModel.load`: the held ranges rebuilt from ``pieces`` (CPU tensors) on the
    zone's shards device, with their optimizer state. The ranges: ``spans`` (start, end,
    purpose), else those ``layout`` gives ``me``.

    Raises:
        TransferError: the pieces leave part of a held range uncovered.
    """
    elements, _ = zone.state_layout()
    rebuilt = []
    held = [(s.start, s.end, purpose) for s, purpose in zone._held(layout, me)] if spans is None else spans
    device = zone.device
    for start, end, purpose in held:
        flat = torch.full((end - start,), float("nan"), device=device)
        state = {k: torch.empty(end - start, device=device) for k in elements}
        covered = 0
        for a, b, bufs in pieces:
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                flat[lo - start : hi - start] = bufs["values"][lo - a : hi - a]
                for k in elements:
                    state[k][lo - start : hi - start] = bufs[k][lo - a : hi - a]
                covered += hi - lo
        if covered < end - start:
            raise TransferError(f"{me}: only {covered:,} of the {end - start:,} elements of [{start}, {end})")
        rebuilt.append((_views(zone, start, end, purpose, flat), state))
    zone.holdings = [h for h, _ in rebuilt]
    zone.optimizer = zone._build_optimizer()
    if counts is not None:
        for h, state in rebuilt:
            for piece in h.pieces:
                entry: dict[str, Any] = {k: v.clone() for k, v in counts.items()}  # a step count: on the CPU
                for k in elements:  # a view: the rebuilt range is the holding's alone
                    entry[k] = state[k][piece.start - h.start : piece.end - h.start]
                zone.optimizer.state[piece.tensor] = entry
    zone.layout, zone.me = layout, me


def _views(zone: ShardedModel, start: int, end: int, purpose: Purpose, flat: torch.Tensor) -> Holding:
    """The holding of ``[start, end)`` whose pieces are views of ``flat`` (made for it, on the
    shards' device: `ShardedModel._holding` would copy each piece out of it once more)."""
    h = Holding(start, end, purpose)
    for i, (lo, hi) in enumerate(zone._spans):
        a, b = max(lo, start), min(hi, end)
        if a < b:
            h.pieces.append(Piece(i, a, b, flat[a - start : b - start]))
    return h


def move_ranges(zone: ShardedModel, placement: Placement) -> None:
    """`ShardedModel.place` where a device changes: the ranges and their optimizer state go
    through the CPU (`export`, `load_ranges`), the model's parameters to the compute device.
    What moves is what the member holds, which need not be its layout's (none after
    `forget`; a re-shard cut short)."""
    zone.abandon()
    elements, _ = zone.state_layout()
    spans = [(h.start, h.end, h.purpose) for h in zone.holdings]
    pieces = []
    for h in zone.holdings:
        part = zone.export(h.start, h.end)
        flats = {k: as_flat(part["state"].get(k), h.end - h.start) for k in elements}
        pieces.append((h.start, h.end, {"values": part["values"], **flats}))
    counts = zone.shared_state() if zone.stepped() else None
    zone.placement = placement
    move_model(zone.model, placement.compute)
    for p in zone.params:
        free(p)
    load_ranges(zone, zone.layout, zone.me, pieces, counts, spans)


def cross_sum(zone: ShardedModel, group: ProcessGroup, chunk: int) -> None:
    """Each held element's gradient summed over the zones (after its zone's sum): every
    member of ``group`` (all the zones' members) puts in its primary range, so each zone
    gives every element once; ``chunk`` elements at a time, the most held beyond the ranges,
    in CPU buffers whatever device the ranges are on (the zones' group is gloo's).

    Raises:
        CollectiveFailed, EpochAborted: the sum failed or was abandoned."""
    numel = zone.layout.numel
    primaries = [piece for h in zone.holdings if h.purpose is Purpose.PRIMARY for piece in h.pieces]
    pieces = [piece for h in zone.holdings for piece in h.pieces]
    for lo in range(0, numel, chunk):
        hi = min(numel, lo + chunk)
        buf = torch.zeros(hi - lo)
        for piece in primaries:
            a, b = max(piece.start, lo), min(piece.end, hi)
            if a < b and piece.tensor.grad is not None:
                buf[a - lo : b - lo] = piece.tensor.grad[a - piece.start : b - piece.start]
        wait_all([group.allreduce([buf])], zone.scope, "summing the gradient over the zones")
        for piece in pieces:
            a, b = max(piece.start, lo), min(piece.end, hi)
            if a < b:
                if piece.tensor.grad is None:
                    piece.tensor.grad = torch.zeros_like(piece.tensor)
                piece.tensor.grad[a - piece.start : b - piece.start] = buf[a - lo : b - lo]
