"""The dashboard in a real browser: headless Chromium (driven by Playwright) watches a live
job of real processes through a SIGKILL, a join and an operator's drain.

Needs Debian's ``chromium`` (``apt-get install chromium``; ``scripts/setup`` installs it when
run as root) and the ``playwright`` package (in the dev extras); no ``playwright install``,
the system browser is used. Skipped, saying which is missing, when either is.

A screenshot of the page at the end (or at the failure) is kept as ``dashboard.png`` in the
test's ``tmp_path``, and copied into ``$UB_ARTIFACTS`` when that is set::

    UB_ARTIFACTS=/tmp/ub-artifacts pytest tests/integration/test_dashboard.py
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)

CHROMIUM = os.environ.get("UB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
TOKEN = "dashboard-operator-token"
WAIT_MS = 30_000


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    """A Chromium page, screenshotted into ``tmp_path`` (and ``$UB_ARTIFACTS``) when done."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; it is in the dev extras)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set UB_CHROMIUM)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.set_default_timeout(WAIT_MS)
            pg.errors = []
            pg.on("pageerror", lambda exc: pg.errors.append(str(exc)))
            yield pg
            shot = tmp_path / "dashboard.png"
            pg.screenshot(path=str(shot), full_page=True)
            if os.environ.get("UB_ARTIFACTS"):
                out = Path(os.environ["UB_ARTIFACTS"])
                out.mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, out / "dashboard.png")
        finally:
            browser.close()


def rows(page: Any, table: str) -> list[str]:
    names: list[str] = page.eval_on_selector_all(f"#{table} tbody tr", "rows => rows.map(r => r.dataset.node)")
    return names


def test_the_dashboard_follows_a_kill_a_join_and_a_drain(make_cluster, page):
    env = {"UB_TEST_STEPS": "100000", "UB_TEST_DELAY_MS": "20", "UNBROKEN_TOKEN": TOKEN}
    c = make_cluster(env=env, min_nodes=3, coordinator_args=["--token", TOKEN])
    host, port = c.start_coordinator()
    for name in ("a", "b", "c"):
        c.start_node(name)
    c.wait_step(3, timeout=60)
    page.goto(f"http://{host}:{port}/")
    page.wait_for_function("document.querySelectorAll('#members tbody tr').length === 3")
    assert sorted(rows(page, "members")) == ["a", "b", "c"]
    page.wait_for_function("document.querySelector('#status').textContent === 'training'")
    assert page.inner_text("#job") == "test-mlp"
    row = page.inner_text('#members tr[data-node="a"]')
    assert "cpu" in row and "active" in row and "s ago" in row, row
    assert page.locator("#topology g[data-node]").count() == 3

    # The curves grow between two looks.
    page.wait_for_function("+document.querySelector('#loss-chart').dataset.points > 0")
    first = int(page.get_attribute("#loss-chart", "data-points"))
    page.wait_for_function(f"+document.querySelector('#loss-chart').dataset.points > {first}")
    assert int(page.get_attribute("#throughput-chart", "data-points")) > first
    with urllib.request.urlopen(f"http://{host}:{port}/api/history?since_step={first}&nodes=0", timeout=5) as r:
        increment = json.load(r)  # what the page polls: the new steps only, no per-node series
    assert "nodes" not in increment and all(p["step"] > first for p in increment["points"])

    # A SIGKILL shows as a failure, highlighted; a newcomer joins; the next epoch and the
    # recovery (failure -> next commit) are shown.
    c.nodes["b"].kill()
    failure = page.wait_for_selector('#events tr[data-kind="failure"][data-node="b"]')
    assert "anomaly" in (failure.get_attribute("class") or "")
    failure_seq = int(failure.get_attribute("data-seq"))
    page.wait_for_function(
        "seq => [...document.querySelectorAll('#events tr[data-kind=epoch]')].some(r => +r.dataset.seq > seq)",
        arg=failure_seq,
    )
    page.wait_for_selector("#recoveries li")
    assert "recovered in" in page.inner_text("#recoveries")
    c.start_node("d")
    page.wait_for_selector('#events tr[data-kind="join"][data-node="d"]')
    page.wait_for_function("document.querySelectorAll('#members tbody tr').length === 3")
    assert sorted(rows(page, "members")) == ["a", "c", "d"]
    events = rows(page, "events")
    assert events.index("d") < events.index("b")  # newest first

    # Operator actions: refused without the token (the server's reason is shown), then done.
    page.click('#members tr[data-node="a"] button[data-action="drain"]')
    page.wait_for_function("document.querySelector('#action-status').className === 'error'")
    assert "403" in page.inner_text("#action-status") and "token" in page.inner_text("#action-status")
    assert c.nodes["a"].proc.poll() is None
    page.fill("#token", TOKEN)
    page.click("#token-save")
    assert page.input_value("#token") == "" and TOKEN not in page.url
    assert page.evaluate("Object.values(sessionStorage)") == [TOKEN]
    page.click('#members tr[data-node="a"] button[data-action="drain"]')
    page.wait_for_function("document.querySelector('#action-status').className === 'ok'")
    assert c.nodes["a"].proc.wait(timeout=30) == 0
    page.wait_for_selector('#events tr[data-kind="operator"][data-node="a"]')
    page.wait_for_function("document.querySelectorAll('#members tbody tr').length === 2")
    assert page.errors == []
