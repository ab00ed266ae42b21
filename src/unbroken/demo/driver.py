"""`unbroken demo`: a local coordinator and three nodes, a kill, a join, live progress.

Runs the character-level model of `unbroken.demo.charlm` on text that ships with Python.
About a third of the way in one node is SIGKILLed; two thirds of the way a new node
starts and joins. The summary shows what was committed, how fast the group recovered,
the held-out metric and whether every replica ended bit-identical; the same, with the
loss and the commits over time (the kill and the join marked), goes to ``report.html``
next to the logs (`unbroken.demo.report`).

``unbroken demo --ha`` runs a real 3-member etcd cluster and two coordinators instead: a
third of the way in the leading coordinator is SIGKILLed and a node right after it; the
summary shows the failover (who leads, in which term, how soon) and the recovery.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from unbroken.config import CoordinatorConfig, MembershipConfig, ServiceConfig
from unbroken.control.coordinator import Coordinator
from unbroken.demo.report import REPORT_NAME, Mark, write_report
from unbroken.testing.cluster import LocalCluster, NodeProcess
from unbroken.testing.etcd import EtcdCluster

JOB = "unbroken.demo.charlm:job"


def _first_commit_after(node: NodeProcess, epoch: int) -> float | None:
    """Wall time of the node's first commit in an epoch newer than ``epoch``."""
    for e in node.entries():
        if e["kind"] == "commit" and e["epoch"] > epoch:
            return float(e["t"])
    return None


def run_demo(steps: int = 0, nodes: int = 3, out_dir: Path | None = None, ha: bool = False) -> int:
    from unbroken.demo.charlm import make_job

    console = Console()
    num_steps = steps or make_job().num_steps
    workdir = out_dir or Path(tempfile.mkdtemp(prefix="unbroken-demo-"))
    env = {"UNBROKEN_DEMO_STEPS": str(num_steps)}
    how = " with 3 etcd members and 2 coordinators" if ha else ""
    console.print(
        f"[bold]unbroken demo[/]: {nodes} nodes train a character model for {num_steps} steps{how}; logs in {workdir}"
    )
    try:
        if ha:
            with (
                EtcdCluster(workdir / "etcd") as etcd,
                LocalCluster(JOB, workdir, env=env, etcd=etcd.endpoints, min_nodes=nodes) as cluster,
            ):
                for _ in range(2):
                    cluster.start_coordinator()
                cluster.wait_for(lambda: cluster.leader() is not None, 30, "a leader")
                return _drive(console, cluster, _following(cluster), nodes, num_steps, ha=True)
        coord = Coordinator(
            CoordinatorConfig(
                ServiceConfig(port=0, event_log=workdir / "events.jsonl"), MembershipConfig(min_nodes=nodes)
            )
        ).start()
        try:
            with LocalCluster(JOB, workdir, env=env) as cluster:
                cluster.address = coord.address
                return _drive(console, cluster, coord.state, nodes, num_steps, ha=False)
        finally:
            coord.stop()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: nodes stopped[/]")
        return 130


def _following(cluster: LocalCluster) -> Callable[[], dict[str, Any]]:
    """The leader's state; the last one seen while an election is under way."""
    last: dict[str, Any] = {}

    def state() -> dict[str, Any]:
        nonlocal last
        with contextlib.suppress(OSError, ValueError):
            last = cluster.state(timeout=1.0)
        return last

    return state


def _drive(
    console: Console,
    cluster: LocalCluster,
    coordinator_state: Callable[[], dict[str, Any]],
    nodes: int,
    num_steps: int,
    *,
    ha: bool,
) -> int:
    from unbroken.demo.charlm import sample_text

    assert cluster.address is not None
    host, port = cluster.address
    url = f"http://{host}:{port}"
    console.print(f"coordinator on {url}  [bold]dashboard: {url}/[/]  (live state: {url}/api/state)")
    if ha:
        others = ", ".join(f"http://{h}:{p}/" for _, (h, p) in cluster.coordinators)
        console.print(f"coordinators (any one shows who leads): {others}")
    names = [f"node-{i + 1}" for i in range(nodes)]
    for name in names:
        cluster.start_node(name)
    kill_at, join_at = num_steps // 3, 2 * num_steps // 3
    killed: tuple[str, float] | None = None
    joined: tuple[str, float] | None = None
    failover: tuple[float, int] | None = None
    """When the leader was killed, and the term it led."""
    progress = Progress(
        TextColumn("[bold]step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    )
    task = progress.add_task("train", total=num_steps, status="waiting for nodes")
    state: dict[str, Any] = {}
    last_members: list[dict[str, Any]] = []
    deadline = time.monotonic() + 600
    with Live(progress, console=console, refresh_per_second=8):
        while time.monotonic() < deadline:
            state = coordinator_state() or state
            step = int(state.get("step", 0))
            if not state:
                time.sleep(0.1)
                continue
            members = [m for m in state["members"] if m["rank"] is not None]
            if step < num_steps:  # they leave as they finish: the report shows those of the last step
                last_members = state["members"]
            losses = [m["loss"] for m in members if m["loss"] is not None]
            status = (
                f"epoch {state['epoch']} | {len(members)} training: "
                + ", ".join(
                    f"{m['name']}({m['share'] if m['role'] in (None, 'trainer') else m['role']})" for m in members
                )
                + (f" | loss {losses[0]:.3f}" if losses else "")
            )
            if state["finished"]:
                status = f"finished in epoch {state['epoch']}"
            progress.update(task, completed=step, status=status)
            if ha and failover is None and step >= kill_at:
                leader = cluster.leader()
                if leader is not None:
                    term = int(state["leadership"]["term"])
                    cluster.kill_coordinator(leader)
                    failover = (time.time(), term)
                    console.print(f"[red]step {step}: SIGKILL the leading coordinator (term {term})[/]")
                    time.sleep(0.2)
            if killed is None and step >= kill_at and (failover is not None or not ha):
                victim = cluster.nodes[names[1]]
                victim.kill()
                killed = (victim.name, time.time())
                console.print(f"[red]step {step}: SIGKILL {victim.name}[/]")
            if joined is None and step >= join_at:
                newcomer = cluster.start_node(f"node-{nodes + 1}")
                joined = (newcomer.name, newcomer.started_at)
                console.print(f"[green]step {step}: started {newcomer.name}; it will join at a step boundary[/]")
            alive = [n for n in cluster.nodes.values() if n.proc.poll() is None]
            if state["finished"] and not alive:
                break
            time.sleep(0.1)
        progress.update(task, completed=int(state.get("step", 0)))
    console.print()
    codes = cluster.wait_exit([n for n in cluster.nodes if killed is None or n != killed[0]], timeout=60)
    state = coordinator_state()
    if ha:
        state = {**state, "events": cluster.events()}  # every coordinator's, not the last leader's alone
    rows = _summary(console, cluster, state, killed, joined, codes, num_steps, failover)
    finals = [n for n in cluster.nodes.values() if n.final_state.exists()]
    if finals:
        from unbroken.demo.charlm import CharMLP

        model = CharMLP()
        model.load_state_dict(torch.load(finals[0].final_state, weights_only=True)["model"])
        model.eval()
        sample = sample_text(model)
        console.print(f"[bold]sample[/]: {sample!r}")
        rows.append(("sample", repr(sample)))
    try:
        report = write_report(
            cluster.workdir / REPORT_NAME,
            title=f"unbroken demo{' --ha' if ha else ''}: {len(names)} nodes, {num_steps} steps",
            logs=[n.entries() for n in cluster.nodes.values()],
            marks=_marks(cluster, killed, joined, failover),
            members=last_members,
            summary=rows,
        )
        # One line whatever the terminal's width: a wrapped path cannot be copied.
        console.print(f"[bold]report[/]: {report} (open it in a browser)", soft_wrap=True)
    except OSError as exc:  # the run itself succeeded: say so, and why there is no report
        console.print(f"[yellow]no report: could not write {cluster.workdir / REPORT_NAME}: {exc}[/]")
    digests = set(state["final_digests"].values())
    return 0 if state["finished"] and len(digests) == 1 else 1


def _marks(
    cluster: LocalCluster,
    killed: tuple[str, float] | None,
    joined: tuple[str, float] | None,
    failover: tuple[float, int] | None,
) -> list[Mark]:
    """What the demo did to the cluster, for the report's timeline."""
    marks: list[Mark] = []
    if failover is not None:
        marks.append(Mark(failover[0], "leader-kill", f"SIGKILL leader (term {failover[1]})"))
    if killed is not None:
        marks.append(Mark(killed[1], "kill", f"SIGKILL {killed[0]}"))
    if joined is not None:
        name, started = joined
        marks.append(Mark(started, "join", f"{name} started to join"))
        # On a busy machine its start-up may outlast a short job: then it never commits.
        first = next((float(e["t"]) for e in cluster.nodes[name].entries() if e["kind"] == "commit"), None)
        if first is not None:
            marks.append(Mark(first, "joined", f"{name}'s first commit"))
    return sorted(marks, key=lambda m: m.t)


def _summary(
    console: Console,
    cluster: LocalCluster,
    state: dict[str, Any],
    killed: tuple[str, float] | None,
    joined: tuple[str, float] | None,
    codes: dict[str, int],
    num_steps: int,
    failover: tuple[float, int] | None = None,
) -> list[tuple[str, str]]:
    """Print the summary table; return its rows, for the report."""
    events = state["events"]
    table = Table(title="unbroken demo summary", show_header=False)
    rows: list[tuple[str, str]] = []

    def add(figure: str, value: str) -> None:
        rows.append((figure, value))
        table.add_row(figure, value)

    add("steps committed", f"{state['step']} / {num_steps}")
    add("epochs (membership versions)", str(state["epoch"]))
    if failover is not None:
        t_kill, term = failover
        elected = next((e for e in events if e["kind"] == "leader" and e["time"] > t_kill), None)
        if elected is not None:
            add(
                "leader SIGKILL -> a standby leads",
                f"{elected['time'] - t_kill:.2f} s ({elected['reason']}; the killed one led term {term})",
            )
        commits = [e["t"] for n in cluster.nodes.values() for e in n.entries() if e["kind"] == "commit"]
        before = sum(1 for t in commits if t_kill - 2 <= t < t_kill) / 2
        after = sum(1 for t in commits if t_kill <= t < t_kill + 2) / 2
        add("commits/s (all nodes) 2 s before -> after the leader's kill", f"{before:.0f} -> {after:.0f}")
    failures = [e for e in events if e["kind"] == "failure"]
    shifts = [e for e in events if e["kind"] in ("role", "straggler") or "rebalance" in e["reason"]]
    if shifts:
        add("plan changes for speed", "".join(f"\n  {e['reason'][:150]}" for e in shifts).lstrip("\n"))
    unseen = []
    if killed is not None and not any(killed[0] in e["reason"] for e in failures):
        unseen = [f"{killed[0]}: killed while no coordinator led (its peers' step failed; no event)"]
    faults = [e["reason"] for e in failures] + unseen
    add("faults survived", str(len(faults)) + "".join(f"\n  {r}" for r in faults))
    if killed is not None:
        name, t_kill = killed
        failure = next((e for e in failures if name in e["reason"]), None)
        if failure is not None:
            add("kill -> failure detected", f"{(failure['time'] - t_kill) * 1e3:.0f} ms")
        # Killed while nobody led (--ha), the node's failure is no event: its epoch broke all the same.
        epochs = [int(e["epoch"]) for e in cluster.nodes[name].entries() if e["kind"] == "epoch"]
        broken = failure["epoch"] if failure is not None else max(epochs, default=0)
        survivors = [n for n in cluster.nodes.values() if n.name != name]
        firsts = [c for n in survivors if (c := _first_commit_after(n, broken)) is not None]
        if firsts:
            add("kill -> survivors' next commit", f"{(min(firsts) - t_kill) * 1e3:.0f} ms")
    if joined is not None:
        name, t_start = joined
        node = cluster.nodes[name]
        sync = next((e for e in node.entries() if e["kind"] == "sync"), None)
        commit = next((e["t"] for e in node.entries() if e["kind"] == "commit"), None)
        if sync is not None:
            add("join: state received", f"{sync['mb']:.1f} MB in {sync['seconds'] * 1e3:.0f} ms")
        if commit is not None:
            add("join: process start -> first commit", f"{commit - t_start:.1f} s (includes Python/torch start-up)")
    for k, v in state["final_metrics"].items():
        hint = " (uniform guessing: 6.6; lower is better)" if k == "heldout_bits_per_char" else ""
        add(k.replace("_", " "), f"{v:.3f}{hint}")
    digests = state["final_digests"]
    agree = len(set(digests.values())) == 1
    add(
        "replicas bit-identical",
        f"{'yes' if agree else 'NO'} ({len(digests)} nodes, digest {next(iter(digests.values()), '')[:16]})",
    )
    add("node exit codes", ", ".join(f"{k}={v}" for k, v in codes.items()))
    console.print(table)
    return rows
