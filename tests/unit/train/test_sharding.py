"""A sharded zone's sync decision, as a pure function of what the members report."""

from __future__ import annotations

import pytest
import torch

from unbroken.errors import JobHalted
from unbroken.state.shards import layout_for
from unbroken.train.sharding import STALE, Report, assemble, decide, decode, encode

NUMEL = 1000
OLD = layout_for(NUMEL, {"a": 4, "b": 4, "c": 4, "d": 4})


def held(*members: str, step: int = 10, epoch: int = 3) -> dict[str, Report]:
    return {m: Report(4, OLD, epoch, step) for m in members}


def test_a_new_zone_lays_out_its_ranges_by_memory_and_a_restart_reads_them_from_the_checkpoint() -> None:
    reports = {"a": Report(2), "b": Report(1), "c": Report(1)}
    d = decide(reports, 0, NUMEL, 1)
    assert d.fresh is not None and not d.restore
    assert [s.size for s in d.fresh.shards] == [500, 250, 250]
    assert decide(reports, 40, NUMEL, 1).restore


def test_the_same_members_at_the_same_step_move_nothing() -> None:
    d = decide(held("a", "b", "c", "d"), 10, NUMEL, 1)
    assert d.unchanged and d.keep == {"a", "b", "c", "d"}


def test_a_lost_member_is_repaired_from_its_buddies() -> None:
    d = decide(held("a", "b", "d"), 10, NUMEL, 1)
    assert d.plan is not None and d.plan.lost == {"c"} and not d.plan.missing
    assert d.keep == {"a", "b", "d"} and not d.unchanged


def test_a_member_behind_the_group_drops_its_copies_and_joins_again_under_its_own_name() -> None:
    reports = held("a", "b", "c") | {"d": Report(4, OLD, 3, 9)}  # it missed step 10's commit
    d = decide(reports, 10, NUMEL, 1)
    assert d.plan is not None
    assert d.plan.lost == {"d" + STALE} and d.plan.joining == ("d",)
    assert "d" not in d.keep
    assert all(t.source != "d" for t in d.plan.transfers), "nothing is read from stale copies"
    assert any(t.destination == "d" for t in d.plan.transfers)


def test_a_member_of_an_older_layout_counts_as_stale() -> None:
    other = layout_for(NUMEL, {"a": 1, "b": 1, "c": 1, "d": 1}, align=10)
    reports = held("a", "b", "c", epoch=5) | {"d": Report(4, other, 4, 10)}
    d = decide(reports, 10, NUMEL, 1)
    assert "d" not in d.keep


def test_both_holders_of_a_range_lost_stops_the_job_naming_the_range() -> None:
    first = OLD.shards[0]
    assert first.buddy is not None
    alive = [m for m in OLD.members if m not in (first.primary, first.buddy)]
    with pytest.raises(JobHalted, match=r"\[0, 250\).*lost both their holders.*checkpoint"):
        decide(held(*alive), 10, NUMEL, 1)


def test_ranges_older_than_the_group_stop_the_job() -> None:
    with pytest.raises(JobHalted, match=r"step 12 but the newest ranges .* step 10"):
        decide(held("a", "b"), 12, NUMEL, 1)


def test_a_report_survives_the_wire() -> None:
    for report in (Report(7), Report(4, OLD, 3, 10)):
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
    reports = held("a", "b", "d", step=13, epoch=1) | {"c": Report(4, OLD, 1, 12, summed=12)}
    d = decide(reports, 13, NUMEL, 1)
    assert d.late == {"c"} and "c" in d.keep and d.unchanged


def test_a_member_behind_without_the_sum_is_stale_and_one_with_a_sum_of_another_step_too() -> None:
    for summed in (-1, 11):
        reports = held("a", "b", "d", step=13, epoch=1) | {"c": Report(4, OLD, 1, 12, summed=summed)}
        d = decide(reports, 13, NUMEL, 1)
        assert not d.late and "c" not in d.keep
