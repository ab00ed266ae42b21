"""The sharded zone's data plane on in-memory groups (ranks as threads): training equals
one process with the whole batch, each range's buddy copy stays bit-identical to its
primary, and a member's death is repaired from the copies on the survivors' next group."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from unbroken.comm.group import EpochScope
from unbroken.comm.sharded import OptimizerFactory, ShardedModel
from unbroken.errors import CollectiveFailed, TransferError
from unbroken.state.shards import Layout, Plan, layout_for, plan
from unbroken.testing.fake import FakeWorld

pytestmark = pytest.mark.timeout(60)

B, STEPS = 24, 6
WEIGHTS = {"a": 4, "b": 2, "c": 2, "d": 1}
"""Memory offered: a's range is four times d's."""

_g = torch.Generator().manual_seed(5)
X = torch.randn(STEPS * B, 8, generator=_g)
Y = torch.randint(0, 5, (STEPS * B,), generator=_g)


class Tiny(nn.Module):
    """Three blocks and a parameter of the model's own (gathered with the model)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.LayerNorm(16))
        self.head = nn.Linear(16, 5)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.tanh(self.embed(x))) * self.scale)


def groups_of(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as real jobs do (two param groups)."""
    decay = [n for n, p in model.named_parameters() if p.dim() > 1]
    rest = [n for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=0.01)


def momentum(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Moments without a step count: whether it stepped shows in its state alone."""
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def reference(steps: int, make: OptimizerFactory = adamw) -> dict[str, torch.Tensor]:
    model = Tiny()
    named = dict(model.named_parameters())
    opt = make([dict(g, params=[named[n] for n in g["params"]]) for g in groups_of(model)])
    for s in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(X[s * B : (s + 1) * B]), Y[s * B : (s + 1) * B]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def scope() -> EpochScope:
    return EpochScope(threading.Event(), lambda: None, 10.0)


def train(zone: ShardedModel, model: nn.Module, step: int, slices: dict[str, tuple[int, int]], me: str) -> None:
    lo, hi = slices[me]
    x, y = X[step * B + lo : step * B + hi], Y[step * B + lo : step * B + hi]
    if hi > lo:
        (F.cross_entropy(model(x), y) * ((hi - lo) / B)).backward()
    zone.finish_backward()
    zone.step()


def even(members: list[str]) -> dict[str, tuple[int, int]]:
    cuts = [B * i // len(members) for i in range(len(members) + 1)]
    return {m: (cuts[i], cuts[i + 1]) for i, m in enumerate(members)}


def run(members: list[str], fn: Callable[[str], Any]) -> dict[str, Any]:
    """``fn(member)`` on a thread per member; what each returned or raised."""
    out: dict[str, Any] = {}

    def target(m: str) -> None:
        try:
            out[m] = fn(m)
        except BaseException as exc:  # reported to the test
            out[m] = exc

    threads = [threading.Thread(target=target, args=(m,), name=m) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def member(
    model: Tiny, layout: Layout, me: str, ranks: dict[str, int], world: FakeWorld, make: OptimizerFactory = adamw
) -> ShardedModel:
    """``me``'s share of the zone, blocks and param groups as every test has them."""
    return ShardedModel(
        model, layout, me, ranks, world.group(ranks[me]), scope(), make,
        blocks=[model.embed, model.body, model.head], groups=groups_of(model),
    )  # fmt: skip


def start(
    members: list[str], make: OptimizerFactory = adamw
) -> tuple[dict[str, ShardedModel], dict[str, nn.Module], FakeWorld]:
    numel = sum(p.numel() for p in Tiny().parameters())
    layout = layout_for(numel, {m: WEIGHTS[m] for m in members})
    world = FakeWorld(len(members))
    ranks = {m: i for i, m in enumerate(members)}
    models = {m: Tiny() for m in members}
    zones = {m: member(models[m], layout, m, ranks, world, make) for m in members}
    return zones, models, world


def buddies_agree(zones: dict[str, ShardedModel]) -> None:
    layout = next(iter(zones.values())).layout
    for s in layout.shards:
        assert s.buddy is not None
        assert zones[s.primary].digest(s.start, s.end) == zones[s.buddy].digest(s.start, s.end), s


def train_steps(zones: dict[str, ShardedModel], models: dict[str, nn.Module], members: list[str], steps: range) -> None:
    """``steps`` on ``members``, the batch split evenly; every buddy copy checked after each."""
    slices = even(members)
    live = {m: zones[m] for m in members}
    for step in steps:
        out = run(members, lambda m, s=step: train(zones[m], models[m], s, slices, m))
        assert not any(isinstance(v, BaseException) for v in out.values()), out
        buddies_agree(live)


def reshard_all(zones: dict[str, ShardedModel], p: Plan, members: list[str], world: FakeWorld) -> dict[str, Any]:
    """``p`` carried out by ``members`` (ranks in that order) on ``world``: what each returned or raised."""
    ranks = {m: i for i, m in enumerate(members)}
    return run(members, lambda m: zones[m].reshard(p, m, ranks, world.group(ranks[m]), scope()))


def assert_matches(zones: dict[str, ShardedModel], want: dict[str, torch.Tensor]) -> None:
    got = run(list(zones), lambda m: zones[m].full_state())
    for m, state in got.items():
        assert not isinstance(state, BaseException), state
        for name, value in want.items():
            assert torch.allclose(state[name], value, atol=2e-6), (m, name, (state[name] - value).abs().max())


def test_a_sharded_zone_with_uneven_ranges_trains_as_one_process_and_buddies_stay_bit_identical() -> None:
    members = list(WEIGHTS)
    zones, models, _ = start(members)
    sizes = {m: sum(h.end - h.start for h in zones[m].holdings) for m in members}
    numel = zones["a"].layout.numel
    assert sizes["a"] > 2 * sizes["d"] and all(s < numel for s in sizes.values()), sizes
    train_steps(zones, models, members, range(STEPS))
    assert all(p.untyped_storage().nbytes() == 0 for p in models["a"].parameters()), "nothing full stays held"
    assert_matches(zones, reference(STEPS))


@pytest.mark.parametrize("make", [adamw, momentum], ids=["adamw", "sgd-momentum"])
def test_a_member_killed_mid_step_is_repaired_from_the_buddies_and_training_matches_one_process(
    make: OptimizerFactory,
) -> None:
    members = list(WEIGHTS)
    zones, models, world = start(members, make)
    train_steps(zones, models, members, range(2))

    def doomed(m: str) -> None:
        if m == "c":
            world.kill(2)  # dies before its part of step 2's first gather
            raise SystemExit
        train(zones[m], models[m], 2, even(members), m)

    out = run(members, doomed)
    assert all(isinstance(out[m], CollectiveFailed) for m in ("a", "b", "d")), out
    survivors = ["a", "b", "d"]
    p = plan(zones["a"].layout, lost={"c"})
    assert not p.missing
    done = reshard_all(zones, p, survivors, FakeWorld(3))
    assert not any(isinstance(v, BaseException) for v in done.values()), done
    live = {m: zones[m] for m in survivors}
    buddies_agree(live)
    train_steps(zones, models, survivors, range(2, STEPS))
    assert_matches(live, reference(STEPS, make))


def test_both_holders_of_a_range_lost_is_named_not_guessed() -> None:
    members = list(WEIGHTS)
    zones, _, _ = start(members)
    layout = zones["a"].layout
    shard = next(s for s in layout.shards if s.primary == "b")
    assert shard.buddy is not None
    p = plan(layout, lost={"b", shard.buddy})
    rest = [m for m in members if m not in {"b", shard.buddy}]
    out = reshard_all(zones, p, rest, FakeWorld(len(rest)))
    for m in rest:
        assert isinstance(out[m], TransferError) and "lost both holders" in str(out[m]), out[m]


def test_a_model_whose_forward_changes_float_buffers_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    numel = sum(p.numel() for p in model.parameters())
    with pytest.raises(Exception, match="buffers"):
        ShardedModel(
            copy.deepcopy(model), layout_for(numel, {"a": 1}), "a", {"a": 0}, FakeWorld(1).group(0), scope(), adamw
        )


def test_a_joiner_receives_only_its_new_ranges_and_training_goes_on_as_one_process() -> None:
    first = ["a", "b", "c"]
    zones, models, _ = start(first)
    train_steps(zones, models, first, range(2))
    p = plan(zones["a"].layout, joining={"d": WEIGHTS["d"]})
    sent_to_d = sum(t.size for t in p.transfers if t.destination == "d")
    assert sent_to_d == sum(e - s for s, e in p.new.held("d")), "the joiner is sent its new ranges, nothing more"
    members = [*first, "d"]
    world = FakeWorld(4)
    ranks = {m: i for i, m in enumerate(members)}
    models["d"] = Tiny()
    # It holds nothing of the old layout: everything it will hold comes in the re-shard.
    zones["d"] = member(models["d"], zones["a"].layout, "d", ranks, world)
    assert zones["d"].holdings == []
    done = run(members, lambda m: zones[m].reshard(p, m, ranks, world.group(ranks[m]), scope()))
    assert not any(isinstance(v, BaseException) for v in done.values()), done
    buddies_agree(zones)
    train_steps(zones, models, members, range(2, STEPS))
    assert_matches(zones, reference(STEPS))


def test_a_graceful_leaver_sends_its_ranges_before_it_goes() -> None:
    members = list(WEIGHTS)
    zones, models, _ = start(members)
    train_steps(zones, models, members, range(2))
    p = plan(zones["a"].layout, leaving={"b"})
    assert any(t.source == "b" for t in p.transfers), "the leaver's ranges come from it while it is still here"
    transfer = FakeWorld(4)  # the leaver is in the group of the re-shard, not in the next one
    ranks = {m: i for i, m in enumerate(members)}
    done = run(members, lambda m: zones[m].reshard(p, m, ranks, transfer.group(ranks[m]), scope()))
    assert not any(isinstance(v, BaseException) for v in done.values()), done
    assert zones["b"].holdings == []
    stay = ["a", "c", "d"]
    world = FakeWorld(3)
    ranks = {m: i for i, m in enumerate(stay)}
    for m in stay:
        zones[m].regroup(ranks, world.group(ranks[m]), scope())
    live = {m: zones[m] for m in stay}
    buddies_agree(live)
    train_steps(zones, models, stay, range(2, STEPS))
    assert_matches(live, reference(STEPS))


def test_a_frozen_member_is_left_at_the_abort_and_the_others_go_on_without_it() -> None:
    """A member that stops answering (SIGSTOP) holds no collective forever: the waits end at
    the epoch's abort (what the leader's urgent order does once its lease lapsed), and the
    others re-shard without it from the copies."""
    from unbroken.errors import EpochAborted

    members = list(WEIGHTS)
    zones, models, world = start(members)
    train_steps(zones, models, members, range(2))
    lease = threading.Event()

    def lapsed() -> EpochAborted | None:
        return EpochAborted("c's lease lapsed") if lease.is_set() else None

    for m in ("a", "b", "d"):
        zones[m].scope = EpochScope(threading.Event(), lapsed, 10.0)
    thawed = threading.Event()

    def step_with_c_frozen(m: str) -> None:
        if m == "c":
            thawed.wait(30)  # frozen: never joins step 2's collectives
            return
        train(zones[m], models[m], 2, even(members), m)

    threading.Timer(0.5, lease.set).start()
    out = run(["a", "b", "d"], step_with_c_frozen)
    assert all(isinstance(out[m], EpochAborted) for m in ("a", "b", "d")), out
    thawed.set()
    world.kill(2)
    survivors = ["a", "b", "d"]
    p = plan(zones["a"].layout, lost={"c"})
    done = reshard_all(zones, p, survivors, FakeWorld(3))
    assert not any(isinstance(v, BaseException) for v in done.values()), done
    live = {m: zones[m] for m in survivors}
    train_steps(zones, models, survivors, range(2, STEPS))
    buddies_agree(live)
    assert_matches(live, reference(STEPS))


def test_each_member_writes_its_range_and_a_restore_reshards_to_another_number_of_members(tmp_path: Path) -> None:
    from unbroken.comm.shard_files import restore_shards, save_shard

    members = list(WEIGHTS)
    zones, models, _ = start(members)
    train_steps(zones, models, members, range(3))
    written = [path for m in members for path in save_shard(zones[m], tmp_path, 3)]
    assert len(set(written)) == 4, written  # its primary range alone, without copies
    stay = ["x", "y", "z"]  # three new processes, other memory: another layout
    numel = zones["a"].layout.numel
    layout = layout_for(numel, {"x": 1, "y": 3, "z": 2})
    world = FakeWorld(3)
    ranks = {m: i for i, m in enumerate(stay)}
    fresh = {m: Tiny() for m in stay}
    again = {m: member(fresh[m], layout, m, ranks, world) for m in stay}
    assert {restore_shards(again[m], tmp_path, layout, m) for m in stay} == {3}
    buddies_agree(again)
    slices = even(stay)
    for step in range(3, STEPS):
        out = run(stay, lambda m, s=step: train(again[m], fresh[m], s, slices, m))
        assert not any(isinstance(v, BaseException) for v in out.values()), out
    assert_matches(again, reference(STEPS))
    written[1].unlink()
    with pytest.raises(TransferError, match="no step's shard files"):
        restore_shards(again["x"], tmp_path, layout, "x")
