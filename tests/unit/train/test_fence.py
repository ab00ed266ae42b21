"""The commit fence: a step in flight while the control session was lost with a stale lease
does not commit, whatever a later session says (the chaos soak's split: a node cut off
mid-step was welcomed back into its old epoch by a coordinator still recovering, and
committed a step its group had committed without it in a newer epoch)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from unbroken.comm.group import EpochScope
from unbroken.comm.reduce import Reducer
from unbroken.control.messages import Capabilities
from unbroken.errors import EpochAborted, Where
from unbroken.sched.zones import Zones
from unbroken.train.hooks import NoFaults
from unbroken.train.session import hello
from unbroken.train.step import StepProtocol


def protocol(client: SimpleNamespace) -> StepProtocol:
    params = [torch.nn.Parameter(torch.zeros(3))]
    node = SimpleNamespace(
        numel=3, compressed_numel=3, scale=None, zone=None, name="n1", client=client, state=SimpleNamespace(step=168),
        faults=NoFaults(),
        replica=SimpleNamespace(params=params, device=torch.device("cpu")),
        scope=lambda **_kw: EpochScope(threading.Event(), lambda: None, 5.0),
        where=lambda: Where(1, 169, 0),
    )  # fmt: skip
    group = SimpleNamespace(shares=[4], rank=0, size=1, epoch=1)
    return StepProtocol(node, group, Reducer(0, Zones(()), None))  # type: ignore[arg-type]


def test_a_step_commits_while_the_session_held() -> None:
    client = SimpleNamespace(lapses=2, commit_allowed=lambda: True)
    protocol(client).fence()


def test_a_session_lost_with_a_stale_lease_during_the_step_ends_the_epoch_here() -> None:
    client = SimpleNamespace(lapses=0, commit_allowed=lambda: True)
    p = protocol(client)
    client.lapses = 1  # lost mid-step with the lease stale; a new session's welcome renewed it
    with pytest.raises(EpochAborted, match="epoch 1 may be over"):
        p.fence()


def test_the_fence_still_waits_for_a_lease_confirmed_on_the_same_session() -> None:
    confirmed = threading.Event()
    client = SimpleNamespace(lapses=0, commit_allowed=confirmed.is_set)
    p = protocol(client)
    threading.Timer(0.3, confirmed.set).start()
    p.fence()  # a heartbeat acknowledged on the same session: the step commits
    assert confirmed.is_set()


def test_a_resume_after_a_lapse_during_the_step_says_the_epoch_is_abandoned() -> None:
    # The CI failure: a node reconnected to the leader that took over, resumed its epoch as
    # intact, and only then refused its step at the fence and left the epoch. The leader had
    # adopted the epoch, so the others waited in that step for it until a join re-formed it.
    client = SimpleNamespace(lapses=0, commit_allowed=lambda: True, latest_order=lambda: None)
    p = protocol(client)
    g = SimpleNamespace(epoch=1, members=["n1#a", "n2#b"], shares=[4, 4], roles=["trainer"] * 2, pg=object())
    p.group = g  # type: ignore[assignment]
    node = SimpleNamespace(
        group=g, client=client, protocol=p, state=SimpleNamespace(step=168), name="n1", model_fingerprint=[],
        job_identity="j", job_spec="{}",
        job=SimpleNamespace(name="j", identity=lambda: "j", batch_size=8, num_steps=300, evaluate=None),
        config=SimpleNamespace(weight=1.0, role="auto", zone=""), records=SimpleNamespace(restored_epoch=None),
        capabilities=lambda: Capabilities(), epochs=SimpleNamespace(forwarded=False, offered=""),
    )  # fmt: skip
    resume = hello(node, "n1#a").resume  # type: ignore[arg-type]
    assert resume is not None and not resume.abandoned
    client.lapses = 1  # the session was lost with the lease stale during the step
    resume = hello(node, "n1#a").resume  # type: ignore[arg-type]
    assert resume is not None and resume.abandoned
    with pytest.raises(EpochAborted):
        p.fence()
