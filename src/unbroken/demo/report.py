"""The demo's report: one self-contained HTML file of its run, written next to its logs.

It shows the training loss over the committed steps, the steps committed over time with
the demo's faults marked (the kill, the join, the leader's kill with ``--ha``), the members
at the end and the summary's figures. The pictures are inline SVG drawn here, so the report
needs nothing beyond the standard library to write or to open (no matplotlib, no network).
The document is well-formed XML as well as HTML, so that any XML parser can check it, and
it carries the loss series as JSON (``<script id="loss-series">``) for tools to read back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

REPORT_NAME = "report.html"

_W, _H = 640, 260
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 20, 28, 44
_MARK_COLORS = {"kill": "#c0392b", "leader-kill": "#8e44ad", "join": "#7f8c8d", "joined": "#27ae60"}


@dataclass(frozen=True)
class Mark:
    """Something the demo did to its cluster, at wall time ``t``."""

    t: float
    kind: str
    """``kill``, ``leader-kill``, ``join`` (a new node's process started) or ``joined`` (its first commit)."""
    label: str


@dataclass(frozen=True)
class Series:
    """Each committed step once: its first commit line over all nodes' logs."""

    steps: list[int]
    losses: list[float | None]
    """None where the loss was not finite (a step the group skipped for it is not committed)."""
    times: list[float]

    @classmethod
    def from_logs(cls, logs: Iterable[Iterable[dict[str, Any]]]) -> Series:
        first: dict[int, dict[str, Any]] = {}
        for entries in logs:
            for e in entries:
                if e.get("kind") != "commit":
                    continue
                step = int(e["step"])
                if step not in first or float(e["t"]) < float(first[step]["t"]):
                    first[step] = e
        steps = sorted(first)
        losses = [_finite(first[s].get("loss")) for s in steps]
        return cls(steps, losses, [float(first[s]["t"]) for s in steps])


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 10 or x == int(x) else f"{x:.2g}"


def svg_plot(
    xs: Sequence[float],
    ys: Sequence[float | None],
    *,
    title: str,
    x_label: str,
    y_label: str,
    marks: Sequence[tuple[float, str, str]] = (),
    element_id: str = "",
) -> str:
    """A line chart as an inline ``<svg>``; ``marks`` are (x, kind, label) drawn as labelled vertical lines.

    A None in ``ys`` breaks the line (a gap, not a zero).
    """
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    all_x = [x for x, _ in points] + [m[0] for m in marks]
    x_lo, x_hi = (min(all_x), max(all_x)) if all_x else (0.0, 1.0)
    y_lo, y_hi = (min(y for _, y in points), max(y for _, y in points)) if points else (0.0, 1.0)
    if x_hi == x_lo:
        x_hi = x_lo + 1
    if y_hi == y_lo:
        y_hi = y_lo + 1
    pw, ph = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def px(x: float) -> float:
        return _LEFT + (x - x_lo) / (x_hi - x_lo) * pw

    def py(y: float) -> float:
        return _TOP + ph - (y - y_lo) / (y_hi - y_lo) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img"'
        + (f' id="{escape(element_id)}"' if element_id else "")
        + f' aria-label="{escape(title)}">',
        f'<text x="{_W / 2}" y="16" text-anchor="middle" class="title">{escape(title)}</text>',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
    ]
    for t in _ticks(x_lo, x_hi):
        out.append(f'<line x1="{px(t):.1f}" y1="{_TOP + ph}" x2="{px(t):.1f}" y2="{_TOP + ph + 4}" stroke="#999"/>')
        out.append(f'<text x="{px(t):.1f}" y="{_TOP + ph + 16}" text-anchor="middle">{_fmt(t)}</text>')
    for t in _ticks(y_lo, y_hi):
        out.append(f'<line x1="{_LEFT - 4}" y1="{py(t):.1f}" x2="{_LEFT}" y2="{py(t):.1f}" stroke="#999"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    out.append(f'<text x="{_LEFT + pw / 2}" y="{_H - 6}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(
        f'<text x="14" y="{_TOP + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {_TOP + ph / 2})">'
        f"{escape(y_label)}</text>"
    )
    # One polyline per unbroken run of points, so that a missing value shows as a gap.
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys, strict=True):
        if y is None:
            runs.append([])
        else:
            runs[-1].append((x, y))
    for run in runs:
        if run:
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
            out.append(f'<polyline class="series" fill="none" stroke="#2c6fbb" stroke-width="1.5" points="{pts}"/>')
    for i, (x, kind, label) in enumerate(marks):
        color = _MARK_COLORS.get(kind, "#333")
        y_text = _TOP + 12 + 12 * (i % 3)  # staggered, so that marks close together stay readable
        out.append(
            f'<g class="mark" data-kind="{escape(kind)}" data-x="{x:.3f}">'
            f'<line x1="{px(x):.1f}" y1="{_TOP}" x2="{px(x):.1f}" y2="{_TOP + ph}" stroke="{color}" '
            f'stroke-dasharray="4 3"/>'
            f'<text x="{px(x) + 3:.1f}" y="{y_text}" fill="{color}">{escape(label)}</text></g>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]], element_id: str = "") -> str:
    ident = f' id="{escape(element_id)}"' if element_id else ""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(_cell(c))}</td>" for c in r) + "</tr>\n" for r in rows)
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 700px; color: #222; }
svg text { font-size: 11px; fill: #333; } svg text.title { font-size: 13px; font-weight: bold; }
table { border-collapse: collapse; margin: 1em 0; } td, th { border: 1px solid #ccc; padding: 3px 8px; }
td { text-align: right; white-space: pre-line; } td:first-child, #summary td { text-align: left; }
th { background: #f4f4f4; }
"""


def write_report(
    path: Path,
    *,
    title: str,
    logs: Iterable[Iterable[dict[str, Any]]],
    marks: Sequence[Mark],
    members: Sequence[dict[str, Any]],
    summary: Sequence[tuple[str, str]] = (),
) -> Path:
    """Write the report to ``path`` and return it.

    ``logs``: the nodes' commit logs; ``members``: the coordinator's members (its ``/api/state``)
    as last seen before they finished; ``summary``: (figure, value) rows as the terminal summary showed them.
    """
    series = Series.from_logs(logs)
    t0 = min([*series.times[:1], *(m.t for m in marks)], default=0.0)
    step_at = dict(zip(series.times, series.steps, strict=True))

    def step_of(t: float) -> str:
        done = [s for tt, s in step_at.items() if tt <= t]
        return str(max(done)) if done else "-"

    loss_svg = svg_plot(
        [float(s) for s in series.steps],
        series.losses,
        title="Training loss over the committed steps",
        x_label="step",
        y_label="loss",
        element_id="loss",
    )
    commits_svg = svg_plot(
        [t - t0 for t in series.times],
        [float(s) for s in series.steps],
        title="Steps committed over time",
        x_label="seconds from the start",
        y_label="step",
        marks=[(m.t - t0, m.kind, m.label) for m in marks],
        element_id="commits",
    )
    member_rows = [
        [m.get("name"), m.get("role") or "trainer", m.get("rank"), m.get("share"), m.get("loss")] for m in members
    ]
    mark_rows = [[m.label, f"{m.t - t0:.2f} s", step_of(m.t)] for m in marks]
    loss_json = json.dumps({"step": series.steps, "loss": series.losses})
    doc = f"""<!DOCTYPE html>
<html xmlns="http://www.w3.org/1999/xhtml" lang="en">
<head>
<meta charset="utf-8"/>
<title>{escape(title)}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>{escape(title)}</h1>
<h2>Loss</h2>
{loss_svg}
<h2>Commits</h2>
{commits_svg}
{_table(["what happened", "at", "committed step"], mark_rows, "marks")}
<h2>Members at the end of training</h2>
{_table(["member", "role", "rank", "share", "loss"], member_rows, "members")}
<h2>Summary</h2>
{_table(["figure", "value"], summary, "summary")}
<script type="application/json" id="loss-series">{loss_json}</script>
</body>
</html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc, encoding="utf-8")
    return path
