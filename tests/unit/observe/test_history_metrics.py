"""The dashboard's curves and the Prometheus exposition, from a fixed state."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from unbroken.events import Kind
from unbroken.observe.history import COARSE_EVERY, History
from unbroken.observe.metrics import render


def test_one_point_per_step_and_old_steps_thinned() -> None:
    h = History(max_points=50)
    assert h.add(1, 100.0, 2.0, 10.0, 3, 1)
    assert not h.add(1, 100.1, 2.0, 10.0, 3, 1)  # another node's report of the same step
    for s in range(2, 201):
        h.add(s, 100.0 + s, 1.0, 10.0, 3, 1)
    steps = [p.step for p in h.points()]
    assert steps[-50:] == list(range(151, 201))
    assert all(s % COARSE_EVERY == 0 for s in steps[:-50]) and steps == sorted(steps)
    assert h.step_rate(window_s=10) == 1.0
    assert [p.step for p in h.points(since_step=198)] == [199, 200]


def test_a_non_finite_loss_is_kept_as_a_gap() -> None:
    h = History()
    h.add(1, 0.0, float("nan"), 1.0, 1, 1)
    assert h.to_json()["points"][0]["loss"] is None


def test_metrics_parse_and_carry_the_state() -> None:
    h = History()
    h.add(9, 10.0, 0.5, 90.0, 2, 3)
    h.add(10, 10.5, 0.4, 95.0, 2, 3)
    snapshot = {
        "job": "j",
        "step": 10,
        "epoch": 3,
        "members": [
            {"name": "a", "state": "active", "role": "trainer", "share": 20, "compute_s": [0.1],
             "bytes_sent": {"intra_zone": 100, "inter_zone": 0}},
            {"name": "b", "state": "active", "role": "standby", "share": 0, "compute_s": None,
             "bytes_sent": {"intra_zone": 5, "inter_zone": 7}},
        ],
        "recoveries": [{"duration_s": 0.2}, {"duration_s": 0.4}],
    }  # fmt: skip
    text = render(snapshot, {Kind.FAILURE: 2, Kind.JOIN: 4}, h).decode()
    fams = {f.name: f.samples for f in text_string_to_metric_families(text)}
    one = {name: samples[0].value for name, samples in fams.items() if len(samples) == 1}
    assert one["unbroken_step"] == 10 and one["unbroken_epoch"] == 3 and one["unbroken_loss"] == 0.4
    assert abs(one["unbroken_step_seconds"] - 0.5) < 1e-9
    assert one["unbroken_failures"] == 2 and one["unbroken_recoveries"] == 2
    rates = {s.labels["node"]: s.value for s in fams["unbroken_node_samples_per_second"]}
    assert rates == {"a": 200.0, "b": 0.0}
    recovery = {s.name: s.value for s in fams["unbroken_recovery_seconds"]}
    assert (
        recovery["unbroken_recovery_seconds_count"] == 2 and abs(recovery["unbroken_recovery_seconds_sum"] - 0.6) < 1e-9
    )
    roles = {(s.labels["state"], s.labels["role"]): s.value for s in fams["unbroken_members"]}
    assert roles == {("active", "trainer"): 1, ("active", "standby"): 1}


def test_metrics_say_whether_this_coordinator_leads_and_in_which_term() -> None:
    def scrape(leadership: dict[str, object] | None) -> dict[str, float]:
        snapshot = {"job": "j", "step": 1, "epoch": 1, "members": [], "recoveries": []}
        if leadership is not None:
            snapshot["leadership"] = leadership
        text = render(snapshot, {}, History()).decode()
        return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if len(f.samples) == 1}

    assert scrape(None)["unbroken_coordinator_leading"] == 1  # a single coordinator leads
    standby = scrape({"role": "standby", "term": 12})
    assert standby["unbroken_coordinator_leading"] == 0 and standby["unbroken_leader_term"] == 12
    assert scrape({"role": "leader", "term": 13})["unbroken_coordinator_leading"] == 1
