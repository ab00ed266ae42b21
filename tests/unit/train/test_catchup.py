"""What a member claims of its --checkpoint-dir when the group's holders are gone (the
newest checkpoint in the range asked that it read whole itself, and why each newer one in
that range was not used), and what the members do with the claims (in memory)."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tests.unit.control.test_membership import JOIN_SETTLE_S, hello, lone_holder, only_order

from unbroken.comm.group import EpochGroup, EpochScope
from unbroken.comm.transfer import sync_state
from unbroken.errors import BadRequest, EpochAborted
from unbroken.events import BACK_TO_CHECKPOINT, GOES_ON_FROM, Entry, Kind, goes_back
from unbroken.state.ckpt_files import checkpoint_path, load_checkpoint
from unbroken.state.snapshot import TrainState
from unbroken.testing.fake import FakeWorld
from unbroken.train.catchup import catch_up, newest_readable


def save(directory: Path, step: int, job: str = "j", **more: object) -> None:
    torch.save({"step": step, "cursor": 4 * step, "model": {"w": torch.ones(2)}, "job": job, **more},
               checkpoint_path(directory, step))  # fmt: skip


def test_the_newest_checkpoint_in_range_whose_description_reads_is_claimed_and_the_others_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (5, 10, 20):
        save(tmp_path, step)
    save(tmp_path, 30)  # above the group's step: another run's, passed over without a word
    save(tmp_path, 24, job="other")
    checkpoint_path(tmp_path, 25).write_bytes(b"not a checkpoint")
    torch.save({"step": 23, "cursor": 0}, checkpoint_path(tmp_path, 23))  # no training state
    torch.save({"step": 21, "cursor": 0, "model": {}, "job": "j"}, checkpoint_path(tmp_path, 22))  # another step's
    reads = loads(monkeypatch)
    step, path, bad = newest_readable(tmp_path, "j", above=8, upto=26)
    assert (step, path) == (20, checkpoint_path(tmp_path, 20))
    assert [b.split(" ")[0] for b in bad] == [str(checkpoint_path(tmp_path, s)) for s in (25, 24, 23, 22)], bad
    assert "cannot be used" in bad[0] and "another job's" in bad[1] and "no training state" in bad[2], bad
    assert "step 21, not of step 22" in bad[3], bad
    # The others wait for the claim: no tensor is read, whatever the model's size.
    assert reads and {where for _, where in reads} == {"meta"}, reads


def test_nothing_above_the_state_held_is_claimed(tmp_path: Path) -> None:
    save(tmp_path, 10)
    assert newest_readable(tmp_path, "j", above=10, upto=26)[0] == -1
    assert newest_readable(tmp_path, "j", above=8, upto=9)[0] == -1
    assert newest_readable(None, "j", above=0, upto=26) == (-1, None, [])
    assert newest_readable(tmp_path / "absent", "j", above=0, upto=26)[0] == -1


def test_a_directory_that_cannot_be_listed_is_named_and_claims_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(tmp_path, 10)

    def unlistable(directory: Path) -> list[tuple[int, Path]]:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("unbroken.train.catchup.checkpoint_steps", unlistable)
    step, path, bad = newest_readable(tmp_path, "j", above=0, upto=26)
    assert (step, path) == (-1, None) and bad == [f"{tmp_path} cannot be listed (OSError: Input/output error)"], bad


def test_a_new_order_ends_the_claim(tmp_path: Path) -> None:
    save(tmp_path, 10)
    ordered = EpochScope(threading.Event(), lambda: EpochAborted("epoch 6 ordered"), 10.0)
    with pytest.raises(EpochAborted, match="epoch 6 ordered"):
        newest_readable(tmp_path, "j", above=0, upto=26, scope=ordered)


def loads(monkeypatch: pytest.MonkeyPatch, failing: Path | None = None) -> list[tuple[Path, str]]:
    """Every checkpoint read from now on, with where its tensors went ("meta": none read);
    a whole read of ``failing`` fails as a file whose tensors do not read does."""
    reads: list[tuple[Path, str]] = []

    def load(path: Path, map_location: str | None = None) -> dict[str, Any]:
        reads.append((path, map_location or "whole"))
        if path == failing and map_location is None:
            raise RuntimeError("PytorchStreamReader failed reading file data/0: invalid header or archive is corrupted")
        return load_checkpoint(path, map_location)

    monkeypatch.setattr("unbroken.state.ckpt_files.load_checkpoint", load)
    monkeypatch.setattr("unbroken.train.catchup.load_checkpoint", load)
    return reads


class _Node:
    """What `catch_up` sees of a node (`train.views.CatchUpNode`), over an in-memory world."""

    def __init__(self, name: str, step: int, directory: Path | None) -> None:
        torch.manual_seed(step)  # each its own state
        model = torch.nn.Linear(2, 1)
        self.name, self.zone, self.diloco = name, None, None
        self.job = SimpleNamespace(identity=lambda: "j", num_steps=40)
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


def _together(world: FakeWorld, nodes: list[_Node], group_step: int, failing: bool = False) -> list[BaseException]:
    """`catch_up` on every rank at once, then the sync phase that follows it; what each rank
    raised (none, unless ``failing``)."""
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
    assert failing or not errors, errors
    return errors


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


def test_with_no_newer_checkpoint_every_member_says_where_the_group_goes_on_from(tmp_path: Path) -> None:
    save(tmp_path, 5)  # older than the best state: of no use
    first, second = _Node("n1", 8, tmp_path), _Node("n2", 3, None)
    _together(FakeWorld(2), [first, second], group_step=25)
    assert first.restores == second.restores == 0 and not first.logged
    for n in (first, second):
        (said,) = n.client.sent
        assert said.kind is Kind.ROLLBACK and said.step == 8 and "steps 9..25 (17 committed" in said.reason
        assert f"{GOES_ON_FROM} 8" in said.reason and goes_back(said.kind, said.reason), said
        assert n.state.lineage == 1, "a new history: the lost steps' states are not the group's"
    assert second.state.step == 8, "the sync phase gives the best state to the others"


def test_after_steps_lost_the_leader_goes_back_with_the_group_and_orders_no_second_catch_up(tmp_path: Path) -> None:
    # The lone holder a dies at step 32; b2 goes on from its state of step 8, reaches step
    # 20, and c joins: c's epoch must not start behind step 32 again (checkpoints of steps
    # 21..32 would be taken again, and said lost again).
    ms = lone_holder()
    ms.fail("a", 0.7, "control connection dropped")
    ms.admit(hello("b2", step=8), 0.72)
    t = 0.72 + JOIN_SETTLE_S
    order = only_order(ms.tick(t))
    assert order.members == ["b2"] and order.group_step == 32
    b2 = _Node("b2", 8, tmp_path)
    _together(FakeWorld(1), [b2], order.group_step)
    for said in b2.client.sent:  # as the coordinator takes a report
        if goes_back(said.kind, said.reason):
            ms.roster.went_back("b2", said.step)
    ms.heartbeat("b2", 20, t + 0.1)
    ms.admit(hello("c"), t + 0.2)
    ms.heartbeat("b2", 20, t + 0.2 + JOIN_SETTLE_S)
    order = only_order(ms.tick(t + 0.2 + JOIN_SETTLE_S))
    assert order.members == ["b2", "c"] and order.group_step == 0, order
    # a, frozen rather than dead, back holding step 26 of the lost steps: not the group's.
    stale = _Node("a", 26, None)
    _together(FakeWorld(2), [b2, stale], group_step=0)
    assert stale.state.step == 8 and stale.state.digest() == b2.state.digest()


def test_a_file_whose_tensors_do_not_read_passes_to_the_next_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = {s: _Node("writer", s, None) for s in (10, 20)}
    for s, n in at.items():
        torch.save(n.state.tree() | {"job": "j"}, checkpoint_path(tmp_path, s))
    reads = loads(monkeypatch, failing=checkpoint_path(tmp_path, 20))
    reader, other = _Node("n1", 8, tmp_path), _Node("n2", 0, None)
    _together(FakeWorld(2), [reader, other], group_step=25)
    assert reader.restores == 1 and reader.logged[0][1]["path"] == str(checkpoint_path(tmp_path, 10))
    for n in (reader, other):
        assert n.state.step == 10 and n.state.digest() == at[10].state.digest(), n.name
    whole = [p for p, where in reads if where == "whole"]
    assert whole == [checkpoint_path(tmp_path, 20), checkpoint_path(tmp_path, 10)], (
        "only the chosen files are read whole"
    )


def test_two_claimants_holding_different_states_of_a_step_restore_neither(tmp_path: Path) -> None:
    # A --checkpoint-dir per node: both hold step 20, of different histories.
    dirs = [tmp_path / "n1", tmp_path / "n2"]
    for d, seed in zip(dirs, (20, 21), strict=True):
        d.mkdir()
        n = _Node("writer", seed, None)
        n.state.step, n.state.cursor = 20, 80
        torch.save(n.state.tree() | {"job": "j"}, checkpoint_path(d, 20))
    first, second = _Node("n1", 8, dirs[0]), _Node("n2", 8, dirs[1])
    _together(FakeWorld(2), [first, second], group_step=25)
    # One word against the other's: neither is taken, and the loss is said (no older file).
    assert (first.restores, second.restores) == (0, 0)
    assert first.state.step == second.state.step == 8


@pytest.mark.parametrize(("step", "lineage"), [(3, 2**63 - 1), (2**40, 0), (-5, 0)])
def test_a_report_out_of_range_names_its_rank(tmp_path: Path, step: int, lineage: int) -> None:
    torch.save(_Node("writer", 20, None).state.tree() | {"job": "j"}, checkpoint_path(tmp_path, 20))
    honest, liar = _Node("n1", 8, tmp_path), _Node("n2", 0, None)
    liar.state.step, liar.state.lineage = step, lineage
    errors = _together(FakeWorld(2), [honest, liar], group_step=25, failing=True)
    assert len(errors) == 2 and all(isinstance(e, BadRequest) and e.rank == 1 for e in errors), errors
    assert "rank 1 said" in str(errors[0]) and honest.restores == 0


def test_a_new_order_ends_the_read_of_the_chosen_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save(_Node("writer", 20, None).state.tree() | {"job": "j"}, checkpoint_path(tmp_path, 20))
    release = threading.Event()

    def slow(path: Path, map_location: str | None = None) -> dict[str, Any]:
        if map_location is None:  # a large state on slow storage
            release.wait(5)
        return load_checkpoint(path, map_location)

    monkeypatch.setattr("unbroken.train.catchup.load_checkpoint", slow)
    node, ordered = _Node("n1", 8, tmp_path), threading.Event()
    aborted = lambda: EpochAborted("epoch 6 ordered") if ordered.is_set() else None  # noqa: E731
    node.scope = lambda during_step: EpochScope(threading.Event(), aborted, 30.0)  # type: ignore[method-assign]
    g = EpochGroup(epoch=5, rank=0, members=["n1"], shares=[1], pg=FakeWorld(1).group(0))
    threading.Timer(0.2, ordered.set).start()
    try:
        with pytest.raises(EpochAborted, match="epoch 6 ordered"):
            catch_up(node, g, 25)  # type: ignore[arg-type]
        assert not release.is_set() and node.restores == 0
    finally:
        release.set()


def test_a_member_claiming_a_step_it_never_reads_holds_nobody_in_catch_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It claims step 22 every round whatever it is told, and its read fails: every member's
    # cap goes below the step after a round without a reader, so the honest member passes
    # its claim over and the group goes on (a reviewer's reproduction looped 50 rounds).
    liar_dir = tmp_path / "liar"
    liar_dir.mkdir()
    save(liar_dir, 22)
    loads(monkeypatch, failing=checkpoint_path(liar_dir, 22))
    real, rounds = newest_readable, []

    def lying(directory: Path | None, identity: str, above: int, upto: int, *rest: Any) -> Any:
        if directory == liar_dir:
            rounds.append(upto)
            assert len(rounds) <= 5, "still asked to claim"
            return real(directory, identity, above, 25, *rest)  # ignores its cap
        return real(directory, identity, above, upto, *rest)

    monkeypatch.setattr("unbroken.train.catchup.newest_readable", lying)
    honest, liar = _Node("n1", 8, None), _Node("n2", 8, liar_dir)
    _together(FakeWorld(2), [honest, liar], group_step=25)
    assert rounds == [25, 21] and honest.restores == 0 and honest.state.step == 8
