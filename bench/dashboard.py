"""What watching costs: step time with a browser on the dashboard vs without, side by side.

    python bench/dashboard.py                         # 3 interleaved repeats, ~2 min on 2 cores
    python bench/dashboard.py --repeats 5 --steps 600 --pages 3

Both sides run the same job (``bench/jobs.py``, default the ~0.67M-parameter MLP) on a real
coordinator and ``--nodes`` node subprocesses on loopback (`unbroken.testing.LocalCluster`),
OMP_NUM_THREADS=1, the same global batch B:

- baseline: nobody looks at the coordinator;
- dashboard: ``--pages`` tabs of headless Chromium (Debian's ``/usr/bin/chromium``, driven by
  Playwright) have the dashboard open from before the first step to the end, polling
  /api/state, /api/events and /api/history once a second and redrawing the charts.
  The browser shares the machine's cores with the nodes: that is part of the cost measured.

Step time = gap between consecutive ``commit`` lines of a node's commit log after
``--warmup`` steps, pooled over nodes (as in bench/steady_state.py). Runs alternate
(baseline, dashboard, dashboard, baseline, ...) so drift on a shared machine hits both. The
figure is the ratio of median step times, dashboard / baseline. Also shown, from /proc: how
busy the machine's CPUs were, the coordinator's CPU time and Chromium's (all its processes)
per second of the run (100% = one core), and how many API requests a tab made per second.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jobs
from common import ProgressLine, fmt, median, print_command, print_table, ratio, step_times, write_results
from unbroken.testing import LocalCluster

COLUMNS = [
    "side", "median step", "p90 step", "samples/s", "machine CPU busy", "coordinator CPU", "Chromium CPU",
    "API requests/s per tab", "per-run medians (ms)", "vs baseline",
]  # fmt: skip
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (Linux)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chromium_cpu_seconds() -> float:
    """CPU seconds of the live Chromium processes started by this process (its descendants)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    mine, total = {os.getpid()}, 0.0
    grew = True
    while grew:
        more = {pid for pid, pp in parent.items() if pp in mine} - mine
        mine |= more
        grew = bool(more)
    for pid in mine - {os.getpid()}:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("chromium"):
                total += cpu_seconds(pid)
    return total


@contextlib.contextmanager
def browser_pages(url: str, count: int) -> Iterator[list[Any]]:
    """``count`` Chromium tabs on ``url`` (none when count is 0)."""
    if count == 0:
        yield []
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            pages = []
            for _ in range(count):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url)
                page.evaluate("performance.setResourceTimingBufferSize(1000000)")
                pages.append(page)
            yield pages
        finally:
            browser.close()


def run(args: argparse.Namespace, workdir: Path, pages: int) -> dict[str, Any]:
    env = jobs.env_for(args.steps, args.batch)
    with LocalCluster(jobs.job_ref(args.model), workdir, env=env, min_nodes=args.nodes) as c:
        host, port = c.start_coordinator()
        assert c.coordinator is not None
        with browser_pages(f"http://{host}:{port}/", pages) as tabs:
            busy0, total0 = cpu_jiffies()
            t0, coordinator0, browser0 = time.monotonic(), cpu_seconds(c.coordinator.pid), chromium_cpu_seconds()
            for i in range(args.nodes):
                c.start_node(f"n{i}")
            codes = c.wait_exit(timeout=args.timeout)
            busy1, total1 = cpu_jiffies()
            wall = time.monotonic() - t0
            coordinator_cpu = (cpu_seconds(c.coordinator.pid) - coordinator0) / wall
            browser_cpu = (chromium_cpu_seconds() - browser0) / wall
            if any(code != 0 for code in codes.values()):
                raise RuntimeError(f"run failed: {codes}\n{c.diagnostics()}")
            rates, points = [], 0
            for tab in tabs:  # API requests over the tab's life
                count, alive_s = tab.evaluate(
                    "[performance.getEntriesByType('resource').filter(e => e.name.includes('/api/')).length,"
                    " performance.now() / 1000]"
                )
                rates.append(count / alive_s)
                points = int(tab.get_attribute("#loss-chart", "data-points") or 0)
            if tabs and points < args.steps // 2:
                raise RuntimeError(f"the dashboard plotted {points} of {args.steps} steps: was it live?")
        gaps: list[float] = []
        for n in c.nodes.values():
            gaps += step_times(n.entries(), args.warmup)
        return {
            "gaps": gaps,
            "cpu": (busy1 - busy0) / max(total1 - total0, 1),
            "coordinator_cpu": coordinator_cpu,
            "browser_cpu": browser_cpu,
            "requests_per_s": median(rates),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved")
    p.add_argument("--steps", type=int, default=400, help="steps per run")
    p.add_argument("--warmup", type=int, default=30, help="steps left out at the start of each run")
    p.add_argument("--nodes", type=int, default=3, help="node processes")
    p.add_argument("--batch", type=int, default=96, help="global batch B")
    p.add_argument("--pages", type=int, default=1, help="browser tabs on the dashboard (dashboard side)")
    p.add_argument("--model", choices=sorted(jobs.JOBS), default="small")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds allowed for one run")
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    args = p.parse_args()
    if args.steps <= args.warmup + 2:
        p.error("--steps must exceed --warmup by at least 3")
    if not Path(CHROMIUM).exists():
        p.error(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    print_command()
    n_params = jobs.num_params(args.model)
    print(
        f"model {args.model} ({n_params:,} parameters), B={args.batch}, {args.nodes} nodes, {args.steps} steps per "
        f"run (first {args.warmup} left out), {args.pages} dashboard tab(s), OMP_NUM_THREADS=1",
        flush=True,
    )

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="ub-dashboard-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    sides = {"baseline": 0, "dashboard": args.pages}
    per_run: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    progress = ProgressLine(2 * args.repeats)
    try:
        for rep in range(args.repeats):
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for side in order:
                progress.update(f"repeat {rep + 1}/{args.repeats}: {side} running")
                t0 = time.monotonic()
                result = run(args, root / f"{side}{rep}", sides[side])
                result["median"] = median(result["gaps"])
                per_run[side].append(result)
                progress.update(
                    f"repeat {rep + 1}/{args.repeats}: {side} median step {1e3 * (result['median'] or 0):.2f} ms "
                    f"({time.monotonic() - t0:.0f} s)",
                    advance=1,
                )
    finally:
        progress.close()
        if tmp is not None:
            tmp.cleanup()

    base = median(r["median"] for r in per_run["baseline"])
    rows = []
    labels = {"baseline": "no browser (baseline)", "dashboard": f"dashboard in {args.pages} tab(s)"}
    for side, label in labels.items():
        runs = per_run[side]
        med = median(r["median"] for r in runs)
        gaps = sorted(g for r in runs for g in r["gaps"])
        p90 = gaps[int(0.9 * (len(gaps) - 1))] if gaps else None
        rows.append([
            label,
            fmt(med and med * 1e3, " ms", 2),
            fmt(p90 and p90 * 1e3, " ms", 2),
            fmt(med and args.batch / med, "", 0),
            fmt(median(100 * r["cpu"] for r in runs), "%", 0),
            fmt(median(100 * r["coordinator_cpu"] for r in runs), "%", 1),
            fmt(median(100 * r["browser_cpu"] for r in runs), "%", 1) if side == "dashboard" else "-",
            fmt(median(r["requests_per_s"] for r in runs), "", 1) if side == "dashboard" else "-",
            ", ".join(f"{(r['median'] or 0) * 1e3:.2f}" for r in runs),
            ratio(med, base, 3),
        ])  # fmt: skip
    per_rep = ", ".join(
        f"{a['median'] / b['median']:.3f}"
        for a, b in zip(per_run["dashboard"], per_run["baseline"], strict=True)
        if a["median"] and b["median"]
    )
    print_table(
        f"Step time with and without the dashboard watched, {args.model} MLP ({n_params / 1e6:.2f}M params), "
        f"B={args.batch}, {args.nodes} nodes, medians over {args.repeats} runs",
        COLUMNS,
        rows,
        caption=f"ratio dashboard/baseline = {ratio(median(r['median'] for r in per_run['dashboard']), base, 3)}; "
        f"per-repeat ratios: {per_rep}",
    )


if __name__ == "__main__":
    main()
    write_results()
