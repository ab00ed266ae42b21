"""What a member claims of its --checkpoint-dir when the group's holders are gone (the
newest checkpoint in the range asked that it read whole itself, and why each newer one in
that range was not used), and what the members do with the claims (in memory)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from unbroken.comm.group import EpochGroup, EpochScope
from unbroken.comm.transfer import sync_state
from unbroken.events import BACK_TO_CHECKPOINT, Entry, Kind
from unbroken.state.ckpt_files import checkpoint_path
from unbroken.state.snapshot import TrainState
from unbroken.testing.fake import FakeWorld
from unbroken.train.catchup import catch_up, newest_readable


def save(directory: Path, step: int, job: str = "j", **more: object) -> None:
    torch.save({"step": step, "cursor": 4 * step, "model": {"w": torch.ones(2)}, "job": job, **more},
               checkpoint_path(directory, step))  # fmt: skip


def test_the_newest_readable_checkpoint_in_range_is_claimed_and_the_others_named(tmp_path: Path) -> None:
    for step in (5, 10, 20):
        save(tmp_path, step)
    save(tmp_path, 30)  # above the group's step: another run's, passed over without a word
    save(tmp_path, 24, job="other")
    checkpoint_path(tmp_path, 25).write_bytes(b"not a checkpoint")
    torch.save({"step": 23, "cursor": 0}, checkpoint_path(tmp_path, 23))  # no training state
    torch.save({"step": 21, "cursor": 0, "model": {}, "job": "j"}, checkpoint_path(tmp_path, 22))  # another step's
    step, path, snap, bad = newest_readable(tmp_path, "j", above=8, upto=26)
    assert (step, path) == (20, checkpoint_path(tmp_path, 20))
    assert snap is not None and snap["step"] == 20 and snap["cursor"] == 80
    assert [b.split(" ")[0] for b in bad] == [str(checkpoint_path(tmp_path, s)) for s in (25, 24, 23, 22)], bad
    assert "does not load" in bad[0] and "another job's" in bad[1] and "no training state of step 23" in bad[2]


def test_nothing_above_the_state_held_is_claimed(tmp_path: Path) -> None:
    save(tmp_path, 10)
    assert newest_readable(tmp_path, "j", above=10, upto=26)[0] == -1
    assert newest_readable(tmp_path, "j", above=8, upto=9)[0] == -1
    assert newest_readable(None, "j", above=0, upto=26) == (-1, None, None, [])
    assert newest_readable(tmp_path / "absent", "j", above=0, upto=26)[0] == -1


class _Node:
    """What `catch_up` sees of a node (`train.views.CatchUpNode`), over an in-memory world."""

    def __init__(self, name: str, step: int, directory: Path | None) -> None:
        torch.manual_seed(step)  # each its own state
        model = torch.nn.Linear(2, 1)
        self.name, self.zone, self.diloco = name, None, None
        self.job = SimpleNamespace(identity=lambda: "j")
        self.state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        self.state.step, self.state.cursor = step, 4 * step
        self.config = SimpleNamespace(checkpoint_dir=directory)
        self.client = SimpleNamespace(sent=[], send=lambda msg: self.client.sent.append(msg))
        self.logged: list[tuple[Entry, dict[str, Any]]] = []
        self.records = SimpleNamespace(settle=lambda: None, log=lambda kind, fields: self.logged.append((kind, fields)))
        self.audits = SimpleNamespace(committed_epoch=2, checkpoint_epoch=-1, behind=True, audited={"step": 0})
        self.restores = 0

    def scope(self, *, during_step: bool) -> EpochScope:
        return EpochScope(threading.Event(), lambda: None, 10.0)

    def restored(self) -> None:
        self.restores += 1


def _together(world: FakeWorld, nodes: list[_Node], group_step: int) -> None:
    """`catch_up` on every rank at once, then the sync phase that follows it."""
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            g = EpochGroup(epoch=5, rank=r, members=[n.name for n in nodes], shares=[1] * len(nodes), pg=world.group(r))
            catch_up(nodes[r], g, group_step)  # type: ignore[arg-type]
            sync_state(g.pg, r, len(nodes), nodes[r].state, nodes[r].scope(during_step=False),
                       lineage=nodes[r].state.lineage)  # fmt: skip
        except BaseException as exc:  # reported by the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors


def test_the_reader_restores_the_newer_checkpoint_and_the_others_take_it_from_it(tmp_path: Path) -> None:
    reader = _Node("n1", 8, tmp_path)
    reader_at_20 = _Node("writer", 20, None)  # the state the lone member checkpointed, then died
    torch.save(reader_at_20.state.tree() | {"job": "j"}, checkpoint_path(tmp_path, 20))
    other = _Node("n3", 0, None)  # a joiner with no --checkpoint-dir
    _together(FakeWorld(2), [reader, other], group_step=25)
    assert reader.restores == 1 and reader.state.lineage == 1 and reader.audits.behind is False
    assert reader.audits.committed_epoch == -1 and reader.audits.audited is None
    ((kind, fields),) = reader.logged
    assert kind is Entry.RESTORE and fields["path"] == str(checkpoint_path(tmp_path, 20))
    for n in (reader, other):
        assert n.state.step == 20 and n.state.digest() == reader_at_20.state.digest(), n.name
        (said,) = n.client.sent
        assert said.kind is Kind.FALLBACK and said.step == 20 and f"{BACK_TO_CHECKPOINT} 20" in said.reason


def test_with_no_newer_checkpoint_the_first_member_says_what_was_lost(tmp_path: Path) -> None:
    save(tmp_path, 5)  # older than the best state: of no use
    first, second = _Node("n1", 8, tmp_path), _Node("n2", 3, None)
    _together(FakeWorld(2), [first, second], group_step=25)
    assert first.restores == second.restores == 0 and not first.logged
    (said,) = first.client.sent
    assert said.kind is Kind.ROLLBACK and "steps 9..25 (17 committed" in said.reason and not second.client.sent
    assert second.state.step == 8, "the sync phase gives the best state to the others"
