"""Seeing the swarm: /metrics, the event log, anomalies with their explanations, operator
actions. Real coordinator and node processes; causes injected deterministically."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from integration.helpers import assert_promises


def get(c, path: str) -> bytes:
    assert c.address is not None
    with urllib.request.urlopen(f"http://{c.address[0]}:{c.address[1]}{path}", timeout=5) as r:
        return r.read()


def post(c, path: str, token: str | None = None) -> tuple[int, str]:
    assert c.address is not None
    req = urllib.request.Request(f"http://{c.address[0]}:{c.address[1]}{path}", data=b"", method="POST")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def events(c, **query: str) -> list[dict[str, Any]]:
    qs = "&".join(f"{k}={v}" for k, v in query.items())
    return json.loads(get(c, f"/api/events?{qs}"))["events"]


def metrics(c) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(get(c, "/metrics").decode()):
        out.setdefault(family.name, []).extend(family.samples)
    return out


def test_metrics_events_and_loss_anomalies(make_cluster):
    # The loss reported at step 25 jumps by 100 and at step 40 is NaN: a constant added to the
    # loss of those steps' samples (60 x 10 = the 600 samples: each is seen once), so the
    # gradients, and so the model, are untouched.
    env = {"UB_TEST_STEPS": "60", "UB_TEST_BATCH": "10", "UB_TEST_DELAY_MS": "10", "UB_TEST_LOSS_BUMP": "25:100,40:nan"}
    c = make_cluster(env=env, min_nodes=3, node_args=["--digest-every", "1"])
    c.start_coordinator()
    for name in ("a", "b", "c"):
        c.start_node(name)
    codes = c.wait_exit(timeout=120)
    assert codes == {"a": 0, "b": 0, "c": 0}, c.diagnostics()
    assert_promises(c, env, finishers=3)

    spike = events(c, kind="loss-spike")
    assert len(spike) == 1 and spike[0]["step"] >= 24 and "jumped to 10" in spike[0]["reason"], spike
    nan = events(c, kind="loss-nan")
    assert len(nan) == 1 and "nan" in nan[0]["reason"], nan
    joins = events(c, kind="join")
    assert {e["node"] for e in joins} == {"a", "b", "c"}
    for e in events(c):
        assert {"time", "node", "epoch", "step", "kind", "reason", "seq"} <= set(e), e
    seqs = [e["seq"] for e in events(c)]
    assert seqs == sorted(seqs) and events(c, since=str(seqs[-2])) == events(c)[-1:]
    assert {e["kind"] for e in events(c, node="b")} >= {"join"}

    history = json.loads(get(c, "/api/history"))
    steps = [p["step"] for p in history["points"]]
    assert steps == sorted(steps) and steps[-1] == 60 and len(steps) >= 30, steps
    assert set(history["nodes"]) == {"a", "b", "c"}

    fams = metrics(c)
    value = {f: s[0].value for f, s in fams.items() if len(s) == 1}
    assert value["unbroken_step"] == 60
    assert value["unbroken_epoch"] >= 1
    kinds = {s.labels["kind"]: s.value for s in fams["unbroken_events"] if s.name == "unbroken_events_total"}
    assert kinds["join"] == 3 and kinds["loss-spike"] == 1 and kinds["loss-nan"] == 1, kinds
    assert "unbroken_recovery_seconds" in fams and "unbroken_failures" in fams


def test_a_flapping_node_is_named(make_cluster):
    env = {"UB_TEST_STEPS": "100000", "UB_TEST_DELAY_MS": "10"}
    c = make_cluster(env=env, min_nodes=1)
    c.start_coordinator()
    c.start_node("steady")
    for _ in range(3):
        flappy = c.start_node("flappy")
        c.wait_for(
            lambda: any(m["name"] == "flappy" and m["state"] == "active" for m in c.state()["members"]), 60, "flappy in"
        )
        c.wait_step(c.max_committed() + 3, timeout=30)
        flappy.proc.send_signal(signal.SIGKILL)
        flappy.proc.wait(timeout=10)
        c.wait_for(lambda: not any(m["name"] == "flappy" for m in c.state()["members"]), 30, "flappy out")
    flapping = events(c, kind="flapping")
    assert len(flapping) == 1 and flapping[0]["node"] == "flappy", events(c)
    assert "failed 3 times" in flapping[0]["reason"]


def test_a_throughput_collapse_is_explained(make_cluster):
    # Every node slows down 10x at step 45: the group's rate collapses with the same members.
    env = {"UB_TEST_STEPS": "70", "UB_TEST_DELAY_MS": "0", "UB_TEST_SAMPLE_MS": "1"}
    c = make_cluster(env=env, min_nodes=2, node_args=["--throttle", "1,45:0.1"])
    c.start_coordinator()
    c.start_node("a")
    c.start_node("b")
    codes = c.wait_exit(timeout=180)
    assert codes == {"a": 0, "b": 0}, c.diagnostics()
    collapse = events(c, kind="throughput-collapse")
    assert len(collapse) == 1 and 45 <= collapse[0]["step"] <= 55, events(c)
    assert "still 2 members" in collapse[0]["reason"], collapse


def test_operator_actions_need_the_token_and_drain_or_kill_a_node(make_cluster, tmp_path):
    token = "s3cret-operator-token"
    env = {"UB_TEST_STEPS": "400", "UB_TEST_DELAY_MS": "10", "UNBROKEN_TOKEN": token}
    c = make_cluster(env=env, min_nodes=3, node_args=["--digest-every", "1"], coordinator_args=["--token", token])
    c.start_coordinator()
    for name in ("a", "b", "c"):
        c.start_node(name)
    c.wait_step(10, timeout=60)
    fams = metrics(c)  # per-node figures while the nodes are in
    sent = {(s.labels["node"], s.labels["link"]): s.value for s in fams["unbroken_node_bytes_sent"]}
    assert sent[("a", "intra_zone")] > 0 and ("c", "inter_zone") in sent, sent
    active = sum(s.value for s in fams["unbroken_members"] if s.labels["state"] == "active")
    assert active == 3
    assert {s.labels["node"] for s in fams["unbroken_node_samples_per_second"]} == {"a", "b", "c"}
    status, text = post(c, "/api/nodes/c/kill")
    assert status == 403 and "token" in text
    status, text = post(c, "/api/nodes/c/kill", token="wrong-token-0000")
    assert status == 403
    assert post(c, "/api/nodes/nobody/drain", token=token)[0] == 404
    assert post(c, "/api/nodes/c/reboot", token=token)[0] == 404
    assert c.nodes["c"].proc.poll() is None  # refused actions changed nothing
    assert post(c, "/api/nodes/c/kill", token=token)[0] == 200
    assert c.nodes["c"].proc.wait(timeout=20) == -signal.SIGKILL
    step = c.max_committed()
    c.wait_step(step + 10, timeout=60)  # the others carry on
    assert post(c, "/api/nodes/b/drain", token=token)[0] == 200
    assert c.nodes["b"].proc.wait(timeout=30) == 0
    codes = c.wait_exit(timeout=120)
    assert codes == {"a": 0, "b": 0, "c": -signal.SIGKILL}, c.diagnostics()
    ops = events(c, kind="operator")
    assert [e["node"] for e in ops] == ["c", "b"] and "kill" in ops[0]["reason"] and "drain" in ops[1]["reason"]
    assert_promises(c, env, finishers=1)


def test_status_and_events_commands(make_cluster):
    env = {"UB_TEST_STEPS": "30", "UB_TEST_DELAY_MS": "5"}
    c = make_cluster(env=env, min_nodes=2)
    c.start_coordinator()
    c.start_node("a")
    c.start_node("b")
    assert c.wait_exit(timeout=120) == {"a": 0, "b": 0}, c.diagnostics()
    where = f"{c.address[0]}:{c.address[1]}"

    def run(*argv: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "unbroken", *argv, "--coordinator", where],
            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    status = run("status", "--once")
    assert "step 30" in status and "FINISHED" in status and "recent events" in status, status
    assert "finished" in status  # the last event
    lines = [json.loads(x) for x in run("events", "--json").splitlines()]
    assert [e["kind"] for e in lines][:2] == ["join", "join"] and lines[-1]["kind"] == "finished"
    assert all({"time", "node", "epoch", "step", "kind", "reason"} <= set(e) for e in lines)
    joins = run("events", "--kind", "join", "--node", "b").splitlines()
    assert len(joins) == 1 and " join " in joins[0] and " b " in joins[0], joins
    followed = run("events", "--follow", "--json").splitlines()  # ends with the finished job
    assert len(followed) == len(lines)
    bad = subprocess.run(
        [sys.executable, "-m", "unbroken", "events", "--coordinator", "127.0.0.1:1"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "cannot reach the coordinator" in bad.stderr
