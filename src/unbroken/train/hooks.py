"""What the CLI or a test may inject into a node: faults at chosen points of its life, and
the planes it talks to (`Control`, `GroupMaker`: the real ones by default, in-memory ones in
unit tests of the step loop, `unbroken.testing.inmemory`).

A node asks its `Faults` at each point where a fault can strike (before a step's compute,
while a collective is in flight, after a commit, when it builds an epoch's data plane) and
does what the answer says. The library knows only this protocol and `NoFaults`; the fault
specs and their plan live with the testing aids (`unbroken.testing.faults`), which the CLI
(`unbroken node --fault`) and tests build and hand to `Node` or `unbroken.swarm.launch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from unbroken.events import Entry

if TYPE_CHECKING:
    from pydantic import BaseModel

    from unbroken.comm.group import EpochScope, ProcessGroup
    from unbroken.control import messages as m
    from unbroken.control.client import Listener

Record = Callable[[Entry, Mapping[str, object]], None]
"""Writes one entry to the node's commit log (a fault that fires says so there first)."""

LIES = {"hide-nan": float("nan"), "hide-spike": -1e6, "forge-slot": float("inf")}
"""What a lying member does to its contribution (`Faults.lie`): ``hide-nan`` and
``hide-spike`` multiply the gradient it sends by the value after its norm was taken, so its
slot carries the norm of its true gradient; ``forge-slot`` writes the value into the next
rank's norm slot (to get an honest member blamed)."""


class Faults(Protocol):
    """A node's injected faults. Every method is asked at its point of the node's life and
    returns what to do there; the faults that fire record themselves first."""

    def attach(self, record: Record) -> None:
        """Where fired faults are recorded: the node's commit log, once it has one."""

    def maybe_fire(self, phase: str, step: int) -> None:
        """Signal this process (or hang its step loop) if a fault is due at ``phase`` of ``step``."""

    def corruption(self, step: int, phase: str = "grad") -> float | None:
        """The factor that poisons this step's gradient (``outer``: the pseudo-gradient)."""

    def lie(self, step: int, phase: str = "grad") -> str | None:
        """The lie (a key of `LIES`) this member tells at ``step`` (``outer``: in the
        pseudo-gradient it sends as a DiLoCo zone leader after inner step ``step``)."""

    def muted(self, epoch: int) -> bool:
        """Whether this node's rendezvous entries for ``epoch`` must not go out."""

    def unreachable(self, epoch: int) -> bool:
        """Whether this node's rendezvous entries for ``epoch`` must give an unreachable address."""

    def greedy(self, epoch: int) -> int:
        """How many chunks this node tells each donor it wants when it receives state in
        ``epoch`` (0: the chunks it wants)."""

    def dropping_port(self, host: str) -> int:
        """A port on ``host`` where connections hang."""

    def false_alarm(self, step: int, epoch: int) -> bool:
        """Whether to report, after committing ``step``, a collective failure that did not happen."""

    def bitflip(self, step: int) -> bool:
        """Whether a bit of this node's state flips (`flip_bit`) right after committing ``step``."""

    def lapse(self, step: int) -> bool:
        """Whether this node's commit fence of ``step`` fails after the vote went through."""

    def wrong_samples(self, step: int) -> bool:
        """Whether this node's data loader reads other samples than its slice's at ``step``
        (the next step's: a loader off by a batch), while it reports its own slice's."""


class NoFaults:
    """A node without injected faults: the default."""

    def attach(self, record: Record) -> None:
        pass

    def maybe_fire(self, phase: str, step: int) -> None:
        pass

    def corruption(self, step: int, phase: str = "grad") -> float | None:
        return None

    def lie(self, step: int, phase: str = "grad") -> str | None:
        return None

    def muted(self, epoch: int) -> bool:
        return False

    def unreachable(self, epoch: int) -> bool:
        return False

    def greedy(self, epoch: int) -> int:
        return 0

    def dropping_port(self, host: str) -> int:
        raise RuntimeError("no unreachable-address fault was injected")

    def false_alarm(self, step: int, epoch: int) -> bool:
        return False

    def bitflip(self, step: int) -> bool:
        return False

    def lapse(self, step: int) -> bool:
        return False

    def wrong_samples(self, step: int) -> bool:
        return False


class Control(Protocol):
    """What a node needs of the control plane: `unbroken.control.client.ControlClient`
    (a session with the job's leader) unless a test gives another."""

    member_id: str
    """This node's identity in the group (a new one after an expulsion)."""
    expelled: str | None
    """Why the leader expelled this node (None while it is a member)."""
    quarantined: bool
    """The expulsion is final: the node stops instead of rejoining."""
    finished: int | None
    """The job's last step, once the leader said the job is over."""
    halted: str | None
    """Why the job was stopped rather than finished (with ``finished``)."""
    final_digest: str
    """Once ``finished``: the state the job finished with, as the leader said (may be empty)."""
    step: int
    """The step this node has committed (what its heartbeats say)."""

    @property
    def rtt_s(self) -> float:
        """Round-trip time to the leader (0 until measured)."""

    @property
    def welcome(self) -> m.Welcome | None:
        """The last welcome (None before the first)."""

    @property
    def lapses(self) -> int:
        """Sessions lost with a stale lease (`unbroken.control.connection`)."""

    def add_listener(self, listener: Listener) -> None:
        """Tell ``listener`` every state change and unpolled order (`unbroken.control.client.Notice`)."""

    def expel(self, reason: str) -> None:
        """Take this node for expelled (``reason``): the step loop rejoins as a new member."""

    def start(self) -> m.Welcome:
        """Join the job (blocks until welcomed or refused)."""

    def rejoin(self) -> m.Welcome:
        """Join again as a new member (after an expulsion)."""

    def close(self) -> None: ...

    def send(self, msg: BaseModel) -> None:
        """Queue a message for the leader."""

    def touch(self) -> None:
        """The step loop is alive."""

    def latest_order(self) -> m.EpochOrder | None: ...

    def commit_allowed(self) -> bool:
        """Whether this node can be sure it is still a member (the commit fence)."""


Build = Callable[..., "tuple[ProcessGroup, float]"]
"""Builds one of an epoch's groups: ``build(group, rank, ids, lazy=False, streams=1)`` returns
its process group and the seconds the build took (`unbroken.train.epochs.Epochs`)."""

GroupMaker = Callable[[int, "EpochScope"], Build]
"""The data plane's groups of an epoch: ``make(epoch, scope)`` is that epoch's `Build`."""


def flip_bit(t: torch.Tensor, index: int = 0, bit: int = 20) -> None:
    """Flip one bit of one element in place (a float32's mantissa bit by default: a small,
    silent change of value): silent data corruption, which the consistency audit must catch."""
    with torch.no_grad():
        flat = t.data.view(-1)
        word = flat[index : index + 1].view(torch.int32)
        word ^= 1 << bit
