"""A sharded zone's sync decision, as a pure function of what the members report."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from unbroken.comm.group import EpochScope
from unbroken.comm.placement import MemberDevice
from unbroken.errors import ConfigError, JobHalted
from unbroken.job import Job, Sharding
from unbroken.state.shards import Layout, layout_for
from unbroken.testing.fake import FakeWorld
from unbroken.train.shard_reports import Report, decide, decode, encode
from unbroken.train.sharding import ShardedZone, assemble

NUMEL = 1000
OLD = layout_for(NUMEL, {"a": 4, "b": 4, "c": 4, "d": 4})


def held(*members: str, step: int = 10, epoch: int = 3, layout: Layout = OLD) -> dict[str, Report]:
    return {
        m: Report(4, layout, epoch, step, held=_ranges(layout, m), digests=_digests(_ranges(layout, m)))
        for m in members
    }


def _ranges(layout: Layout, member: str) -> tuple[tuple[int, int], ...]:
    """What a member reports holding: each range it holds, primary or copy, apart."""
    return tuple(sorted((s.start, s.end) for s in layout.shards if member in (s.primary, s.buddy)))


def _digests(ranges: tuple[tuple[int, int], ...]) -> tuple[str, ...]:
    return tuple(f"d{a}-{b}" for a, b in ranges)  # the same bytes wherever a range is held


def test_a_new_zone_lays_out_its_ranges_by_memory_from_one_members_model() -> None:
    reports = {"a": Report(2), "b": Report(1), "c": Report(1)}
    d = decide(reports, 0, NUMEL, 1)
    assert d.fresh is not None and not d.restore and d.source == "a"
    assert [s.size for s in d.fresh.shards] == [500, 250, 250]
    assert decide(reports, 40, NUMEL, 1).restore


def test_the_same_members_at_the_same_step_move_nothing() -> None:
    d = decide(held("a", "b", "c", "d"), 10, NUMEL, 1)
    assert d.unchanged and d.keep == {"a", "b", "c", "d"}


def test_a_lost_member_is_repaired_from_its_buddies() -> None:
    d = decide(held("a", "b", "d"), 10, NUMEL, 1)
    assert d.plan is not None and d.plan.lost == {"c"} and not d.plan.missing
    assert d.keep == {"a", "b", "d"} and not d.unchanged


def test_a_member_behind_the_group_drops_its_copies_and_gets_its_ranges_anew() -> None:
    reports = held("a", "b", "c") | {
        "d": Report(4, OLD, 3, 9, held=_ranges(OLD, "d"), digests=_digests(_ranges(OLD, "d")))
    }  # it missed step 10's commit
    d = decide(reports, 10, NUMEL, 1)
    assert d.plan is not None and "d" not in d.keep and not d.late
    assert all(t.source != "d" for t in d.plan.transfers), "nothing is read from stale copies"
    assert {t.destination for t in d.plan.transfers} == {"d"}


def test_a_re_shard_cut_short_leaves_two_layouts_at_one_step_and_every_range_of_both_is_a_source() -> None:
    # a, b, c and a joiner e re-shard; e dies while a finished (it had nothing to receive)
    # and b, c still waited: a holds the new layout, b and c the old one, all at step 10.
    three = layout_for(NUMEL, {"a": 4, "b": 4, "c": 4})
    four = layout_for(NUMEL, {"a": 4, "b": 4, "c": 4, "e": 4})
    reports = held("a", layout=four, epoch=5) | held("b", "c", layout=three, epoch=4)
    d = decide(reports, 10, NUMEL, 1)
    assert d.plan is not None and not d.plan.missing and d.keep == {"a", "b", "c"}
    for t in d.plan.transfers:  # every transfer reads what its source holds now
        assert any(s <= t.start and t.end <= e for s, e in reports[t.source].held), t


def test_both_holders_of_a_range_lost_stops_the_job_naming_the_range() -> None:
    first = OLD.shards[0]
    assert first.buddy is not None
    alive = [m for m in OLD.members if m not in (first.primary, first.buddy)]
    with pytest.raises(JobHalted, match=r"\[0, 250\).*lost every holder.*checkpoint"):
        decide(held(*alive), 10, NUMEL, 1)


def test_ranges_older_than_the_group_stop_the_job() -> None:
    with pytest.raises(JobHalted, match=r"step 12 but the newest ranges .* step 10"):
        decide(held("a", "b"), 12, NUMEL, 1)


def test_a_report_survives_the_wire() -> None:
    for report in (Report(7), Report(4, OLD, 3, 10, 9, _ranges(OLD, "b"), _digests(_ranges(OLD, "b")), 2)):
        assert decode(encode(report)) == report


def test_the_finished_model_is_assembled_from_primaries_and_a_gap_is_refused() -> None:
    spans = [("w", [2, 3]), ("b", [2])]
    parts = [
        {"spans": spans, "numel": 8, "start": 0, "end": 5, "values": torch.arange(5.0)},
        {"spans": spans, "numel": 8, "start": 5, "end": 8, "values": torch.arange(5.0, 8.0)},
    ]
    got = assemble(parts)
    assert torch.equal(got["w"], torch.arange(6.0).view(2, 3)) and torch.equal(got["b"], torch.tensor([6.0, 7.0]))
    with pytest.raises(ValueError, match="cover 5 of 8"):
        assemble(parts[:1])


def test_a_member_whose_commit_failed_where_the_others_committed_applies_the_step_late() -> None:
    # The step's sums are complete on every member; c's vote failed (a frozen peer's expulsion
    # ended its epoch) while a, b and d committed: c holds the only other copy of some ranges.
    reports = held("a", "b", "d", step=13, epoch=1) | {
        "c": Report(4, OLD, 1, 12, summed=12, held=_ranges(OLD, "c"), digests=_digests(_ranges(OLD, "c")))
    }
    d = decide(reports, 13, NUMEL, 1)
    assert d.late == {"c"} and "c" in d.keep and d.unchanged


def test_a_member_behind_without_the_sum_is_stale_and_one_with_a_sum_of_another_step_too() -> None:
    for summed in (-1, 11):
        reports = held("a", "b", "d", step=13, epoch=1) | {
            "c": Report(4, OLD, 1, 12, summed=summed, held=_ranges(OLD, "c"), digests=_digests(_ranges(OLD, "c")))
        }
        d = decide(reports, 13, NUMEL, 1)
        assert not d.late and "c" not in d.keep


def _job(optimizer: Any = None, **kw: Any) -> Job:
    return Job(
        name="t",
        model=lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)),
        optimizer=optimizer or (lambda model: torch.optim.AdamW(model.parameters(), lr=0.01)),
        dataset=TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))),
        loss=F.cross_entropy,
        batch_size=4,
        num_steps=2,
        shard=Sharding(),
        **kw,
    )


def scope() -> EpochScope:
    return EpochScope(threading.Event(), lambda: None, 10.0)


def _zone(job: Job) -> tuple[ShardedZone, nn.Module]:
    model, opt = job.build()
    return ShardedZone(job, model, opt, 0), model


@pytest.mark.parametrize(
    "make",
    [
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
        lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01),
    ],
    ids=["sgd-momentum", "adamw", "rmsprop"],
)
def test_element_wise_optimizers_are_taken(make: Any) -> None:
    _zone(_job(make))


def test_an_optimizer_that_updates_by_shape_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="Adafactor updates a parameter by its shape"):
        _zone(_job(lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01)))


@pytest.mark.parametrize("hook", ["evaluate", "after_step", "before_update"])
def test_hooks_that_need_the_whole_model_are_refused_naming_the_way_out(hook: str) -> None:
    with pytest.raises(ConfigError, match=f"cannot take Job.{hook}"):
        _zone(_job(**{hook: lambda *_: {}}))


def test_a_step_abandoned_twice_keeps_its_complete_sums_for_a_late_apply() -> None:
    # The step undoes itself, then the epoch is abandoned: the second must not drop the sums
    # the first kept (a late apply then stepped on zeros).
    zone, model = _zone(_job())
    numel = sum(p.numel() for p in model.parameters())
    world = FakeWorld(1)
    zone.engine = zone._build(layout_for(numel, {"a": 1}), "a", {"a": 0}, world.group(0), scope())
    F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 0, 1])).backward()
    zone.finish_backward(3)
    zone.abandon(3)
    zone.abandon(3)
    assert zone.pending is not None and zone.pending[0] == 3
    grads = [piece.tensor.grad for h in zone.engine.holdings for piece in h.pieces]
    assert grads and all(g is not None and bool(g.abs().sum() > 0) for g in grads)


def test_a_members_report_says_it_is_forwarded_and_its_kept_group_and_a_step_left_unsettled_drops_it() -> None:
    zone, model = _zone(_job())
    numel = sum(p.numel() for p in model.parameters())
    zone.engine = zone._build(layout_for(numel, {"a": 1}), "a", {"a": 0}, FakeWorld(1).group(0), scope())
    kept = object()
    zone.devices.comm.token, zone.devices.comm.members, zone.devices.comm.pg = "c0ffee", ("a",), kept
    said = MemberDevice.decode(decode(encode(zone.report(["a"], forwarded=True))).device)
    assert said.forwarded and said.holds == "c0ffee"
    zone.abandon(3)  # nothing in flight: the group may serve the next epoch
    assert zone.devices.comm.pg is kept
    zone.engine.broken = True  # a collective of it failed
    zone.abandon(3)
    assert zone.devices.comm.pg is None and MemberDevice.decode(zone.report(["a"]).device).holds == ""


def test_parts_of_different_steps_are_not_assembled() -> None:
    spans = [("w", [2])]
    parts = [
        {"spans": spans, "numel": 2, "start": 0, "end": 1, "values": torch.zeros(1), "step": 5},
        {"spans": spans, "numel": 2, "start": 1, "end": 2, "values": torch.zeros(1), "step": 6},
    ]
    with pytest.raises(ValueError, match="different steps"):
        assemble(parts)


def test_a_range_whose_two_holders_differ_stops_the_job_naming_both() -> None:
    reports = held("a", "b", "c", "d")
    b = reports["b"]
    reports["b"] = Report(4, OLD, 3, 10, held=b.held, digests=("bad", *b.digests[1:]))
    with pytest.raises(JobHalted, match=r"differs between its holders a .* and b .*bad.* step 10"):
        decide(reports, 10, NUMEL, 1)


def test_a_model_with_running_statistics_is_refused_before_it_joins() -> None:
    job = dataclasses.replace(_job(), model=lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)))
    with pytest.raises(ConfigError, match="'1' keeps running statistics"):
        _zone(job)


def test_members_wait_for_a_holder_of_lost_ranges_as_long_as_the_one_that_waited_longest_says() -> None:
    from unbroken.errors import RangesAbsent
    from unbroken.train.shard_fallback import ABSENT_WAIT_S, remaining_wait

    assert remaining_wait([0.0, 0.0], ABSENT_WAIT_S) == ABSENT_WAIT_S
    assert remaining_wait([0.0, 12.0, 3.0], 30.0) == 18.0  # a joiner does not start the wait over
    assert remaining_wait([45.0], 30.0) == 0.0
    assert issubclass(RangesAbsent, JobHalted)


def test_ranges_from_before_a_fall_back_to_a_checkpoint_are_not_current() -> None:
    """x, expelled before a fall-back of a, b to a checkpoint, comes back holding ranges of the
    old layout at the step the group has reached again: they are of the abandoned history."""
    before = layout_for(NUMEL, {"a": 1, "b": 1, "x": 1, "y": 1})
    after = layout_for(NUMEL, {"a": 1, "b": 1})

    def report(layout: Layout, m: str, epoch: int, lineage: int) -> Report:
        spans = _ranges(layout, m)
        return Report(1, layout, epoch, 130, -1, spans, tuple(f"{lineage}{s}" for s in spans), lineage)

    reports = {"a": report(after, "a", 20, 1), "b": report(after, "b", 20, 1), "x": report(before, "x", 9, 0)}
    d = decide(reports, 130, NUMEL, 1, lineage=1)
    assert d.keep == {"a", "b"} and d.plan is not None
    assert not any(t.source == "x" for t in d.plan.transfers), "x's ranges are fetched, never sent"
    assert set(d.plan.new.members) == {"a", "b", "x"}
    old = decide(reports, 130, NUMEL, 1)  # the same reports read as one history: x's ranges count
    assert "x" in old.keep


def test_members_left_holding_no_ranges_wait_for_a_holder_rather_than_read_a_checkpoint() -> None:
    """After a fall-back to a checkpoint only a holds ranges (b could not read it); a is then
    lost while its machine is busy. b alone holds none: a loss that waits for a to rejoin,
    not a restart of the job (b has no checkpoint to read, and a comes back current)."""
    from unbroken.errors import RangesAbsent

    after = layout_for(NUMEL, {"a": 1, "b": 0})
    spare = {"b": Report(1, after, 20, 95, held=(), digests=())}
    with pytest.raises(RangesAbsent, match=r"lost every holder at step 95 \(a\)"):
        decide(spare, 95, NUMEL, 1)
    assert decide({"b": Report(1)}, 95, NUMEL, 1).restore, "a restarted job's members read their checkpoint"


def test_a_gpu_member_offers_no_more_than_its_gpu_holds_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from unbroken.train.sharding import MIB, memory_weight

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=4 * 1024 * MIB))
    host = memory_weight(0)
    gpu = memory_weight(0, torch.device("cuda", 0))
    assert gpu == min(host, 4 * 1024) == 4 * 1024, "the GPU is smaller than this machine"
    assert memory_weight(0, torch.device("cpu")) == host
    assert memory_weight(512 * 1024 * MIB, torch.device("cuda", 0)) == 512 * 1024, "--memory-limit decides"
