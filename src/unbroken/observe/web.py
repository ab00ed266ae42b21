"""The coordinator's pages for people and scrapers.

- ``GET /``: the dashboard (`unbroken/observe/static/`; no CDN: works offline);
- ``GET /api/state``: members, plan, recent events (served by the coordinator itself);
- ``GET /api/events?since=SEQ&kind=K1,K2&node=NAME&limit=N``: the event log, oldest first;
- ``GET /api/history?since_step=S&nodes=0``: loss and throughput per committed step, and
  each node's recent rates (left out with ``nodes=0``: the dashboard's polls need only the steps);
- ``GET /metrics``: Prometheus text format;
- ``POST /api/nodes/{name}/drain`` and ``.../kill``: operator actions (`control_refusal`).
  With a job token they need ``Authorization: Bearer <token>`` (send it over TLS:
  ``--tls-cert``). A job without a token takes none, unless the coordinator was started with
  ``--open-control``: then clients on this machine (loopback) may act. Pages of other sites
  may not, whatever the token (`unbroken.control.browsers` checks ``Origin`` and ``Host``).
"""

from __future__ import annotations

import hmac
from importlib import resources
from typing import TYPE_CHECKING

from aiohttp import web

from unbroken.events import Kind
from unbroken.observe.metrics import CONTENT_TYPE, render

if TYPE_CHECKING:
    from unbroken.control.coordinator import Coordinator

ACTIONS = ("drain", "kill")
MAX_EVENTS_PER_PAGE = 5000
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


def add_routes(app: web.Application, coordinator: Coordinator) -> None:
    pages = _Pages(coordinator)
    app.router.add_get("/", pages.index)
    app.router.add_get("/static/{name}", pages.static)
    app.router.add_get("/api/events", pages.events)
    app.router.add_get("/api/history", pages.history)
    app.router.add_get("/metrics", pages.metrics)
    app.router.add_post("/api/nodes/{name}/{action}", pages.act)


class _Pages:
    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator

    async def index(self, request: web.Request) -> web.StreamResponse:
        return await self._file("dashboard.html")

    async def static(self, request: web.Request) -> web.StreamResponse:
        return await self._file(request.match_info["name"])

    async def _file(self, name: str) -> web.StreamResponse:
        suffix = name[name.rfind(".") :] if "." in name else ""
        if "/" in name or "\\" in name or name.startswith(".") or suffix not in _TYPES:
            raise web.HTTPNotFound()
        path = resources.files("unbroken.observe").joinpath("static", name)
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.Response(body=path.read_bytes(), content_type=_TYPES[suffix], charset="utf-8")

    async def events(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            since = int(q.get("since", "-1"))
            limit = min(int(q.get("limit", "1000")), MAX_EVENTS_PER_PAGE)
        except ValueError:
            raise web.HTTPBadRequest(text="since and limit must be integers") from None
        try:
            kinds = [Kind(k) for k in q.get("kind", "").split(",") if k]
        except ValueError as exc:
            known = ", ".join(k.value for k in Kind)
            raise web.HTTPBadRequest(text=f"{exc}: kind must be among {known}") from None
        out = [r.to_json() for r in self.c.events.since(since, kinds, q.get("node"))]
        return web.json_response({"events": out[:limit], "last_seq": self.c.events.seq})

    async def history(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since_step", "-1"))
        except ValueError:
            raise web.HTTPBadRequest(text="since_step must be an integer") from None
        data = self.c.history.to_json(since)
        if request.query.get("nodes") == "0":
            del data["nodes"]
        return web.json_response(data)

    async def metrics(self, request: web.Request) -> web.Response:
        body = render(self.c.snapshot(), self.c.events.counts, self.c.history)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def act(self, request: web.Request) -> web.Response:
        name, action = request.match_info["name"], request.match_info["action"]
        if action not in ACTIONS:
            raise web.HTTPNotFound(text=f"unknown action {action!r}: use one of {list(ACTIONS)}")
        service = self.c.config.service
        refusal = control_refusal(
            self.c.token, service.open_control, request.remote, request.headers.get("Authorization", "")
        )
        if refusal is not None:
            raise web.HTTPForbidden(text=refusal)
        done = self.c.command(name, action, f"{action} requested by an operator from {request.remote}")
        if not done:
            raise web.HTTPNotFound(text=f"no connected node is named {name!r}")
        return web.json_response({"ok": True, "node": name, "action": action})


def control_refusal(token: str | None, open_control: bool, remote: str | None, authorization: str) -> str | None:
    """Why an operator action from ``remote``, sent with this ``Authorization`` header, is
    refused (None: it is taken)."""
    if token is not None:
        if authorization.startswith("Bearer ") and hmac.compare_digest(authorization[7:].encode(), token.encode()):
            return None
        return "operator actions need the job's token: send 'Authorization: Bearer <token>'"
    if not open_control:
        # Anything that can send a request from this machine (any local user, any page a
        # browser here shows) could otherwise drain or kill the job's nodes.
        return (
            "this job has no token, so operator actions are off: start the coordinator with --token-file FILE "
            "(and send 'Authorization: Bearer <token>'), or with --open-control to take them from this machine "
            "without one"
        )
    if remote in ("127.0.0.1", "::1"):
        return None
    return "this job has no token: operator actions (--open-control) are only taken from the coordinator's machine"
