"""A browser may change nothing at the coordinator for a page of another site: ``Origin``
and ``Host`` are checked on every state-changing request and websocket upgrade that a
browser sends; nodes and the CLI, which send no ``Origin``, dial it by any address."""

from __future__ import annotations

import asyncio
import socket

import pytest

from unbroken.config import ServiceConfig
from unbroken.control.browsers import Names, names_of, refusal
from unbroken.errors import ConfigError

NAMES = Names(own=frozenset({"gpu-box", "gpu-box.lab.example"}), allowed=frozenset({"dash.example.org"}))
HERE = "127.0.0.1:29400"


def post(host: str | None = HERE, origin: str | None = None, scheme: str = "http") -> str | None:
    headers = {k: v for k, v in (("Host", host), ("Origin", origin)) if v is not None}
    return refusal("POST", headers, scheme, NAMES)


def test_a_post_from_another_sites_page_is_refused_naming_its_origin() -> None:
    why = post(origin="http://evil.example")
    assert why is not None and "'http://evil.example'" in why and "--allow-host evil.example" in why
    assert post(origin="null") is not None  # a sandboxed frame, a file:// page
    assert post(origin="http://127.0.0.1:8080") is not None  # another port of this machine: another site
    assert post(origin="https://127.0.0.1:29400") is not None  # another scheme: another site


def test_the_dashboards_own_page_and_allowed_origins_may_act() -> None:
    assert post(origin="http://127.0.0.1:29400") is None
    assert post(host="localhost:9000", origin="http://localhost:9000") is None  # an ssh tunnel's port
    assert post(host="[::1]:29400", origin="http://[::1]:29400") is None
    assert post(host="GPU-Box.lab.example.:443", origin="https://gpu-box.lab.example", scheme="https") is None
    assert post(host="10.0.0.5:29400", origin="https://dash.example.org") is None  # a reverse proxy's page


def test_a_host_that_is_not_the_coordinators_is_refused_dns_rebinding() -> None:
    # The attacker's name resolves to the coordinator: Origin and Host agree, Host names them.
    why = post(host="evil.example:29400", origin="http://evil.example:29400")
    assert why is not None and "'evil.example:29400'" in why and "rebinding" in why
    assert "--allow-host evil.example" in why and "gpu-box" in why
    assert post(host="evil.example:29400") is not None  # a POST without Origin too
    assert post(host="a.b:notaport") is not None


def test_addresses_localhost_and_the_machines_names_are_the_coordinators() -> None:
    for host in ("10.1.2.3:29400", "[fe80::1]:1", "localhost", "app.localhost:80", "gpu-box", "dash.example.org"):
        assert post(host=host) is None, host
    assert post(host=None) is None  # HTTP/1.0: no browser's


def test_nodes_and_reads_are_not_checked_browsers_websockets_are() -> None:
    # A node dials by whatever address reaches the coordinator (a NAT's, a DNS alias): no Origin.
    upgrade = {"Host": "public-name.example:29400", "Upgrade": "websocket"}
    assert refusal("GET", upgrade, "http", NAMES) is None
    assert refusal("GET", {**upgrade, "Origin": "http://evil.example"}, "http", NAMES) is not None
    here = {"Host": HERE, "Upgrade": "websocket", "Origin": "http://127.0.0.1:29400"}
    assert refusal("GET", here, "http", NAMES) is None
    # The read-only views stay as they were, whoever asks.
    assert refusal("GET", {"Host": "evil.example", "Origin": "http://evil.example"}, "http", NAMES) is None
    assert refusal("DELETE", {"Host": "evil.example"}, "http", NAMES) is not None


def test_names_of_a_service_are_this_machines_and_its_bound_and_advertised_names() -> None:
    names = asyncio.run(names_of("0.0.0.0", "coord.lab.example:29400", ["Dash.Example.org."]))
    assert socket.gethostname().lower() in names.own and "coord.lab.example" in names.own
    assert names.allowed == frozenset({"dash.example.org"})


@pytest.mark.parametrize("name", ["http://dash.example", "dash.example:443", "*.example", "a b", "ev\x1bil", ""])
def test_allow_host_takes_a_host_name_only(name: str) -> None:
    with pytest.raises(ConfigError, match=r"--allow-host.*is not a host name"):
        ServiceConfig(allow_hosts=(name,))
    assert ServiceConfig(allow_hosts=("dash.example.org", "gpu_box")).allow_hosts


def test_open_control_is_for_a_job_without_a_token() -> None:
    with pytest.raises(ConfigError, match=r"--open-control.*without a token"):
        ServiceConfig(token="x" * 16, open_control=True)
