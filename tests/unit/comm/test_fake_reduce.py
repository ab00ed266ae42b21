"""The reducer on the in-memory process group (`unbroken.testing.fake`): every rule and codec,
zones, and faults in the middle of a collective, without sockets or processes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from unbroken.comm.codecs import make_codec
from unbroken.comm.group import EpochScope
from unbroken.comm.reduce import VOTE_SLOTS, Reducer
from unbroken.comm.robust import combine
from unbroken.comm.transfer import sync_state
from unbroken.errors import BadContribution, CollectiveFailed, EpochAborted, Where
from unbroken.sched.zones import Zones
from unbroken.specs import parse_rule
from unbroken.state.snapshot import TrainState
from unbroken.testing.fake import FakeWorld

K = 8
"""Gradient elements at the head of the flat tensor."""
SHARE = 4


def run(n: int, body: Callable[[int], Any], timeout: float = 20.0) -> dict[int, Any]:
    """``body(rank)`` on ``n`` threads; each rank's result, or the exception it raised."""
    out: dict[int, Any] = {}

    def main(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except BaseException as exc:  # compared by the test
            out[rank] = exc

    threads = [threading.Thread(target=main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return out


def trained_state(seed: int, step: int) -> TrainState:
    """A small model's state after one SGD step with momentum, at ``step`` (``seed``: its own)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    st = TrainState(model, opt)
    st.step = step
    return st


def contribution(rank: int, n: int, grad: torch.Tensor | None = None) -> torch.Tensor:
    """A member's flat tensor as the step lays it out: gradient, vote slots, norm slots."""
    flat = torch.zeros(K + VOTE_SLOTS + n)
    g = torch.arange(K, dtype=torch.float32) * (rank + 1) - rank if grad is None else grad
    flat[:K] = g
    flat[K : K + VOTE_SLOTS] = torch.tensor([1.0, float(SHARE), 0.0, 0.5, 0.0])
    flat[K + VOTE_SLOTS + rank] = torch.linalg.vector_norm(g)
    return flat


def flat_reducer(rank: int, world: FakeWorld, rule: str = "mean", **kw: Any) -> Reducer:
    n = world.size
    return Reducer(
        rank, Zones(("",) * n), world.group(rank), rule=parse_rule(rule), compressed=K,
        weights=(1.0 / n,) * n, shares=(SHARE,) * n, norms_at=K + VOTE_SLOTS, **kw,
    )  # fmt: skip


def reduce(
    reducer: Reducer, flat: torch.Tensor, abort: Callable[[], Any] = lambda: None, deadline: float = 10.0
) -> torch.Tensor:
    reducer.allreduce(flat, EpochScope(threading.Event(), abort, deadline), "step 7")
    return flat


def test_the_mean_rule_sums_every_member_and_every_rank_holds_the_same_bits() -> None:
    world = FakeWorld(3)
    out = run(3, lambda r: reduce(flat_reducer(r, world), contribution(r, 3)))
    expected = sum(contribution(r, 3) for r in range(3))
    for flat in out.values():
        assert torch.equal(flat, out[0]) and torch.allclose(flat, expected)
    assert flat[K] == 3.0 and flat[K + 1] == 3 * SHARE, "votes and samples are counted"


@pytest.mark.parametrize("rule", ["checked", "clip:2", "trimmed:0.25"])
def test_robust_rules_gather_rows_and_combine_them_as_the_rule_says(rule: str) -> None:
    world = FakeWorld(4)
    rows = [contribution(r, 4) for r in range(4)]
    out = run(4, lambda r: reduce(flat_reducer(r, world, rule), rows[r].clone()))
    norms = sum(rows)[K + VOTE_SLOTS :].tolist()
    head = combine([row[:K] for row in rows], (0.25,) * 4, norms, parse_rule(rule))
    for flat in out.values():
        assert torch.equal(flat, out[0])
        assert torch.allclose(flat[:K], head)
        assert torch.equal(flat[K:], sum(rows)[K:])
    assert ("allgather" in {op for _, op in world.calls}) and ("allreduce" not in {op for _, op in world.calls})


@pytest.mark.parametrize("rule", ["checked", "clip:2", "trimmed:0.25"])
def test_a_row_that_lies_about_its_norm_is_named_by_every_rank(rule: str) -> None:
    world = FakeWorld(4)

    def body(r: int) -> torch.Tensor:
        flat = contribution(r, 4)
        if r == 2:
            flat[:K] *= -1e6  # spoiled after its norm was written: the slot claims the true one
        return reduce(flat_reducer(r, world, rule), flat)

    out = run(4, body)
    assert all(isinstance(e, BadContribution) and e.rank == 2 for e in out.values()), out
    assert "declared a gradient norm" in str(out[0])


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "int4", "int2", "int1", "topk:0.5"])
def test_two_zones_exchange_through_every_codec_and_agree_on_the_sum(codec: str) -> None:
    # Ranks 0, 1 in zone A and 2, 3 in zone B: zones sum first, leaders 0 and 2 exchange
    # the coded head (and the exact tail), then each zone's leader broadcasts.
    zones = Zones(("A", "A", "B", "B"))
    world, zone_a, zone_b, leaders = FakeWorld(4), FakeWorld(2), FakeWorld(2), FakeWorld(2)

    def body(r: int) -> torch.Tensor:
        zone_world = zone_a if r < 2 else zone_b
        reducer = Reducer(
            r, zones, world.group(r), zone_pg=zone_world.group(r % 2),
            leaders_pg=leaders.group(r // 2) if r in (0, 2) else None, codec=make_codec(codec), compressed=K,
            norms_at=K + VOTE_SLOTS,
        )  # fmt: skip
        return reduce(reducer, contribution(r, 4))

    out = run(4, body)
    expected = sum(contribution(r, 4) for r in range(4))
    # The head is each zone's sum as its leader's codec carries it (a fresh codec: no residual).
    head = torch.zeros(K)
    for zone_sum in (contribution(0, 4) + contribution(1, 4), contribution(2, 4) + contribution(3, 4)):
        c = make_codec(codec)
        head += c.decode(c.encode(zone_sum[:K]), K)
    for flat in out.values():
        assert torch.equal(flat, out[0]), "every rank holds the same bits"
        assert torch.equal(flat[K:], expected[K:]), "votes, samples and norms travel exact"
        assert torch.allclose(flat[:K], head, rtol=0, atol=1e-5)
    if codec == "none":
        assert torch.equal(out[0], expected)


def test_a_member_killed_mid_collective_fails_the_step_on_every_other_rank() -> None:
    world = FakeWorld(3)
    posted = threading.Barrier(2)

    def scope(r: int) -> EpochScope:
        return EpochScope(threading.Event(), lambda: None, 10.0, lambda: Where(epoch=4, step=7, rank=r))

    def body(r: int) -> Any:
        if r == 2:  # dies before it contributes, after the others are inside the all-reduce
            posted.wait()
            world.kill(2)
            return None
        reducer = flat_reducer(r, world)
        flat = contribution(r, 3)
        if r == 0:
            reducer.allreduce(flat, scope(r), "step 7", after_post=posted.wait)
        else:
            reducer.allreduce(flat, scope(r), "step 7")
        return flat

    out = run(3, body)
    for r in (0, 1):
        assert isinstance(out[r], CollectiveFailed), out[r]
        # Each says where it happened: its epoch, the step it was taking, its own rank.
        assert out[r].where == Where(epoch=4, step=7, rank=r)
        assert str(out[r]).endswith(
            f"step 7 failed: Connection reset by peer (rank 2 is gone) [epoch 4, step 7, rank {r}]"
        )


def test_a_frozen_member_holds_the_collective_until_the_deadline_or_an_abort() -> None:
    world = FakeWorld(2)
    reducer = flat_reducer(0, world)  # rank 1 never arrives
    with pytest.raises(CollectiveFailed, match=r"ran past its 0\.2 s deadline"):
        reduce(reducer, contribution(0, 2), deadline=0.2)
    world = FakeWorld(2)
    reducer = flat_reducer(0, world)
    with pytest.raises(EpochAborted, match="step 7 abandoned: epoch 4 ordered"):
        reduce(reducer, contribution(0, 2), abort=lambda: EpochAborted("epoch 4 ordered"))


def test_ranks_that_disagree_on_the_collective_are_an_error_not_a_hang() -> None:
    world = FakeWorld(2)
    a, b = world.group(0), world.group(1)
    a.allreduce([torch.ones(2)])
    with pytest.raises(RuntimeError, match="collective 1 is broadcast, the others' allreduce"):
        b.broadcast(torch.ones(2), 0)


def test_the_sync_phase_moves_the_majoritys_state_to_the_one_behind() -> None:
    world = FakeWorld(3)
    states = [trained_state(1, 12), trained_state(1, 12), trained_state(7, 3)]  # rank 2 was away: older and different
    out = run(
        3,
        lambda r: sync_state(
            world.group(r), r, 3, states[r], EpochScope(threading.Event(), lambda: None, 10.0), chunk_bytes=4096
        ),
    )
    assert out[2].role == "receiver" and set(out[2].peers) <= {0, 1}, out
    assert {out[0].role, out[1].role} <= {"source", "donor", "none"}
    assert states[2].step == 12 and states[2].digest() == states[0].digest() == states[1].digest()
    assert ("send" in {op for _, op in world.calls}) and ("recv" in {op for _, op in world.calls})


def test_a_donor_killed_mid_transfer_fails_the_receivers_fetch_not_the_others() -> None:
    world = FakeWorld(2)
    donor, joiner = trained_state(1, 12), trained_state(7, 0)
    before = joiner.digest()

    def die_after(chunks: int) -> None:
        if chunks == 2:
            world.kill(0)
            raise SystemExit  # the donor's process is gone

    scope = EpochScope(threading.Event(), lambda: None, 10.0)
    out = run(2, lambda r: sync_state(world.group(r), r, 2, [donor, joiner][r], scope, chunk_bytes=1024,
                                      on_sent=die_after if r == 0 else None))  # fmt: skip
    assert isinstance(out[1], CollectiveFailed) and "rank 0 is gone" in str(out[1]), out[1]
    assert joiner.step == 0 and joiner.digest() == before, "a fetch cut short changes nothing committed"
