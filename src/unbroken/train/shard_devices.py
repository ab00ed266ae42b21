"""Where a sharded zone keeps its shards, epoch by epoch (`unbroken.train.sharding`): what a
member says of its device in its reports, the placement the zone's reports decide
(`unbroken.comm.placement.place`), and the NCCL group it builds or keeps
(`unbroken.comm.nccl`).

What a member says, and what follows for its whole zone::

    its device (kind, GPU id and model, NCCL)     the backend, where the shards live
    reached through a forwarder                   gloo (NCCL dials every peer directly)
    its NCCL build failed, and why                gloo, while the zone's members stay
    the NCCL group it keeps (a token)             kept where every member keeps the same

A build failed "here" where this member's own NCCL refused (`NcclRefused`: no peer had a
part in it), or where `REFUSED_AFTER` builds in a row failed with the zone's members and
ranks unchanged (a connect that fails every time). A build that failed once for anything
else (a peer died during it, a connect, a deadline) says nothing: the next epoch, without
the dead peer, tries NCCL again. The mark holds while the zone's members and ranks are
those it was made with; the first report to another membership drops it, and the zone
tries NCCL again (a persistent refusal costs one failed build per membership change).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from unbroken.comm.group import EpochScope, ProcessGroup
from unbroken.comm.nccl import Communicator, build_nccl, nccl_environment
from unbroken.comm.placement import Backend, MemberDevice, Placement, member_device, place
from unbroken.errors import CollectiveFailed, NcclRefused

log = logging.getLogger(__name__)

REFUSED_AFTER = 2
"""NCCL builds failed in a row with the zone's members and ranks unchanged, after which a
member says its build failed though its own NCCL never refused: a connect refused each time
(a firewall between the GPUs' hosts, an interface the peers cannot reach) would otherwise
fail every epoch. A peer's death changes the members: it counts once."""


class ZoneDevices:
    """One member's side of its zone's placement."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        """Where this member computes (the node's ``--device``)."""
        self.failed = ""
        """Why this member's NCCL builds fail (said in its reports while its zone's members
        are `failed_with`; empty: none failed)."""
        self.failed_with: tuple[str, ...] = ()
        """The zone's members, in rank order, that `failed` was said of."""
        self.comm = Communicator()
        """The NCCL group kept from the last epoch, if any."""
        self._reason = ""
        self._streak: tuple[tuple[str, ...], int] = ((), 0)
        """The members the last builds failed with, and how many failed in a row."""
        if device.type == "cuda":  # before any NCCL group: torch reads them at a group's build
            nccl_environment()

    def said(self, forwarded: bool, members: Sequence[str]) -> str:
        """This member's device as its report says it (`MemberDevice`, encoded); ``forwarded``:
        its peers reach it through a forwarder; ``members``: its zone's members this epoch,
        in rank order (a failed build is said only to the members it failed with)."""
        if self.failed and tuple(members) != self.failed_with:
            log.info("its sharded zone's members changed since its NCCL build failed (%s): NCCL is tried again",
                     self.failed)  # fmt: skip
            self.failed, self.failed_with = "", ()
        mine = member_device(self.device)
        return replace(mine, forwarded=forwarded, holds=self.comm.token, failed=self.failed).encode()

    def place(
        self,
        name: str,
        me: str,
        devices: Mapping[str, MemberDevice],
        ranks: Mapping[str, int],
        group: ProcessGroup,
        scope: EpochScope,
        *,
        ranged: bool,
    ) -> tuple[Placement, ProcessGroup]:
        """The zone's placement from its members' ``devices`` (as their reports said them),
        and the group its gathers and sums run on: the NCCL group every member kept, one
        built now over the zone's gloo ``group`` (named ``name``), or ``group`` itself.

        Raises:
            CollectiveFailed: the NCCL build failed (where it failed here, see the module's
                docstring, this member's reports say so while the zone's members stay: its
                next placements take gloo).
            EpochAborted: the epoch was abandoned during the build.
        """
        placement = place(devices, me, self.device, ranged=ranged)
        if placement.reason != self._reason:
            self._reason = placement.reason
            log.log(logging.WARNING if placement.fallback else logging.INFO, "%s: sharded zone placement: %s",
                    me, placement.reason)  # fmt: skip
        if placement.backend is not Backend.NCCL:
            self.comm.drop()
            self._streak = ((), 0)  # "in a row": an epoch between that built nothing breaks it
            return placement, group
        members = sorted(ranks, key=ranks.__getitem__)
        kept = self.comm.reusable([devices[m].holds for m in members], members)
        if kept is not None:
            self._streak = ((), 0)
            return placement, kept
        self.comm.drop()
        try:
            built = build_nccl(group, name, ranks[me], len(ranks), placement.shards, scope)
        except NcclRefused as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            self._fail(me, members, str(cause).splitlines()[0][:200] or type(cause).__name__)
            raise
        except CollectiveFailed as exc:  # maybe a peer's doing: only a streak says it
            failed_with, count = self._streak
            self._streak = (tuple(members), count + 1 if failed_with == tuple(members) else 1)
            if self._streak[1] >= REFUSED_AFTER:
                self._fail(me, members, f"{self._streak[1]} builds in a row: {str(exc).splitlines()[0][:200]}")
            raise
        self._streak = ((), 0)
        self.comm.keep(built, members)
        log.info("%s: zone group %s built in %.1f ms: %s", me, name, built.seconds * 1e3, placement.reason)
        return placement, built.pg

    def _fail(self, me: str, members: Sequence[str], why: str) -> None:
        self.failed, self.failed_with, self._streak = why, tuple(members), ((), 0)
        log.warning("%s: its NCCL build failed (%s): its zone takes gloo from the next placement, while its "
                    "members stay", me, why)  # fmt: skip
