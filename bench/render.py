"""Render docs/benchmarks.md and its plots from the benchmarks' results.

    python bench/render.py                      # bench/results/*.json -> docs/benchmarks.md, docs/img/bench/*.png
    python bench/render.py --results DIR --out PAGE.md --img DIR

Each bench writes ``bench/results/<bench>.json`` at its end (`common.write_results`: its
command, date, machine and load, the tables it printed and the series behind the plots).
This script turns them into one page: per bench, its command and date, its tables as
printed, their captions under them, and a plot where the bench has a time series or a
trade-off to show. ``bench/results/manual.json`` holds the figures measured by hand before
the benches wrote JSON (the README's former Measured table): they are shown under their
bench, each with its command and date as written then, so nothing measured is lost.
``goodput.json`` (bench/goodput.py) is drawn when present, and said to be missing when not.

Needs matplotlib (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
Plot = Callable[[dict[str, Any], Path], bool]

# Page order and headings; a results file not listed here follows, under its own name.
SECTIONS: dict[str, str] = {
    "recovery": "Recovery from a crash and a freeze",
    "failover": "Leader failover",
    "goodput": "Goodput against failure rate",
    "steady_state": "Steady-state step time",
    "own_loop": "Your own loop against the Job loop",
    "hetero": "Unequal nodes",
    "slowlink": "Zones on slow links: codecs and DiLoCo",
    "checkpoint_stall": "What a checkpoint costs the step",
    "join": "Joining a running job",
    "resync": "Catching up after an absence",
    "robust": "Robust aggregation",
    "verify": "Checking the trainers' work",
    "hostile": "Under attack",
    "scale": "The control plane at scale",
    "simulate": "The control plane simulated",
    "dashboard": "Watching the dashboard",
    "fresh_memory": "Fresh memory",
    "chaos_soak": "Chaos soak",
}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit('bench/render.py draws its plots with matplotlib: pip install -e ".[bench]"')
    return plt


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No software or date in the file: a render of the same results gives the same bytes.
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    _pyplot().close(fig)


def _cumulative(times: list[float]) -> tuple[list[float], list[int]]:
    ts = sorted(times)
    return ts, list(range(1, len(ts) + 1))


# Legends for the benches' scenario keys.
LABELS = {
    "unbroken kill": "unbroken, node SIGKILL",
    "ddp kill": "plain DDP, rank SIGKILL",
    "unbroken stop": "unbroken, node SIGSTOP",
    "ddp stop": "plain DDP, rank SIGSTOP",
    "ha-kill": "etcd: leader SIGKILL",
    "1-kill": "single coordinator: SIGKILL, restarted 1 s later",
    "ha-kn": "etcd: leader SIGKILL, a node 0.1 s later",
    "1-kn": "single: SIGKILL and restart, a node 0.1 s later",
    "ha-stop": "etcd: leader SIGSTOP for 4 s",
}


def plot_commits_around_fault(series: dict[str, Any], path: Path, title: str, fault: str) -> bool:
    runs = {k: v for k, v in series.get("commit_times", {}).items() if isinstance(v, list) and v}
    if not runs:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, times in runs.items():
        xs, ys = _cumulative(times)
        ax.step(xs, ys, where="post", label=LABELS.get(name, name))
    ax.axvline(0.0, color="black", linestyle="--", linewidth=1)
    ax.annotate(fault, (0.0, 0.98), xycoords=("data", "axes fraction"), xytext=(3, 0), textcoords="offset points",
                ha="left", va="top", fontsize=8)  # fmt: skip
    ax.set_xlabel("seconds from the fault")
    ax.set_ylabel("steps committed in the window")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    _save(fig, path)
    return True


def plot_recovery(series: dict[str, Any], path: Path) -> bool:
    return plot_commits_around_fault(
        series, path, "Commits around a SIGKILL / SIGSTOP of 1 of 3 nodes (first run of each)", "fault"
    )


def plot_failover(series: dict[str, Any], path: Path) -> bool:
    return plot_commits_around_fault(
        series, path, "Commits around the coordinator's fault (first run of each scenario)", "leader fault"
    )


def plot_hetero(series: dict[str, Any], path: Path) -> bool:
    dyn = series.get("dynamic")
    if not dyn or not dyn.get("t"):
        return False
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    t = dyn["t"]
    for name, shares in sorted(dyn["shares"].items()):
        label = name + (f" (slowed to {dyn['slow_factor']:g})" if name == dyn.get("slowed") else "")
        top.plot(t, [s if s is not None else float("nan") for s in shares], label=label, drawstyle="steps-post")
    rates = [r if r is not None else float("nan") for r in dyn["samples_per_s"]]
    bottom.plot(t, rates, color="gray", linewidth=1)
    slow_t = dict(zip(dyn["step"], t, strict=True)).get(dyn["slow_at"])
    for ax in (top, bottom):
        if slow_t is not None:
            ax.axvline(slow_t, color="black", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    if slow_t is not None:
        top.annotate(f"slowed at step {dyn['slow_at']}", (slow_t, 0.98), xycoords=("data", "axes fraction"),
                     xytext=(3, 0), textcoords="offset points", ha="left", va="top", fontsize=8)  # fmt: skip
    top.set_ylabel("samples in its share")
    top.set_title("Shares over time, one of 3 nodes slowed mid-run (first repeat)", fontsize=10)
    top.legend(fontsize=8)
    bottom.set_ylabel("group samples/s")
    bottom.set_xlabel("seconds from the first commit")
    _save(fig, path)
    return True


def plot_slowlink(series: dict[str, Any], path: Path) -> bool:
    codecs = {k: v for k, v in series.get("codecs", {}).items() if v.get("bytes_per_sample") and v.get("heldout")}
    if not codecs:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for codec, c in codecs.items():
        ax.scatter(c["bytes_per_sample"], c["heldout"], zorder=3)
        ax.annotate(c.get("label", codec), (c["bytes_per_sample"], c["heldout"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("inter-zone bytes per sample (log)")
    ax.set_ylabel("held-out loss")
    ax.set_title("Inter-zone bytes against held-out loss, per codec (same samples)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    _save(fig, path)
    return True


def plot_checkpoint_stall(series: dict[str, Any], path: Path) -> bool:
    runs = {k: v for k, v in series.get("step_times", {}).items() if v.get("gaps")}
    if not runs:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for config, run in runs.items():
        steps = sorted(int(s) for s in run["gaps"])
        gaps_ms = [1e3 * run["gaps"][str(s)] for s in steps]
        (line,) = ax.plot(steps, gaps_ms, label=config, linewidth=1)
        # the stall of a checkpoint (audit) taken after step m lands in the gap to step m + 1
        hit = [(s, g) for s, g in zip(steps, gaps_ms, strict=True) if s - 1 in set(run["marks"])]
        if hit:
            ax.scatter(*zip(*hit, strict=True), color=line.get_color(), s=18, zorder=3)
    ax.set_xlabel("step (dots: the step that took a checkpoint or an audit)")
    ax.set_ylabel("step time, ms")
    ax.set_title("Step times with and without checkpoints (first repeat of each)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)
    return True


def _curves(data: dict[str, Any]) -> dict[str, list[Any]]:
    """unbroken's and each baseline's goodput per rate; a baseline that did not run has a reason instead."""
    baselines = data.get("baselines", {})
    return {"unbroken": data["ours"], **{k: v for k, v in baselines.items() if isinstance(v, list)}}


def plot_goodput(data: dict[str, Any], path: Path) -> bool:
    rates = data.get("rates") or []
    if not rates:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, values in _curves(data).items():
        ys = [v if v is not None else float("nan") for v in values]
        ax.plot(rates, ys, marker="o", linestyle="-" if name == "unbroken" else "--", label=name)
    ax.set_xlabel("seconds between faults (more faults to the right)")
    ax.set_ylabel("goodput (÷ its own run without faults)")
    ax.invert_xaxis()
    ax.set_title("Goodput against failure rate", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)
    return True


PLOTS: dict[str, Plot] = {
    "recovery": plot_recovery,
    "failover": plot_failover,
    "hetero": plot_hetero,
    "slowlink": plot_slowlink,
    "checkpoint_stall": plot_checkpoint_stall,
}


# ------------------------------------------------------------------- markdown


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|") or " "


PROSE = 40
"""A value cell longer than this (characters) is a sentence: it moves under the table, as a note."""


def md_table(columns: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; a value cell holding a sentence becomes a numbered note under it.

    The first column labels its row and stays whole; the others hold figures, so that a long
    explanation a bench printed in one reads below the table with the same words.
    """
    notes: list[str] = []

    def value(x: Any) -> str:
        text = _cell(x)
        if len(text) <= PROSE:
            return text
        notes.append(" ".join(str(x).split()))
        return f"note {len(notes)}"

    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join([_cell(r[0]), *(value(x) for x in r[1:])]) + " |" for r in rows if r]
    if notes:
        lines += ["", *(f"{i}. {n}" for i, n in enumerate(notes, 1))]
    return "\n".join(lines)


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def _load_line(data: dict[str, Any]) -> str:
    m, load = data.get("machine", {}), data.get("load", {})
    parts = [f"{m.get('cores', '?')} cores", f"{m.get('memory_gb', '?')} GB", m.get("cpu_model") or "CPU model unknown"]
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    text = ", ".join(parts)
    if load:
        start, end = (load.get(k, [None])[0] for k in ("start", "end"))
        text += f"; load average (1 min) {start} at start, {end} at end"
    return text


def bench_section(data: dict[str, Any], img_dir: Path, page_dir: Path) -> list[str]:
    name = data["bench"]
    out = [
        f"Command: `{data['command']}`  ",
        f"Date: {data['date']}, {data.get('duration_s', '?')} s  ",
        f"Machine: {_load_line(data)}",
        "",
    ]
    plot = PLOTS.get(name)
    png = img_dir / f"{name}.png"
    if plot is not None and plot(data.get("series", {}), png):
        out += [f"![{SECTIONS.get(name, name)}]({png.relative_to(page_dir).as_posix()})", ""]
    for table in data.get("tables", []):
        out += [f"**{_cell(table['title'])}**", "", md_table(table["columns"], table["rows"]), ""]
        if table.get("caption"):
            out += [" ".join(table["caption"].split()), ""]
    by_offset = data.get("series", {}).get("by_offset")
    if name == "checkpoint_stall" and by_offset:  # printed as lines under its table
        offsets = sorted({k for v in by_offset.values() for k in v}, key=lambda k: int(k))
        rows = [[c, *("-" if v.get(k) is None else f"{v[k]:.2f}" for k in offsets)] for c, v in by_offset.items()]
        out += ["**Each gap over its run's median step, by commits since the checkpoint's**", ""]
        out += [md_table(["checkpoints", *offsets], rows), ""]
    return out


def manual_section(entries: list[dict[str, Any]]) -> list[str]:
    out = ["Measured by hand before the benches wrote their results (from the README's former table):", ""]
    for e in entries:
        out += [
            f"- **{e['what']}**",
            f"    - unbroken: {e['unbroken']}",
            f"    - baseline: {e['baseline']}",
            f"    - command: {e['command']}; date: {e['date']}",
        ]
    return [*out, ""]


def render(results: Path, page: Path, img_dir: Path) -> str:
    page, img_dir = page.resolve(), img_dir.resolve()
    found = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json")) if p.stem != "manual"}
    manual_path = results / "manual.json"
    manual = json.loads(manual_path.read_text()) if manual_path.exists() else {"entries": [], "notes": []}
    by_bench: dict[str | None, list[dict[str, Any]]] = {}
    for e in manual["entries"]:
        by_bench.setdefault(e.get("bench"), []).append(e)
    page_dir = page.parent
    lines = [
        "# Benchmarks",
        "",
        "<!-- Written by bench/render.py from bench/results/*.json: edit those, or rerun a bench, then "
        "`python bench/render.py`. -->",
        "",
        "Every benchmark under `bench/` runs its baseline side by side in the same invocation and writes what it "
        "printed to `bench/results/<bench>.json`. The machine is shared: each section gives the load beside its "
        "run, so read ratios rather than absolute times.",
        "",
    ]
    names = [n for n in SECTIONS if n in found or n in by_bench or n == "goodput"]
    names += sorted(n for n in set(found) | {b for b in by_bench if b} if n not in SECTIONS)
    for name in names:
        lines += [f"## {SECTIONS.get(name, name)}", ""]
        if name == "goodput":
            lines += goodput_section(found.get("goodput"), img_dir, page_dir)
        elif name in found:
            lines += bench_section(found[name], img_dir, page_dir)
        else:
            lines += [f"No results file yet: run `python bench/{name}.py`.", ""]
        if by_bench.get(name):
            lines += manual_section(by_bench[name])
        lines += [n["text"] + "\n" for n in manual.get("notes", []) if n.get("bench") == name]
    if by_bench.get(None):
        lines += ["## Other measurements", "", *manual_section(by_bench[None])]
    general = [n["text"] for n in manual.get("notes", []) if n.get("bench") not in names]
    if manual.get("setup") or general:
        lines += ["## Notes on the figures measured by hand", ""]
        for note in [manual.get("setup", "").rstrip(":"), *general]:
            lines += [note, ""]
    text = "\n".join(lines).rstrip() + "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    return text


def goodput_section(data: dict[str, Any] | None, img_dir: Path, page_dir: Path) -> list[str]:
    if data is None:
        return ["Goodput: not measured yet (`python bench/goodput.py` writes `bench/results/goodput.json`).", ""]
    out: list[str] = []
    if "command" in data:
        out += [f"Command: `{data['command']}`  ", f"Date: {data.get('date', '?')}  ", f"Machine: {_load_line(data)}"]
        out.append("")
    # bench/goodput.py's own keys, or its series where it writes through common.write_results
    curve = data if "rates" in data else data.get("series", {})
    if curve.get("rates"):
        png = img_dir / "goodput.png"
        if plot_goodput(curve, png):
            out += [f"![Goodput against failure rate]({png.relative_to(page_dir).as_posix()})", ""]
        curves = _curves(curve)
        rows = [[r, *(_num(v[i]) for v in curves.values())] for i, r in enumerate(curve["rates"])]
        out += [md_table(["seconds between faults", *curves], rows), ""]
        for name, why in curve.get("baselines", {}).items():
            if not isinstance(why, list):
                out += [f"- {name}: not run ({why})"]
        out.append("")
        if curve.get("samples_per_s"):
            # Goodput is each system against itself: the absolute rates say what spares cost.
            free, under = curve.get("free_samples_per_s", {}), curve["samples_per_s"]
            rows = [
                [r, *(f"{_num((free.get(n) or [None] * len(curve['rates']))[i])} / {_num(under[n][i])}" for n in under)]
                for i, r in enumerate(curve["rates"])
            ]
            spares = curve.get("spares", 0)
            beside = " (unbroken-spares: ours with hot spares, side by side)" if "unbroken-spares" in under else ""
            out += [
                f"Committed samples/s, without faults / under faults, every system on {curve.get('nodes', '?')} "
                "processes" + (f" (unbroken's: {curve.get('nodes', 0) - spares} training, {spares} hot spare"
                               f"{'s' if spares != 1 else ''})" if spares else "") + beside + ":",
                "",
                md_table(["seconds between faults", *under], rows),
                "",
            ]  # fmt: skip
    if data.get("fault_costs"):
        out += [
            "Every system trains the same global batch B a step on the same processes under the same "
            "fault schedule (torchft's quorum splits B among its participants), so a committed sample "
            "costs each the same work. Each fault is in effect until the process it concerns trains "
            "again (a replacement, the woken one, a joiner); the training lost meanwhile is its cost, "
            "shared by the faults in effect together, and the costs add up to what the window lost.",
            "",
        ]
    for table in data.get("tables", []):
        out += [f"**{_cell(table['title'])}**", "", md_table(table["columns"], table["rows"]), ""]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="the results directory")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the page to write")
    p.add_argument("--img", type=Path, default=ROOT / "docs" / "img" / "bench", help="where the plots go")
    args = p.parse_args()
    if not args.results.is_dir():
        p.error(f"--results {args.results}: no such directory (run a bench first: it writes bench/results/)")
    if not args.img.resolve().is_relative_to(args.out.parent.resolve()):
        p.error(f"--img {args.img} must lie under the page's directory {args.out.parent} (the page links to it)")
    render(args.results, args.out, args.img)
    print(f"wrote {args.out} and its plots under {args.img}")


if __name__ == "__main__":
    main()
