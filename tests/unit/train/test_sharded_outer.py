"""The outer loop's state per held range (`train.sharded_outer`): the outer step is torch's
Nesterov SGD range by range, and the momentum moves with the ranges when a zone re-shards
(an in-memory group: no sockets)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import torch

from unbroken.comm.blocks import Holding, Piece, restore_storage
from unbroken.comm.group import EpochScope
from unbroken.comm.sharded import ShardedModel
from unbroken.comm.solo import Solo
from unbroken.specs import CodecSpec
from unbroken.state.shards import Purpose, Transfer, layout_for
from unbroken.testing.fake import FakeWorld
from unbroken.train.sharded_outer import ShardedOuter, cut

SETTINGS = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def zone_holding(me: str, spans: list[tuple[int, int]], values: torch.Tensor) -> Any:
    """What `ShardedOuter` reads of a zone: this member's holdings (one piece each)."""
    holdings = []
    for start, end in spans:
        h = Holding(start, end, Purpose.PRIMARY)
        h.pieces.append(Piece(0, start, end, values[start:end].clone()))
        holdings.append(h)
    return SimpleNamespace(ready=SimpleNamespace(holdings=holdings, me=me), moved=None, step=0)


def test_the_outer_step_of_each_range_is_torchs_nesterov_sgd_of_the_whole() -> None:
    g = torch.Generator().manual_seed(0)
    anchor = torch.randn(30, generator=g)
    spans = [(0, 11), (11, 30)]
    zone = zone_holding("m", spans, anchor)
    outer = ShardedOuter(zone, SETTINGS, CodecSpec.parse("none"))
    whole = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([whole], **SETTINGS)  # type: ignore[arg-type]
    for step in range(1, 4):
        grad = torch.randn(30, generator=g)
        outer.anchor = {
            s: {"values": torch.cat([p.tensor for p in h.pieces])}
            for s, h in zip(spans, zone.ready.holdings, strict=True)
        }
        outer._sums = {s: grad[s[0] : s[1]].clone() for s in spans}
        outer.apply(step)
        whole.grad = grad.clone()
        sgd.step()
        got = torch.cat([p.tensor for h in zone.ready.holdings for p in h.pieces])
        assert torch.allclose(got, whole.detach(), rtol=0, atol=1e-6), step
        assert outer.momentum_step == step
        # The checkpoint of the step is written before the zone hears of the commit: its files
        # carry the momentum of the step just applied, and of no other.
        saved = outer.saved(step, 0, 30)
        assert saved is not None and torch.allclose(saved, sgd.state[whole]["momentum_buffer"], rtol=0, atol=1e-6)
        assert outer.saved(step - 1, 0, 30) is None


def test_cut_puts_a_span_together_from_pieces_and_says_where_they_leave_a_gap() -> None:
    store = {(0, 4): torch.arange(4.0), (4, 10): torch.arange(4.0, 10.0)}
    got = cut(store, 2, 8)
    assert got is not None and torch.equal(got, torch.arange(2.0, 8.0))
    assert cut({(0, 4): torch.arange(4.0), (6, 10): torch.zeros(4)}, 0, 10) is None


def test_momentum_moves_with_the_ranges_and_a_stale_copy_is_not_used() -> None:
    # y is new in the zone: x sends it the momentum of [0, 50), which it is to hold as buddy;
    # z missed the last outer step (its momentum is of step 5, the group's of step 10): what it
    # receives from x wins over its own older copy.
    numel = 100
    new = layout_for(numel, {"x": 1, "y": 1})
    momentum = torch.arange(float(numel))
    transfers = (
        Transfer("x", "y", 50, 100, Purpose.PRIMARY),
        Transfer("x", "z", 0, 50, Purpose.BUDDY),
    )
    world = FakeWorld(3)
    ranks = {"x": 0, "y": 1, "z": 2}
    held = {"x": [(0, 100)], "y": [(50, 100)], "z": [(0, 50)]}
    outers: dict[str, ShardedOuter] = {}
    for m in ranks:
        zone = zone_holding(m, held[m], torch.zeros(numel))
        zone.step = 10
        zone.moved = SimpleNamespace(
            zone="Z",
            layouts={"Z": new},
            transfers=transfers,
            fresh=False,
            unchanged=False,
            world=ranks,
            pg=world.group(ranks[m]),
        )
        outers[m] = ShardedOuter(zone, SETTINGS, CodecSpec.parse("none"))
    outers["x"].momentum, outers["x"].momentum_step = {(0, 100): momentum.clone()}, 10
    outers["z"].momentum, outers["z"].momentum_step = {(0, 50): torch.full((50,), -1.0)}, 5
    errors: list[BaseException] = []

    def run(m: str) -> None:
        try:
            outers[m].after_sync(EpochScope(threading.Event(), lambda: None, 10.0))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,)) for m in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert torch.equal(outers["y"].momentum[(50, 100)], momentum[50:])
    assert torch.equal(outers["z"].momentum[(0, 50)], momentum[:50]), "the received momentum, not its own stale one"
    assert all(o.momentum_step == 10 for o in outers.values())


def test_a_failed_round_puts_the_ranges_values_inner_state_and_residuals_back() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    numel = sum(p.numel() for p in model.parameters())
    layout = layout_for(numel, {"m": 1})
    engine = ShardedModel(
        model, layout, "m", {"m": 0}, Solo(), EpochScope(threading.Event(), lambda: None, 10.0),
        lambda groups: torch.optim.AdamW(groups, lr=0.01),
    )  # fmt: skip
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def inner_step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        engine.finish_backward()
        engine.step()

    inner_step()  # the round starts with inner optimizer state to put back
    zone = SimpleNamespace(ready=engine, engine=engine, moved=None, step=1, pending=None)
    outer = ShardedOuter(zone, SETTINGS, CodecSpec.parse("int8"))
    outer.begin_round(1)
    before = engine.digests()
    residual = outer.codecs.of((0, numel))
    residual.encode(torch.randn(numel))  # a residual of the round's start
    outer.begin_round(1)
    kept = outer.codecs.state_dict()[(0, numel)]["residual"].clone()
    for _ in range(3):
        inner_step()
    outer.codecs.of((0, numel)).encode(torch.randn(numel))  # the failed exchange's encoding
    zone.step, zone.pending = 4, (3, [], 1.0)
    outer.rollback(moved=True)
    assert engine.digests() == before, "values and inner optimizer state as at the round's start"
    got = outer.codecs.of((0, numel)).residual
    assert got is not None and torch.equal(got, kept), "the retried round encodes from the same residual"
    assert zone.step == 1 and zone.pending is None


def test_ranges_made_afresh_forget_the_old_layouts_round_start() -> None:
    """A fall-back to a checkpoint rebuilds the zone on a fresh layout at an older step: an
    epoch aborted before the next round anchors must not roll back to the old round's start
    (its spans are the old layout's, its step is past the checkpoint's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    numel = sum(p.numel() for p in model.parameters())
    scope = EpochScope(threading.Event(), lambda: None, 10.0)

    def adam(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=0.01)

    before = ShardedModel(model, layout_for(numel, {"m": 1, "x": 1, "y": 1}), "m", {"m": 0, "x": 1, "y": 2}, Solo(),
                          scope, adam)  # fmt: skip
    zone = SimpleNamespace(ready=before, engine=before, moved=None, step=40, pending=None)
    outer = ShardedOuter(zone, SETTINGS, CodecSpec.parse("none"))
    outer.begin_round(40)  # the round in progress when x and y were lost
    before.close()
    restore_storage(model)
    after = ShardedModel(model, layout_for(numel, {"m": 1}), "m", {"m": 0}, Solo(), scope, adam)
    zone.engine = zone.ready = after
    zone.step = 30  # the checkpoint's
    zone.moved = SimpleNamespace(fresh=True)
    half = numel // 2  # the checkpoint's files: the momentum of the first half only
    zone.read_momentum = {(0, half): torch.arange(float(half))}
    outer.after_sync(scope)
    (span,) = outer.momentum
    want = torch.cat([torch.arange(float(half)), torch.zeros(numel - half)])
    assert span == (0, numel) and torch.equal(outer.momentum[span], want), "as read, 0 where the files had none"
    assert zone.momentum_of is not None and torch.equal(zone.momentum_of(30, 0, numel), want), "saved as it is"
    digests = after.digests()
    outer.rollback(moved=True)  # the epoch aborted before the next round began
    assert zone.step == 30 and after.digests() == digests, "the checkpoint's ranges stay as read"
