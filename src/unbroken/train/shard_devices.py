"""Where a sharded zone keeps its shards, epoch by epoch (`unbroken.train.sharding`): what a
member says of its device in its reports, the placement the zone's reports decide
(`unbroken.comm.placement.place`), and the NCCL group it builds or keeps
(`unbroken.comm.nccl`).

What a member says, and what follows for its whole zone::

    its device (kind, GPU id and model, NCCL)     the backend, where the shards live
    reached through a forwarder                   gloo (NCCL dials every peer directly)
    its NCCL build failed, and why                gloo, from then on
    the NCCL group it keeps (a token)             kept where every member keeps the same
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import torch

from unbroken.comm.group import EpochScope, ProcessGroup
from unbroken.comm.nccl import Communicator, build_nccl, nccl_environment
from unbroken.comm.placement import Backend, MemberDevice, Placement, member_device, place
from unbroken.errors import CollectiveFailed

log = logging.getLogger(__name__)


class ZoneDevices:
    """One member's side of its zone's placement."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        """Where this member computes (the node's ``--device``)."""
        self.failed = ""
        """Why this member's NCCL build failed (said in every report after; empty: none did)."""
        self.comm = Communicator()
        """The NCCL group kept from the last epoch, if any."""
        self._reason = ""
        if device.type == "cuda":  # before any NCCL group: torch reads them at a group's build
            nccl_environment()

    def said(self, forwarded: bool) -> str:
        """This member's device as its report says it (`MemberDevice`, encoded); ``forwarded``:
        its peers reach it through a forwarder."""
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
            CollectiveFailed: the NCCL build failed (where it failed here, this member's
                reports say so from now on: the zone's next placements take gloo).
            EpochAborted: the epoch was abandoned during the build.
        """
        placement = place(devices, me, self.device, ranged=ranged)
        if placement.reason != self._reason:
            self._reason = placement.reason
            log.log(logging.WARNING if placement.fallback else logging.INFO, "%s: sharded zone placement: %s",
                    me, placement.reason)  # fmt: skip
        if placement.backend is not Backend.NCCL:
            self.comm.drop()
            return placement, group
        members = sorted(ranks, key=ranks.__getitem__)
        kept = self.comm.reusable([devices[m].holds for m in members], members)
        if kept is not None:
            return placement, kept
        self.comm.drop()
        try:
            built = build_nccl(group, name, ranks[me], len(ranks), placement.shards, scope)
        except CollectiveFailed as exc:
            if exc.__cause__ is not None:  # its own NCCL refused, not a deadline or a peer
                self.failed = str(exc.__cause__).splitlines()[0][:200] or type(exc.__cause__).__name__
                log.warning("%s: its NCCL build failed (%s): its zone takes gloo from the next placement",
                            me, self.failed)  # fmt: skip
            raise
        self.comm.keep(built, members)
        log.info("%s: zone group %s built in %.1f ms: %s", me, name, built.seconds * 1e3, placement.reason)
        return placement, built.pg
