"""DiLoCo's exchange between sharded zones, range by range (`comm.outer_ranges`): the tiling
of one zone's range by every zone's, the routes, per-range codec state, and the exchange
itself over an in-memory group (ranks are threads: no sockets)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest
import torch

from unbroken.comm.codecs import Codec
from unbroken.comm.group import EpochScope
from unbroken.comm.outer_ranges import (
    RangeCodecs,
    Span,
    exchange,
    held_by,
    named,
    posts,
    receivers,
    routes,
    sources,
    tiles,
)
from unbroken.errors import BadContribution, CollectiveFailed
from unbroken.specs import CodecSpec
from unbroken.state.shards import Layout, layout_for
from unbroken.testing.fake import FakeWorld
from unit.comm.lazy import Connections, LazyGroup

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


class Spoiled(Codec):
    """A sender's codec that puts NaN on the wire whatever its own part was (a hostile or
    broken primary: what it sends is not what it holds)."""

    def __init__(self, inner: Codec) -> None:
        self.inner = inner

    def payload_bytes(self, numel: int) -> int:
        return self.inner.payload_bytes(numel)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.encode(torch.full_like(x, float("nan")))

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return self.inner.decode(payload, numel)


class SpoiledCodecs(RangeCodecs):
    def of(self, span: Span) -> Codec:
        return Spoiled(super().of(span))


def run_exchange(
    codec: str,
    parts: Mapping[str, torch.Tensor],
    spoil: str | None = None,
    judge: bool = True,
    ranks: Mapping[str, int] = RANKS,
    streams: int | None = None,
) -> dict[str, dict[Span, torch.Tensor] | BaseException]:
    """Every member's exchange, on threads: ``parts`` is each zone's whole pseudo-gradient,
    of which each member passes the ranges it holds; ``spoil``'s payloads carry NaN;
    ``streams``: over a lazily connected group of that many streams (`Connections`)."""
    world = FakeWorld(len(ZONE))
    connections = Connections(streams) if streams is not None else None
    out: dict[str, dict[Span, torch.Tensor] | BaseException] = {}

    def member(m: str) -> None:
        zone = ZONE[m]
        own = {span: parts[zone][span[0] : span[1]].clone() for span in held_by(LAYOUTS[zone], m)}
        codecs = (SpoiledCodecs if m == spoil else RangeCodecs)(CodecSpec.parse(codec))
        scope = EpochScope(threading.Event(), lambda: None, 10.0)
        try:
            group = world.group(ranks[m]) if connections is None else LazyGroup(world, ranks[m], connections)
            out[m], _ = exchange(own, False, LAYOUTS, zone, m, ranks, group, scope, codecs, "round", judge=judge)
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


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("order", ["a1 a2 b1 b2 b3", "a1 a2 b2 b3 b1", "b3 a2 b1 a1 b2"])
def test_the_exchange_completes_on_a_lazily_connected_group_whatever_the_ranks(streams: int, order: str) -> None:
    """Across zones the epoch's group connects a pair on its first use, and that first use
    blocks until the peer's (`Connections`): posted in an order the members do not share,
    two of them wait for each other for good (the hang of the round after b1 was benched:
    its epoch moved b1 to the last rank, and no earlier transfer had connected the pairs)."""
    ranks = {m: i for i, m in enumerate(order.split())}
    g = torch.Generator().manual_seed(2)
    parts = {z: torch.randn(NUMEL, generator=g) for z in "AB"}
    out = run_exchange("none", parts, ranks=ranks, streams=streams)
    for m, sums in out.items():
        assert isinstance(sums, dict), f"{m}: {sums!r}"
        for (start, end), total in sums.items():
            assert torch.equal(total, parts["A"][start:end] + parts["B"][start:end]), m


def test_each_pair_of_members_posts_what_they_share_in_the_same_order() -> None:
    """What makes the order safe (`posts`): both ends of every send post it, and they meet
    their shared operations in one order, (tag, lower rank, higher rank) across the epoch."""
    ranks = {m: i for i, m in enumerate(["b2", "a1", "b3", "a2", "b1"])}
    every = {m: posts(LAYOUTS, ZONE[m], m, ranks) for m in ZONE}
    for m, mine in every.items():
        keys = [(p.source.tag, *sorted((ranks[m], ranks[p.peer]))) for p in mine]
        assert keys == sorted(keys) and len(set(keys)) == len(keys), m
        for peer in ZONE:
            with_peer = [(p.source.tag, p.send) for p in mine if p.peer == peer]
            from_peer = [(p.source.tag, not p.send) for p in every[peer] if p.peer == m]
            assert with_peer == from_peer, (m, peer)


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
def test_a_payload_not_finite_is_refused_by_every_receiver_with_its_sender_named(codec: str) -> None:
    """int8's scales fail to decode; the others decode to NaN (fp16's clamp lets NaN through):
    either way each receiver of b2's range names b2, and no receiver takes the round."""
    parts = {z: torch.ones(NUMEL) for z in "AB"}
    out = run_exchange(codec, parts, spoil="b2")
    receivers = {m for m in ZONE if any(src.primary == "b2" for src in routes(LAYOUTS, ZONE[m], m).receives)}
    assert receivers == {"a1", "a2"}, "the test needs b2's range received by every member of zone A"
    refused = {m: r for m, r in out.items() if isinstance(r, BadContribution)}
    assert set(refused) == receivers and all(r.rank == RANKS["b2"] for r in refused.values()), out
    assert all(f"rank {RANKS['b2']} sent" in str(r) for r in refused.values()), refused


def test_a_member_whose_own_part_is_not_finite_says_so_and_sends_zeros_in_its_place() -> None:
    """Its receivers finish the exchange (they must hear it say so, `named`) with nothing of
    its NaN: zeros came in its place; it names itself alone."""
    parts = {z: torch.ones(NUMEL) for z in "AB"}
    parts["B"][600] = float("nan")  # b2's range [250, 750): b2 and its buddy b3 hold it
    out = run_exchange("fp16", parts)
    refused = {m: r for m, r in out.items() if isinstance(r, BaseException)}
    assert set(refused) == {"b2", "b3"}, out
    for m, r in refused.items():
        assert isinstance(r, BadContribution) and r.rank == RANKS[m], r
        assert f"rank {RANKS[m]}'s own pseudo-gradient of" in str(r) and "is not finite" in str(r)
    for m in "a1", "a2":
        sums = out[m]
        assert isinstance(sums, dict) and all(bool(torch.isfinite(t).all()) for t in sums.values()), m
    assert named(found(out), LAYOUTS, ZONE, RANKS) in {RANKS[m] for m in refused}


def test_a_steps_gradient_is_not_judged_here_its_members_norms_are_at_the_vote() -> None:
    """Synchronous mode's coded sum (`CodedSum`): a range's part is the sum of its zone's
    gradients, so neither its holder nor its sender is the culprit of a NaN in it: it goes
    through, and the step's vote (each member's own norm) names whose it was."""
    parts = {z: torch.ones(NUMEL) for z in "AB"}
    parts["B"][600] = float("nan")
    out = run_exchange("fp16", parts, judge=False)
    assert all(isinstance(r, dict) for r in out.values()), out
    a1 = out["a1"]
    assert isinstance(a1, dict) and not all(bool(torch.isfinite(t).all()) for t in a1.values())


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


def found(out: Mapping[str, dict[Span, torch.Tensor] | BaseException]) -> list[int]:
    """What each rank found of the ranges it received (the gathered entries): a rank, or -1."""
    rows = [-1] * len(RANKS)
    for m, r in out.items():
        if isinstance(r, BadContribution):
            rows[RANKS[m]] = r.rank
    return rows


def test_a_sender_most_of_its_receivers_found_not_finite_is_named_by_every_member() -> None:
    out = run_exchange("fp16", {z: torch.ones(NUMEL) for z in "AB"}, spoil="b2")
    assert named(found(out), LAYOUTS, ZONE, RANKS) == RANKS["b2"]
    assert receivers(LAYOUTS, "B", "b2") == ["a1", "a2"]


def test_one_receivers_word_names_no_one() -> None:
    """a1 alone says b1's range was not finite (a2, which received it too, does not): an
    honest sender is not named on a liar's word, nor by members that did not receive it."""
    alone = [-1] * len(RANKS)
    alone[RANKS["a1"]] = RANKS["b1"]
    assert named(alone, LAYOUTS, ZONE, RANKS) is None
    outsiders = [-1] * len(RANKS)
    outsiders[RANKS["b2"]] = outsiders[RANKS["b3"]] = RANKS["b1"]  # b1's own zone received nothing
    assert named(outsiders, LAYOUTS, ZONE, RANKS) is None
    both = list(alone)
    both[RANKS["a2"]] = RANKS["b1"]
    assert named(both, LAYOUTS, ZONE, RANKS) == RANKS["b1"]


def test_a_sender_with_one_receiver_is_never_named_on_its_word() -> None:
    layouts = {"A": layout_for(10, {"a": 1}), "B": layout_for(10, {"b": 1})}
    ranks = {"a": 0, "b": 1}
    assert named([1, -1], layouts, {"a": "A", "b": "B"}, ranks) is None


class _DeadPeer:
    """A lazily connected gloo group whose first post meets a peer that died: gloo connects
    the pair inside the post and raises there, before any work to wait on exists."""

    def send(self, *_: object) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7574")

    recv = send


def test_a_post_to_a_peer_that_died_fails_the_round_not_the_node() -> None:
    # CI: b1 and b2 ended with this RuntimeError when a2 was SIGKILLed mid-round.
    m = "a1"
    own = {span: torch.ones(span[1] - span[0]) for span in held_by(LAYOUTS[ZONE[m]], m)}
    scope = EpochScope(threading.Event(), lambda: None, 10.0)
    codecs = RangeCodecs(CodecSpec.parse("int8"))
    with pytest.raises(CollectiveFailed, match=r"round \(ranges between zones\) failed: .*Connection closed by peer"):
        exchange(own, False, LAYOUTS, ZONE[m], m, RANKS, _DeadPeer(), scope, codecs, "round")  # type: ignore[arg-type]
