"""`unbroken demo`: a local coordinator and three nodes, a kill, a join, live progress.

Runs the character-level model of `unbroken.demo.charlm` on text that ships with Python.
About a third of the way in one node is SIGKILLed; two thirds of the way a new node
starts and joins. The summary shows what was committed, how fast the group recovered,
the held-out metric and whether every replica ended bit-identical.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from unbroken.config import CoordinatorConfig
from unbroken.control.coordinator import Coordinator
from unbroken.testing.cluster import LocalCluster, NodeProcess

JOB = "unbroken.demo.charlm:job"


def _first_commit_after(node: NodeProcess, epoch: int) -> float | None:
    """Wall time of the node's first commit in an epoch newer than ``epoch``."""
    for e in node.entries():
        if e["kind"] == "commit" and e["epoch"] > epoch:
            return float(e["t"])
    return None


def run_demo(steps: int = 0, nodes: int = 3, out_dir: Path | None = None) -> int:
    from unbroken.demo.charlm import make_job

    console = Console()
    num_steps = steps or make_job().num_steps
    workdir = out_dir or Path(tempfile.mkdtemp(prefix="unbroken-demo-"))
    env = {"UNBROKEN_DEMO_STEPS": str(num_steps)}
    console.print(
        f"[bold]unbroken demo[/]: {nodes} nodes train a character model for {num_steps} steps; logs in {workdir}"
    )
    coord = Coordinator(CoordinatorConfig(port=0, min_nodes=nodes, event_log=workdir / "events.jsonl")).start()
    try:
        return _drive(console, coord, workdir, env, nodes, num_steps)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: nodes stopped[/]")
        return 130
    finally:
        coord.stop()


def _drive(console: Console, coord: Coordinator, workdir: Path, env: dict[str, str], nodes: int, num_steps: int) -> int:
    from unbroken.demo.charlm import sample_text

    with LocalCluster(JOB, workdir, env=env) as cluster:
        cluster.address = host, port = coord.address
        url = f"http://{host}:{port}"
        console.print(f"coordinator on {url}  [bold]dashboard: {url}/[/]  (live state: {url}/api/state)")
        names = [f"node-{i + 1}" for i in range(nodes)]
        for name in names:
            cluster.start_node(name)
        kill_at, join_at = num_steps // 3, 2 * num_steps // 3
        killed: tuple[str, float] | None = None
        joined: tuple[str, float] | None = None
        progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
        )
        task = progress.add_task("train", total=num_steps, status="waiting for nodes")
        state: dict[str, Any] = {}
        deadline = time.monotonic() + 600
        with Live(progress, console=console, refresh_per_second=8):
            while time.monotonic() < deadline:
                state = coord.state()
                step = int(state["step"])
                members = [m for m in state["members"] if m["rank"] is not None]
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
                if killed is None and step >= kill_at:
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
        state = coord.state()
        _summary(console, cluster, state, killed, joined, codes, num_steps)
        finals = [n for n in cluster.nodes.values() if n.final_state.exists()]
        if finals:
            from unbroken.demo.charlm import CharMLP

            model = CharMLP()
            model.load_state_dict(torch.load(finals[0].final_state, weights_only=True)["model"])
            model.eval()
            console.print(f"[bold]sample[/]: {sample_text(model)!r}")
        digests = set(state["final_digests"].values())
        return 0 if state["finished"] and len(digests) == 1 else 1


def _summary(
    console: Console,
    cluster: LocalCluster,
    state: dict[str, Any],
    killed: tuple[str, float] | None,
    joined: tuple[str, float] | None,
    codes: dict[str, int],
    num_steps: int,
) -> None:
    events = state["events"]
    table = Table(title="unbroken demo summary", show_header=False)
    table.add_row("steps committed", f"{state['step']} / {num_steps}")
    table.add_row("epochs (membership versions)", str(state["epoch"]))
    failures = [e for e in events if e["kind"] == "failure"]
    shifts = [e for e in events if e["kind"] in ("role", "straggler") or "rebalance" in e["reason"]]
    if shifts:
        table.add_row("plan changes for speed", "".join(f"\n  {e['reason'][:150]}" for e in shifts).lstrip("\n"))
    table.add_row("faults survived", str(len(failures)) + "".join(f"\n  {e['reason']}" for e in failures))
    if killed is not None:
        name, t_kill = killed
        failure = next((e for e in failures if name in e["reason"]), None)
        if failure is not None:
            table.add_row("kill -> failure detected", f"{(failure['time'] - t_kill) * 1e3:.0f} ms")
            survivors = [n for n in cluster.nodes.values() if n.name != name]
            firsts = [c for n in survivors if (c := _first_commit_after(n, failure["epoch"])) is not None]
            if firsts:
                table.add_row("kill -> survivors' next commit", f"{(min(firsts) - t_kill) * 1e3:.0f} ms")
    if joined is not None:
        name, t_start = joined
        node = cluster.nodes[name]
        sync = next((e for e in node.entries() if e["kind"] == "sync"), None)
        commit = next((e["t"] for e in node.entries() if e["kind"] == "commit"), None)
        if sync is not None:
            table.add_row("join: state received", f"{sync['mb']:.1f} MB in {sync['seconds'] * 1e3:.0f} ms")
        if commit is not None:
            table.add_row(
                "join: process start -> first commit", f"{commit - t_start:.1f} s (includes Python/torch start-up)"
            )
    for k, v in state["final_metrics"].items():
        hint = " (uniform guessing: 6.6; lower is better)" if k == "heldout_bits_per_char" else ""
        table.add_row(k.replace("_", " "), f"{v:.3f}{hint}")
    digests = state["final_digests"]
    agree = len(set(digests.values())) == 1
    table.add_row(
        "replicas bit-identical",
        f"{'yes' if agree else 'NO'} ({len(digests)} nodes, digest {next(iter(digests.values()), '')[:16]})",
    )
    table.add_row("node exit codes", ", ".join(f"{k}={v}" for k, v in codes.items()))
    console.print(table)
