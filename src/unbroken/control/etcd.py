"""A small asyncio client for etcd's v3 JSON gateway (``POST /v3/...``), over aiohttp.

etcd holds who leads a job, the leader's term and small epoch records; heartbeats and
reports never go through it (docs/design.md, the control plane). The gateway ships with
every etcd server, so this needs no gRPC stack: a handful of calls, each with a deadline,
tried on every endpoint in turn until one answers (a cluster member that is down costs one
connection refusal, not the call).

Keys and values are bytes on the wire as base64, as the gateway wants them; revisions and
lease ids travel as decimal strings.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import json
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from unbroken.config import EtcdTLS as EtcdTLS
from unbroken.config import check_tls as check_tls
from unbroken.config import parse_endpoints as parse_endpoints
from unbroken.errors import EtcdUnavailable

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 1.0
"""One request to one endpoint; a member that does not answer in this long is skipped."""


class View(str, enum.Enum):
    """What one etcd member says of its cluster when asked alone (`Etcd.views`)."""

    DOWN = "down"
    """It refused the connection: nothing listens there."""
    LEADERLESS = "leaderless"
    """It answered and knows no raft leader: it is not part of a majority."""
    LED = "led"
    """It answered and follows (or is) a raft leader."""
    SILENT = "silent"
    """No answer in time: down, cut off or overloaded; nothing is known."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    @staticmethod
    def parse(raw: dict[str, Any]) -> KeyValue:
        return KeyValue(
            key=base64.b64decode(raw.get("key", "")),
            value=base64.b64decode(raw.get("value", "")),
            create_revision=int(raw.get("create_revision", 0)),
            mod_revision=int(raw.get("mod_revision", 0)),
            lease=int(raw.get("lease", 0)),
        )

    def json(self) -> dict[str, Any]:
        """The value parsed as a JSON object (empty when it is not one)."""
        try:
            data = json.loads(self.value)
        except (ValueError, UnicodeDecodeError):
            return {}
        return data if isinstance(data, dict) else {}


_CLIENT_CERT = (
    "etcd refused this client's TLS handshake: give --etcd-cert and --etcd-key, a client certificate "
    "signed by the CA etcd trusts (its --trusted-ca-file), and --etcd-cacert"
)
_SERVER_CERT = "etcd's certificate is not trusted: give --etcd-cacert, the CA that signed it"
_PLAIN_TO_TLS = "if etcd serves TLS, write its endpoints as https://... with --etcd-cacert/--etcd-cert/--etcd-key"


def _hint(endpoint: str, exc: BaseException) -> str:
    """The fix for one endpoint's failure, when it is about TLS ("" when it is not)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return _SERVER_CERT
    if isinstance(exc, (ssl.SSLError, aiohttp.ClientSSLError)) or "SSL" in str(exc):
        return _CLIENT_CERT
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return _CLIENT_CERT if endpoint.startswith("https://") else _PLAIN_TO_TLS
    return ""


class Etcd:
    """An etcd cluster reached through any of its members' client URLs."""

    def __init__(
        self, endpoints: Sequence[str], *, timeout_s: float = REQUEST_TIMEOUT_S, tls: EtcdTLS | None = None
    ) -> None:
        """``tls``: certificates for ``https://`` endpoints (none: the system's CAs, no client certificate)."""
        if not endpoints:
            raise ValueError("no etcd endpoints")
        check_tls(endpoints, tls)
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._ssl: ssl.SSLContext | bool = tls.context() if tls is not None else True
        self._preferred = 0
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> Etcd:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first member that answers.

        Raises:
            EtcdUnavailable: no member answered (every one refused, timed out or erred).
        """
        if self._http is None:
            self._http = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        errors = []
        hints: dict[str, None] = {}
        n = len(self.endpoints)
        for i in range(n):
            index = (self._preferred + i) % n
            url = f"{self.endpoints[index]}/v3/{path}"
            try:
                async with self._http.post(url, json=body, timeout=timeout, ssl=self._ssl) as r:
                    if r.status == 400 and url.startswith("http://"):
                        text = await r.text()
                        if "HTTPS" in text:
                            errors.append(f"{self.endpoints[index]}: it serves TLS")
                            hints[_PLAIN_TO_TLS] = None
                            continue
                    data = await r.json(content_type=None)
                    if r.status != 200:
                        message = data.get("message") or data.get("error") if isinstance(data, dict) else data
                        errors.append(f"{self.endpoints[index]}: HTTP {r.status} {message}")
                        continue
                    self._preferred = index
                    if not isinstance(data, dict):
                        raise EtcdUnavailable(f"etcd at {self.endpoints[index]} answered {data!r} to {path}")
                    return data
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
                errors.append(f"{self.endpoints[index]}: {type(exc).__name__} {exc}".strip())
                hints[_hint(self.endpoints[index], exc)] = None
        fix = "; ".join(h for h in hints if h) or "check --etcd and that a majority of the etcd cluster is up"
        raise EtcdUnavailable(f"no etcd member answered {path} ({'; '.join(errors)}): {fix}")

    async def views(self) -> list[View]:
        """Each member's own view of the cluster, asked of all at once (a status is served
        locally: it answers at once even where a read would wait for a majority)."""
        if self._http is None:
            self._http = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)

        async def view(endpoint: str) -> View:
            assert self._http is not None
            try:
                url = f"{endpoint}/v3/maintenance/status"
                async with self._http.post(url, json={}, timeout=timeout, ssl=self._ssl) as r:
                    data = await r.json(content_type=None)
            except aiohttp.ClientConnectorError as exc:
                return View.DOWN if isinstance(exc.os_error, ConnectionRefusedError) else View.SILENT
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                return View.SILENT
            if r.status != 200 or not isinstance(data, dict):
                return View.SILENT
            return View.LED if str(data.get("leader", "0")) not in ("", "0") else View.LEADERLESS

        return list(await asyncio.gather(*(view(e) for e in self.endpoints)))

    async def cluster_size(self) -> int:
        """How many members the cluster has, as the first member that answers knows it
        (served locally, without a majority)."""
        data = await self.call("cluster/member/list", {})
        return len(data.get("members") or [])

    # ---------------------------------------------------------------- leases

    async def grant(self, ttl_s: int) -> int:
        data = await self.call("lease/grant", {"TTL": ttl_s})
        if data.get("error") or "ID" not in data:
            raise EtcdUnavailable(f"etcd refused a {ttl_s} s lease: {data.get('error') or data}")
        return int(data["ID"])

    async def keepalive(self, lease: int, timeout_s: float | None = None) -> int:
        """Renew a lease; its TTL in seconds, 0 when it has already expired."""
        data = await self.call("lease/keepalive", {"ID": str(lease)}, timeout_s)
        if "result" not in data:  # a stream error, not an answer: the lease may well be alive
            raise EtcdUnavailable(f"etcd did not answer the keepalive: {str(data)[:200]}")
        return int(data["result"].get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("lease/revoke", {"ID": str(lease)})

    # ---------------------------------------------------------------- keys

    async def get(self, key: bytes) -> KeyValue | None:
        data = await self.call("kv/range", {"key": _b64(key)})
        kvs = data.get("kvs") or []
        return KeyValue.parse(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: bytes, limit: int = 1000) -> list[KeyValue]:
        """Every key that starts with ``prefix`` (at most ``limit``), in key order."""
        end = prefix[:-1] + bytes([prefix[-1] + 1]) if prefix and prefix[-1] < 255 else b"\0"
        data = await self.call("kv/range", {"key": _b64(prefix), "range_end": _b64(end), "limit": limit})
        return [KeyValue.parse(kv) for kv in data.get("kvs") or []]

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        data = await self.call("kv/put", body)
        return int(data.get("header", {}).get("revision", 0))

    async def create(self, key: bytes, value: bytes, lease: int) -> tuple[bool, KeyValue | None]:
        """Put ``key`` only if it does not exist. (True, the new key) or (False, the holder's key)."""
        k = _b64(key)
        data = await self.call(
            "kv/txn",
            {
                "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [
                    {"request_put": {"key": k, "value": _b64(value), "lease": str(lease)}},
                    {"request_range": {"key": k}},
                ],
                "failure": [{"request_range": {"key": k}}],
            },
        )
        won = bool(data.get("succeeded"))
        ranges = [r["response_range"] for r in data.get("responses", []) if "response_range" in r]
        kvs = ranges[-1].get("kvs", []) if ranges else []
        return won, (KeyValue.parse(kvs[0]) if kvs else None)

    async def put_if_held(self, guard: bytes, create_revision: int, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Put ``key`` only while ``guard`` still has this create revision (a leader's fenced write)."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        data = await self.call(
            "kv/txn",
            {
                "compare": [
                    {"key": _b64(guard), "target": "CREATE", "result": "EQUAL", "create_revision": str(create_revision)}
                ],
                "success": [{"request_put": put}],
            },
        )
        return bool(data.get("succeeded"))

    async def delete_if_unchanged(self, key: bytes, mod_revision: int) -> bool:
        """Delete ``key`` only if nobody wrote it since ``mod_revision`` (it is as last read)."""
        k = _b64(key)
        data = await self.call(
            "kv/txn",
            {
                "compare": [{"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
                "success": [{"request_delete_range": {"key": k}}],
            },
        )
        return bool(data.get("succeeded"))

    async def delete_if_held(self, key: bytes, create_revision: int) -> bool:
        k = _b64(key)
        data = await self.call(
            "kv/txn",
            {
                "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": str(create_revision)}],
                "success": [{"request_delete_range": {"key": k}}],
            },
        )
        return bool(data.get("succeeded"))

    async def status(self) -> dict[str, Any]:
        """The answering member's status (version, leader, raft term)."""
        return await self.call("maintenance/status", {})
