"""DiLoCo's exchange between sharded zones, range by range (`comm.outer_ranges`): the tiling
of one zone's range by every zone's, the routes, per-range codec state, and the exchange
itself over an in-memory group (ranks are threads: no sockets)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest
import torch

from unbroken.comm.group import EpochScope
from unbroken.comm.outer_ranges import RangeCodecs, Span, exchange, held_by, routes, sources, tiles
from unbroken.errors import BadContribution
from unbroken.specs import CodecSpec
from unbroken.state.shards import Layout, layout_for
from unbroken.testing.fake import FakeWorld

NUMEL = 1000
LAYOUTS = {
    "A": layout_for(NUMEL, {"a1": 3, "a2": 1}),
    "B": layout_for(NUMEL, {"b1": 1, "b2": 2, "b3": 1}),
}
ZONE = {"a1": "A", "a2": "A", "b1": "B", "b2": "B", "b3": "B"}
RANKS = {m: i for i, m in enumerate(ZONE)}


def test_the_zones_layouts_differ_and_each_zone_tiles_every_range_once() -> None:
    a, b = ({(s.start, s.end) for s in LAYOUTS[z].shards} for z in "AB")
    assert a != b, "the test needs ranges that do not line up"
    for zone in "AB":
        for span in held_by(LAYOUTS[zone], LAYOUTS[zone].shards[0].primary):
            parts = tiles(LAYOUTS, span)
            assert [src.zone for src, _ in parts] == sorted(src.zone for src, _ in parts), "zone order"
            for z in "AB":
                covered = torch.zeros(span[1] - span[0], dtype=torch.int64)
                for src, (lo, hi) in parts:
                    if src.zone == z:
                        assert src.start <= lo < hi <= src.end and span[0] <= lo and hi <= span[1]
                        covered[lo - span[0] : hi - span[0]] += 1
                assert bool((covered == 1).all()), f"zone {z} must cover {span} once"


def test_routes_send_each_primary_range_to_the_other_zones_holders_of_its_elements() -> None:
    every = {m: routes(LAYOUTS, ZONE[m], m) for m in ZONE}
    sent = {(src.tag, to) for r in every.values() for src, tos in r.sends for to in tos}
    received = {(src.tag, m) for m, r in every.items() for src in r.receives}
    assert sent == received, "every send has its receive, and no receive waits for nothing"
    for m, r in every.items():
        assert all(src.primary == m and src.zone == ZONE[m] for src, _ in r.sends)
        assert all(src.zone != ZONE[m] for src in r.receives), "nothing moves inside a zone"
        held = held_by(LAYOUTS[ZONE[m]], m)
        other = next(z for z in "AB" if z != ZONE[m])
        for span in held:  # what it needs of the other zone: every range that cuts its own
            needed = {s.tag for s in sources(LAYOUTS) if s.zone == other and s.start < span[1] and span[0] < s.end}
            assert needed <= {src.tag for src in r.receives}


def test_range_codecs_keep_a_residual_per_range_and_forget_the_ranges_let_go() -> None:
    codecs = RangeCodecs(CodecSpec.parse("topk:0.1"))
    x, y = torch.arange(100.0), torch.arange(50.0)
    codecs.of((0, 100)).encode(x)
    codecs.of((100, 150)).encode(y)
    state = codecs.state_dict()
    assert state[(0, 100)]["residual"].numel() == 100 and state[(100, 150)]["residual"].numel() == 50
    again = RangeCodecs(CodecSpec.parse("topk:0.1"))
    again.load_state_dict(state)  # a retried round encodes as the first try did
    assert torch.equal(again.of((0, 100)).encode(x), codecs.of((0, 100)).encode(x))
    codecs.keep_only([(100, 150)])
    assert set(codecs.state_dict()) == {(100, 150)}
    codecs.reset()
    assert codecs.state_dict() == {}


def run_exchange(
    codec: str, parts: Mapping[str, torch.Tensor], spoil: str | None = None
) -> dict[str, dict[Span, torch.Tensor] | BaseException]:
    """Every member's exchange, on threads: ``parts`` is each zone's whole pseudo-gradient,
    of which each member passes the ranges it holds."""
    world = FakeWorld(len(ZONE))
    out: dict[str, dict[Span, torch.Tensor] | BaseException] = {}

    def member(m: str) -> None:
        zone = ZONE[m]
        own = {span: parts[zone][span[0] : span[1]].clone() for span in held_by(LAYOUTS[zone], m)}
        codecs = RangeCodecs(CodecSpec.parse(codec))
        if m == spoil:  # a primary whose int8 scales are not finite: refused by name at its receivers
            own = {span: x * float("inf") for span, x in own.items()}
        scope = EpochScope(threading.Event(), lambda: None, 10.0)
        try:
            out[m], _ = exchange(own, False, LAYOUTS, zone, m, RANKS, world.group(RANKS[m]), scope, codecs, "round")
        except BaseException as exc:
            out[m] = exc

    threads = [threading.Thread(target=member, args=(m,)) for m in ZONE]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


@pytest.mark.parametrize("codec", ["none", "int8", "topk:0.2"])
def test_every_holder_of_an_element_in_every_zone_gets_the_same_sum(codec: str) -> None:
    g = torch.Generator().manual_seed(1)
    parts = {z: torch.randn(NUMEL, generator=g) for z in "AB"}
    out = run_exchange(codec, parts)
    values: dict[int, set[float]] = {}
    for m, sums in out.items():
        assert isinstance(sums, dict), f"{m}: {sums!r}"
        assert set(sums) == set(held_by(LAYOUTS[ZONE[m]], m))
        for (start, end), total in sums.items():
            for i in range(0, NUMEL, 37):
                if start <= i < end:
                    values.setdefault(i, set()).add(float(total[i - start]))
            if codec == "none":  # the exact sum, added in zone order
                assert torch.equal(total, parts["A"][start:end] + parts["B"][start:end])
    assert all(len(v) == 1 for v in values.values()), "holders of an element disagree"
    assert len(values) == len(range(0, NUMEL, 37)), "every element is held"


def test_a_payload_that_does_not_decode_is_refused_with_its_sender_named() -> None:
    parts = {z: torch.ones(NUMEL) for z in "AB"}
    out = run_exchange("int8", parts, spoil="b2")
    refused = {m: r for m, r in out.items() if isinstance(r, BadContribution)}
    assert refused and all(r.rank == RANKS["b2"] for r in refused.values()), out
    assert all(ZONE[m] == "A" for m in refused), "only the other zone's holders decode b2's payload"


def test_a_zone_without_samples_sends_zeros_and_keeps_its_residual() -> None:
    layouts: dict[str, Layout] = {"A": layout_for(10, {"a": 1}), "B": layout_for(10, {"b": 1})}
    world = FakeWorld(2)
    codecs = {m: RangeCodecs(CodecSpec.parse("int8")) for m in "ab"}
    codecs["a"].of((0, 10)).residual = torch.full((10,), 0.5)
    got: dict[str, dict[Span, torch.Tensor]] = {}

    def member(m: str, silent: bool) -> None:
        scope = EpochScope(threading.Event(), lambda: None, 10.0)
        own = {(0, 10): torch.full((10,), 2.0)}
        got[m], _ = exchange(
            own, silent, layouts, m.upper(), m, {"a": 0, "b": 1}, world.group("ab".index(m)), scope, codecs[m], "r"
        )

    threads = [threading.Thread(target=member, args=(m, m == "a")) for m in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert torch.allclose(got["a"][(0, 10)], torch.full((10,), 2.0)) and torch.equal(
        got["a"][(0, 10)], got["b"][(0, 10)]
    )
    residual = codecs["a"].of((0, 10)).residual
    assert residual is not None and torch.equal(residual, torch.full((10,), 0.5))
