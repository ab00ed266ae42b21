"""Forming an epoch's data plane: the groups an epoch order names, built on the rendezvous
the coordinator relays (`control.meeting`), and what a node does when a peer cannot be
reached (it tries the peers' addresses and says whom: `unbroken.comm.reach`)."""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from unbroken.comm.codecs import Codec, make_codec
from unbroken.comm.forward import ForwarderThread, job_hosts, offered_address
from unbroken.comm.group import PUBLISH_S, EpochGroup, EpochScope, Meeting, build_group, wait_until
from unbroken.comm.links import probe
from unbroken.comm.reach import Stall, accuse, reach, refusing, unreachable_fault
from unbroken.comm.reduce import Reducer
from unbroken.comm.tunnel import LOOPBACK, ForwardingError, NatView, Tunnel
from unbroken.control import messages as m
from unbroken.control.meeting import data_address, with_port
from unbroken.errors import BadContribution, CollectiveFailed, ConfigError, Unreachable
from unbroken.events import Entry
from unbroken.sched.zones import WORLD, Zones
from unbroken.specs import CodecSpec, Mode, Rule
from unbroken.train.hooks import Build, GroupMaker
from unbroken.train.step import EXTRA

if TYPE_CHECKING:
    from unbroken.train.views import EpochsNode

log = logging.getLogger(__name__)


def zones_of(order: m.EpochOrder) -> Zones:
    return Zones(tuple(order.zones) if order.zones else tuple("" for _ in order.members), tuple(order.ring))


class Epochs:
    """Builds each epoch's groups and reducer for one node; answers the leader's probes."""

    def __init__(self, node: EpochsNode, groups: GroupMaker | None = None) -> None:
        """``groups``: how an epoch's process groups are made (default: gloo groups on the
        rendezvous the leader relays)."""
        self.node = node
        self.groups: GroupMaker = groups or self._builder
        config = node.config
        forwarding = config.forwarders or config.no_inbound
        self.tunnel = Tunnel(config.forwarders, config.token, node.name) if forwarding else None
        """This node's session with a forwarder, where it may need one (`comm.tunnel`)."""
        self.meeting = Meeting(self._meet)
        self.forwarder: ForwarderThread | None = None
        """The forwarder this node serves for members behind NAT (``--offer-forwarding``)."""
        self.offered = ""
        """Where that forwarder is, as its hello says (HOST:PORT; empty: none)."""
        self.codec = CodecSlot(node.name)
        self._accusing = threading.Lock()
        self._moving = threading.Lock()
        self._former: tuple[int, dict[str, tuple[str, int]]] = (-1, {})
        """The epoch this node was in when a new leader welcomed it, with its other members'
        data-plane addresses there (`check`)."""
        self._accused: dict[tuple[int, str], bool] = {}
        """(epoch, group) builds whose peers' addresses this node tried: whether any failed."""

    def form(self, order: m.EpochOrder) -> tuple[EpochGroup, Reducer]:
        """This node's group of ``order``'s epoch (now `Node.group`), connected, and the step's reducer."""
        node = self.node
        node.records.mark("ordered")  # (also when its listener ran first: it is here at once)
        # The order's listener may not have run yet (it is told after the order is visible
        # to the step loop): a move behind a forwarder comes first, or this node's entries
        # would advertise the address its peers just failed to reach.
        self.ordered(order)
        rank = order.members.index(node.client.member_id)
        group = EpochGroup(
            order.epoch,
            rank,
            list(order.members),
            list(order.shares),
            None,
            roles=list(order.roles),
            microbatches=list(order.microbatches),
        )
        node.group = group  # the epoch now current: what the build's abort checks compare orders with
        if self.tunnel is not None:
            self.tunnel.learn(order.forwarders)
        build = self.groups(order.epoch, node.scope(during_step=False))
        # Where zones exist, the step reduces through the zone and leaders' groups: the
        # world group only carries the sync phase, robust gathers and audits, whose
        # rings and transfers touch a few peers each, so it connects only those.
        zones = zones_of(order)
        # A state transfer between zones crosses the slow links too: spread over streams.
        pg, took = build(
            WORLD, rank, list(order.members), lazy=zones.multi, streams=zones.streams(WORLD, order.policy.streams)
        )
        group.pg, group.built_in_s, group.lazy = pg, took, zones.multi
        group.addresses = self._addresses(group)
        reducer = self._reducer(order, zones, group, build)
        node.records.mark("formed")
        return group, reducer

    def _builder(self, epoch: int, scope: EpochScope) -> Build:
        """Builds the epoch's groups (by name, `Zones.groups`; ``ids``: its members by rank)
        on its rendezvous. A build waits for its peers up to the collective timeout: the
        others may still be finishing a step or a round; one that never comes is named by
        the leader (`--build-deadline` after most of the group started), and the next
        epoch's order ends the wait. A build that every entry reached but that still has
        not finished half a build deadline later, or failed, has a peer it cannot connect
        to: this node tries their addresses and says whom (`unbroken.comm.reach`). A
        ``lazy`` build returns at once and connects pairs on first use (`Meeting.devices`)."""
        node = self.node

        def build(group: str, rank: int, ids: list[str], lazy: bool = False, streams: int = 1) -> tuple[Any, float]:
            assert node.client.welcome is not None  # an order came: the node was welcomed
            complete = functools.partial(self.meeting.complete, epoch, group, len(ids))
            # Connecting takes milliseconds once the entries are in: half the deadline is
            # plenty, and leaves the other half to try the peers and bench one (≤ deadline).
            stall_s = node.client.welcome.build_deadline_s / 2
            stall = Stall(complete, stall_s, lambda: self.accuse(epoch, group, ids, rank))

            def tick() -> None:
                self.meeting.publish(epoch)
                stall()

            devices = self.meeting.devices(epoch, group, self.gloo_host(epoch), lazy=lazy, streams=streams)
            try:
                pg, took = build_group(self.meeting.store(epoch), group, rank, len(ids), devices, scope, tick)
                if lazy:
                    # Returned at once: wait for every entry as an eager build does, so that
                    # the next builds (zone, leaders) start when they used to, with the
                    # members of the epoch before (the leader's clock for them starts then).
                    def entries_in() -> bool:
                        tick()
                        return complete()

                    wait_until(entries_in, scope, f"entries of group {group}", poll_s=PUBLISH_S)
                return pg, took
            except CollectiveFailed as exc:
                if complete() and self.accuse(epoch, group, ids, rank):
                    unreachable = Unreachable(exc.args[0] if exc.args else str(exc))
                    raise (unreachable.at(exc.where) if exc.where else unreachable) from exc
                raise

        return build

    def _reducer(self, order: m.EpochOrder, zones: Zones, group: EpochGroup, build: Build) -> Reducer:
        """The step's reduction: flat, or two-level with a zone group and a leaders' group."""
        node = self.node
        B = node.job.batch_size
        rank = group.rank
        policy = order.policy.parsed()
        assert group.pg is not None, "the epoch's group is built before its reducer"
        reducer = Reducer(
            rank,
            zones,
            group.pg,
            codec=self.codec.for_spec(policy.codec),
            compressed=node.compressed_numel,
            link=node.link,
            wire=node.wire,
            rule=policy.aggregate if policy.mode is Mode.SYNC else Rule("mean"),
            weights=tuple(s / B for s in order.shares),
            shares=tuple(order.shares),
            norms_at=node.numel + EXTRA,
            overflow_allowed=lambda: node.scale is not None and node.scale.may_skip,
            bucket_bytes=int(policy.bucket_mb * (1 << 20)),
        )
        if not zones.multi:
            return reducer
        mine = zones.of_rank[rank]
        members = zones.members(mine)
        z = zones.names.index(mine)
        if len(members) > 1:
            reducer.zone_pg, _ = build(f"zone{z}", members.index(rank), [order.members[r] for r in members])
            group.extra_pgs.append(reducer.zone_pg)
        if rank in zones.leaders:
            leaders = [order.members[r] for r in zones.leaders]
            reducer.streams = zones.streams("leaders", policy.streams)
            reducer.leaders_pg, _ = build("leaders", zones.leaders.index(rank), leaders, streams=reducer.streams)
            group.extra_pgs.append(reducer.leaders_pg)
            if order.probe_links:
                self._probe_links(order, zones, reducer)
        return reducer

    def _probe_links(self, order: m.EpochOrder, zones: Zones, reducer: Reducer) -> None:
        """Measure the links to the other zones' leaders and report them (`comm.links`)."""
        node = self.node
        rank = zones.leaders.index(reducer.rank)
        assert reducer.leaders_pg is not None, "links are probed by zone leaders"
        rates = probe(reducer.leaders_pg, rank, zones.names, node.link, node.scope(during_step=False))
        log.info("%s: links from the other zones (MB/s): %s", node.name,
                 ", ".join(f"{z} {r:.0f}" for z, r in sorted(rates.items())))  # fmt: skip
        node.records.log(Entry.LINKS, {"epoch": order.epoch, "rates": rates})
        node.client.send(m.Links(epoch=order.epoch, rates=rates))

    def open(self) -> None:
        """Start serving as a forwarder, where this node offers it; go through one, where
        this node accepts no connection (declared, or found by the forwarder's probe)."""
        config = self.node.config
        if config.offer_forwarding is not None:
            host, port = config.offer_forwarding
            try:
                self.forwarder = ForwarderThread(config.token, host, port)
            except OSError as exc:
                raise ConfigError(
                    f"cannot forward on {host}:{port} ({exc.strerror or exc}): give --offer-forwarding a free port"
                ) from None
            hosts = job_hosts([*config.coordinators, *config.relays], config.etcd)
            try:
                self.offered = offered_address(host, self.forwarder.address[1], hosts, named=config.gloo_host)
            except ConfigError:
                self.forwarder.close()
                self.forwarder = None
                raise
        if self.tunnel is None:
            return
        if config.no_inbound:
            self.meeting.behind(NatView(self.tunnel), 0)
            return
        if not config.forwarders:
            return
        host = config.gloo_host or socket.gethostbyname(socket.gethostname())
        with socket.create_server((host, 0)) as listener:
            try:
                why = self.tunnel.probe((host, listener.getsockname()[1]))
            except ForwardingError as exc:
                log.warning(
                    "%s: could not learn whether peers reach it (%s): it takes connections directly",
                    self.node.name,
                    exc,
                )
                return
        if why is None:
            self.tunnel.close()  # reachable: no session held at the forwarder
            self.tunnel = None
        else:
            log.warning("%s: its forwarder cannot connect to its data-plane address %s (%s): peers reach it "
                        "through the forwarder", self.node.name, host, why)  # fmt: skip
            self.meeting.behind(NatView(self.tunnel), 0)

    @property
    def forwarded(self) -> bool:
        """Peers reach this node through a forwarder (`comm.tunnel`)."""
        return self.meeting.view is not None

    def ordered(self, order: m.EpochOrder) -> None:
        """An epoch order has arrived (control thread, before any of its rendezvous entries):
        where it names this node among those the others could not connect to, the epoch's
        peers reach it through a forwarder the order names (`sched.nat.unreachable`). It
        stays there until it restarts, even once its port is open again: a move back would
        cost an epoch, and the forwarder only adds a hop."""
        node = self.node
        if node.client.member_id in order.members:
            node.records.mark("ordered")
        with self._moving:  # the control thread (the order's listener) and `form`: one moves
            if self.forwarded or node.client.member_id not in order.behind:
                return
            try:
                tunnel = self.tunnel or Tunnel(node.config.forwarders, node.config.token, node.name)
            except ForwardingError as exc:
                log.error("%s: its peers cannot connect to it, and it cannot go behind a forwarder: %s", node.name, exc)
                return  # its peers name it unreachable again, and, behind a forwarder on paper, it is benched
            tunnel.learn(order.forwarders)
            self.tunnel = tunnel
            self.meeting.behind(NatView(tunnel), order.epoch)
        log.warning("%s: its peers cannot connect to its data-plane address: from epoch %d they reach it "
                    "through a forwarder (%s)", node.name, order.epoch, ", ".join(order.forwarders))  # fmt: skip

    def close(self) -> None:
        if self.forwarder is not None:
            self.forwarder.close()
        if self.tunnel is not None:
            self.tunnel.close()

    def gloo_host(self, epoch: int) -> str | None:
        config = self.node.config
        if self.forwarded and epoch >= self.meeting.view_from:
            return LOOPBACK  # peers reach it through the forwarder (`comm.tunnel`)
        if config.gloo_host:
            return config.gloo_host
        host = (config.coordinators or config.relays or (("", 0),))[0][0]
        return "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else None

    # ---------------------------------------------------------------- unreachable peers

    def unreachable_in_lazy_group(self, order: m.EpochOrder, exc: Exception) -> bool:
        """A collective of a lazily connected group failed: a peer this node cannot reach
        shows only now (its build never connected). Try them all and report whom."""
        g = self.node.group
        if g is None or not g.lazy or g.epoch != order.epoch or isinstance(exc, BadContribution):
            return False
        return self.accuse(order.epoch, WORLD, list(order.members), g.rank)

    def accuse(self, epoch: int, group: str, ids: list[str], rank: int) -> bool:
        """Try the addresses of a build's peers; report the ones this node cannot reach."""
        with self._accusing:  # the stall's thread and the failed build's: one tries, both learn
            if (epoch, group) not in self._accused:
                for old in [k for k in self._accused if k[0] < epoch - 2]:
                    del self._accused[old]
                entries = self.meeting.entries(epoch, group)
                self._accused[epoch, group] = accuse(epoch, group, entries, ids, rank, self.node.client.send)
            return self._accused[epoch, group]

    # ---------------------------------------------------------------- control callbacks

    def probe(self, probe: m.Probe) -> None:
        """The leader asks: can this node connect to ``probe.member``'s data plane?"""

        def attempt() -> None:
            address = (probe.host, probe.port)
            if failed := reach({probe.member: address}):
                fault = unreachable_fault(probe.epoch, probe.group, probe.member, *address, failed[probe.member])
                self.node.client.send(fault)

        threading.Thread(target=attempt, name="probe", daemon=True).start()

    def _meet(self, epoch: int, key: str, value: bytes) -> None:
        faults = self.node.faults
        if faults.muted(epoch):
            return
        if faults.unreachable(epoch):
            value = with_port(value, faults.dropping_port(self.gloo_host(epoch) or "127.0.0.1"))
        self.node.client.send(m.Meet(epoch=epoch, key=key, value=base64.b64encode(value).decode()))

    def met(self, met: m.Met) -> None:
        self.meeting.deliver(met.epoch, {k: base64.b64decode(v) for k, v in met.entries.items()})

    def check(self, check: m.Check) -> None:
        """A new leader asks which of ``check.members`` left nothing listening at the
        data-plane address they had in this node's last epoch (`m.Check`)."""
        epoch, addresses = self._former
        if check.epoch != epoch:
            return
        targets = {mid: addresses[mid] for mid in check.members if mid in addresses}
        if not targets:
            return

        def attempt() -> None:
            if gone := refusing(targets):
                self.node.client.send(m.Vanished(epoch=epoch, members=gone))

        threading.Thread(target=attempt, name="check", daemon=True).start()

    def gone_ahead(self, latest: m.EpochOrder) -> str | None:
        """A member of this epoch that left it for ``latest`` (its rendezvous entry for that
        epoch arrived half a build deadline ago), if any. A step waits out an order that is
        not urgent (the group switches after it, by vote), but members not yet in the step
        leave at once (a sync phase's transfer, a build): once one of them builds the new
        epoch, the step can never complete, and waiting for it would only get this node named
        absent there (a build deadline after the first member of this epoch wrote its entry).
        A member that committed the step by vote builds the new epoch too, while this node's
        part of that step may still be arriving (over a slow link, for seconds): the entry
        must have been here a while, and the other half of the deadline is left to build."""
        node = self.node
        g, welcome = node.group, node.client.welcome
        if g is None or welcome is None:
            return None
        since = time.monotonic() - welcome.build_deadline_s / 2
        writers = self.meeting.writers(latest.epoch, WORLD, before=since)
        if not writers:  # most polls of a step waiting for its switch: no set of the members built
            return None
        peers = set(g.members) - {node.client.member_id}
        for r in sorted(writers):
            if r < len(latest.members) and latest.members[r] in peers:
                return latest.members[r]
        return None

    def welcomed(self, welcome: m.Welcome, new_coordinator: bool) -> None:
        self.node.records.mark("welcomed")
        if new_coordinator:
            g = self.node.group
            self._former = (g.epoch, g.addresses) if g is not None else (-1, {})  # for `check`
            self.meeting.reset()
        else:
            self.meeting.republish()

    def _addresses(self, g: EpochGroup) -> dict[str, tuple[str, int]]:
        """The data-plane addresses ``g``'s other members wrote for its world group."""
        out = {}
        for r, raw in self.meeting.entries(g.epoch, WORLD).items():
            if r < len(g.members) and r != g.rank:
                with contextlib.suppress(ValueError):  # the leader checked it; garbled since, it says nothing
                    out[g.members[r]] = data_address(raw)
        return out


class CodecSlot:
    """The inter-zone codec, made when an epoch order names it; its error-feedback residual
    is node-local snapshot state: a node restarted from its own checkpoint resumes it, so no
    compression error is dropped."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.codec: Codec | None = None
        self.spec: CodecSpec | None = None
        self.pending: dict[str, Any] | None = None
        """A restored residual waiting for its codec (made at the first epoch order)."""

    def for_spec(self, spec: CodecSpec) -> Codec:
        if self.codec is None or self.spec != spec:
            self.codec, self.spec = make_codec(spec), spec
            if self.pending is not None and self._names(self.pending, spec):
                self.codec.load_state_dict(self.pending["codec"])
            self.pending = None
        return self.codec

    def state_dict(self) -> dict[str, Any]:
        if self.codec is None:
            return {}
        state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.codec.state_dict().items()}
        return {"spec": str(self.spec), "codec": state}  # as checkpoints name it

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self.codec is not None and self.spec is not None and self._names(state, self.spec):
            self.codec.load_state_dict(state["codec"])
        else:  # the codec is made when the first epoch order names it
            self.pending = state

    @staticmethod
    def _names(state: dict[str, Any], spec: CodecSpec) -> bool:
        """Whether a checkpoint's codec state is of ``spec``'s codec (an unknown name is not)."""
        try:
            return CodecSpec.parse(str(state.get("spec", ""))) == spec
        except (ValueError, ConfigError):
            return False
