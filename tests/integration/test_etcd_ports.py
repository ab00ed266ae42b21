"""The test etcd cluster starts again on fresh ports when a port it found free was taken
before a member bound it (another process's ephemeral port: a race, not a fault)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from unbroken.testing import etcd


def test_a_port_taken_before_a_member_binds_it_is_replaced_and_the_cluster_comes_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    etcd.etcd_binary()  # a clear error where etcd is missing (scripts/setup installs it)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real = etcd._free_ports
    calls = []

    def first_with_a_taken_port(n: int) -> list[int]:
        ports = real(n)
        calls.append(n)
        return [taken.getsockname()[1], *ports[1:]] if len(calls) == 1 else ports

    monkeypatch.setattr(etcd, "_free_ports", first_with_a_taken_port)
    try:
        with etcd.EtcdCluster(tmp_path, size=1) as cluster:
            assert len(calls) == 2, calls
            assert cluster.healthy(0)
    finally:
        taken.close()
