"""The chaos soak's pure parts: which fault kinds may be drawn, link names that fit, recovery times."""

from __future__ import annotations

import itertools

import pytest

from unbroken.errors import ConfigError
from unbroken.testing import netns
from unbroken.testing.chaos import HA_KINDS, KINDS, STOP_S, Commits, feasible_kinds, schedule, time_outside

SIGNAL_KINDS = ["kill", "stop", "term", "join", "coordinator"]


def test_every_kind_when_the_group_is_healthy_and_links_can_fail() -> None:
    assert feasible_kinds(training=3, slowable=3, alive=3, nodes=3, links=True) == [
        k for k in KINDS if k not in HA_KINDS
    ]


def test_with_etcd_the_leader_faults_replace_the_coordinator_restart_and_one_etcd_member_at_most_is_down() -> None:
    kinds = feasible_kinds(training=3, slowable=3, alive=3, nodes=3, links=False, ha=True)
    assert kinds == ["kill", "stop", "term", "join", "leader-kill", "leader-stop", "etcd-kill"]
    down = feasible_kinds(training=3, slowable=3, alive=3, nodes=3, links=False, ha=True, etcd_down=True)
    assert "etcd-kill" not in down and "leader-kill" in down


def test_without_links_the_kinds_and_their_order_are_those_of_before_link_faults() -> None:
    # Same list, same weights: a seed's schedule on a host without namespaces is unchanged.
    assert feasible_kinds(training=3, slowable=3, alive=3, nodes=3, links=False) == SIGNAL_KINDS


def test_the_last_training_node_is_never_taken_out_but_may_be_slowed() -> None:
    kinds = feasible_kinds(training=1, slowable=1, alive=3, nodes=3, links=True)
    assert kinds == ["join", "coordinator", "slow"]
    assert feasible_kinds(training=0, slowable=0, alive=2, nodes=3, links=True) == ["join", "coordinator"]


def test_no_slow_when_every_trainer_is_slowed_already() -> None:
    assert "slow" not in feasible_kinds(training=2, slowable=0, alive=3, nodes=3, links=True)


def test_joins_stop_at_two_spare_nodes() -> None:
    assert "join" in feasible_kinds(training=3, slowable=3, alive=4, nodes=3, links=False)
    assert "join" not in feasible_kinds(training=3, slowable=3, alive=5, nodes=3, links=False)


@pytest.mark.parametrize("pid", [1, 99999, 2**22])
@pytest.mark.parametrize("host", [2, 254])
def test_link_names_fit_the_kernels_15_characters(pid: int, host: int) -> None:
    netns_name, host_dev, node_dev = netns.names(pid, host)
    assert len({netns_name, host_dev, node_dev}) == 3
    assert all(len(n) <= 15 for n in (host_dev, node_dev, f"unb{pid}b"))
    assert netns._OURS.match(host_dev) and int(netns._OURS.match(host_dev).group(1)) == pid


def test_probe_says_why_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    netns.probe.cache_clear()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    try:
        assert "root" in (netns.probe() or "")
        assert not netns.available()
    finally:
        netns.probe.cache_clear()


def test_probe_says_which_tool_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    netns.probe.cache_clear()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else f"/sbin/{tool}")
    try:
        assert "`tc`" in (netns.probe() or "")
    finally:
        netns.probe.cache_clear()


def test_recovery_beyond_coordinator_downtime_takes_out_only_the_overlap() -> None:
    down = [(10.0, 11.6), (13.0, 14.7)]
    assert time_outside(5.0, 6.0, down) == pytest.approx(1.0)  # no coordinator fault near
    assert time_outside(10.5, 12.0, down) == pytest.approx(0.4)  # fault while it was down
    assert time_outside(9.0, 15.0, down) == pytest.approx(6.0 - 1.6 - 1.7)  # two restarts inside
    assert time_outside(11.0, 11.2, down) == 0.0  # recovered while it was still down
    assert time_outside(12.0, 11.0, down) == 0.0


def test_a_step_in_flight_at_the_fault_is_not_the_recovery() -> None:
    """Step 7 was contributed before the fault at t=10 and commits at 10.01; the group then
    stalls, and step 8 (contributed at 12.0, in a new epoch) commits at 12.5."""
    logs = {
        "a": [
            {"kind": "contrib", "t": 9.5, "epoch": 1, "step": 6},
            {"kind": "commit", "t": 9.9, "epoch": 1, "step": 6},
            {"kind": "contrib", "t": 9.95, "epoch": 1, "step": 6},
            {"kind": "commit", "t": 10.01, "epoch": 1, "step": 7},
            {"kind": "contrib", "t": 12.0, "epoch": 2, "step": 7},
            {"kind": "commit", "t": 12.5, "epoch": 2, "step": 8},
        ],
        "b": [
            {"kind": "contrib", "t": 9.96, "epoch": 1, "step": 6},
            {"kind": "commit", "t": 10.02, "epoch": 1, "step": 7},  # the same step, by another node
            {"kind": "contrib", "t": 11.9, "epoch": 2, "step": 7},
            {"kind": "commit", "t": 12.5, "epoch": 2, "step": 8},
        ],
    }
    after, fresh = Commits(logs).after(10.0)
    assert after == 10.01 and fresh == 12.5
    # A fault after the in-flight step's commit: that commit is before it, step 8 is both.
    assert Commits(logs).after(10.015) == (12.5, 12.5)
    # A commit whose contributions are not logged (a state received from a peer) counts.
    assert Commits({"c": [{"kind": "commit", "t": 3.0, "epoch": 1, "step": 2}]}).after(1.0) == (3.0, 3.0)


def test_a_step_whose_compute_began_before_the_fault_is_not_the_recovery() -> None:
    """The fault lands while step 7 is being computed: its contributions are logged after
    the fault (when computed), but began before it."""
    logs = {
        "a": [
            {"kind": "commit", "t": 9.9, "epoch": 1, "step": 6},
            {"kind": "contrib", "t": 10.05, "epoch": 1, "step": 6, "compute_s": 0.1},
            {"kind": "commit", "t": 10.08, "epoch": 1, "step": 7},
            {"kind": "contrib", "t": 11.5, "epoch": 2, "step": 7, "compute_s": 0.1},
            {"kind": "commit", "t": 11.6, "epoch": 2, "step": 8},
        ]
    }
    assert Commits(logs).after(10.0) == (10.08, 11.6)


def test_a_schedule_drawn_in_advance_is_the_same_for_a_seed_and_another_for_another_seed() -> None:
    a, b = schedule(3, 0.1, 600.0), schedule(3, 0.1, 600.0)
    assert a == b and a != schedule(4, 0.1, 600.0)


def test_a_schedule_keeps_its_rate_its_kinds_and_its_window() -> None:
    plan = schedule(1, 0.2, 5000.0, kinds=("kill", "stop", "join"))
    # ~1000 faults expected; the cap at three mean gaps shortens a few gaps, never many.
    assert 900 < len(plan) < 1200
    assert {f.kind for f in plan} == {"kill", "stop", "join"}
    assert all(0 < f.at < 5000.0 for f in plan) and [f.at for f in plan] == sorted(f.at for f in plan)
    assert all(b.at - a.at <= 3.0 / 0.2 + 1e-9 for a, b in itertools.pairwise(plan))
    assert all(0 <= f.pick < 1 and STOP_S[0] <= f.lasts <= STOP_S[1] for f in plan)
    # kill is drawn at KINDS' weight 0.3 against stop 0.2 and join 0.2
    kills = sum(f.kind == "kill" for f in plan) / len(plan)
    assert 0.35 < kills < 0.51


@pytest.mark.parametrize(("rate", "kinds", "needle"), [(0.0, ("kill",), "must be positive"), (0.1, ("kil",), "'kil'")])
def test_a_schedule_refuses_a_rate_or_kind_that_cannot_be_drawn(
    rate: float, kinds: tuple[str, ...], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        schedule(0, rate, 60.0, kinds=kinds)
