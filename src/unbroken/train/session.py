"""A node's dealings with the control plane (`train.runtime.Node`): the session it opens
and what it says in its hello, what it does with what the session tells it, and the
resources a run holds (`Session`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from unbroken.control import identity
from unbroken.control import messages as m
from unbroken.control.client import ControlClient, Notice
from unbroken.control.connection import Change
from unbroken.events import Entry
from unbroken.train.candidate import Candidate

if TYPE_CHECKING:
    from unbroken.train.runtime import Node

log = logging.getLogger(__name__)


def connect(node: Node) -> ControlClient:
    """A session with ``node``'s coordinators, as its config says (not started)."""
    config = node.config
    return ControlClient(
        config.coordinators,
        lambda member_id: hello(node, member_id),
        name=node.name,
        connect_timeout_s=config.connect_timeout_s,
        wake=node.wake,
        stall_timeout_s=config.stall_timeout_s,
        token=config.token,
        key=identity.load_or_create(config.key_file) if config.key_file else None,
        tls_ca=str(config.tls_ca) if config.tls_ca else None,
        etcd=config.etcd,
        etcd_prefix=config.etcd_prefix,
        etcd_tls=config.etcd_tls,
        relays=config.relays,
    )


def hello(node: Node, member_id: str) -> m.Hello:
    """What ``node`` says as ``member_id`` when it joins: its job and model, where it is,
    and the epoch it may resume."""
    g = node.group
    latest = node.client.latest_order()
    resume = None
    if g is not None and member_id in g.members:
        # A step in flight across a lapse will not commit here (`StepProtocol.fence`):
        # the epoch is as good as abandoned, and a leader that took over must not adopt
        # it for members still waiting in that step for this one.
        p = node.protocol
        lapsed = p is not None and p.group is g and p.lapsed()
        resume = m.Resume(
            epoch=g.epoch,
            members=g.members,
            step=node.state.step,
            shares=g.shares,
            roles=g.roles,
            abandoned=g.pg is None or lapsed,
        )
    return m.Hello(
        job=node.job.name,
        job_identity=node.job_identity,
        job_spec=node.job_spec,
        fingerprint=node.model_fingerprint,
        member_id=member_id,
        name=node.name,
        batch_size=node.job.batch_size,
        steps=node.job.num_steps,
        weight=node.config.weight,
        step=node.state.step,
        host=socket.gethostname(),
        pid=os.getpid(),
        resume=resume,
        last_epoch=latest.epoch if latest is not None else 0,
        restored_epoch=node.records.restored_epoch,
        capabilities=node.capabilities(),
        role=node.config.role,
        evaluates=node.job.evaluate is not None,
        zone=node.config.zone,
        no_inbound=node.epochs.forwarded,
        forwarding=node.epochs.offered,
    )


def heard(node: Node, notice: Notice) -> None:
    """What the control session tells ``node`` besides what its step loop polls for
    (control thread)."""
    if isinstance(notice, Change):
        if notice.welcome is not None:
            node.epochs.welcomed(notice.welcome, notice.new_coordinator)
    elif isinstance(notice, m.Command):
        command(node, notice)
    elif isinstance(notice, m.EpochOrder):
        node.epochs.ordered(notice)
    elif isinstance(notice, m.Met):
        node.epochs.met(notice)
    elif isinstance(notice, m.Probe):
        node.epochs.probe(notice)
    elif isinstance(notice, m.Check):
        node.epochs.check(notice)
    else:
        node.checker.ordered(notice)


def command(node: Node, cmd: m.Command) -> None:
    """An operator's action (control thread)."""
    log.warning("%s: operator command %s: %s", node.name, cmd.action, cmd.reason)
    if cmd.action == "drain":
        node.request_leave()
    elif cmd.action == "kill":
        entry = {"signal": "kill", "phase": "operator", "step": node.state.step, "pid": os.getpid()}
        node.records.log(Entry.FAULT, entry)
        os.kill(os.getpid(), signal.SIGKILL)


def install_signals(node: Node) -> None:
    """SIGTERM and Ctrl-C leave gracefully after the step in flight; a second one exits."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: object) -> None:
        if node.leave_requested:
            raise SystemExit(128 + signum)
        # Only a flag: Event.set() takes a lock the interrupted main thread may hold.
        # Every wait in the loop wakes at least every 0.5 s and sees it.
        node.leave_requested = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


class Session:
    """`Node.session`: what a run holds, opened in order and closed in reverse."""

    def __init__(self, node: Node, calibrate: Callable[[], None] | None) -> None:
        self.node = node
        self.calibrate = calibrate
        self.candidate: Candidate | None = None

    def __enter__(self) -> Node:
        node = self.node
        node.records.restore_checkpoint()
        if node.records.restored_epoch is not None:
            node.audits.checkpoint_epoch = node.records.restored_epoch
        install_signals(node)
        try:
            node.epochs.open()
            if node.config.coordinate:
                self.candidate = Candidate(node.config)
                self.candidate.start()
                node.records.log(Entry.CANDIDATE, {"pid": self.candidate.proc.pid if self.candidate.proc else 0})
            if self.calibrate is not None:
                self.calibrate()
            node.client.start()
        except BaseException:
            self.__exit__()
            raise
        return node

    def __exit__(self, *exc: object) -> None:
        node = self.node
        if self.candidate is not None:
            self.candidate.close()
        if node.sidecar is not None:
            node.sidecar.close()
        node.client.close()
        node.epochs.close()
        node.records.close()


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics as the control plane takes them: a NaN or infinite one (a diverged model's
    evaluation) is left out, with a warning, instead of refusing the whole report."""
    bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
    if bad:
        log.warning("metrics %s are not finite: left out of the report", ", ".join(bad))
    return {k: v for k, v in metrics.items() if k not in bad}
