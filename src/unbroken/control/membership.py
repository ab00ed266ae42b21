"""Membership, leases and epochs: the coordinator's decisions, as a pure state machine.

No sockets and no clock of its own: every call takes ``now`` and returns the orders to
send. The service in `coordinator.py` feeds it and delivers what it returns.

Member life::

    joining ──(epoch formed)──▶ active ──(leave: graceful epoch)──▶ gone
       │                          │
       └──(session drop / lease)──┴──(urgent epoch without it)────▶ gone

Coordinator life::

    fresh ──first join──▶ running
    recovering ──(all members of the newest reported epoch back: adopt it)──▶ running
               └─(window over: urgent epoch of whoever is back)─────────────▶ running

A recovering coordinator leaves out a member of the newest reported epoch that is not back
no sooner than `OUTAGE_TRUST_LEASES` (and a margin) after it started: that member may be
training on in an outage, which it trusts as long past its last evidence that no
coordinator had started (`unbroken.control.client`). Unless it is gone: once that wait is
all that holds the coordinator, the members back try the addresses the missing ones had in
the epoch (`m.Check`), and one that most of them, two at least, find nothing listening at
is not waited for (`Membership.vanished`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import math
import statistics
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from unbroken.config import MembershipConfig
from unbroken.control.admissions import Admissions
from unbroken.control.checks import Candidate, Checks, Finding, Outcome, Verdict, confirmer
from unbroken.control.hearsay import LIMIT as HEARSAY_LIMIT
from unbroken.control.hearsay import PERIOD_S as HEARSAY_PERIOD_S
from unbroken.control.hearsay import Hearsay, Report
from unbroken.control.messages import (
    OUTAGE_TRUST_LEASES,
    REFUSALS_KEPT,
    Capabilities,
    Checked,
    Commitment,
    EpochOrder,
    Hello,
    PolicyMsg,
    Refusal,
    Resume,
    TensorSpec,
    Verify,
)
from unbroken.events import Event, Kind
from unbroken.sched.balance import Plan, Preference, Profile, Role, adopt, plan, rebalance
from unbroken.sched.links import RING_MIN_ZONES, Links, bottleneck
from unbroken.sched.stragglers import find_stragglers
from unbroken.sched.zones import AUTO, Zones, group_by_rtt
from unbroken.specs import Policy, Rule

JOIN_SETTLE_S = 0.25
"""Joins that arrive this close together share one epoch change."""
FAULT_GRACE_S = 0.1
"""A reported collective failure waits this long for the failed member's session to drop,
so one failure makes one epoch change."""
HELD = {True: "", False: " (held: nothing bore out its last report yet)"}
"""What a report's event adds when `Hearsay` holds it back."""
OFFENCES = {
    Kind.ABSENT: "never joined the data plane",
    Kind.UNREACHABLE: "its data plane is unreachable",
    Kind.UNFOUNDED: "its reports of failed collectives are borne out by nothing",
    Kind.BAD_REQUEST: "it asked its donors for state that does not exist",
}
"""What keeps a member out of the epochs (`Membership.absent`), for the epoch's reason."""
PROBE_WAIT_S = 2.0
"""A member that says it cannot reach a peer's data plane: how long the others have to try
(`unbroken.control.messages.Probe`) before the epoch is formed again with everyone."""
FRESH_JOB_GRACE_S = 1.0
"""After a restart, how long a first hello without a resume waits for members to come back."""
BROKEN_SETTLE_S = 0.3
"""After a restart, once a member says the newest epoch is broken (it abandoned it), how
long to wait for the rest of the group to reconnect before forming the next epoch."""
OUTAGE_MARGIN_S = 0.1
"""Beyond a node's outage trust, how long a recovering coordinator waits before leaving out
a member of the epoch it found (the clocks' rates, the evidence's way to the node)."""
REASONS_SHOWN = 8
"""An epoch's reason names this many causes, then counts the rest."""
PLAN_DWELL_S = 1.0
"""A plan stays at least this long before a rebalance may replace it."""
PLAN_DWELL_STEPS = 3
"""...and until every trainer has reported this many step times under it."""
REBALANCE_EVERY_S = 0.25
"""How often the coordinator reconsiders the plan (the cost model is not free)."""
REVIEW_MEMBERS = 500
"""Groups larger than this are reviewed proportionally less often."""
REBALANCE_PERSIST_S = 0.5
"""A better plan must stay better for this long before it replaces the current one."""
WANDER_REVIEWS = 120
"""A member's speeds noted at this many plan reviews (half a minute for a small group) say
how far its speed strays by itself: a machine's processes sharing its cores make identical
nodes look 2-3 times apart for a second or more, each in turn, and shares that follow that
only move back and forth. Its spread (robust: a lasting change of level moves it only once it
fills half the window) counts as noise of its speed when a rebalance is judged (not in the
plan itself: truly unequal nodes keep shares by their speeds)."""
WANDER_KNOWN_AFTER = 8
"""Reviews before a member's wander counts (none until then: a node that is slow from the
start is moved at once)."""
WANDER_EVERY = 4
"""Its wander is computed again every this many reviews (a spread of 120 values moves little)."""
STRAGGLER_PERSIST_S = 2.0
"""A trainer must stand out in every review for this long to be called a straggler (on a
shared machine the one descheduled for a few steps changes from moment to moment)."""
SETTLED_AFTER = 3
"""Steps or probes a node must have measured before the plan moves it out of training."""
WINDOW = 8
"""Recent step times kept per member for straggler detection."""
BENCH_S = 30.0
"""A member whose gradient was refused does not train for this long."""
CHECKED_STEPS = 20
"""Steps gathered and checked row by row after a sum did not add up (`Suspicion`)."""
RING_REASON = "leaders' ring "
"""How a pending epoch's reason names the ring it reorders to (one, the newest)."""
QUARANTINE_AFTER = 3
"""...and after this many refusals it is quarantined: told to stop, and out of every epoch."""
ROLLBACK_PERIODS = 2
"""A failed audit may discard at most this many audit periods of steps; past it the job halts."""
REFUSED_STEPS_KEPT = 64
"""Steps behind the newest refused one whose refusals are remembered (`Membership.halt`)."""


class MemberState(str, enum.Enum):
    JOINING = "joining"
    ACTIVE = "active"
    LEAVING = "leaving"


class StepQuorum:
    """The highest step most of an epoch's members reported reaching: the group's step rises
    with it, so one member's word (an insider standing by at 199,999 of 200,000) moves it no
    more. A report costs the distinct steps reported above the group's (a handful), not the
    members: thousands of members report every step."""

    def __init__(self, size: int, floor: int) -> None:
        self.need = size // 2 + 1
        self.floor = floor
        self._at: dict[str, int] = {}
        """Each member's step, where above ``floor``."""
        self._count: collections.Counter[int] = collections.Counter()

    def report(self, member_id: str, step: int) -> int:
        """A member of the epoch reached ``step``: the step most of them reached now."""
        old = self._at.get(member_id)
        if step <= self.floor or (old is not None and step <= old):
            return self.floor
        if old is not None:
            self._count[old] -= 1
        self._at[member_id] = step
        self._count[step] += 1
        if len(self._at) < self.need:
            return self.floor
        reached = 0
        for s in sorted((s for s, n in self._count.items() if n > 0), reverse=True):
            reached += self._count[s]
            if reached >= self.need:
                self.floor = s
                break
        self._at = {mid: s for mid, s in self._at.items() if s > self.floor}
        self._count = collections.Counter(self._at.values())
        return self.floor


@dataclass
class Member:
    member_id: str
    name: str
    weight: float
    joined_at: float
    last_seen: float
    host: str = ""
    pid: int = 0
    key: str = ""
    """The public key its member id is bound to (`unbroken.control.identity`)."""
    source: str = ""
    """Where its session came from (the peer's address, or its relay)."""
    trained: bool = False
    """The group committed a step in an epoch it belonged to, as another member reported:
    its exit is no churn (`unbroken.control.admissions`)."""
    state: MemberState = MemberState.JOINING
    step: int = 0
    loss: float | None = None
    samples_per_s: float = 0.0
    caps: Capabilities = field(default_factory=Capabilities)
    preference: Preference = Preference.AUTO
    evaluates: bool = False
    role: Role | None = None
    compute_times: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    validation: dict[str, float] | None = None
    checkpoint_error: str | None = None
    """Why its last checkpoint failed (None: it did not, or it writes none)."""
    zone: str = ""
    flags: int = 0
    """Its offences (`Membership._offence`): gradients refused, work found wrong..."""
    benched_until: float = 0.0
    excluded_until: float = 0.0
    """Out of every epoch until then (it never joined an epoch's data plane)."""
    quarantined: bool = False
    bytes_intra: int = 0
    bytes_inter: int = 0
    levels: deque[float] = field(default_factory=lambda: deque(maxlen=WANDER_REVIEWS))
    """Its predicted time for an even share at each recent plan review, as a logarithm."""
    reviews: int = 0
    wander: float = 0.0
    """How far its speed strays from its usual level (relative; see `WANDER_REVIEWS`)."""
    typical_wander: float = 0.0
    """The median of its fellow trainers' wander at the last review."""

    def profile(self, now: float = 0.0) -> Profile:
        c = self.caps
        return Profile(
            self.name,
            c.per_sample_s,
            c.overhead_s,
            c.max_microbatch,
            self.weight,
            self.preference,
            self.evaluates,
            benched=now < self.benched_until,
            settled=c.measurements >= SETTLED_AFTER,
            noise=c.noise,
        )

    def review(self, even_share: float) -> None:
        """Note its speed at a plan review; its wander is the spread of those it noted."""
        t = self.profile().time_for(max(1, round(even_share)))
        if t <= 0:
            return
        self.levels.append(math.log(t))
        self.reviews += 1
        if len(self.levels) < WANDER_KNOWN_AFTER or self.reviews % WANDER_EVERY:
            return
        centre = statistics.median(self.levels)
        self.wander = 1.4826 * statistics.median(abs(v - centre) for v in self.levels)


@dataclass
class Decision:
    """What the service must do after a call: orders to deliver and sessions to close."""

    orders: dict[str, EpochOrder] = field(default_factory=dict)
    expel: dict[str, str] = field(default_factory=dict)
    refuse: str | None = None
    events: list[Event] = field(default_factory=list)
    quarantine: dict[str, str] = field(default_factory=dict)
    """Members told not to come back (their sessions closed), with why."""
    halt: str | None = None
    """The job stops here with this error (`Membership.halt`): every member is told."""
    verify: dict[str, Verify] = field(default_factory=dict)
    """Members asked to check a trainer's work (`Membership.checked`)."""

    def merge(self, other: Decision) -> Decision:
        self.orders.update(other.orders)
        self.verify.update(other.verify)
        self.expel.update(other.expel)
        self.events.extend(other.events)
        self.quarantine.update(other.quarantine)
        self.halt = self.halt or other.halt
        return self


@dataclass(frozen=True)
class Awaited:
    """What a recovering coordinator waits for once only its outage fence holds it
    (`Membership.awaited`)."""

    epoch: int
    """The epoch it found."""
    missing: list[str]
    """Its members that are not back."""
    back: list[str]
    """Its members that are back (asked to try the missing ones' addresses)."""


def _vanished_quorum(group: Collection[str]) -> int:
    """Members of an epoch of ``group`` that must find one of them gone (`Membership.vanished`):
    most of the others, and never one alone (in an epoch of two, one word against nothing)."""
    return max(2, (len(group) - 1) // 2 + 1)


def _spec_differences(ours: Mapping[str, Any], theirs: Mapping[str, Any], limit: int = 6) -> list[str]:
    """The fields in which two `Job.identity_spec` differ, as ``path: ours vs theirs``."""
    found: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if len(found) >= limit or a == b:
            return
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for key in sorted(set(a) | set(b), key=str):
                walk(a.get(key, "(none)"), b.get(key, "(none)"), f"{path}.{key}" if path else str(key))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(isinstance(x, dict) for x in a):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                walk(x, y, f"{path}[{i}]")
        else:
            found.append(f"{path}: {json.dumps(a)[:200]} vs {json.dumps(b)[:200]}")

    walk(ours, theirs, "")
    return found


def job_differences(ours: str, theirs: str) -> list[str]:
    """The fields two nodes' job specs (`Hello.job_spec`, JSON) differ in; none if either is
    missing or unreadable (a node's word: shown, never acted on)."""
    try:
        a, b = json.loads(ours), json.loads(theirs)
    except ValueError:
        return []
    if not isinstance(a, dict) or not isinstance(b, dict):
        return []
    return _spec_differences(a, b)


def first_mismatch(ours: Sequence[TensorSpec], theirs: Sequence[TensorSpec]) -> str | None:
    """Describe the first difference between two model fingerprints, or None if equal."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a.name != b.name:
            return f"parameter #{i} is named {b.name!r} here but {a.name!r} in the group"
        if a.shape != b.shape:
            return f"{b.name!r} has shape {tuple(b.shape)} here but {tuple(a.shape)} in the group"
        if a.dtype != b.dtype:
            return f"{b.name!r} has dtype {b.dtype} here but {a.dtype} in the group"
    if len(theirs) > len(ours):
        return f"{theirs[len(ours)].name!r} is not in the group's model"
    if len(ours) > len(theirs):
        return f"{ours[len(theirs)].name!r} is missing from this node's model"
    return None


class Membership:
    """The coordinator's view: who is in, which epoch, which plan."""

    def __init__(
        self,
        config: MembershipConfig | None = None,
        *,
        now: float,
        recovering: bool = False,
        policy: Policy | None = None,
    ) -> None:
        """``recovering``: a coordinator (re)started while a group may be training: wait up to
        ``config.recovery_window_s`` for the last epoch's members before forming one."""
        config = config or MembershipConfig()
        self.policy = policy or Policy()
        """How the group trains: every epoch order carries it (`_aggregate` may tighten its rule)."""
        self._policy_msg = PolicyMsg.of(self.policy)
        self.term = 0
        """The leader's term, carried by every epoch order (0 without etcd)."""
        self.lease_s = config.lease_s
        self.min_nodes = config.min_nodes
        self.balance = config.balance
        """Shares and roles follow measured throughput (else: the operators' weights)."""
        self.plan: Plan | None = None
        self._rollback_to = -1
        """A failed audit's rollback, carried by the next epoch order."""
        self._verdicts: list[Refusal] = []
        """The latest audit verdicts, sent in every order (`EpochOrder.refused`) and published
        with each epoch in etcd, whence a new leader takes them over (`remember_verdicts`)."""
        self._zones_in_force: list[str] = []
        """The zones of the epoch in force (empty: one zone)."""
        self._formed_at_step = -1
        """The group's step when the epoch in force was formed."""
        self.links = Links()
        """What zone leaders measured between zones (`sched.links`)."""
        self._ring: list[str] = []
        """The leaders' ring of the epoch in force (zone names; empty: fewer than 4 zones)."""
        self._planned_at = now
        self._planned_times: dict[str, float] = {}
        self._next_rebalance = now
        self._vacated = 0
        self._stragglers: set[str] = set()
        """Members reported as stragglers under the plan in force."""
        self._straggling: dict[str, tuple[float, str]] = {}
        """Members standing out in the latest review: since when, and why."""
        self._refused: set[tuple[int, str]] = set()
        self._better_since: float | None = None
        self.members: dict[str, Member] = {}
        self.epoch = 0
        self._epoch_floor = 0
        self._started = False
        """Nodes have heard of epochs up to this one (from before a restart): number above it."""
        self._epoch_members: list[str] = []
        self._ranks: dict[str, int] = {}
        self._quorum = StepQuorum(0, 0)
        self.shares: list[int] = []
        self.job: str | None = None
        self.job_identity: str | None = None
        self.job_spec = ""
        """The first member's `Job.identity_spec` (JSON): what a refused node differs in."""
        self.batch_size: int | None = None
        self.fingerprint: list[TensorSpec] | None = None
        self.step = 0
        self.num_steps = 0
        """The job's last step, as its first member said (0: not said)."""
        self.finished = False
        self.halted: str | None = None
        """Why the job was stopped without finishing (`halt`): ``finished`` is True too."""
        self._rolled_back: dict[int, set[int]] = {}
        """A step failed audits went back to → the epochs of those audits (`_rollback_bounded`)."""
        self._refused_at: dict[int, dict[str, str]] = {}
        """Step → the members whose contribution to it was refused, with why (`halt`)."""
        self.final_digests: dict[str, str] = {}
        self._quarantined_keys: set[str] = set()
        self._last_epoch: list[str] = []
        """The members of the epoch in which most members reached the job's last step."""
        self._finishers_gone: dict[str, tuple[float, str]] = {}
        """Members of the epoch that said done and left before the job finished: when, and
        their names. Theirs is no failure once most of the epoch reached the last step too;
        a lease without that, and it is one (a session saying done with a made-up digest,
        taken into an epoch it never builds, had held the group for good)."""
        """Members that reported the job's last step, with their state's digest."""
        self._accusers: dict[tuple[int, str, str], set[str]] = {}
        """(epoch, culprit or "", kind) → the members that reported it."""
        self._hearsay = Hearsay(window_s=max(2.0, 2 * config.lease_s))
        """Reports of failed collectives that nothing else bore out yet."""
        self._witnesses: dict[int, dict[str, str]] = {}
        """The last epochs' members, each with its zone (who could see a verdict's evidence)."""
        self._rollbacks: dict[int, dict[str, int]] = {}
        """Epoch → its members that reported an audit verdict, each with the step it went back to."""
        self._readmit_at: float | None = None
        """When a member kept out of the epochs may come back (an epoch forms then)."""
        self.admissions = Admissions()
        """Strikes against keys and addresses whose members left before training, which
        make their next joins wait (`unbroken.control.admissions`)."""
        self._committers: set[str] = set()
        """Members of the epoch in force that reported a commit in it (two at most: a
        member's own report never proves that it trained)."""
        self._checking_from: int | None = None
        """Since this step every contribution is gathered and checked (a sum did not add up)."""
        self.final_digest: str | None = None
        """The state most of the last epoch's trainers finished with."""
        self._final_metrics: dict[str, dict[str, float]] = {}
        self.final_metrics: dict[str, float] = {}
        self._pending_due: float | None = None
        self._pending_urgent = False
        self._pending_reasons: dict[str, None] = {}
        self.recovering_until = now + config.recovery_window_s if recovering else None
        self._outage_fence = now + self._outage_wait_s if recovering else now
        """Until when a recovering coordinator leaves no member of the epoch it found out (but
        one found gone: `vanished`)."""
        self._came_back: set[str] = set()
        """Members that resumed here: one that fails after is gone as in a running epoch."""
        self._vanished: dict[tuple[int, str], set[str]] = {}
        """(epoch found, a member of it not back) → the members back from that epoch that found
        nothing listening at its data-plane address there (`vanished`)."""
        self._resumes: dict[str, Resume] = {}
        self._next_expiry_scan = now
        self.checks = Checks(self._confirmer, self._name)
        """The trainers' commitments and the findings of the members checking them."""

    @property
    def epoch_members(self) -> list[str]:
        """The members of the epoch in force; rank = position."""
        return self._epoch_members

    @epoch_members.setter
    def epoch_members(self, members: list[str]) -> None:
        for mid in self._epoch_members:
            if (m := self.members.get(mid)) is not None and self._committers - {mid}:
                m.trained = True
        self._committers = set()
        self._epoch_members = list(members)
        self._ranks = {mid: rank for rank, mid in enumerate(self._epoch_members)}
        self._quorum = StepQuorum(len(self._epoch_members), self.step)
        for mid in self._epoch_members:  # what the new epoch's members said before it
            if (x := self.members.get(mid)) is not None:
                self.step = max(self.step, self._quorum.report(mid, x.step))

    def rank_of(self, member_id: str) -> int | None:
        """The member's rank in the epoch in force (None: not in it), in constant time."""
        return self._ranks.get(member_id)

    # ----------------------------------------------------------------- joins and leaves

    def unbound(self, member_id: str, key: str, one_per_key: bool = False) -> str | None:
        """Why a hello as ``member_id`` signed by ``key`` may not stand for it: the member id
        is bound to another key (a token holder speaking as another member), or, with
        ``one_per_key`` (a job admitting listed keys), the key is another member's now."""
        if key and key in self._quarantined_keys:
            return "its key was quarantined by the group (give the node a new key only once it is fixed)"
        m = self.members.get(member_id)
        if m is not None and m.key and m.key != key:
            return (
                f"member id {member_id!r} belongs to another node's key: a node cannot take another member's "
                "place (a restarted node joins under a new member id)"
            )
        if one_per_key and m is None:
            other = next((x for x in self.members.values() if x.key == key), None)
            if other is not None:
                return (
                    f"its key is {other.name}'s ({other.member_id}), in the job now: one member per key (give "
                    "each node its own, `unbroken keygen`; a node that died is let go within a lease)"
                )
        return None

    def admit(self, hello: Hello, now: float, reconnect: bool = False, key: str = "", source: str = "") -> Decision:
        """Check a hello; on success the node becomes a joining member. ``reconnect``: the
        member's previous session was still open and has been replaced (it stays as it was).
        ``key`` and ``source``: its node key and where its session came from; a join under
        those that churned lately waits before an epoch takes it (`admissions`)."""
        d = Decision()
        if self.job is not None and (hello.job != self.job or hello.job_identity != self.job_identity):
            differs = job_differences(self.job_spec, hello.job_spec)
            said = f"; it differs in {'; '.join(differs)} (the group's vs this node's)" if differs else ""
            if any(d.startswith("shard") for d in differs):
                said += "; a sharded job's nodes all shard: start every node with --shard (or give the Job shard=)"
            d.refuse = (
                f"this coordinator runs job {self.job!r} ({self.job_identity}); this node runs "
                f"{hello.job!r} ({hello.job_identity}){said}: start a separate coordinator per job (with etcd: "
                "a separate --etcd-prefix), or use the same job settings (name, batch size, steps, seed, dataset "
                "size, arguments, the optimizer's hyperparameters)"
            )
            return d
        if self.num_steps and hello.steps and hello.steps != self.num_steps:
            d.refuse = f"this node's job ends at step {hello.steps}, the group's at step {self.num_steps}"
            return d
        if (why := self.beyond(hello.step)) is not None:
            d.refuse = f"this node claims {why}"
            return d
        if self.fingerprint is not None:
            diff = first_mismatch(self.fingerprint, hello.fingerprint)
            if diff is not None:
                d.refuse = f"model does not match the group's: {diff}"
                return d
        if hello.member_id in self.members:
            if reconnect:
                self.heartbeat(hello.member_id, hello.step, now)
                self._left_epoch(hello, now)
                return d
            d.refuse = f"member id {hello.member_id!r} is already connected"
            return d
        if self.halted is not None:
            d.refuse = f"job {self.job!r} was stopped at step {self.step}: {self.halted}"
            return d
        if self.finished:
            d.refuse = f"job {self.job!r} already finished at step {self.step}"
            return d
        r = hello.resume
        if r is not None and self.recovering_until is None and self.epoch_members and r.epoch != self.epoch:
            # Its epoch was superseded while it was away (frozen, cut off): it must not
            # commit anything more there, so it comes back as a new member and catches up.
            d.refuse = f"epoch {r.epoch} is over (the group is in epoch {self.epoch}); rejoin as a new member"
            return d
        # A group in training never takes a newcomer's word that it is ahead (a checkpoint of
        # another run): its step counts from the group's; the node drops that state itself.
        running = bool(self._epoch_members) and self.recovering_until is None and hello.resume is None
        step = min(hello.step, self.step) if running else hello.step
        self.job, self.job_identity = hello.job, hello.job_identity
        self.job_spec = self.job_spec or hello.job_spec
        self.num_steps = self.num_steps or hello.steps
        self.fingerprint = list(hello.fingerprint)
        self.batch_size = hello.batch_size
        self.members[hello.member_id] = Member(
            member_id=hello.member_id,
            name=hello.name,
            weight=hello.weight,
            joined_at=now,
            last_seen=now,
            host=hello.host,
            pid=hello.pid,
            key=key,
            source=source,
            trained=hello.resume is not None,  # back from an epoch that trained (a leader changed)
            step=step,
            caps=hello.capabilities,
            preference=Preference(hello.role),
            evaluates=hello.evaluates,
            zone=hello.zone,
        )
        if self.recovering_until is None or hello.resume is not None:  # a newcomer's word moves no recovery
            self.step = max(self.step, step)
        self._epoch_floor = max(self._epoch_floor, hello.last_epoch, hello.restored_epoch or 0)
        live = hello.resume is not None or hello.last_epoch > 0 or (hello.step > 0 and hello.restored_epoch is None)
        self._started = self._started or live
        d.events.append(self._event(now, Kind.JOIN, hello.member_id, f"{hello.name} connected"))
        if hello.resume is None and self.recovering_until is not None and not self._resumes:
            # Perhaps a fresh job; perhaps a restarted coordinator whose members have not
            # reconnected yet while a new node got here first. Forming a group of new nodes
            # now would start a second job from step 0 beside the live one: wait a little.
            self.recovering_until = min(self.recovering_until, now + max(FRESH_JOB_GRACE_S, 2 * self.lease_s))
        if hello.resume is not None and self.recovering_until is not None:
            r = hello.resume
            if not self._resumes:
                # Live members retry every 0.1 s: one silent for a lease after the first is back
                # would be failed by its lease anyway. Waiting longer only stalls the group.
                self.recovering_until = min(self.recovering_until, now + self.lease_s + JOIN_SETTLE_S)
            self._resumes[hello.member_id] = r
            self._came_back.add(hello.member_id)
            self.epoch = max(self.epoch, r.epoch)
            if r.abandoned and r.epoch >= self.epoch:  # self.epoch: the newest resumed so far
                # The newest epoch cannot go on: form the next as soon as the others are back.
                self.recovering_until = min(self.recovering_until, now + BROKEN_SETTLE_S)
            return d
        wait = self.admissions.wait(key, source, now)
        if wait is not None:
            # Kept out of the epochs until then, as a benched member is: not refused (an honest
            # node behind a churner's address only waits), and its join re-forms nothing now.
            member = self.members[hello.member_id]
            member.excluded_until = wait.until
            self._readmit_at = min(self._readmit_at or wait.until, wait.until)
            d.events.append(self._event(now, Kind.CHURN, hello.member_id, f"{hello.name}: {wait.reason}"))
            return d
        self._want_epoch(now, urgent=False, reason=f"{hello.name} joined", delay=JOIN_SETTLE_S)
        return d

    def _churned(self, m: Member, now: float) -> None:
        """``m`` is leaving: a strike against its key and address unless it trained (the group
        committed a step in an epoch it belonged to). A join it made that no epoch took yet
        re-forms nothing any more."""
        if m.trained or (self.rank_of(m.member_id) is not None and self._committers - {m.member_id}):
            return
        self.admissions.churned(m.key, m.source, now)
        joined = f"{m.name} joined"
        if self.rank_of(m.member_id) is None and joined in self._pending_reasons:
            joining = (o for o in self.members.values() if o is not m and o.state is MemberState.JOINING)
            if not any(o.name == m.name for o in joining):
                del self._pending_reasons[joined]
                if not self._pending_reasons:
                    self._pending_due, self._pending_urgent = None, False

    def _left_epoch(self, hello: Hello, now: float) -> None:
        """A session replaced (or a relay's member back) says it abandoned its epoch (its
        fence refuses the step in flight): the epoch cannot go on without it."""
        r, mid = hello.resume, hello.member_id
        if r is None or not r.abandoned:
            return
        if self.recovering_until is not None:
            if mid in self._resumes:
                self._resumes[mid] = r
                if r.epoch >= self.epoch:
                    self.recovering_until = min(self.recovering_until, now + BROKEN_SETTLE_S)
            return
        if r.epoch == self.epoch and self.rank_of(mid) is not None:
            self._trace(mid, now)  # its leaving bears out what the others report of the epoch
            why = f"{self.members[mid].name} left epoch {r.epoch} (its session lapsed)"
            self._want_epoch(now, urgent=True, reason=why, delay=0.0)

    def revoke(self, keys: Callable[[str], bool], now: float) -> Decision:
        """Members whose key ``keys`` no longer admits (taken off the allowed keys) are
        expelled, as for a lapsed lease: the job goes on without them, and their rejoin is
        refused."""
        d = Decision()
        for mid, m in list(self.members.items()):
            if m.key and not keys(m.key):
                d.expel[mid] = "its key was taken off the job's allowed keys"
                d.merge(self.fail(mid, now, "its key was taken off the job's allowed keys"))
        return d

    def leave(self, member_id: str, now: float, reason: str) -> Decision:
        m = self.members.get(member_id)
        d = Decision()
        if m is None:
            return d
        d.events.append(self._event(now, Kind.LEAVE, member_id, f"{m.name} leaves: {reason}"))
        self._trace(member_id, now)
        self._churned(m, now)
        self._vacated += m.role is Role.TRAINER
        if self.rank_of(member_id) is not None:
            m.state = MemberState.LEAVING
            # A failure already pending keeps its urgency: its step in flight must be abandoned.
            d.merge(self._form_epoch(now, urgent=self._pending_urgent, reason=f"{m.name} left"))
            del self.members[member_id]
        else:
            del self.members[member_id]
        return d

    def fail(self, member_id: str, now: float, cause: str) -> Decision:
        """A member is gone (session dropped, lease expired, malformed message)."""
        m = self.members.get(member_id)
        d = Decision()
        if m is None:
            return d
        self._churned(m, now)
        del self.members[member_id]
        d.events.append(self._event(now, Kind.FAILURE, member_id, f"{m.name}: {cause}"))
        self._trace(member_id, now)
        self._vacated += m.role is Role.TRAINER
        if self.rank_of(member_id) is not None and not self.finished and member_id in self.final_digests:
            self._finishers_gone[member_id] = (now, m.name)
        elif self.rank_of(member_id) is not None and not self.finished:
            self._want_epoch(now, urgent=True, reason=f"{m.name} failed ({cause})", delay=0.0)
        if self._resumes.pop(member_id, None) is not None:
            self._epoch_broke(now, f"{m.name} failed ({cause})")
        return d

    def _trace(self, member_id: str, now: float) -> None:
        """A member failed or left: what others reported about its epochs is borne out."""
        epochs = {e for e, w in self._witnesses.items() if member_id in w}
        self._release(self._hearsay.borne_out(epochs, now, by=member_id), now)

    def _release(self, borne: list[Report], now: float) -> None:
        """Held reports that something bore out after all: the current epoch's re-forms."""
        for r in borne:
            if r.epoch == self.epoch and r.member_id in self.members:
                name = self.members[r.member_id].name
                self._want_epoch(now, urgent=True, reason=f"collective failed at {name}: {r.reason}", delay=0.0)

    def _epoch_broke(self, now: float, reason: str) -> None:
        """During a recovery, the epoch the members came back with cannot go on: stop
        waiting for the rest of them (the others are back within a settle)."""
        if self.recovering_until is not None:
            self.recovering_until = min(self.recovering_until, now + BROKEN_SETTLE_S)
            self._want_epoch(now, urgent=True, reason=reason, delay=BROKEN_SETTLE_S)

    def session_closed(self, member_id: str, now: float) -> Decision:
        """The member's session ended; after ``done``, ``leave`` or the job's end that is no failure."""
        m = self.members.get(member_id)
        if self.finished or m is None:
            self.members.pop(member_id, None)
            return Decision()
        if member_id in self.final_digests:
            del self.members[member_id]
            if self.rank_of(member_id) is not None:
                self._finishers_gone[member_id] = (now, m.name)
            return Decision()
        return self.fail(member_id, now, "control connection dropped")

    def _finishers_check(self, now: float) -> Decision:
        """Members that said done and left (`_finishers_gone`): borne out once most of the
        epoch's members still here report the last step; a lease without that, and the
        epoch forms again without them."""
        d = Decision()
        if self.finished:
            self._finishers_gone.clear()
            return d
        # Its own word counts (an honest pair's other member may be evaluating before its
        # done), but one member here at least must have reached the last step too.
        here = sum(
            1 for mid in self._epoch_members if (x := self.members.get(mid)) is not None and x.step >= self.num_steps
        )
        gone = sum(1 for mid in self._finishers_gone if self.rank_of(mid) is not None)
        if self.num_steps and here >= 1 and here + gone >= len(self._epoch_members) // 2 + 1:
            return d
        for mid, (since, name) in list(self._finishers_gone.items()):
            if now - since < self.lease_s:
                continue
            del self._finishers_gone[mid]
            if self.rank_of(mid) is None:
                continue
            why = f"{name} said done at the last step and left, and most of the epoch never reached it"
            d.events.append(self._event(now, Kind.FAILURE, mid, why))
            self._want_epoch(now, urgent=True, reason=why, delay=0.0)
        return d

    def number_above(self, epoch: int) -> None:
        """Epochs formed from now on are numbered above ``epoch`` (one published before)."""
        self._epoch_floor = max(self._epoch_floor, epoch)

    def listening(self, now: float) -> None:
        """The coordinator began to listen: a recovering one's wait for members of the epoch it
        finds counts from now (until then its address refused connections, which a node in
        an outage takes for evidence that no coordinator runs there)."""
        if self.recovering_until is not None:
            self._outage_fence = max(self._outage_fence, now + self._outage_wait_s)

    @property
    def _outage_wait_s(self) -> float:
        """How long a member not back may still trust an outage (`OUTAGE_TRUST_LEASES`)."""
        return self.lease_s * OUTAGE_TRUST_LEASES + OUTAGE_MARGIN_S

    def awaited(self, now: float) -> Awaited | None:
        """What a recovering coordinator still waits for once only the outage fence holds it:
        members of the epoch it found that are not back (one may be cut off and committing
        there), and the members back from that epoch, whom it asks to try their addresses
        (`m.Check`). None while it waits for anything else, or for nothing."""
        if self.recovering_until is None or now < self.recovering_until or now >= self._outage_fence:
            return None
        found = self._found()
        if found is None:
            return None
        epoch, group = found
        missing = sorted(group - set(self.members) - self._came_back - self._dead(epoch, group))
        if not missing:
            return None
        back = sorted(mid for mid, r in self._resumes.items() if r.epoch == epoch and mid in self.members)
        return Awaited(epoch, missing, back)

    def _found(self) -> tuple[int, set[str]] | None:
        """The newest epoch members came back from, and its members (as they reported them)."""
        if not self._resumes:
            return None
        newest = max(r.epoch for r in self._resumes.values())
        return newest, {mid for r in self._resumes.values() if r.epoch == newest for mid in r.members}

    def vanished(self, reporter: str, epoch: int, members: Iterable[str], now: float) -> Decision:
        """A member back from ``epoch`` found nothing listening at these members' data-plane
        addresses there (`m.Vanished`). A dead process commits nothing more: once most of the
        epoch's other members, and never one alone, say so of one, the new epoch need not
        wait for it."""
        d = Decision()
        r, found = self._resumes.get(reporter), self._found()
        if self.recovering_until is None or r is None or found is None or not r.epoch == found[0] == epoch:
            return d
        group = found[1]
        for mid in members:
            if mid in group and mid != reporter and mid not in self.members:
                seen = self._vanished.setdefault((epoch, mid), set())
                seen.add(reporter)
                if len(seen) == _vanished_quorum(group):  # reached now (each reporter counts once)
                    why = f"{mid}: nothing listens at its data-plane address of epoch {epoch} ({len(seen)} found)"
                    d.events.append(self._event(now, Kind.FAILURE, mid, f"{why}: not waited for"))
        return d

    def _dead(self, epoch: int, group: set[str]) -> set[str]:
        """Members of ``group`` (epoch ``epoch``, found) that most of the others found gone."""
        need = _vanished_quorum(group)
        return {mid for (e, mid), seen in self._vanished.items() if e == epoch and len(seen & group) >= need}

    def remember_verdicts(self, verdicts: Iterable[Refusal]) -> None:
        """The audits' verdicts a previous leader ordered (published with its last epoch)."""
        for r in verdicts:
            self._refuse(r.epoch, r.step)

    def extend(self, member_ids: Iterable[str], until: float) -> None:
        """These members' leases run at least until ``until`` (their relay went silent: they
        need time to reconnect elsewhere before their lease may lapse)."""
        for mid in member_ids:
            m = self.members.get(mid)
            if m is not None:
                m.last_seen = max(m.last_seen, until - self.lease_s)

    def pause(self, seconds: float) -> None:
        """The service was not listening for ``seconds``: that time counts against no lease."""
        for m in self.members.values():
            m.last_seen += seconds

    # ---------------------------------------------------------------- reports

    def heartbeat(self, member_id: str, step: int, now: float) -> None:
        m = self.members.get(member_id)
        if m is not None:
            m.last_seen = now
            m.step = max(m.step, step)
            if not self._epoch_members:  # no epoch yet (a start, a recovery): the claims are all there is
                if self.recovering_until is None or member_id in self._resumes:
                    self.step = max(self.step, m.step)
            elif member_id in self._ranks:  # a newcomer's claim moves nothing, one member's alone neither
                self.step = max(self.step, self._quorum.report(member_id, m.step))
                if self.num_steps and self.step >= self.num_steps and not self._last_epoch:
                    self._last_epoch = list(self._epoch_members)

    def progress(
        self,
        member_id: str,
        step: int,
        loss: float,
        sps: float,
        now: float,
        *,
        epoch: int | None = None,
        compute_s: float = 0.0,
        caps: Capabilities | None = None,
        wire: tuple[int, int] | None = None,
    ) -> None:
        self.heartbeat(member_id, step, now)
        m = self.members.get(member_id)
        if m is None:
            return
        m.loss = loss
        m.samples_per_s = sps
        if caps is not None:
            m.caps = caps
        if wire is not None:
            m.bytes_intra, m.bytes_inter = wire
        if epoch == self.epoch and m.role is Role.TRAINER and compute_s > 0:
            m.compute_times.append(compute_s)
        if epoch == self.epoch and len(self._committers) < 2 and member_id in self._ranks:
            self._committers.add(member_id)

    def links_measured(self, member_id: str, epoch: int, rates: dict[str, float], now: float) -> Decision:
        """A zone leader's rates from the other zones (an order's ``probe_links``). Only the
        epoch's leaders are heard, and only of that epoch's zones: a member may lie, and its
        word moves nothing but the ring's order. Once every pair is known, a ring whose
        slowest link is `sched.links.GAIN` times faster forms a new epoch at a step boundary."""
        d = Decision()
        if epoch != self.epoch or member_id not in self.epoch_members or not self._ring:
            return d
        zones = Zones(tuple(self._zones_in_force), tuple(self._ring))
        rank = self.epoch_members.index(member_id)
        if rank not in zones.leaders:
            return d
        mine = zones.of_rank[rank]
        heard = {z: r for z, r in rates.items() if z in zones.names and z != mine}
        self.links.report(mine, heard, now)
        shown = ", ".join(f"{z} {r:.0f}" for z, r in sorted(heard.items()))
        d.events.append(self._event(now, Kind.LINKS, member_id, f"zone {mine} received (MB/s): {shown}"))
        ring = self.links.ring(zones.names, self._ring, now)
        if ring != self._ring:
            rate = self.links.rates(now)
            before, after = bottleneck(self._ring, rate), bottleneck(ring, rate)
            why = f"{RING_REASON}{' > '.join(ring)}: slowest link {before:.0f} -> {after:.0f} MB/s"
            # Newer reports may choose another ring before the epoch forms: it forms with that one.
            self._want_epoch(now, urgent=False, reason=why, delay=0.0, replacing=RING_REASON)
        return d

    def validation(self, member_id: str, step: int, metrics: dict[str, float], seconds: float, now: float) -> Decision:
        d = Decision()
        m = self.members.get(member_id)
        if m is None:
            return d
        m.validation = {"step": float(step), **metrics}
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
        d.events.append(
            self._event(now, Kind.VALIDATION, member_id, f"{m.name} evaluated step {step}: {shown} ({seconds:.2f} s)")
        )
        return d

    def committed(self, member_id: str, commitments: Sequence[Commitment], now: float) -> Decision:
        """A trainer's commitments to its slices (`Progress.commitments`, `control.checks`)."""
        if member_id not in self.members:
            return Decision()
        # Of the epoch in force or the one before (reports cross an epoch change), no other:
        # a member's word about other epochs would only fill the record.
        kept = [c for c in commitments if self.epoch - 1 <= c.epoch <= self.epoch]
        return self._check_outcomes(self.checks.committed(member_id, kept, self.step), now)

    def checked(self, member_id: str, check: Checked, now: float) -> Decision:
        """A member's recomputation of a trainer's slice (`control.checks`): compared with
        the trainer's commitment; a first finding against it has another member check it
        again (`Decision.verify`), a second member's benches it (`Kind.BAD_WORK`)."""
        m = self.members.get(member_id)
        if m is None or m.quarantined or m.flags or check.trainer == member_id:
            return Decision()
        # Only a validator's finding, or one a member was asked for, counts: a trainer or a
        # standby saying so unasked is one more voice an attacker could add.
        if m.role is not Role.VALIDATOR and not check.ordered:
            return Decision()
        t = self.members.get(check.trainer)
        arithmetic = t.caps.arithmetic if t is not None and t.caps.arithmetic else None
        return self._check_outcomes(self.checks.checked(Finding(member_id, check, now), arithmetic), now)

    def _check_outcomes(self, outcomes: list[Outcome], now: float) -> Decision:
        d = Decision()
        for o in outcomes:
            t = self.members.get(o.trainer)
            if o.verdict is Verdict.MATCH or t is None:
                continue
            if o.verdict is Verdict.CONFIRMED:
                why = f"wrong work from {t.name}"
                d.merge(self._offence(t, self.epoch, o.reason, now, Kind.BAD_WORK, why, keep_checking=True))
                continue
            if o.confirmer is not None:
                again = f"another member found {t.name}'s work differing from its commitment: {o.reason}"
                d.verify[o.confirmer] = Verify(epoch=self.epoch, trainer=o.trainer, step=self.step, reason=again)
            d.events.append(self._event(now, Kind.CHECK, o.trainer, f"{t.name}: {o.reason}"))
        return d

    def _confirmer(self, trainer: str, accusers: Collection[str]) -> str | None:
        """Who checks ``trainer`` again (`control.checks.confirmer`), in the epoch in force."""
        t = self.members.get(trainer)
        if t is None or len(self.shares) != len(self.epoch_members):
            return None
        candidates = [
            Candidate(mid, c.role, share, c.caps.arithmetic)
            for mid, share in zip(self.epoch_members, self.shares, strict=True)
            if (c := self.members.get(mid)) is not None and c.role is not None and not c.flags
        ]
        return confirmer(candidates, trainer, accusers, t.caps.arithmetic)

    def fault(
        self,
        member_id: str,
        epoch: int,
        reason: str,
        now: float,
        culprit: str | None = None,
        kind: Kind = Kind.BAD_GRADIENT,
        rollback_to: int = -1,
        zone_only: bool = False,
        step: int = -1,
    ) -> Decision:
        """A member saw a collective fail, or refused a bad contribution (``culprit``), or a
        sum that did not add up (``Kind.SUSPECT``). Re-form the epoch unless it already
        changed. A culprit is benched, and quarantined when it offends again and again,
        once most of the members that saw the evidence named it (``zone_only``: the
        culprit's zone, a DiLoCo inner step's); their reports count for the epoch before
        the current one too (the first report already re-formed it)."""
        d = Decision()
        witnesses = self._witnesses.get(epoch)
        if witnesses is None and epoch == self.epoch:  # an epoch the members resumed with
            witnesses = {mid: "" for mid in self._epoch_members or self._resumes}
        m = self.members.get(member_id)
        if witnesses is None or member_id not in witnesses or m is None:
            return d
        if m.quarantined or m.excluded_until > now:
            return d  # kept out of the epochs: its word re-forms none
        current = epoch == self.epoch
        if current and self.recovering_until is not None:
            self._epoch_broke(now, f"{m.name} reports: {reason}")
        back = self._rollback_reported(member_id, epoch, kind, rollback_to, witnesses)
        if back >= 0:
            # Remembered whatever the epoch now (a report may come after the next order):
            # a member away since must not bring back what the verdict refused.
            self._refuse(epoch, back, replace=True)
        if current and back >= 0:
            if (halt := self._rollback_bounded(epoch, back, reason, now)) is not None:
                return halt
            # Every copy of the audited state predates the corruption (a joiner's copy is of
            # the step it joined at, a member cut short of a verdict holds an older one), and
            # a member without it fetches it from one that holds it.
            self._rollback_to = back
        act, released = self._hearsay.reported(member_id, epoch, now, reason)
        self._release(released, now)
        c = self.members.get(culprit) if culprit is not None else None
        if kind is Kind.SUSPECT or c is not None:
            # Every member reaches the same verdict from the same data (the all-reduced sum,
            # the gathered rows or digests): a verdict counts once most of them reached it.
            seen = witnesses
            if zone_only and c is not None and kind is Kind.BAD_GRADIENT:
                seen = {mid: z for mid, z in witnesses.items() if z == witnesses.get(c.member_id)}
            if member_id not in seen:
                return d
            key = (epoch, c.member_id if c is not None else "", kind)
            accusers = self._accusers.setdefault(key, set())
            first = not accusers
            accusers.add(member_id)
            agreed = len(accusers) >= len(seen) // 2 + 1
            if kind is Kind.UNREACHABLE and c is not None:
                # Only the others can try to reach it: most of them, and never one alone (in
                # an epoch of two it is one word against another). A member that reaches
                # few of its peers names itself, and its word about itself is enough.
                others = len(accusers - {c.member_id})
                agreed = c.member_id in accusers or others >= max(2, (len(seen) - 1) // 2 + 1)
                if agreed:
                    return self.absent(c.member_id, epoch, reason, now, kind=Kind.UNREACHABLE)
                if first and current:
                    d.events.append(self._event(now, Kind.FAULT, member_id, f"{m.name} reports: {reason}{HELD[act]}"))
                    if act:
                        # Most of the epoch is trying the address meanwhile (`Probe`): if
                        # they reach it, the epoch is formed again with everyone.
                        self._want_epoch(now, urgent=True, reason=f"{m.name} reports: {reason}", delay=PROBE_WAIT_S)
                return d
            if kind is Kind.BAD_REQUEST and c is not None:
                # What a receiver asked of its donors is on their wires alone: most of the
                # others (one of a pair) say so, or the epoch is formed again without a verdict.
                # (A receiver that asks one donor alone escapes this; one donor's word is not
                # enough to keep anyone out, or one liar could keep out whom it liked.)
                if len(accusers - {c.member_id}) >= (len(seen) - 1) // 2 + 1:
                    return self.absent(c.member_id, epoch, reason, now, kind=Kind.BAD_REQUEST)
                if len(accusers) > 1 or not current:
                    return d
                reason = f"{reason} (names {c.name}; kept out only when most of the others agree)"
            elif agreed and c is not None:
                what = "bad gradient" if kind is Kind.BAD_GRADIENT else "failed audit"
                return self._offence(c, epoch, reason, now, kind, f"{what} from {c.name}", step)
            if agreed and c is None and self._checking_from is None:
                # A contribution lied, and only the gathered rows can say whose: check each.
                self._checking_from = self.step
                then = (
                    "DiLoCo's exchange gathers no rows: the round is retried as it was"
                    if self.policy.diloco is not None
                    else f"the next {CHECKED_STEPS} steps gather and check every member's contribution"
                )
                d.events.append(self._event(now, Kind.SUSPECT, None, f"{reason}; {then}"))
                self._want_epoch(now, urgent=True, reason="a step's sum did not add up: checking each part", delay=0.0)
                return d
            if len(accusers) > 1 or not current:
                return d
            if c is not None:
                reason = f"{reason} (names {c.name}; benched only when most of the epoch agrees)"
        if not current:
            return d
        d.events.append(self._event(now, Kind.FAULT, member_id, f"{m.name} reports: {reason}{HELD[act]}"))
        if not act:
            return d
        self._want_epoch(now, urgent=True, reason=f"collective failed at {m.name}: {reason}", delay=FAULT_GRACE_S)
        return d

    def _rollback_reported(
        self, member_id: str, epoch: int, kind: Kind, rollback_to: int, witnesses: dict[str, str]
    ) -> int:
        """A member's audit verdict on ``epoch`` (going back to its audited state of step
        ``rollback_to``; -1: it holds none): the step the group goes back to, -1 until it is
        known. Each member reaches the verdict from the same gathered digests: one member's
        word alone rolls nobody back. It is known once most of the epoch's members reported
        and two of them name the same step (members audited together hold the same one: the
        oldest such), or once all of them reported (the oldest named: a joiner's copy is newer
        than the last audit). A liar that reports first cannot get its step ordered before the
        others' arrive, and a member's first report is the one that counts. Until then the
        members that saw the verdict went back on their own, and the sync phase's floors take
        back those that did not."""
        if kind is not Kind.AUDIT:
            return -1
        members = set(witnesses)
        if (found := self._found()) is not None and found[0] == epoch and epoch not in self._witnesses:
            members = found[1]  # recovering: the epoch's members, not only those back so far
        if member_id not in members:
            return -1
        reports = self._rollbacks.setdefault(epoch, {})
        reports.setdefault(member_id, rollback_to)
        if len(reports) < len(members) // 2 + 1:
            return -1
        steps = [s for s in reports.values() if s >= 0]
        named_twice = [s for s in set(steps) if steps.count(s) >= 2]
        if not named_twice and len(reports) < len(members):
            return -1
        return min(named_twice or steps, default=-1)

    def _rollback_bounded(self, epoch: int, back: int, reason: str, now: float) -> Decision | None:
        """A halt instead of the rollback to ``back`` that an audit of ``epoch`` decided, when
        it is one no repair can end: the group already went back to that step after an audit
        of another epoch (repaired, it diverged again), or it would discard more than
        `ROLLBACK_PERIODS` audit periods (a job whose audits go back further and further)."""
        epochs = self._rolled_back.setdefault(back, set())
        epochs.add(epoch)
        if len(epochs) >= 2:
            return self.halt(
                now,
                f"the replicas diverged again after the group went back to step {back} and repaired them "
                f"(the last audit: {reason}). A difference that comes back is how the members compute, not a "
                "flipped bit: state the training loop changes outside what unbroken replicates (a scheduler not "
                "given to replicate(), a learning rate or a counter the loop sets itself), code or settings that "
                "differ between nodes, nondeterministic kernels or mixed devices. Make the members compute "
                "alike, then restart from the last checkpoint",
            )
        every = self.policy.audit_every
        if every and self.step - back > ROLLBACK_PERIODS * every:
            return self.halt(
                now,
                f"a failed audit ({reason}) would take the group back {self.step - back} steps, from step "
                f"{self.step} to step {back}: more than {ROLLBACK_PERIODS} audit periods of {every} steps, so "
                "the audits before it did not pass either. Training on would redo the run, not repair it: "
                "find why the members' states differ (the audits name who), then restart from the last checkpoint",
            )
        return None

    def _refuse(self, epoch: int, step: int, replace: bool = False) -> None:
        """Record a verdict: states committed in ``epoch`` or before, above ``step`` (the
        oldest step said for the epoch, or, ``replace``, this one: the reports' step so far)."""
        for i, r in enumerate(self._verdicts):
            if r.epoch == epoch:
                self._verdicts[i] = Refusal(epoch=epoch, step=step if replace else min(step, r.step))
                return
        self._verdicts = [*self._verdicts, Refusal(epoch=epoch, step=step)][-REFUSALS_KEPT:]

    def absent(self, member_id: str, epoch: int, reason: str, now: float, kind: Kind = Kind.ABSENT) -> Decision:
        """The leader saw ``member_id`` never join epoch ``epoch``'s data plane (its own
        evidence: it holds the rendezvous), or most of the epoch could not connect to it
        (``Kind.UNREACHABLE``), or its reports of failed collectives were borne out by
        nothing, again and again (``Kind.UNFOUNDED``, `Hearsay`). Kept out of the epochs
        like a culprit; quarantined when it happens again and again."""
        c = self.members.get(member_id)
        # Evidence about the epoch before counts too (reports cross the next epoch's
        # forming): the member is still in the current one, doing the same.
        if c is None or not self.epoch - 1 <= epoch <= self.epoch or self.rank_of(member_id) is None:
            return Decision()
        # Out of the epochs, not only of training: a member in an epoch must build its
        # groups (this one would hold every build up again) and may report failures.
        c.excluded_until = now + BENCH_S
        self._readmit_at = min(self._readmit_at or c.excluded_until, c.excluded_until)
        return self._offence(c, epoch, reason, now, kind, f"{c.name}: {OFFENCES[kind]}")

    def _offence(
        self,
        c: Member,
        epoch: int,
        reason: str,
        now: float,
        kind: Kind,
        why: str,
        step: int = -1,
        keep_checking: bool = False,
    ) -> Decision:
        """Bench ``c`` for an offence in ``epoch`` (counted once per epoch) and re-form;
        quarantine it after `QUARANTINE_AFTER`. A bad gradient at ``step`` that another
        member was refused for too is the step's samples, not a node: the job halts.
        ``keep_checking``: the offence says nothing of a sum that did not add up (wrong work,
        `checked`): the steps checked row by row since (if any) stay so."""
        d = Decision()
        if (epoch, c.member_id) in self._refused:
            return d
        self._refused.add((epoch, c.member_id))
        if kind is Kind.BAD_GRADIENT and step >= 0:
            refused = self._refused_at.setdefault(step, {})
            refused.setdefault(c.member_id, reason)
            for old in [s for s in self._refused_at if s < step - REFUSED_STEPS_KEPT]:
                del self._refused_at[old]
            if len(refused) >= 2:
                said = "; ".join(f"{self._name(mid)}: {why}" for mid, why in refused.items())
                return self.halt(
                    now,
                    f"step {step} was refused for every member that computed it ({said}). Its samples give "
                    "that gradient whoever computes them: the model or the data (NaN/Inf in these samples, a "
                    "learning rate too high, no loss scaling), not a faulty node. Fix it and restart from the "
                    "last checkpoint",
                    step,
                )
        self._release(self._hearsay.borne_out({epoch}, now, by=c.member_id), now)
        if not keep_checking:
            self._checking_from = None  # found: the next epoch goes back to the job's rule
        c.flags += 1
        c.benched_until = now + BENCH_S
        d.events.append(self._event(now, kind, c.member_id, f"{c.name} (offence {c.flags}): {reason}"))
        if c.flags >= QUARANTINE_AFTER and not c.quarantined:
            c.quarantined = True
            if c.key:
                self._quarantined_keys.add(c.key)  # its node, restarted under the same key, too
            said = (
                f"{c.name} quarantined after {c.flags} offences (refused gradients, wrong work, failed audits, "
                f"absent from or unreachable on the data plane), the last: {reason}"
            )
            d.events.append(self._event(now, Kind.QUARANTINE, c.member_id, f"{said}; out of training"))
            # Told to stop. Even the last member: its sessions' peers may be reconnecting, and
            # a group with no member waits for nodes (a job whose data is at fault halts when
            # a second member is refused for the same step, above).
            d.quarantine[c.member_id] = said
        self._want_epoch(now, urgent=True, reason=why, delay=0.0)
        return d

    def halt(self, now: float, reason: str, step: int = -1) -> Decision:
        """Stop the job on a failure training cannot go past: no epoch forms after it, every
        member is told to stop with ``reason``, and a node that comes later is refused with it
        (a loop that retries or rolls back forever would look like training and never end).
        ``step``: the step that could not be taken (the group committed every one before it)."""
        d = Decision()
        if self.finished:
            return d
        self.step = max(self.step, step)
        self.finished = True
        self.halted = reason
        self._pending_due = None
        d.halt = reason
        d.events.append(self._event(now, Kind.HALTED, None, f"job stopped at step {self.step}: {reason}"))
        return d

    def _name(self, member_id: str) -> str:
        member = self.members.get(member_id)
        return member.name if member is not None else member_id

    def done(self, member_id: str, step: int, digest: str, metrics: dict[str, float], now: float) -> Decision:
        """A member reached the job's last step. The job is finished once most of the
        epoch's trainers said so with the same state: one member's word ends nothing."""
        d = Decision()
        m = self.members.get(member_id)
        if m is None:
            return d
        if self.num_steps and step != self.num_steps:
            d.events.append(
                self._event(now, Kind.REFUSED, member_id, f"{m.name} reports done at step {step}, not the job's "
                            f"last step {self.num_steps}: ignored")
            )  # fmt: skip
            return d
        if self._epoch_members and self.rank_of(member_id) is None and member_id not in self._last_epoch:
            d.events.append(
                self._event(now, Kind.REFUSED, member_id, f"{m.name} reports done but is no member of the epoch "
                            f"that trains: ignored")
            )  # fmt: skip
            return d
        self.heartbeat(member_id, step, now)
        self.final_digests[member_id] = digest
        self._final_metrics[member_id] = metrics
        if self.finished:
            if digest == self.final_digest:
                self.final_metrics.update(metrics)
            return d
        # Only the epoch's members vote (each applied every step: whatever its role, it holds
        # the state), each once, whether or not its session is still open (a finisher's
        # closes): sessions outside the epoch, however many one token holder opens, cannot make
        # a majority, and neither can one member the plan made the only trainer.
        voters = self._voters()
        agree = [mid for mid in voters if self.final_digests.get(mid) == digest]
        if len(agree) < len(voters) // 2 + 1:
            return d
        self.finished = True
        self.final_digest = digest
        for mid in agree:
            self.final_metrics.update(self._final_metrics[mid])
        d.events.append(
            self._event(now, Kind.FINISHED, member_id, f"final step {step} reached ({len(agree)} agree on the state)")
        )
        return d

    def reported_step(self) -> int:
        """The second highest step the epoch's members reported (the highest where it has one
        member): what a joiner's checkpoint is held against. The group's step (`StepQuorum`)
        trails it by a report, and a checkpoint of the newest step must not look ahead of
        the group; one member's word alone still moves it nothing."""
        steps = sorted((x.step for mid in self._epoch_members if (x := self.members.get(mid))), reverse=True)
        return max(self.step, steps[min(1, len(steps) - 1)] if steps else 0)

    def _voters(self) -> list[str]:
        """Whose done counts: the members of the epoch in which most members reached the
        job's last step (an epoch formed after, a member having died at the end, holds only
        some of them), else of the epoch in force, else, for a leader recovering, of the epoch
        its members came back from."""
        if self._last_epoch:
            return self._last_epoch
        if self._epoch_members:
            return self._epoch_members
        found = self._found()
        return sorted(found[1]) if found is not None else []

    def beyond(self, step: int) -> str | None:
        """Why ``step``, as a member reported it, cannot be true (past the job's last step)."""
        if self.num_steps and step > self.num_steps:
            return f"step {step} is past the job's last step {self.num_steps}"
        return None

    # ---------------------------------------------------------------- time

    def tick(self, now: float, expire: bool = True) -> Decision:
        """Expire leases, end a recovery window, and form a pending epoch when due."""
        d = Decision()
        # Leases are checked a tenth of a lease apart, not on every tick: with thousands of
        # members a scan costs milliseconds, and a tenth of a lease late is soon enough.
        scan = expire and now >= self._next_expiry_scan
        if scan:
            self._next_expiry_scan = now + self.lease_s / 10
        for mid, m in list(self.members.items()) if scan else []:
            if now - m.last_seen > self.lease_s and not (self.finished and mid in self.final_digests):
                d.expel[mid] = f"no heartbeat for {now - m.last_seen:.2f} s (lease {self.lease_s} s)"
                d.merge(self.fail(mid, now, f"lease expired after {now - m.last_seen:.2f} s"))
        if self.recovering_until is not None:
            d.merge(self._recover(now))
            if self.recovering_until is not None:
                return d
        if not self._started and len(self.members) < self.min_nodes:
            return d  # the job has not started: wait for enough nodes
        if not self._started and all(m.preference is Preference.VALIDATOR for m in self.members.values()):
            return d  # ...and for one that may train: a validator never does (`--role validator`)
        d.merge(self._check_outcomes(self.checks.expire(now), now))
        if self._finishers_gone:
            d.merge(self._finishers_check(now))
        for mid in self._hearsay.due(now):
            why = f"reported {HEARSAY_LIMIT} failed collectives within {HEARSAY_PERIOD_S:g} s that nothing bore out"
            d.merge(self.absent(mid, self.epoch, why, now, kind=Kind.UNFOUNDED))
        if self._readmit_at is not None and now >= self._readmit_at:
            later = [m.excluded_until for m in self.members.values() if m.excluded_until > now]
            self._readmit_at = min(later) if later else None
            back = [m for m in self.members.values() if 0 < m.excluded_until <= now and m.member_id not in self._ranks]
            for m in back:
                if m.quarantined:
                    continue
                # A join that waited (`admissions`) is a join; anyone else was kept out for an offence.
                joined = m.state is MemberState.JOINING
                why = f"{m.name} joined" if joined else "a member kept out of the data plane may try again"
                self._want_epoch(now, urgent=False, reason=why, delay=0)
        if self._checking_from is not None and self.step >= self._checking_from + CHECKED_STEPS:
            self._checking_from = None
            self._want_epoch(now, urgent=False, reason=f"no culprit in {CHECKED_STEPS} checked steps", delay=0.0)
        if self._pending_due is not None and now >= self._pending_due and not self.finished:
            d.merge(self._form_epoch(now, self._pending_urgent, self._pending_reason()))
        elif self._pending_due is None and not self.finished and now >= self._next_rebalance:
            # A large group is reviewed less often (a review costs about 10 µs a member):
            # it stays a few percent of the loop at any size.
            self._next_rebalance = now + REBALANCE_EVERY_S * max(1.0, len(self._epoch_members) / REVIEW_MEMBERS)
            d.merge(self._review_plan(now))
        return d

    def _review_plan(self, now: float) -> Decision:
        """Report stragglers; replace the plan when the measurements say a better one exists."""
        d = Decision()
        if self.plan is None or self.batch_size is None or not self.epoch_members:
            return d
        members = [self.members.get(mid) for mid in self.epoch_members]
        if any(m is None for m in members):
            return d
        live = [m for m in members if m is not None]
        trainers = [m for m in live if m.role is Role.TRAINER]
        times = {m.member_id: list(m.compute_times) for m in trainers}
        planned = len(self.shares) == len(self.epoch_members)
        shares = dict(zip(self.epoch_members, self.shares, strict=True)) if planned else None
        found = find_stragglers(times, self._planned_times, self._comm_s(trainers), shares)
        self._straggling = {mid: (self._straggling.get(mid, (now, ""))[0], why) for mid, why in found.items()}
        for mid, (since, why) in self._straggling.items():
            if mid not in self._stragglers and now - since >= STRAGGLER_PERSIST_S:
                d.events.extend(self._straggler(now, mid, why))
        if now - self._planned_at < PLAN_DWELL_S:
            return d
        if any(m.zone == AUTO for m in live):
            zones = self.zones_of(live)
            if (zones if len(set(zones)) > 1 else []) != self._zones_in_force:
                groups = ", ".join(f"{m.name} {z}" for m, z in zip(live, zones, strict=True) if m.zone == AUTO)
                self._want_epoch(now, urgent=False, reason=f"zones regrouped by round-trip time: {groups}", delay=0.0)
                return d
        if not self.balance:
            return d
        if any(len(m.compute_times) < PLAN_DWELL_STEPS for m in trainers):
            return d
        for m in trainers:
            m.review(self.batch_size / len(trainers))
        # What makes a speed stray (processes sharing cores, other jobs) is mostly the site's,
        # and a difference between two members strays with both: a member whose own record
        # happened to be calm is judged with the group's typical wander at least.
        typical = statistics.median(m.wander for m in trainers) if trainers else 0.0
        for m in trainers:
            m.typical_wander = typical
        better = rebalance(
            self.batch_size,
            self.shares,
            [m.profile(now) for m in live],
            overhead_s=self._comm_s(trainers),
            wander=[max(m.wander, m.typical_wander) for m in live],
        )
        if better is None:
            self._better_since = None
        elif self._better_since is None:
            self._better_since = now  # a passing disturbance (a process starting) must not move shares
        elif now - self._better_since >= REBALANCE_PERSIST_S:
            self._better_since = None
            # Whoever stands out now moved the shares: it was slow long enough to matter.
            for mid, (_, why) in self._straggling.items():
                if mid not in self._stragglers:
                    d.events.extend(self._straggler(now, mid, why))
            self._want_epoch(now, urgent=False, reason=better[1], delay=0.0)
        return d

    def _straggler(self, now: float, mid: str, why: str) -> list[Event]:
        self._stragglers.add(mid)
        return [self._event(now, Kind.STRAGGLER, mid, f"{self.members[mid].name}: {why}")]

    def _recover(self, now: float) -> Decision:
        assert self.recovering_until is not None
        d = Decision()
        if self._resumes:
            newest = max(r.epoch for r in self._resumes.values())
            first = next(r for r in self._resumes.values() if r.epoch == newest)
            group = first.members
            back = {mid for mid, r in self._resumes.items() if r.epoch == newest and r.members == group}
            intact = not any(r.abandoned for r in self._resumes.values() if r.epoch == newest)
            if intact and set(group) <= back and set(group) <= set(self.members):
                self.recovering_until = None
                self.epoch = newest
                self.epoch_members = list(group)
                members = [self.members[m] for m in group]
                self._make_plan(members, now)
                if len(first.shares) == len(group) and len(first.roles) == len(group):
                    # The plan in force is the one the nodes carry, not one made from new reports.
                    roles = [Role(r) for r in first.roles]
                    self.plan = adopt([m.profile() for m in members], first.shares, roles)
                    self.shares = list(first.shares)
                    self._planned_times = self._times(members, self.shares)
                    for mem, role in zip(members, roles, strict=True):
                        mem.role = role
                for mid in group:
                    self.members[mid].state = MemberState.ACTIVE
                d.events.append(self._event(now, Kind.ADOPT, None, f"rebuilt epoch {newest} from {len(group)} members"))
                if len(self.members) > len(group):
                    self._want_epoch(now, urgent=False, reason="nodes joined during recovery", delay=0.0)
                return d
        if now >= self.recovering_until:
            if now < self._outage_fence and (found := self._found()) is not None:
                epoch, found_members = found
                if not found_members <= set(self.members) | self._came_back | self._dead(epoch, found_members):
                    return d  # one not back may still commit in that epoch
            self.recovering_until = None
            if self.members and self._pending_due is not None:
                self._pending_due, self._pending_urgent = now, True  # a failure during recovery said why
            elif self.members:
                why = (
                    "a member abandoned the last epoch while no coordinator led"
                    if any(r.abandoned for r in self._resumes.values())
                    else "members of the last epoch did not return after restart"
                    if self._resumes
                    else "nodes connected to a coordinator that had just started"
                )
                self._want_epoch(now, urgent=True, reason=why, delay=0.0)
        return d

    def _want_epoch(self, now: float, urgent: bool, reason: str, delay: float, replacing: str | None = None) -> None:
        """Form an epoch ``delay`` from ``now`` (or sooner if one is pending) for ``reason``,
        which replaces the pending reasons that start with ``replacing``."""
        due = now + delay
        if self._pending_due is None:
            self._pending_due = due
            self._pending_reasons = {reason: None}
        else:
            self._pending_due = min(self._pending_due, due)
            if replacing is not None:
                self._pending_reasons = {r: None for r in self._pending_reasons if not r.startswith(replacing)}
            self._pending_reasons[reason] = None
        self._pending_urgent = self._pending_urgent or urgent

    def _pending_reason(self) -> str:
        """Why the pending epoch forms: every reason when few, else the first few and a count
        (a thousand joins make one epoch, not a reason of a thousand parts)."""
        reasons = list(self._pending_reasons)
        if len(reasons) <= REASONS_SHOWN:
            return "; ".join(reasons)
        return "; ".join(reasons[:REASONS_SHOWN]) + f"; and {len(reasons) - REASONS_SHOWN} more"

    @staticmethod
    def zones_of(members: Sequence[Member]) -> list[str]:
        """Each member's zone: its own, or for ``--zone auto`` one grouped by round-trip time."""
        auto = group_by_rtt({m.member_id: m.caps.rtt_s for m in members if m.zone == AUTO})
        return [auto.get(m.member_id, m.zone) for m in members]

    def _policy(self, members: Sequence[Member]) -> PolicyMsg:
        """The job's policy, with its rule tightened to ``checked`` (every contribution gathered
        and checked) while a sum recently did not add up or a member that offended before is
        in the epoch: a benched member still sends a row, and only gathered rows say what each
        member sent."""
        watched = self._checking_from is not None or any(m.flags for m in members)
        if watched and self.policy.aggregate.kind == "mean":
            return PolicyMsg.of(dataclasses.replace(self.policy, aggregate=Rule("checked")))
        return self._policy_msg

    @staticmethod
    def _times(members: Sequence[Member], shares: Sequence[int]) -> dict[str, float]:
        """Each member's predicted compute time for its share (what stragglers are judged against)."""
        return {m.member_id: m.profile().time_for(s) for m, s in zip(members, shares, strict=True)}

    @staticmethod
    def _comm_s(trainers: Sequence[Member]) -> float:
        """Time a step spends outside compute: the all-reduce as the slowest trainer sees it
        (it waits for nobody), i.e. the smallest reported."""
        reported = [m.caps.comm_s for m in trainers if m.caps.comm_s > 0]
        return min(reported, default=0.0)

    def _make_plan(self, members: Sequence[Member], now: float) -> list[Event]:
        """Plan shares and roles for the new epoch's members; events for changed roles."""
        events: list[Event] = []
        if self.batch_size is None:
            self.plan, self.shares = None, [0] * len(members)
            return events
        p = plan(
            self.batch_size,
            [m.profile(now) for m in members],
            balance=self.balance,
            spares_wanted=self._vacated,
            overhead_s=self._comm_s([m for m in members if m.role is Role.TRAINER]),
        )
        self.plan, self.shares = p, list(p.shares)
        self._planned_at = now
        self._better_since = None
        self._planned_times = self._times(members, p.shares)
        self._vacated = 0
        self._stragglers.clear()
        self._straggling.clear()
        for m, role, why in zip(members, p.roles, p.reasons, strict=True):
            m.compute_times.clear()
            if m.preference is Preference.STANDBY and role is Role.TRAINER:
                m.preference = Preference.AUTO  # a promoted spare stays a regular member
            if role is not m.role and (m.role is not None or role is not Role.TRAINER):
                was = m.role.value if m.role is not None else "new"
                events.append(self._event(now, Kind.ROLE, m.member_id, f"{m.name}: {was} -> {role.value}: {why}"))
            m.role = role
        return events

    def _form_epoch(self, now: float, urgent: bool, reason: str) -> Decision:
        d = Decision()
        self._pending_due, self._pending_urgent, self._pending_reasons = None, False, {}
        if not urgent and self.epoch_members and self.step <= self._formed_at_step:
            # Nothing of the epoch in force has committed (that the leader heard of): some
            # members may be in its first step while others still sync, and the ones syncing
            # would leave for the new order while the others wait in that step for them. A
            # graceful switch needs a step all of them reach: this one switches at once.
            urgent = True

        def eligible(m: Member) -> bool:
            # A member that said done trains no more: an epoch holding it would wait for it.
            return not m.quarantined and m.excluded_until <= now and m.member_id not in self.final_digests

        keep = [
            m
            for m in self.epoch_members
            if m in self.members and self.members[m].state != MemberState.LEAVING and eligible(self.members[m])
        ]
        # A benched member goes behind the others (a stable sort): it never leads its zone,
        # whose DiLoCo pseudo-gradient is its leader's word alone.
        keep.sort(key=lambda mid: self.members[mid].benched_until > now)
        kept = set(keep)
        new = sorted(
            (
                m
                for m in self.members.values()
                if m.member_id not in kept
                and (m.state == MemberState.JOINING or (m.state == MemberState.ACTIVE and m.excluded_until))
                and eligible(m)
            ),
            key=lambda m: (m.joined_at, m.member_id),
        )
        order = keep + [m.member_id for m in new]
        if not order:
            return d
        old = list(self.epoch_members)
        self.epoch = max(self.epoch, self._epoch_floor) + 1
        self._started = True
        self.epoch_members = order
        self._formed_at_step = self.step  # after the members: their earlier reports may raise it
        members = [self.members[m] for m in order]
        d.events.extend(self._make_plan(members, now))
        zones = self.zones_of(members)
        self._witnesses[self.epoch] = dict(zip(order, zones, strict=True))
        for e in [e for e in self._witnesses if e < self.epoch - 1]:
            del self._witnesses[e]
        self._accusers = {k: v for k, v in self._accusers.items() if k[0] >= self.epoch - 1}
        self._rollbacks = {e: r for e, r in self._rollbacks.items() if e >= self.epoch - 1}
        self._zones_in_force = zones if len(set(zones)) > 1 else []
        names = list(dict.fromkeys(self._zones_in_force))
        self._ring = self.links.ring(names, self._ring, now) if len(names) >= RING_MIN_ZONES else []
        for m in members:
            m.state = MemberState.ACTIVE
        msg = EpochOrder(
            epoch=self.epoch,
            term=self.term,
            members=order,
            shares=self.shares,
            urgent=urgent,
            reason=reason,
            roles=list(self.plan.roles) if self.plan else [],
            microbatches=list(self.plan.microbatches) if self.plan else [],
            zones=self._zones_in_force,
            ring=self._ring,
            probe_links=bool(self._ring) and not self.links.complete(self._ring, now),
            policy=self._policy(members),
            rollback_to=self._rollback_to,
            refused=self._verdicts,
        )
        self._rollback_to = -1  # told once: a later epoch must not roll back again
        # Everyone of the old epoch hears of it (a leaver learns it may go), and everyone of the new.
        for mid in dict.fromkeys(old + order):
            if mid in self.members or mid in old:
                d.orders[mid] = msg
        d.events.append(self._event(now, Kind.EPOCH, None, f"epoch {self.epoch} with {len(order)} members: {reason}"))
        return d

    def _event(self, now: float, kind: Kind, member: str | None, reason: str) -> Event:
        return Event(time=now, kind=kind, member=member, epoch=self.epoch, step=self.step, reason=reason)
