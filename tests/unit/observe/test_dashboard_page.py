"""The dashboard works offline and marks every anomaly (the page itself is tested in a real
browser by tests/integration/test_dashboard.py)."""

from __future__ import annotations

import re
from importlib import resources

from unbroken.events import ALARMS, ANOMALIES, Kind
from unbroken.observe import web

STATIC = resources.files("unbroken.observe").joinpath("static")
PAGE_FILES = ("dashboard.html", "dashboard.js", "dashboard.css")


def test_everything_the_page_loads_is_served_by_the_coordinator() -> None:
    html = STATIC.joinpath("dashboard.html").read_text()
    refs = [r for r in re.findall(r'(?:src|href)="([^"]+)"', html) if not r.startswith("data:")]
    assert "/static/uplot-1.6.32.min.js" in refs and "/static/dashboard.js" in refs
    for ref in refs:
        assert ref.startswith("/static/"), ref
        name = ref.removeprefix("/static/")
        assert STATIC.joinpath(name).is_file(), ref
        assert name[name.rfind(".") :] in web._TYPES, ref


def test_no_address_outside_the_coordinator() -> None:
    for name in PAGE_FILES:
        text = STATIC.joinpath(name).read_text()
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"'`)]*", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (name, urls)


def test_every_anomaly_kind_is_highlighted() -> None:
    # The page marks the kinds the coordinator's state lists, and no list of its own.
    js = STATIC.joinpath("dashboard.js").read_text()
    assert "ALARMS = new Set(state.alarms" in js and '"straggler"' not in js
    assert {*ANOMALIES, Kind.FAILURE, Kind.BAD_GRADIENT, Kind.QUARANTINE} <= ALARMS
