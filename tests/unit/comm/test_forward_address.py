"""Where a forwarder says it is (`comm.forward.offered_address`): epoch orders name that
address to every member moved behind it, so a loopback one is refused unless the whole job is
on this machine; the relay refuses it at start (`unbroken relay --offer-forwarding`)."""

from __future__ import annotations

import logging

import pytest

from unbroken.cli.main import main
from unbroken.comm import forward
from unbroken.comm.forward import job_hosts, offered_address
from unbroken.errors import ConfigError


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_a_loopback_forwarder_in_a_job_spread_over_machines_is_refused_with_the_fix(host: str) -> None:
    with pytest.raises(ConfigError, match=r"loopback address.*--offer-forwarding HOST:PORT"):
        offered_address(host, 7800, ["10.0.0.1"])


def test_every_interface_is_named_by_the_machines_name_and_refused_where_that_is_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(forward.socket, "gethostname", lambda: "box")
    resolved = {"box": "127.0.1.1"}  # Debian's /etc/hosts names the machine so
    monkeypatch.setattr(forward.socket, "gethostbyname", lambda name: resolved[name])
    with pytest.raises(ConfigError, match=r"127\.0\.1\.1:7800 is a loopback address"):
        offered_address("0.0.0.0", 7800, ["10.0.0.1"])
    assert offered_address("0.0.0.0", 7800, ["10.0.0.1"], named="10.0.0.5") == "10.0.0.5:7800"  # --gloo-host
    resolved["box"] = "10.0.0.7"
    assert offered_address("", 7800, ["10.0.0.1"]) == "10.0.0.7:7800"


def test_a_loopback_forwarder_is_allowed_with_a_warning_where_the_whole_job_is_on_loopback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="unbroken.comm.forward"):
        assert offered_address("127.0.0.1", 7800, ["127.0.0.1", "localhost"]) == "127.0.0.1:7800"
    assert "only members on this machine can use it" in caplog.text
    with pytest.raises(ConfigError):  # no control plane given: nothing says the job is local
        offered_address("127.0.0.1", 7800, [])
    assert offered_address("10.0.0.5", 7800, ["10.0.0.1"]) == "10.0.0.5:7800"


def test_the_control_plane_hosts_include_etcds() -> None:
    hosts = job_hosts([("127.0.0.1", 7000)], ["http://10.0.0.9:2379", "https://[::1]:2379"])
    assert hosts == ["127.0.0.1", "10.0.0.9", "::1"]


def test_a_relay_offering_forwarding_on_its_default_loopback_host_refuses_to_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["relay", "--coordinator", "10.0.0.1:7000", "--port", "0", "--token", "t" * 32, "--offer-forwarding", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "127.0.0.1:" in err and "--offer-forwarding HOST:PORT" in err, err
