"""An asyncio service that also runs from a background thread (tests, embedding).

`Coordinator` and `Relay` serve with ``await service.serve()`` in a process of their own,
or from Python::

    service.start()   # serve() on a thread; returns once it listens, or raises its start-up error
    service.stop()

``serve`` calls `_begin` first and `_listening` once it listens, then waits for `_stopping`.
`_begin` raises the process's limit of open files (`outsiders.raise_open_files_limit`) and
hushes the event loop's and aiohttp's per-connection errors (`observe.quiet.Hush`).
"""

from __future__ import annotations

import abc
import asyncio
import threading
from typing import TypeVar

from unbroken.control.outsiders import Guard, raise_open_files_limit
from unbroken.observe.quiet import hush_library_logs

_S = TypeVar("_S", bound="ThreadedService")


class ThreadedService(abc.ABC):
    name = "service"

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._startup_error: BaseException | None = None
        self.guard = Guard(name=self.name)
        """The leash of connections that have not proven the job token (`outsiders`)."""

    @abc.abstractmethod
    async def serve(self) -> None:
        """Serve until `stop` (`Coordinator.serve`, `Relay.serve`)."""

    def _begin(self) -> asyncio.Event:
        """Bind the service to the running loop; returns the event `stop` sets."""
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        hush_library_logs()
        self.guard.fit(raise_open_files_limit())
        return self._stopping

    def _listening(self) -> None:
        self._ready.set()

    @property
    def ready(self) -> bool:
        """Listening (a coordinator with etcd: and standing for election)."""
        return self._ready.is_set()

    def start(self: _S, timeout: float = 10.0) -> _S:
        """Serve from a background thread; returns once the service is listening.

        Raises:
            TimeoutError: it did not listen within ``timeout`` seconds.
            OSError: its address cannot be bound (in use, or not this host's).
        """

        def run() -> None:
            try:
                asyncio.run(self.serve())
            except BaseException as exc:  # reported to the starter below
                self._startup_error = exc
                self._ready.set()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.name} did not start within {timeout} s")
        if self._startup_error is not None:
            raise self._startup_error
        return self

    def stop_nowait(self) -> None:
        """Ask the service to stop (from any thread); `stop` also waits for it."""
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    def stop(self) -> None:
        self.stop_nowait()
        if self._thread is not None:
            self._thread.join(timeout=10)
