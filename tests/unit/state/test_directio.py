"""Checkpoint bytes written past the page cache: only aligned buffers go direct, and every
write gives the file exactly the bytes it was handed."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from unbroken.state import directio


def spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int]]:
    calls: list[tuple[bool, int]] = []
    real = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & directio.O_DIRECT), len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(directio.os, "pwrite", pwrite)
    return calls


def test_buffers_are_whole_zeroed_pages_that_direct_io_takes() -> None:
    buf = directio.buffer(10_000)
    assert len(buf) == 3 * directio.PAGE and not any(bytes(buf))
    view = memoryview(buf)
    assert directio.aligned(view) and not directio.aligned(view[1 : 1 + directio.PAGE])
    assert not directio.aligned(view[: directio.PAGE - 1]) and not directio.aligned(memoryview(bytes(4096)))


@pytest.mark.skipif(not directio.O_DIRECT, reason="no O_DIRECT on this system")
def test_an_aligned_buffer_goes_direct_in_bounded_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spy(monkeypatch)
    monkeypatch.setattr(directio, "CHUNK", 2 * directio.PAGE)
    buf = directio.buffer(5 * directio.PAGE)
    memoryview(buf)[:] = os.urandom(len(buf))
    directio.write_file(tmp_path / "f", memoryview(buf))
    assert (tmp_path / "f").read_bytes() == bytes(buf)
    assert calls == [(True, 2 * directio.PAGE), (True, 2 * directio.PAGE), (True, directio.PAGE)]


def test_unaligned_bytes_go_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spy(monkeypatch)
    data = os.urandom(3 * directio.PAGE + 7)
    directio.write_file(tmp_path / "f", data)
    assert (tmp_path / "f").read_bytes() == data and calls and not any(direct for direct, _ in calls)
    directio.write_file(tmp_path / "f", b"shorter")  # replaces, not overlays
    assert (tmp_path / "f").read_bytes() == b"shorter"


@pytest.mark.skipif(not directio.O_DIRECT, reason="no O_DIRECT on this system")
def test_a_file_system_that_opens_direct_but_refuses_the_write_gets_it_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.pwrite

    def refusing(fd: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & directio.O_DIRECT:
            raise OSError(22, os.strerror(22))
        return real(fd, data, offset)

    monkeypatch.setattr(directio.os, "pwrite", refusing)
    buf = directio.buffer(3 * directio.PAGE)
    memoryview(buf)[:] = os.urandom(len(buf))
    directio.write_file(tmp_path / "f", memoryview(buf))
    assert (tmp_path / "f").read_bytes() == bytes(buf)


def test_a_write_that_takes_nothing_is_an_error_not_a_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directio.os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(OSError, match="took none"):
        directio.write_file(tmp_path / "f", memoryview(directio.buffer(directio.PAGE)))
