"""Weak nodes check the work (`unbroken.train.checks`, `unbroken.control.checks`): real
processes, a real coordinator. A validator recomputes sampled slices bit for bit: an honest
group is never found wrong; a trainer that scales its gradient by 0.9, or reads the wrong
samples, passes every check of the sum, but is found, confirmed by a second member, named
and benched, and every promise holds."""

from __future__ import annotations

import pytest

from integration.helpers import Pace, assert_promises, events_of, fired

ENV = {"UB_TEST_STEPS": "140", "UB_TEST_DELAY_MS": "0", "UB_TEST_SAMPLE_MS": "0.5"}
"""0.5 ms a sample (a sleep: no CPU), B = 30: steps of 5 ms per trainer's share."""

pytestmark = pytest.mark.timeout(240)


def group(make_cluster, fault: str = "", pace: Pace | None = None):
    """Trainers a, b and odd (``fault``), and validator v (half the speed); all run to the end.
    With ``pace``, steps are slowed until odd is benched: on a busy machine the second
    member's confirmation could otherwise come after the last of the 140 short steps."""
    env = ENV if pace is None else ENV | pace.env | {"UB_TEST_DELAY_MS": "20"}
    c = make_cluster(env=env, min_nodes=4, node_args=["--digest-every", "10"])
    c.start_coordinator()
    for name in ("a", "b"):
        c.start_node(name)
    odd = c.start_node("odd", fault=fault)
    c.start_node("v", extra=["--role", "validator", "--throttle", "0.5"])
    if pace is not None:
        c.wait_for(lambda: events_of(c, "bad-work"), 150, "the odd trainer benched")
        pace.release()
    codes = c.wait_exit(timeout=180)
    assert codes == {"a": 0, "b": 0, "odd": 0, "v": 0}, c.diagnostics()
    return c, odd


def checks_of(c, name: str) -> list[dict]:
    return [e for e in c.nodes[name].entries() if e["kind"] == "check"]


def test_an_honest_group_is_never_found_wrong(make_cluster):
    c, _ = group(make_cluster)
    checked = [e for e in checks_of(c, "v") if e["digest"]]
    assert len(checked) >= 15, f"only {len(checked)} checks in 140 steps"
    assert {e["trainer"].split("#")[0] for e in checked} >= {"a", "b", "odd"} or len(checked) < 3
    assert not events_of(c, "check") and not events_of(c, "bad-work"), events_of(c, "check")[:3]
    assert_promises(c, ENV, finishers=4)


@pytest.mark.parametrize("fault", ["shrink@grad:20", "shift@data:20"])
def test_a_trainer_computing_wrongly_is_found_confirmed_and_benched(make_cluster, fault, tmp_path):
    c, odd = group(make_cluster, fault, Pace(tmp_path))
    assert fired(odd, fault.split("@")[0])
    found = events_of(c, "check")
    assert found and all(e["member"] == found[0]["member"] for e in found), found
    assert "recomputation of its slice" in found[0]["reason"] and "checks it again" in found[0]["reason"], found[0]
    (benched,) = events_of(c, "bad-work")
    assert benched["member"] == found[0]["member"] and "odd" in benched["reason"], benched
    assert "differ from its commitments" in benched["reason"] and "(offence 1)" in benched["reason"]
    # Confirmed by a member other than the validator (a trainer, on its own step loop).
    confirmers = [n for n in ("a", "b") if any(e["ordered"] for e in checks_of(c, n))]
    assert confirmers and confirmers[0] in benched["reason"], (confirmers, benched)
    # Benched: no share from the epoch after, and nobody else is ever found wrong.
    after = [e for e in odd.entries() if e["kind"] == "contrib" and e["epoch"] > benched["epoch"]]
    assert after and not any(e["indices"] for e in after), after[:3]
    assert_promises(c, ENV, finishers=4, reference=False)
