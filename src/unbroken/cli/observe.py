"""``unbroken status`` and ``unbroken events``: the job from a terminal.

    unbroken status --coordinator HOST:PORT            # a table that refreshes until the job ends
    unbroken status --once                              # print it once (scripts)
    unbroken events --coordinator HOST:PORT --kind failure,recovery --node n3
    unbroken events --json --follow                     # JSON lines, new events as they come

Both read the coordinator's HTTP API (``/api/state``, ``/api/history``, ``/api/events``);
``--tls-ca`` for a coordinator served over TLS. With replicated coordinators, give any of
them (``--coordinator A,B``): a standby names the leader, which is read instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from unbroken.config import ENV_COORDINATOR, parse_address
from unbroken.errors import ConfigError, CoordinatorUnreachable
from unbroken.events import ALARMS, Kind, Recorded
from unbroken.observe.printable import printable

REASON_CHARS = 240
"""Of an event's reason, what the status table shows: enough to reach the fix a verdict names
(a member benched as unreachable: how to let its peers reach it)."""


class Api:
    def __init__(self, address: str | None, tls_ca: str | None = None, timeout_s: float = 5.0) -> None:
        texts = [t for t in (address or os.environ.get(ENV_COORDINATOR, "")).split(",") if t.strip()]
        if not texts:
            raise ConfigError(f"no coordinator: pass --coordinator HOST:PORT or set {ENV_COORDINATOR}")
        self.scheme = "https" if tls_ca else "http"
        self.bases = [self._base(parse_address(t)) for t in texts]
        self.base = self.bases[0]
        self.context = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
        self.timeout_s = timeout_s

    def _base(self, address: tuple[str, int]) -> str:
        return f"{self.scheme}://{address[0]}:{address[1]}"

    def get(self, path: str) -> Any:
        """GET from the leader: the first address that answers, or the leader a standby names."""
        error: CoordinatorUnreachable | None = None
        for base in dict.fromkeys([self.base, *self.bases]):
            self.base = base
            try:
                data = self._get(path)
            except CoordinatorUnreachable as exc:
                error = exc
                continue
            lead = data.get("leadership") if isinstance(data, dict) else None
            if isinstance(lead, dict) and lead.get("role") == "standby" and lead.get("leader"):
                with contextlib.suppress(ConfigError, CoordinatorUnreachable):
                    self.base = self._base(parse_address(str(lead["leader"])))
                    return self._get(path)
                self.base = base
            return data
        assert error is not None
        raise error

    def _get(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.base + path, timeout=self.timeout_s, context=self.context) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise CoordinatorUnreachable(f"{self.base}{path}: HTTP {exc.code}: {exc.read().decode()[:200]}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CoordinatorUnreachable(
                f"cannot reach the coordinator at {self.base} ({reason}); is it running, and is the address right?"
            ) from None


# ---------------------------------------------------------------- status


def _leadership(lead: dict[str, Any]) -> list[tuple[str, str] | str]:
    """Who leads, in the status line (nothing for a single coordinator without etcd)."""
    if lead.get("role") in (None, "single"):
        return []
    standbys = ", ".join(lead.get("standbys") or []) or "none"
    return [("  leader ", "bold"), _said(f"{lead.get('leader') or 'none (election)'} term {lead.get('term', 0)}"),
            ("  standbys ", "bold"), _said(standbys)]  # fmt: skip


def _said(value: object) -> str:
    """A figure or a name from the API, as plain text: what a node chose (its name, its
    device's name, a reason) may hold escape sequences, shown escaped, never obeyed."""
    return printable(str(value))


def _cell(value: object) -> Text:
    # A Text, not a str: rich would read a name like "[blink]x" or "[/]" as markup (and
    # raise on the second), and would let ESC through.
    return Text(_said(value))


def status_view(state: dict[str, Any], history: dict[str, Any], events: list[Recorded]) -> Group:
    """The status screen from the API's answers (pure: tested on fixed inputs)."""
    plan = state.get("plan", {})
    points = history.get("points", [])
    last = points[-1] if points else {}
    loss = last.get("loss")
    head = Text.assemble(
        ("job ", "bold"), _said(state.get("job") or "?"),
        ("  step ", "bold"), str(state.get("step", 0)),
        ("  epoch ", "bold"), str(state.get("epoch", 0)),
        *_leadership(state.get("leadership") or {}),
        ("  mode ", "bold"), _said(plan.get("mode", "sync")),
        ("  loss ", "bold"), f"{loss:.4f}" if isinstance(loss, float) else "-",
        ("  steps/s ", "bold"), f"{history.get('step_rate', 0.0):.2f}",
        ("  samples/s ", "bold"), f"{last.get('samples_per_s', 0.0):.0f}",
        ("  FINISHED" if state.get("finished") else "  recovering" if state.get("recovering") else "", "bold green"),
    )  # fmt: skip
    members = Table(title="members", title_justify="left", expand=False)
    for col in ("node", "state", "role", "zone", "share", "samples/s", "step", "device", "memory"):
        members.add_column(col, justify="right" if col in ("share", "samples/s", "step") else "left")
    for mem in sorted(state.get("members", []), key=lambda x: (x.get("rank") is None, x.get("rank") or 0)):
        caps = mem.get("capabilities") or {}
        compute = (mem.get("compute_s") or [0.0])[-1]
        rate = mem.get("share", 0) / compute if compute else 0.0
        used, total = caps.get("memory_used", 0), caps.get("memory_total", 0)
        members.add_row(
            _cell(mem.get("name")),
            _cell(mem.get("state")),
            _cell(mem.get("role") or "-"),
            _cell(mem.get("zone") or "default"),
            _cell(mem.get("share", 0)),
            f"{rate:.0f}",
            _cell(mem.get("step", 0)),
            _cell(caps.get("device_name") or caps.get("device") or "-"),
            f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB" if total else "-",
        )
    log = Table(title="recent events", title_justify="left", show_edge=False)
    for col in ("time", "kind", "node", "step", "reason"):
        log.add_column(col)
    for e in events[-10:]:
        log.add_row(
            time.strftime("%H:%M:%S", time.localtime(e.time)),
            Text(e.kind.value, style="bold red" if e.kind in ALARMS else ""),
            _cell(e.node or "-"),
            str(e.step),
            _cell(e.reason[:REASON_CHARS]),
        )
    return Group(head, members, log)


def _status(args: argparse.Namespace) -> int:
    api = Api(args.coordinator, args.tls_ca)
    console = Console()

    def view() -> tuple[Group, bool]:
        state = api.get("/api/state")
        history = api.get("/api/history")
        events = [Recorded.from_json(e) for e in api.get("/api/events?limit=5000")["events"]]
        return status_view(state, history, events), bool(state.get("finished"))

    if args.once:
        screen, _ = view()
        console.print(screen)
        return 0
    screen, done = view()
    with Live(screen, console=console, refresh_per_second=4) as live:
        while not done:
            time.sleep(args.interval)
            screen, done = view()
            live.update(screen)
    return 0


# ---------------------------------------------------------------- events


def event_line(e: Recorded) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time))
    node = printable(e.node or "-")
    return f"{when}  {e.kind.value:<20} {node:<12} epoch {e.epoch} step {e.step}  {printable(e.reason)}"


def _events(args: argparse.Namespace) -> int:
    api = Api(args.coordinator, args.tls_ca)
    query = []
    if args.kind:
        unknown = [k for k in args.kind.split(",") if k and k not in set(Kind)]
        if unknown:
            known = ", ".join(k.value for k in Kind)
            raise ConfigError(f"unbroken events --kind: no event kind {', '.join(unknown)}; the kinds: {known}")
        query.append(f"kind={args.kind}")
    if args.node:
        query.append(f"node={args.node}")
    since = -1
    while True:
        page = api.get(f"/api/events?since={since}&limit=5000&" + "&".join(query))
        for e in page["events"]:
            print(json.dumps(e) if args.json else event_line(Recorded.from_json(e)), flush=True)
            since = max(since, int(e["seq"]))
        if not page["events"]:
            since = max(since, int(page.get("last_seq", since)))
        if not args.follow:
            return 0
        if api.get("/api/state").get("finished") and not page["events"]:
            return 0
        time.sleep(args.interval)


def add_parsers(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    for name, func, about in (
        ("status", _status, "the job at a glance: members, step, loss, recent events (refreshing)"),
        ("events", _events, "the job's event log (joins, failures, recoveries, anomalies...)"),
    ):
        p = sub.add_parser(name, help=about, formatter_class=fmt)
        p.add_argument("--coordinator", help=f"HOST:PORT of the coordinator (default ${ENV_COORDINATOR})")
        p.add_argument("--tls-ca", help="the coordinator serves TLS: trust this CA bundle (PEM)")
        p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
        if name == "status":
            p.add_argument("--once", action="store_true", help="print once and exit")
        else:
            p.add_argument("--kind", help="only these kinds, comma-separated (e.g. failure,recovery,anomaly kinds)")
            p.add_argument("--node", help="only events of this node")
            p.add_argument("--json", action="store_true", help="JSON lines instead of text")
            p.add_argument("--follow", "-f", action="store_true", help="keep printing new events until the job ends")
        p.set_defaults(func=func)
