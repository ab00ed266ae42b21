"""The gate: what a hello must match to join, and why it is refused when it does not —
the job (its name, identity and spec), its model's fingerprint, its last step, and the key
its member id is bound to (`unbroken.control.identity`).

A refusal names the difference and what to do about it (promise 6): the fields two job
specs differ in, the first parameter two models differ in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from unbroken.control.messages import Hello, TensorSpec
from unbroken.control.recovery import Recovery
from unbroken.control.roster import Roster


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


class Gate:
    """The job the group runs, as its first member said, and the checks each hello passes."""

    def __init__(self, roster: Roster, recovery: Recovery, quarantined_keys: set[str]) -> None:
        """``quarantined_keys``: keys the group quarantined (`tribunal.Tribunal.offence`)."""
        self._roster = roster
        self._recovery = recovery
        self._quarantined_keys = quarantined_keys
        self.job: str | None = None
        self.job_identity: str | None = None
        self.job_spec = ""
        """The first member's `Job.identity_spec` (JSON): what a refused node differs in."""
        self.fingerprint: list[TensorSpec] | None = None

    def let_in(self, hello: Hello) -> None:
        """``hello`` passed: the group's job is the one it runs (the first member's spec stays)."""
        self.job, self.job_identity = hello.job, hello.job_identity
        self.job_spec = self.job_spec or hello.job_spec
        self.fingerprint = list(hello.fingerprint)
        self._roster.num_steps = self._roster.num_steps or hello.steps
        self._roster.batch_size = hello.batch_size

    def beyond(self, step: int) -> str | None:
        """Why ``step``, as a member reported it, cannot be true (past the job's last step)."""
        num_steps = self._roster.num_steps
        if num_steps and step > num_steps:
            return f"step {step} is past the job's last step {num_steps}"
        return None

    def unbound(self, member_id: str, key: str, one_per_key: bool = False) -> str | None:
        """Why a hello as ``member_id`` signed by ``key`` may not stand for it: the member id
        is bound to another key (a token holder speaking as another member), or, with
        ``one_per_key`` (a job admitting listed keys), the key is another member's now."""
        if key and key in self._quarantined_keys:
            return "its key was quarantined by the group (give the node a new key only once it is fixed)"
        m = self._roster.members.get(member_id)
        if m is not None and m.key and m.key != key:
            return (
                f"member id {member_id!r} belongs to another node's key: a node cannot take another member's "
                "place (a restarted node joins under a new member id)"
            )
        if one_per_key and m is None:
            other = next((x for x in self._roster.members.values() if x.key == key), None)
            if other is not None:
                return (
                    f"its key is {other.name}'s ({other.member_id}), in the job now: one member per key (give "
                    "each node its own, `unbroken keygen`; a node that died is let go within a lease)"
                )
        return None

    def refusal(self, hello: Hello, reconnect: bool) -> str | None:
        """Why ``hello`` is refused, or None. A ``reconnect``ing member's hello that passes is
        its heartbeat."""
        r = self._roster
        if self.job is not None and (hello.job != self.job or hello.job_identity != self.job_identity):
            differs = job_differences(self.job_spec, hello.job_spec)
            said = f"; it differs in {'; '.join(differs)} (the group's vs this node's)" if differs else ""
            if any(d.startswith("shard") for d in differs):
                said += "; a sharded job's nodes all shard: start every node with --shard (or give the Job shard=)"
            return (
                f"this coordinator runs job {self.job!r} ({self.job_identity}); this node runs "
                f"{hello.job!r} ({hello.job_identity}){said}: start a separate coordinator per job (with etcd: "
                "a separate --etcd-prefix), or use the same job settings (name, batch size, steps, seed, dataset "
                "size, arguments, the optimizer's hyperparameters)"
            )
        if r.num_steps and hello.steps and hello.steps != r.num_steps:
            return f"this node's job ends at step {hello.steps}, the group's at step {r.num_steps}"
        if (why := self.beyond(hello.step)) is not None:
            return f"this node claims {why}"
        if self.fingerprint is not None:
            diff = first_mismatch(self.fingerprint, hello.fingerprint)
            if diff is not None:
                return f"model does not match the group's: {diff}"
        if hello.member_id in r.members:
            return None if reconnect else f"member id {hello.member_id!r} is already connected"
        if r.halted is not None:
            return f"job {self.job!r} was stopped at step {r.step}: {r.halted}"
        if r.finished:
            return f"job {self.job!r} already finished at step {r.step}"
        x = hello.resume
        if x is not None and self._recovery.until is None and r.epoch_members and x.epoch != r.epoch:
            # Its epoch was superseded while it was away (frozen, cut off): it must not
            # commit anything more there, so it comes back as a new member and catches up.
            return f"epoch {x.epoch} is over (the group is in epoch {r.epoch}); rejoin as a new member"
        return None
