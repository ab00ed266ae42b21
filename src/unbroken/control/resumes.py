"""A reconnecting member's resume sent as a digest of its epoch's lists, and what a
coordinator checks it against.

A node back from an epoch says which one (`wire.Resume`): its members, shares and roles,
which a restarted coordinator rebuilds the epoch from (`recovery`). At 10,000 members those
lists are 370 KB in every reconnecting hello, and a relay's members reconnect together. So
a node sends their digest instead (`digested`); the coordinator checks it against what it
holds of that epoch (its last order, or a resume another member sent in full) and takes the
lists from there (`Resumes.expand`). Where it holds nothing that matches (it has just
started, or the node's lists differ from its own), it refuses that hello asking for the
lists (`Refused.resume_in_full`), and the node sends them at once on a new session: one
round trip, for one member of each epoch.
"""

from __future__ import annotations

import hashlib
import json

from unbroken.control.downward import EpochOrder
from unbroken.control.wire import Resume
from unbroken.specs import Role

KEPT = 8
"""Distinct resumes kept by digest (members of more epochs than this are rare: all but a
few come back from the newest)."""


def digest(epoch: int, members: list[str], shares: list[int], roles: list[Role]) -> str:
    text = json.dumps([epoch, members, shares, [r.value for r in roles]], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def digested(resume: Resume) -> Resume:
    """``resume`` with its lists left out and their digest in their place."""
    if resume.digest:
        return resume
    lists = digest(resume.epoch, list(resume.members), list(resume.shares), list(resume.roles))
    return resume.model_copy(update={"members": [], "shares": [], "roles": [], "digest": lists})


class Resumes:
    """The epochs' lists a coordinator can check a digested resume against."""

    def __init__(self) -> None:
        self._known: dict[str, Resume] = {}
        self._order_epoch = -1

    def learn(self, resume: Resume) -> None:
        """A resume that came in full: a later digest of the same lists is taken from it."""
        if resume.digest or not resume.members:
            return
        if len(self._known) >= KEPT:
            self._known.pop(next(iter(self._known)))
        self._known[digested(resume).digest] = resume

    def expand(self, resume: Resume, last: EpochOrder | None) -> Resume | None:
        """``resume`` with its lists (itself, if it came with them); None: its digest matches
        nothing held here (ask for them)."""
        if not resume.digest:
            self.learn(resume)
            return resume
        if last is not None and last.epoch == resume.epoch and self._order_epoch != last.epoch:
            # The order in force as its members hold it (hashed once per epoch, when asked).
            self._order_epoch = last.epoch
            self.learn(Resume(epoch=last.epoch, members=last.members, step=0, shares=last.shares, roles=last.roles))
        known = self._known.get(resume.digest)
        if known is None or known.epoch != resume.epoch:
            return None
        update = {"members": known.members, "shares": known.shares, "roles": known.roles, "digest": ""}
        return resume.model_copy(update=update)
