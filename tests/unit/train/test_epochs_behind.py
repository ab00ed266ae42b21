"""A node moved behind a forwarder by an epoch order (`train.epochs.Epochs.ordered`): the step
loop may see the order (`ControlClient.latest_order`) before the order's listener has run, and
its build of the epoch must advertise the forwarder all the same, not the address its peers
just failed to reach."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from unbroken.comm.group import EpochScope
from unbroken.comm.tunnel import LOOPBACK
from unbroken.control import messages as m
from unbroken.control.client import ControlClient
from unbroken.train.epochs import Epochs


class Built(Exception):
    """Ends `Epochs.form` at its first build: what the build saw is all the test needs."""


def no_hello(member_id: str) -> Any:
    raise AssertionError("the client is never started")


def test_a_build_started_before_the_orders_listener_ran_goes_through_the_forwarder() -> None:
    # Never started: its message handling alone.
    client = ControlClient([("10.0.0.1", 7000)], no_hello, name="n", connect_timeout_s=1, wake=threading.Event())
    config = SimpleNamespace(
        forwarders=(), no_inbound=False, token="secret", gloo_host="", coordinators=(("10.0.0.1", 7000),), relays=()
    )
    node: Any = SimpleNamespace(
        name="n",
        client=client,
        config=config,
        group=None,
        scope=lambda during_step: EpochScope(threading.Event(), lambda: None, 1.0),
        records=SimpleNamespace(mark=lambda milestone: None),
    )
    seen: dict[int, tuple[str | None, bool]] = {}

    def groups(epoch: int, scope: EpochScope) -> Any:
        def build(group: str, rank: int, ids: list[str], lazy: bool = False, streams: int = 1) -> Any:
            # What the devices listen on and whether this node's entries go through the view.
            seen[epoch] = (epochs.gloo_host(epoch), epochs.meeting._view(epoch) is not None)
            raise Built

        return build

    epochs = Epochs(node, groups)
    built: list[BaseException] = []

    def step_loop(notice: object) -> None:
        """The step thread, polling `latest_order`, in the window before the listeners run."""
        order = client.latest_order()
        if isinstance(notice, m.EpochOrder) and order is not None:
            try:
                epochs.form(order)
            except Built as exc:
                built.append(exc)

    client.add_listener(step_loop)  # first: the order is visible, `Epochs.ordered` not yet told
    client.add_listener(lambda notice: isinstance(notice, m.EpochOrder) and epochs.ordered(notice))
    try:
        order = m.EpochOrder(
            epoch=7,
            members=["peer", client.member_id],
            shares=[4, 4],
            urgent=True,
            reason="the peers could not connect to n",
            forwarders=["10.0.0.2:7001"],
            behind=[client.member_id],
        )
        client._on_message(order)
        assert built, "the build never ran"
        assert seen[7] == (LOOPBACK, True), f"epoch 7's build saw (host, behind a forwarder) = {seen[7]}"
        assert epochs.meeting.view_from == 7 and epochs.meeting._view(6) is None, "the epochs before keep theirs"
    finally:
        epochs.close()


@pytest.mark.parametrize("moved", [False, True])
def test_a_node_not_named_behind_keeps_its_own_address(moved: bool) -> None:
    """The move is idempotent and only for the members the order names."""
    config = SimpleNamespace(
        forwarders=(), no_inbound=False, token="secret", gloo_host="", coordinators=(("10.0.0.1", 7000),), relays=()
    )
    node: Any = SimpleNamespace(
        name="n",
        client=SimpleNamespace(member_id="me"),
        config=config,
        group=None,
        records=SimpleNamespace(mark=lambda milestone: None),
    )
    epochs = Epochs(node)
    try:
        behind = ["me"] if moved else ["other"]
        order = m.EpochOrder(epoch=3, members=["me", "other"], shares=[1, 1], urgent=False, reason="", behind=behind)
        epochs.ordered(order)
        view = epochs.meeting.view
        epochs.ordered(order.model_copy(update={"epoch": 4}))
        assert epochs.meeting.view is view and epochs.forwarded is moved
        assert epochs.gloo_host(3) == (LOOPBACK if moved else None)
    finally:
        epochs.close()
