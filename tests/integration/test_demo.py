"""The quick start's main command, shortened: it must finish with agreeing replicas and
leave a report of its run next to its logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)


def _entries(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # node-2's last line, cut short by its SIGKILL
            continue
    return out


NS = {"h": "http://www.w3.org/1999/xhtml", "s": "http://www.w3.org/2000/svg"}


class _Tags(HTMLParser):
    """The tags an HTML parser opens and closes, in order (void elements close themselves)."""

    VOID = frozenset({"meta", "br", "img", "hr", "input", "link"})

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.seen: set[str] = set()
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self.seen.add(tag)
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag: str, attrs: object) -> None:
        self.seen.add(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.open[-1:]}")
        else:
            self.open.pop()


def _check_report(out_dir: Path, stdout: str, kills: set[str]) -> None:
    """The report is named in the demo's last lines, parses as HTML (and as XML), and shows the
    loss of every committed step, the marks of what the demo did, and the members at the end."""
    report = out_dir / "report.html"
    last_lines = stdout.strip().splitlines()[-3:]
    assert any("report" in line and "report.html" in line for line in last_lines), last_lines
    text = report.read_text(encoding="utf-8")
    tags = _Tags()
    tags.feed(text)
    tags.close()
    assert not tags.errors and not tags.open, (tags.errors, tags.open)
    assert {"html", "head", "title", "body", "svg", "polyline", "table"} <= tags.seen, tags.seen
    root = ET.fromstring(text)

    logged: dict[int, tuple[float, float]] = {}  # step -> (time, loss) of its earliest commit line
    for log in out_dir.glob("node-*.jsonl"):
        for e in _entries(log):
            if e["kind"] == "commit" and (e["step"] not in logged or e["t"] < logged[e["step"]][0]):
                logged[e["step"]] = (e["t"], e["loss"])
    series = json.loads(root.find(".//h:script[@id='loss-series']", NS).text)
    assert series["step"] == sorted(logged) and series["step"][-1] == max(logged), series["step"][-5:]
    assert series["loss"] == [logged[k][1] for k in series["step"]]
    assert series["loss"][-1] < series["loss"][0]  # it trained

    marks = root.findall(".//s:svg[@id='commits']/s:g[@class='mark']", NS)
    by_kind = {g.get("data-kind"): g.find("s:text", NS).text for g in marks}
    # node-4's first commit is marked too when it came before the end: on a busy machine its
    # start-up may outlast the short job
    assert kills | {"join"} <= set(by_kind) <= kills | {"join", "joined"}, by_kind
    assert by_kind["kill"] == "SIGKILL node-2" and by_kind["join"] == "node-4 started to join", by_kind
    xs = {g.get("data-kind"): float(g.get("data-x")) for g in marks}
    span = max(t for t, _ in logged.values()) - min(t for t, _ in logged.values())
    assert 0 < xs["kill"] < xs["join"] < span, (xs, span)
    members = [tr.find("h:td", NS).text for tr in root.findall(".//h:table[@id='members']/h:tbody/h:tr", NS)]
    assert {"node-1", "node-3"} <= set(members) and "node-2" not in members, members


def test_demo_survives_its_kill_and_ends_with_identical_replicas(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "demo", "--steps", "150", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "SIGKILL node-2" in out
    assert "150 / 150" in out
    assert "faults survived" in out and "node-2: control connection dropped" in out
    assert "replicas bit-identical" in out and "│ yes" in out
    assert "heldout bits per char" in out
    _check_report(tmp_path, out, {"kill"})


def test_ha_demo_survives_the_leaders_kill_and_a_nodes(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "demo", "--ha", "--steps", "400", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "SIGKILL the leading coordinator" in out and "SIGKILL node-2" in out
    assert "400 / 400" in out
    assert "leader SIGKILL -> a standby leads" in out and "the killed one led term" in out
    assert "kill -> survivors' next commit" in out
    assert "replicas bit-identical" in out and "│ yes" in out
    _check_report(tmp_path, out, {"leader-kill", "kill"})
