"""Where a sharded zone keeps its shards and which backend gathers and sums them: a pure
function of the zone's members' devices (`place`), the same on every member.

    every member on a CUDA device of its own,      NCCL; the shards (values, gradients,
    one kind of GPU, NCCL in every torch           optimizer state) on the device
    anything else (a CPU member, two members       gloo; the shards on the CPU; a member
    on one GPU, two kinds of GPU, no NCCL, a       computing on a device stages each block's
    member behind a forwarder or whose NCCL        parameters to it and its gradients back
    build failed)

One kind of GPU: a range's primary and buddy step the optimizer on two devices and must stay
bit-identical; two GPU models need not round alike, the CPUs do. One device per member:
NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU detected"), so members
sharing a GPU (a one-GPU machine running several nodes) take gloo with staging. Several zones
whose exchange goes range by range (DiLoCo, a lossy codec: `unbroken.comm.outer_ranges`) keep
the shards on the CPU: those exchanges work on CPU tensors. What crosses zones, re-shards,
digests and shard files are CPU tensors whatever the placement (copied at the boundary).
NCCL connects every pair of members directly, on sockets of its own, so a member its peers
reach only through a forwarder (`unbroken.sched.nat`) cannot be in an NCCL group; a member
whose NCCL build failed (`unbroken.train.shard_devices` says when a failure counts) says so
in its reports while the zone's members stay, and each member, reading the same reports,
decides gloo for the zone (another membership, or a member restarted, tries NCCL again).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch

CPU = torch.device("cpu")
MAX_NCCL_RANKS = 128
"""The most members an NCCL zone takes: its group meets by rank 0's NCCL id alone (relayed
over the zone's gloo group, `unbroken.comm.nccl.build_nccl`); past 128 ranks torch's NCCL
init asks for more roots, each with an id of its own."""


class Backend(Enum):
    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True)
class MemberDevice:
    """What a member says of the device it computes on (in its report of its ranges)."""

    kind: str = "cpu"
    """``cpu``, ``cuda``, ``mps``, ..."""
    uuid: str = ""
    """The GPU's own id (two members with one id share a GPU)."""
    name: str = ""
    """The GPU's model (``NVIDIA H100 80GB HBM3``): its kind, for rounding alike."""
    nccl: bool = False
    """Its torch has NCCL."""
    forwarded: bool = False
    """Its peers reach it through a forwarder (behind NAT, ``--no-inbound``, or moved behind
    one): NCCL dials every peer directly, so its zone cannot form an NCCL group."""
    holds: str = ""
    """The NCCL group it keeps from the last epoch (`unbroken.comm.nccl.Communicator`'s
    token; empty: none): the zone reuses it where every member keeps the same."""
    failed: str = ""
    """Why its NCCL build failed (empty: none did): its zone takes gloo while its members stay."""

    def encode(self) -> str:
        flags = ("nccl" if self.nccl else "", "forwarded" if self.forwarded else "")
        return "|".join((self.kind, self.uuid, self.name, *flags, self.holds, self.failed))

    @staticmethod
    def decode(text: str) -> MemberDevice:
        """The inverse of `encode`; an empty text is a CPU member (a report from before devices)."""
        parts = [*text.split("|", 6), "", "", "", "", "", ""][:7] if text else ["cpu", *[""] * 6]
        return MemberDevice(
            parts[0] or "cpu", parts[1], parts[2], parts[3] == "nccl", parts[4] == "forwarded", parts[5], parts[6]
        )


@dataclass(frozen=True)
class Placement:
    """Where this member's shards live, where it computes, and the zone's backend."""

    backend: Backend = Backend.GLOO
    shards: torch.device = CPU
    """Where the held ranges, their gradients and optimizer state, and the buffers of the
    zone's gathers and sums live."""
    compute: torch.device = CPU
    """Where forward and backward run (the model's parameters are filled there)."""
    reason: str = "every member computes on the CPU: gloo"
    stage: bool = False
    """Stage through `shards` even where it is ``compute`` (tests run the staging path on the CPU)."""
    fallback: bool = False
    """NCCL would serve the zone's devices, but a member cannot take part in an NCCL group
    (behind a forwarder, or its NCCL build failed): said as a warning."""

    @property
    def staged(self) -> bool:
        """Each block's parameters are copied to the compute device and its gradients back."""
        return self.stage or self.compute != self.shards

    @property
    def polled(self) -> bool:
        """Collectives are waited on by polling their completion: NCCL's futures are done
        as soon as the work is queued on its stream, not when it ran."""
        return self.backend is Backend.NCCL


def place(devices: Mapping[str, MemberDevice], me: str, compute: torch.device, *, ranged: bool = False) -> Placement:
    """The zone's placement for ``me`` (computing on ``compute``) from every member's device
    (``devices``: the zone's members, ``me`` among them). ``ranged``: several zones exchange
    range by range (DiLoCo or a lossy codec). The same backend on every member: each decides
    from the same reports."""
    if me not in devices:
        raise ValueError(f"{me} is not among the zone's members {sorted(devices)}")
    kinds = sorted({d.kind for d in devices.values()})
    if kinds == ["cpu"]:
        return Placement(compute=compute)
    why = ""
    fallback = False
    if kinds != ["cuda"]:
        why = f"the members compute on {', '.join(kinds)}"
    elif no := sorted(m for m, d in devices.items() if not d.nccl):
        why = f"{no[0]}'s torch has no NCCL"
    elif failed := sorted(m for m, d in devices.items() if d.failed):
        why, fallback = f"{failed[0]}'s NCCL build failed ({devices[failed[0]].failed})", True
    elif behind := sorted(m for m, d in devices.items() if d.forwarded):
        why, fallback = f"{behind[0]} is reached through a forwarder (NCCL connects to every peer directly)", True
    elif len({d.name for d in devices.values()}) > 1:
        names = sorted({d.name for d in devices.values()})
        why = f"GPUs of {len(names)} kinds ({', '.join(names)}) need not round alike; the CPUs do"
    elif shared := _sharing(devices):
        why = f"{shared[0]} and {shared[1]} compute on one GPU (NCCL takes one rank per device)"
    elif len(devices) > MAX_NCCL_RANKS:
        why = f"{len(devices)} members, more than the {MAX_NCCL_RANKS} an NCCL zone takes"
    elif ranged:
        why = "the zones exchange range by range (DiLoCo or a lossy codec), on CPU shards"
    if why:
        staged = "" if compute.type == "cpu" else f", each block staged to {compute}"
        return Placement(compute=compute, reason=f"{why}: gloo, the shards on the CPU{staged}", fallback=fallback)
    return Placement(
        Backend.NCCL,
        compute,
        compute,
        f"every member on a {devices[me].name} of its own: NCCL, the shards on the device",
    )


def _sharing(devices: Mapping[str, MemberDevice]) -> tuple[str, str] | None:
    seen: dict[str, str] = {}
    for m, d in devices.items():
        if d.uuid in seen:
            return seen[d.uuid], m
        seen[d.uuid] = m
    return None


def member_device(device: torch.device) -> MemberDevice:
    """This process's `MemberDevice` for computing on ``device``."""
    if device.type != "cuda":
        return MemberDevice(device.type)
    import torch.distributed as dist

    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    # Without a uuid (an old driver), the host and index tell devices apart as well.
    uuid = str(getattr(props, "uuid", "") or f"{socket.gethostname()}:{index}")
    return MemberDevice("cuda", uuid, str(props.name), dist.is_nccl_available())
