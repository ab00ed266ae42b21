"""The demo's HTML report: one well-formed document with the loss, the marks and the members."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

from unbroken.demo.report import Mark, Series, svg_plot, write_report

NS = {"h": "http://www.w3.org/1999/xhtml", "s": "http://www.w3.org/2000/svg"}


def _commit(step: int, t: float, loss: float, epoch: int = 1) -> dict[str, object]:
    return {"kind": "commit", "step": step, "t": t, "loss": loss, "epoch": epoch}


def test_each_step_is_taken_once_from_its_earliest_commit_line_and_a_non_finite_loss_is_a_gap() -> None:
    a = [_commit(1, 10.0, 2.0), _commit(2, 10.5, 1.5), {"kind": "epoch", "t": 10.6}]
    b = [_commit(1, 9.9, 2.0), _commit(3, 11.0, math.nan)]
    s = Series.from_logs([a, b])
    assert s.steps == [1, 2, 3]
    assert s.times == [9.9, 10.5, 11.0]
    assert s.losses == [2.0, 1.5, None]


def test_a_missing_value_breaks_the_line_instead_of_dropping_to_zero() -> None:
    svg = ET.fromstring(svg_plot([1, 2, 3, 4], [1.0, None, 2.0, 3.0], title="t", x_label="x", y_label="y"))
    lines = svg.findall("s:polyline", NS)
    assert [len(line.get("points", "").split()) for line in lines] == [1, 2]


def test_the_report_is_well_formed_and_holds_the_loss_series_the_marks_and_the_members(tmp_path) -> None:
    logs = [[_commit(k, 100.0 + 0.1 * k, 3.0 / k) for k in range(1, 41)], [_commit(40, 104.5, 0.075)]]
    marks = [Mark(101.05, "kill", "SIGKILL node-2"), Mark(102.0, "join", "node-4 started to join"),
             Mark(103.0, "joined", "node-4's first commit")]  # fmt: skip
    members = [{"name": "node-1", "role": None, "rank": 0, "share": 60, "loss": 0.07},
               {"name": "node-<4>", "role": "standby", "rank": 1, "share": 0, "loss": None}]  # fmt: skip
    path = write_report(
        tmp_path / "report.html", title="demo & run", logs=logs, marks=marks, members=members,
        summary=[("faults survived", "1\n  node-2: control connection dropped")],
    )  # fmt: skip
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>")
    root = ET.fromstring(text)  # well-formed: names and titles are escaped
    assert root.find("h:head/h:title", NS).text == "demo & run"  # type: ignore[union-attr]

    loss = json.loads(root.find(".//h:script[@id='loss-series']", NS).text)  # type: ignore[union-attr,arg-type]
    assert loss["step"] == list(range(1, 41))
    assert loss["loss"] == [3.0 / k for k in range(1, 41)]

    commits = root.find(".//s:svg[@id='commits']", NS)
    assert commits is not None
    drawn = {g.get("data-kind"): g for g in commits.findall("s:g[@class='mark']", NS)}
    assert set(drawn) == {"kill", "join", "joined"}
    assert drawn["kill"].find("s:text", NS).text == "SIGKILL node-2"  # type: ignore[union-attr]
    assert abs(float(drawn["kill"].get("data-x", "nan")) - 0.95) < 1e-9  # seconds from the first commit

    cells = [[td.text for td in tr.findall("h:td", NS)] for tr in root.findall(".//h:table[@id='marks']//h:tr", NS)]
    assert ["SIGKILL node-2", "0.95 s", "10"] in cells  # the last step committed before the kill (at 101.0)
    members_rows = root.findall(".//h:table[@id='members']/h:tbody/h:tr", NS)
    assert [tr.find("h:td", NS).text for tr in members_rows] == ["node-1", "node-<4>"]  # type: ignore[union-attr]
