"""Warm starts for local nodes: a parent that imported torch once forks each node.

Importing torch costs a node about 2 s of CPU before it does anything. An integration test
starts 3–37 nodes on a 2-core machine, so most of the suite's time went to imports, and a
join took seconds longer than the product needs. A warm node is still a real process (its
own pid, sockets, signals and exit code), forked from a parent that has already imported
torch and unbroken, as PyTorch's DataLoader forks its workers.

Two parents serve in turn, so that neighbouring nodes differ in their hash seed (iteration
order of sets and dicts of strings) as separately started processes do: a node that relied
on its peers ordering a set as it does would still fail a test.

`LocalCluster(warm=True)` uses it (the test suite does); benchmarks that time a join start cold.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from unbroken.testing.netns import pid_alive

PARENTS = 2
"""Forking parents, used in turn (see the module's note on hash seeds)."""
READY_TIMEOUT_S = 180.0
"""How long a parent may take to import what it preloads (minutes on a machine busy with tests:
59 s beside two burners at a load of 9-11, both parents importing at once)."""
PRELOAD = (
    "torch",
    "torch._dynamo",
    "unbroken.cli.main",
    "unbroken.train.runtime",
    "unbroken.control.outsiders",
    "unbroken.testing.faults",
)
"""What a parent imports before it forks: what every node would import first. By name, as
``python -m unbroken`` names what it runs: the harness starts the CLI, it does not use it.
``torch._dynamo``: torch imports it lazily on a job's first optimizer (`torch.optim`'s
``_disable_dynamo``); left to each node, it was 87% of a warm node's start (8 s of 10 at a
load of 13)."""


class WarmProcess:
    """A forked node with `subprocess.Popen`'s handle: pid, poll, wait, send_signal, kill."""

    def __init__(self, parent: _Parent, rid: int, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self._parent = parent
        self._rid = rid
        """Its start request's number: exits are reported by it, since pids are recycled."""

    @property
    def returncode(self) -> int | None:
        return self._parent.code(self._rid, self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._parent.wait(self._rid, self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Parent:
    """The test side of one forking parent: sends start requests, collects exit codes."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken.testing.warm"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._to: IO[bytes] = self._proc.stdin
        self._from: IO[bytes] = self._proc.stdout
        self._cond = threading.Condition()
        self._started: dict[int, int] = {}  # request id -> pid
        self._codes: dict[int, int] = {}  # request id -> exit code
        self._next = 0
        self._alive = True
        ready, _, _ = select.select([self._from], [], [], READY_TIMEOUT_S)
        if not ready or self._from.readline().strip() != b"ready":
            self._proc.kill()
            self._proc.wait(10)
            raise RuntimeError(
                f"the warm-start parent did not start within {READY_TIMEOUT_S:g} s (its stderr is above)"
            )
        threading.Thread(target=self._read, name="warm-start", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self._from:
                msg = json.loads(line)
                with self._cond:
                    if "exit" in msg:
                        self._codes[int(msg["exit"])] = int(msg["code"])
                    else:
                        self._started[int(msg["id"])] = int(msg["pid"])
                    self._cond.notify_all()
        finally:  # its end, or a line that is not its protocol: no more news from it either way
            with self._cond:
                self._alive = False
                self._cond.notify_all()

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> WarmProcess:
        with self._cond:
            rid, self._next = self._next, self._next + 1
            request = {"id": rid, "argv": argv, "env": env, "log": str(log), "cwd": os.getcwd()}
            self._to.write(json.dumps(request).encode() + b"\n")
            self._to.flush()
            if not self._cond.wait_for(lambda: rid in self._started or not self._alive, timeout=30):
                raise RuntimeError("the warm-start parent did not answer within 30 s")
            if rid not in self._started:
                raise RuntimeError("the warm-start parent died")
            return WarmProcess(self, rid, self._started.pop(rid), argv)

    def code(self, rid: int, pid: int) -> int | None:
        with self._cond:
            return self._code(rid, pid)

    def _code(self, rid: int, pid: int) -> int | None:
        if rid in self._codes:
            return self._codes[rid]
        if not self._alive and not pid_alive(pid):
            return -signal.SIGKILL  # its parent died before it; the code is lost with it
        return None

    def wait(self, rid: int, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (code := self._code(rid, pid)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                # A dead parent reports no exits: poll the pid itself.
                self._cond.wait(left if self._alive else min(0.05, left or 0.05))
            return code

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._to.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)


_parents: list[_Parent] = []
_turn = 0
_lock = threading.Lock()


def start(argv: list[str], env: dict[str, str], log: Path) -> WarmProcess:
    """Start ``python -m unbroken *argv`` warm, with ``env`` and stdout and stderr appended to ``log``."""
    global _turn
    with _lock:
        if not _parents:
            _parents.extend(_Parent() for _ in range(PARENTS))
            atexit.register(_close_all)
        parent = _parents[_turn % len(_parents)]
        _turn += 1
    return parent.start(argv, env, log)


def _close_all() -> None:
    for p in _parents:
        p.close()
    _parents.clear()


# ---------------------------------------------------------------- the parent process


def _serve() -> None:
    """Import what a node needs, then fork a node per request line on stdin."""
    imported = _imported_environment(PRELOAD)
    out = sys.stdout.buffer
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    stdin = sys.stdin.fileno()
    out.write(b"ready\n")
    out.flush()
    pending = b""
    rids: dict[int, int] = {}  # pid -> its start request's number
    while True:
        try:
            readable, _, _ = select.select([stdin, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if (rid := rids.pop(pid, None)) is not None:
                out.write(json.dumps({"exit": rid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        if stdin in readable:
            chunk = os.read(stdin, 1 << 16)
            if not chunk:
                return  # the test process is gone or done
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                out.flush()  # or the child would inherit, and could repeat, what is still buffered
                pid = os.fork()
                if pid == 0:
                    # Unset first: a signal would write into whatever reuses the pipe's fd.
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    _child(request, imported)
                rids[pid] = request["id"]
                out.write(json.dumps({"id": request["id"], "pid": pid}).encode() + b"\n")
        out.flush()


def _imported_environment(modules: tuple[str, ...]) -> dict[str, str]:
    """Import ``modules``; what their imports wrote to the environment (gloo's options), which
    a cold node sets over the environment it is given: recorded as written, since this
    parent's own environment may hold the same values already."""
    written: dict[str, str] = {}
    environ = type(os.environ)
    setitem = environ.__setitem__

    def record(self: Any, key: str, value: str) -> None:
        written[key] = value
        setitem(self, key, value)

    environ.__setitem__ = record  # type: ignore[method-assign]
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        environ.__setitem__ = setitem  # type: ignore[method-assign]
    return written


def _child(request: dict[str, Any], imported: dict[str, str]) -> None:
    """Become the node: own stdio, environment and signals, then run the CLI and exit."""
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), errors="backslashreplace", line_buffering=True, write_through=True
        )
        os.environ.clear()
        os.environ.update(request["env"], **imported)
        os.chdir(request["cwd"])
        sys.argv = ["unbroken", *request["argv"]]
        # The parent imported torch with one thread; a cold node reads OMP_NUM_THREADS.
        importlib.import_module("torch").set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        runpy.run_module("unbroken", run_name="__main__", alter_sys=True)  # python -m unbroken ARGV
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # What the interpreter does at exit: wait for non-daemon threads, run atexit hooks.
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve()
