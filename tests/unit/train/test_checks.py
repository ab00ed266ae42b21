"""Checking the work, the members' part (`unbroken.train.checks`): trainers' commitments and
validators' recomputations bit for bit, on the in-memory planes with the leader's real
comparison (`unbroken.control.checks`). An honest group is never found wrong, over many
checks and whatever changes a slice's bits (buffers, micro-batches, a loss scale); a trainer
scaling its gradient by 0.9, or reading the wrong samples, is found, and confirmed by
another member re-checking it. (Benching a named trainer is the coordinator's:
`tests/unit/control/test_checks.py`, `tests/integration/test_checks.py`.)

The in-memory nodes share torch's generator: the job has no random ops (as
`MemoryJob` requires for exactness)."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from jobs import mlp
from unbroken.control import messages as m
from unbroken.control.checks import Candidate, Checks, Finding, Outcome, Verdict, confirmer
from unbroken.events import Entry
from unbroken.job import Job
from unbroken.specs import Role
from unbroken.testing.faults import FaultPlan, parse_faults
from unbroken.testing.inmemory import MemoryControl, MemoryJob
from unbroken.testing.promises import check_promises, environment, reference_state
from unbroken.train.checks import CHANCE, choose
from unbroken.train.commitment import GradientDigest
from unbroken.train.hooks import Faults
from unbroken.train.runtime import NodeResult
from unbroken.train.scale import LossScale

pytestmark = pytest.mark.timeout(180)

ATOL = 1e-5


# ---------------------------------------------------------------- pure decisions


def test_a_validator_checks_a_trainer_with_samples_never_itself_or_another_role() -> None:
    T, V, S = Role.TRAINER, Role.VALIDATOR, Role.STANDBY
    roles, shares = [T, V, T, S, T], [10, 0, 20, 0, 0]
    rng = random.Random(1)
    picks = Counter(choose(roles, shares, 1, rng) for _ in range(2000))
    assert set(picks) == {0, 2}, picks
    assert abs(picks[0] - picks[2]) < 200, "each trainer as likely as the others"
    assert choose(roles, shares, 0, rng) == 2, "a trainer asked to check never picks itself"
    assert choose([V, T], [0, 0], 0, rng) is None, "nobody computed anything"
    assert choose([], [5, 5], 0, rng) == 1, "no roles: every member trains"


def test_a_commitment_is_the_same_whatever_buckets_the_gradient_went_out_in() -> None:
    numels = [6, 1, 12, 3]
    grad = torch.randn(sum(numels), generator=torch.Generator().manual_seed(3))
    whole = GradientDigest(numels)
    whole.add(0, grad)
    in_buckets = GradientDigest(numels)
    for lo, hi in [(19, 22), (7, 19), (0, 7)]:  # last parameters first, as backward goes
        in_buckets.add(lo, grad[lo:hi])
    positions = [4, 9, 2]
    assert whole.commitment(positions) == in_buckets.commitment(positions)
    assert whole.commitment([4, 9, 3]) != in_buckets.commitment(positions), "the positions count"
    bent = grad.clone()
    bent[20] = torch.nextafter(bent[20], torch.tensor(1e9))  # one ulp
    other = GradientDigest(numels)
    other.add(0, bent)
    assert other.commitment(positions) != whole.commitment(positions)


# ---------------------------------------------------------------- on the in-memory planes


class CheckingJob(MemoryJob):
    """A `MemoryJob` whose leader compares commitments and findings as the coordinator does
    (`unbroken.control.checks`) and sends the orders to confirm (`m.Verify`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks = Checks(self._pick)
        self.step = 0
        self.outcomes: list[Outcome] = []
        self._leader = threading.Lock()

    def receive(self, member: str, msg: BaseModel) -> None:
        super().receive(member, msg)
        now = time.monotonic()
        with self._leader:
            if isinstance(msg, m.Progress) and msg.commitments:
                self.step = max(self.step, msg.step)  # the group's step, as the coordinator tracks it
                out = self.checks.committed(member, msg.commitments, self.step)
            elif isinstance(msg, m.Checked):
                out = self.checks.checked(Finding(member, msg, now), None)
            else:
                return
            self.outcomes += out
        for o in out:
            if o.confirmer is not None:
                verify = m.Verify(epoch=1, trainer=o.trainer, step=o.step + 1, reason=o.reason)
                client = self.nodes[o.confirmer].client
                assert isinstance(client, MemoryControl)
                client.tell(verify)

    def _pick(self, trainer: str, accusers: Collection[str]) -> str | None:
        order = self.latest_order()
        assert order is not None
        members = zip(order.members, order.roles, order.shares, strict=True)
        return confirmer([Candidate(mid, role, share, "") for mid, role, share in members], trainer, accusers, "")

    def verdicts(self, trainer: str | None = None) -> Counter[Verdict]:
        with self._leader:
            return Counter(o.verdict for o in self.outcomes if trainer is None or o.trainer == trainer)

    def checked(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.logs()[name] if e["kind"] == Entry.CHECK]


def run(
    tmp_path: Path,
    j: Job,
    *,
    faults: Mapping[str, Faults] | None = None,
    microbatch: int = 0,
    names: Sequence[str] = ("a", "b", "c", "v"),
) -> CheckingJob:
    with CheckingJob(j, names, tmp_path, faults=faults) as mj:
        mj.order(names, roles={n: Role.VALIDATOR for n in names if n.startswith("v")}, microbatch=microbatch)
        results = mj.join(150)
    assert all(isinstance(r, NodeResult) and r.outcome == "finished" for r in results.values()), results
    report = check_promises(mj.logs(), j, finishers=len(names))
    assert report.ok, "\n".join(report.problems)
    return mj


def assert_reference(tmp_path: Path, j: Job) -> None:
    got = torch.load(tmp_path / "a.pt", weights_only=True)["model"]
    for k, v in reference_state(j).items():
        assert (got[k] - v).abs().max().item() <= ATOL, k


@pytest.mark.parametrize(
    ("shape", "microbatch", "scaled"),
    [("plain", 0, False), ("batchnorm", 4, False), ("plain", 3, True)],
    ids=["plain", "buffers-and-micro-batches", "loss-scale"],
)
def test_an_honest_group_is_never_found_wrong_over_many_checks(
    tmp_path: Path, shape: str, microbatch: int, scaled: bool
) -> None:
    with environment({"UB_TEST_BATCHNORM": "1" if shape == "batchnorm" else "0"}):
        j = mlp.make(90, delay_ms=0)
    if scaled:  # the scale grows every 5 steps: each check must use the step's own
        j = dataclasses.replace(j, loss_scale=LossScale(init=2.0**10, growth_interval=5))
    mj = run(tmp_path, j, microbatch=microbatch)
    verdicts = mj.verdicts()
    assert set(verdicts) == {Verdict.MATCH}, [o for o in mj.outcomes if o.verdict is not Verdict.MATCH][:5]
    checked = mj.checked("v")
    assert len(checked) >= 90 * CHANCE / 3, f"{len(checked)} checks in 90 steps"
    assert {e["trainer"] for e in checked} == {"a", "b", "c"}, "every trainer is checked"
    assert verdicts[Verdict.MATCH] == len(checked)
    if microbatch:
        assert {e["microbatch"] for e in checked} == {microbatch}
    assert not any(e["kind"] == Entry.CHECK for n in "abc" for e in mj.logs()[n]), "trainers check on order only"
    if shape == "plain" and not scaled:  # (BatchNorm's statistics are each micro-batch's own)
        assert_reference(tmp_path, j)


@pytest.mark.parametrize(
    ("fault", "validators"),
    [("shrink@grad:20", 1), ("shift@data:20", 1), ("shrink@grad:20", 2)],
    ids=["shrink", "shift", "shrink-two-validators"],
)
def test_a_trainer_computing_wrongly_is_found_and_confirmed_by_another_member(
    tmp_path: Path, fault: str, validators: int
) -> None:
    """One validator: a trainer confirms, recomputing on its step loop; two: the other
    validator, on its sidecar (whichever found it first)."""
    j = mlp.make(90, delay_ms=0)
    names = ["a", "b", "c", "v", "v2"][: 3 + validators]
    mj = run(tmp_path, j, faults={"b": FaultPlan(parse_faults(fault))}, names=names)
    fired = [e for e in mj.logs()["b"] if e["kind"] == Entry.FAULT]
    assert fired and fired[0]["step"] == 20, fired
    assert set(mj.verdicts("a")) | set(mj.verdicts("c")) <= {Verdict.MATCH}, "the honest are never found wrong"
    found = [o for o in mj.outcomes if o.trainer == "b" and o.verdict is not Verdict.MATCH]
    first = found[0] if found else None
    assert first is not None and first.verdict is Verdict.MISMATCH, found
    assert first.step >= 20, "its work before the fault was right"
    accuser = {o.reason.split("'")[0] for o in found[:1]}.pop()
    expected = ("a", "c") if validators == 1 else tuple({"v", "v2"} - {accuser})
    assert first.confirmer in expected, (first, accuser)
    confirmed = [o for o in found if o.verdict is Verdict.CONFIRMED]
    assert confirmed and confirmed[0].accusers == tuple(sorted((accuser, first.confirmer))), found
    # The confirmer recomputed b's slice as ordered (a trainer on its step loop, a validator on its sidecar).
    ordered = [e for e in mj.checked(first.confirmer) if e["ordered"]]
    assert ordered and ordered[0]["trainer"] == "b" and ordered[0]["digest"], ordered
    assert all(o.step < 20 for o in mj.outcomes if o.trainer == "b" and o.verdict is Verdict.MATCH)
