"""What a sharded job's in-process fall-back to a checkpoint reads and decides (no processes)."""

from __future__ import annotations

from pathlib import Path

from unbroken.state.fallback import Source
from unbroken.state.shards import Layout, layout_for
from unbroken.train.shard_fallback import everywhere, readable_steps, recovery_of, unreadable
from unbroken.train.shard_reports import Report


def _touch(directory: Path, *names: str) -> None:
    for name in names:
        (directory / name).write_bytes(b"")


def test_a_step_is_readable_where_its_replicated_state_and_shard_files_covering_the_state_are_there(
    tmp_path: Path,
) -> None:
    _touch(tmp_path, "ckpt-000000010.pt", "shard-000000010-000000000000-000000000600.pt")
    _touch(tmp_path, "shard-000000010-000000000600-000000001000.pt")
    # Step 15: a range missing; step 20: the ranges whole, its replicated state not written yet.
    _touch(tmp_path, "ckpt-000000015.pt", "shard-000000015-000000000000-000000000600.pt")
    _touch(tmp_path, "shard-000000020-000000000000-000000001000.pt")
    assert readable_steps(tmp_path, 1000) == [10]
    assert readable_steps(tmp_path / "absent", 1000) == [] and readable_steps(None, 1000) == []


def _report(layout: Layout, step: int, held: tuple[tuple[int, int], ...]) -> Report:
    return Report(1, layout, 3, step, -1, held, tuple("d" for _ in held))


def test_the_zone_that_lost_ranges_everywhere_goes_back_to_the_newest_common_checkpoint() -> None:
    three = layout_for(900, {"a": 1, "b": 1, "c": 1})  # a [0, 300) buddy b; b buddy c; c buddy a
    reports = {"a": _report(three, 40, three.held("a"))}  # b and c were killed together
    got = recovery_of(reports, {"a": ""}, 40, {30, 35, 45})
    assert got.source is Source.CHECKPOINT and got.checkpoint == 35 and got.lost == ((300, 600),)
    assert got.buddy == ((600, 900),)  # c's range: its buddy a lives
    halted = recovery_of(reports, {"a": ""}, 40, set())
    assert halted.source is Source.HALT and "[300, 600)" in halted.reason


def test_a_group_ahead_of_every_members_ranges_has_lost_all_of_the_state() -> None:
    three = layout_for(900, {"a": 1, "b": 1, "c": 1})
    reports = {m: _report(three, 28, three.held(m)) for m in "abc"}
    got = recovery_of(reports, dict.fromkeys("abc", ""), 42, {20})
    assert got.source is Source.CHECKPOINT and got.checkpoint == 20 and got.lost == ((0, 900),)


def test_the_members_that_cannot_read_the_newest_checkpoint_are_named() -> None:
    readable = {"a": {20, 40}, "b": {20, 40, 60}, "c": set()}  # c: a newcomer without --checkpoint-dir
    said = unreadable(readable, 50)
    assert "step 40 is readable on 2 of 3 members; not on c:" in said
    assert unreadable({"a": set(), "b": {70}}, 50) == "", "nothing readable at or before the step: nothing to name"


def test_the_steps_to_go_back_to_are_those_a_member_of_every_zone_can_read() -> None:
    readable = {"a1": {20, 40}, "a2": set(), "b1": {20}, "b2": {20, 60}}  # a2: without --checkpoint-dir
    assert everywhere(readable, {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}) == {20}
    assert everywhere(readable, dict.fromkeys(readable, "")) == {20, 40, 60}
    assert everywhere({"a1": {20}, "b1": set()}, {"a1": "A", "b1": "B"}) == set(), "zone B can read none"
