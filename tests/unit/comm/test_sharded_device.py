"""The sharded engine through its device paths, run on the CPU: blocks staged between the
shards' device and the compute device, collectives waited on by polling (NCCL's way), and
the ranges moved to another placement between steps. Each must train bit for bit as the
plain CPU path does (no GPU here: the copies are CPU to CPU, the code is the device's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from unbroken.comm.placement import Backend, Placement
from unbroken.comm.reshard import move_ranges
from unbroken.comm.sharded import ShardedModel
from unbroken.errors import CollectiveFailed
from unbroken.state.shards import layout_for, plan
from unbroken.testing.fake import FakeWorld

from .test_sharded import (
    STEPS,
    WEIGHTS,
    B,
    Tiny,
    X,
    Y,
    adamw,
    assert_matches,
    even,
    groups_of,
    reference,
    reshard_all,
    run,
    scope,
    train,
    train_steps,
)

pytestmark = pytest.mark.timeout(60)

STAGED = Placement(stage=True, reason="test: staged on the CPU")
POLLED = Placement(Backend.NCCL, stage=True, reason="test: polled waits and staging on the CPU")


def start(placement: Placement) -> tuple[dict[str, ShardedModel], dict[str, Tiny], FakeWorld]:
    members = list(WEIGHTS)
    numel = sum(p.numel() for p in Tiny().parameters())
    layout = layout_for(numel, WEIGHTS)
    world = FakeWorld(len(members))
    ranks = {m: i for i, m in enumerate(members)}
    models = {m: Tiny() for m in members}
    zones = {
        m: ShardedModel(
            models[m],
            layout,
            m,
            ranks,
            world.group(ranks[m]),
            scope(),
            adamw,
            blocks=[models[m].embed, models[m].body, models[m].head],
            groups=groups_of(models[m]),
            placement=placement,
        )
        for m in members
    }
    return zones, models, world


def digests(zones: dict[str, ShardedModel]) -> dict[str, dict[tuple[int, int], str]]:
    return {m: z.digests() for m, z in zones.items()}


@pytest.mark.parametrize("placement", [STAGED, POLLED], ids=["staged", "polled"])
def test_the_device_paths_train_bit_for_bit_as_the_cpu_path(placement: Placement) -> None:
    plain, plain_models, _ = start(Placement())
    device, device_models, _ = start(placement)
    members = list(WEIGHTS)
    train_steps(plain, plain_models, members, range(STEPS))
    train_steps(device, device_models, members, range(STEPS))
    assert digests(device) == digests(plain)
    assert_matches(device, reference(STEPS))


def test_ranges_moved_to_another_placement_between_steps_train_on_unchanged() -> None:
    plain, plain_models, _ = start(Placement())
    zones, models, _ = start(Placement())
    members = list(WEIGHTS)
    train_steps(plain, plain_models, members, range(STEPS))
    train_steps(zones, models, members, range(STEPS // 2))
    before = digests(zones)
    for z in zones.values():  # through the CPU and back, as a GPU zone that a CPU member joined
        move_ranges(z, POLLED)
    assert digests(zones) == before and all(z.placement is POLLED for z in zones.values())
    train_steps(zones, models, members, range(STEPS // 2, STEPS))
    assert digests(zones) == digests(plain)


def test_a_member_killed_under_polled_waits_fails_the_step_and_the_survivors_reshard() -> None:
    zones, models, world = start(POLLED)
    members = list(WEIGHTS)
    train_steps(zones, models, members, range(2))
    world.kill(members.index("c"))
    slices = even(members)
    out = run([m for m in members if m != "c"], lambda m: train(zones[m], models[m], 2, slices, m))
    assert all(isinstance(v, CollectiveFailed) for v in out.values()), out
    survivors = [m for m in members if m != "c"]
    for m in survivors:
        zones[m].abandon()
    p = plan(zones["a"].layout, lost={"c"})
    done = reshard_all(zones, p, survivors, FakeWorld(len(survivors)))
    assert not any(isinstance(v, BaseException) for v in done.values()), done
    train_steps(zones, models, survivors, range(2, STEPS))
    assert_matches({m: zones[m] for m in survivors}, reference(STEPS))
    assert all(z.placement is POLLED for m, z in zones.items() if m != "c")
    assert torch.isfinite(torch.cat([h.pieces[0].tensor for h in zones["a"].holdings])).all()


class Aborted:
    """A zone group whose communicator was aborted (as torch's NCCL watchdog does after a
    peer's failure): every post of a sum raises, before any wait could see a failure."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def allreduce(self, *args: object, **kwargs: object) -> object:
        raise torch.distributed.DistBackendError("NCCL communicator was aborted on rank 0")


def test_a_post_the_backend_refuses_fails_the_step_as_a_failed_collective_does() -> None:
    zones, models, _ = start(POLLED)
    members = list(WEIGHTS)
    train_steps(zones, models, members, range(2))
    before = digests(zones)
    for z in zones.values():
        z.group = Aborted(z.group)  # type: ignore[assignment]
    out = run(members, lambda m: train(zones[m], models[m], 2, even(members), m))
    assert all(isinstance(v, CollectiveFailed) and "summing" in str(v) for v in out.values()), out
    assert digests(zones) == before, "a failed step is not applied"


def test_a_member_that_forgot_its_stale_ranges_moves_to_another_placement_holding_none() -> None:
    """It missed a commit (`forget`) in the epoch a CPU member joined its GPU zone: the move
    carries what it holds, nothing, and the re-shard gives it its ranges anew."""
    zones, models, _ = start(Placement())
    train_steps(zones, models, list(WEIGHTS), range(2))
    stale = zones["b"]
    stale.forget()
    move_ranges(stale, POLLED)
    assert stale.holdings == [] and stale.placement is POLLED


def test_the_own_gradients_norm_is_read_from_the_device_once_a_step_not_once_a_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    zones, models, _ = start(POLLED)
    members = list(WEIGHTS)
    reads: list[str] = []
    as_float, as_list = torch.Tensor.__float__, torch.Tensor.tolist

    def counted(name: str, read: Any) -> Any:
        def wrapper(self: torch.Tensor, *args: Any) -> Any:
            reads.append(name)
            return read(self, *args)

        return wrapper

    monkeypatch.setattr(torch.Tensor, "__float__", counted("float", as_float))
    monkeypatch.setattr(torch.Tensor, "tolist", counted("tolist", as_list))
    slices = even(members)

    def backward(m: str) -> float:
        lo, hi = slices[m]
        x, y = X[lo:hi], Y[lo:hi]
        (torch.nn.functional.cross_entropy(models[m](x), y) * ((hi - lo) / B)).backward()
        zones[m].finish_backward()
        return zones[m].take_squares()

    out = run(members, backward)
    assert all(isinstance(v, float) and v > 0 for v in out.values()), out
    blocks = len(zones["a"].blocks)
    assert blocks > 1 and len(reads) == len(members), f"{len(reads)} reads for {len(members)} members' steps"


def test_a_zone_group_left_with_work_unfinished_or_failed_may_not_serve_another_epoch() -> None:
    """What decides whether a member keeps its NCCL group for the next epoch (`unsettled`)."""
    zones, models, world = start(POLLED)
    members = list(WEIGHTS)
    train_steps(zones, models, members, range(2))
    assert not any(z.unsettled() for z in zones.values()), "a committed step leaves nothing in flight"
    zones["a"]._post_gather(zones["a"].blocks[0])  # a gather posted ahead, then the step was left
    assert zones["a"].unsettled() and not zones["b"].unsettled()  # b never posted it: a's stream holds it
    zones["a"].abandon()
    world.kill(members.index("d"))
    out = run(["a", "b", "c"], lambda m: train(zones[m], models[m], 2, even(members), m))
    assert all(isinstance(v, CollectiveFailed) for v in out.values()), out
    assert all(zones[m].unsettled() for m in ("a", "b", "c")), "a collective of the group failed"
