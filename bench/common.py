"""Helpers shared by the benchmarks (not a benchmark itself): progress line, tables,
log reading, and the plain-DDP baseline launcher (`run_ddp`).

Every child process is reaped: `DDPRun.close` (used as a context manager) SIGCONTs and
SIGKILLs whatever is still running, and `unbroken.testing.LocalCluster.close` does the same
for coordinator and nodes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

HERE = Path(__file__).resolve().parent
NODE_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 160)


def print_command(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    print("command: python " + " ".join(shlex.quote(a) for a in argv), flush=True)


class ProgressLine:
    """One status line on stderr, rewritten in place on a terminal, one line per update otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()

    def update(self, text: str, advance: int = 0) -> None:
        self.done += advance
        line = f"[{self.done}/{self.total}] {time.monotonic() - self.start:6.1f} s  {text}"
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + line[:150])
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


def median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def fmt(x: float | None, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}{unit}"


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.{digits}f}x"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = "") -> None:
    t = Table(title=escape(title), caption=escape(caption) or None, caption_justify="left")
    for i, c in enumerate(columns):
        t.add_column(escape(c), justify="left" if i == 0 else "right", overflow="fold")
    for r in rows:
        t.add_row(*[escape(str(x)) for x in r])
    console().print(t)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by SIGKILL
            continue
    return out


def step_times(entries: list[dict[str, Any]], warmup: int, kind: str = "commit") -> list[float]:
    """Gaps between consecutive commits whose step is past the warm-up (same epoch for unbroken)."""
    commits = [e for e in entries if e.get("kind") == kind and int(e["step"]) > warmup]
    gaps = []
    for a, b in itertools.pairwise(commits):
        if int(b["step"]) == int(a["step"]) + 1 and a.get("epoch") == b.get("epoch"):
            gaps.append(b["t"] - a["t"])
    return gaps


def wait_until(predicate: Any, timeout: float, what: str, poll: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


# -------------------------------------------------------------------- plain DDP baseline


class DDPRun:
    """``world`` plain-DDP ranks (bench/ddp_worker.py) as subprocesses on gloo/CPU.

    ``throttles`` maps a rank to its ``--throttle`` (an emulated slower device; see the worker).

    The c10d TCPStore used for rendezvous lives in this (the benchmark's) process on an
    ephemeral port, as unbroken's lives in its coordinator, so killing any rank leaves it up.
    """

    def __init__(
        self,
        job: str,
        world: int,
        workdir: Path,
        env: dict[str, str],
        *,
        timeout_s: float = 60.0,
        faults: dict[int, str] | None = None,
        throttles: dict[int, str] | None = None,
        extra: list[str] | None = None,
    ) -> None:
        """``extra``: more arguments for every rank's worker."""
        from datetime import timedelta

        import torch.distributed as dist

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.world = world
        self.store: Any = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(timeout_s, 30)))  # fmt: skip
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.exit_at: dict[int, float] = {}
        self.started_at = time.time()
        full_env = dict(os.environ, **NODE_ENV, **env)
        faults = faults or {}
        throttles = throttles or {}
        for r in range(world):
            cmd = [
                sys.executable, str(HERE / "ddp_worker.py"), "--job", job, "--rank", str(r), "--world", str(world),
                "--store-port", str(self.store.port), "--log", str(self.log_path(r)), "--timeout", str(timeout_s),
            ]  # fmt: skip
            if r in faults:
                cmd += ["--fault", faults[r]]
            if throttles.get(r):
                cmd += ["--throttle", throttles[r]]
            cmd += extra or []
            err = open(self.workdir / f"ddp{r}.err", "ab")  # noqa: SIM115
            self.procs[r] = subprocess.Popen(cmd, stdout=err, stderr=err, env=full_env)
            err.close()

    def __enter__(self) -> DDPRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_path(self, rank: int) -> Path:
        return self.workdir / f"ddp{rank}.jsonl"

    def entries(self, rank: int) -> list[dict[str, Any]]:
        return read_jsonl(self.log_path(rank))

    def poll(self) -> dict[int, int | None]:
        now = time.time()
        codes = {}
        for r, p in self.procs.items():
            code = p.poll()
            if code is not None and r not in self.exit_at:
                self.exit_at[r] = now
            codes[r] = code
        return codes

    def wait_exit(self, ranks: Iterable[int], timeout: float) -> dict[int, int | None]:
        ranks = list(ranks)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = self.poll()
            if all(codes[r] is not None for r in ranks):
                return {r: codes[r] for r in ranks}
            time.sleep(0.005)
        return {r: self.procs[r].poll() for r in ranks}

    def max_step(self) -> int:
        best = 0
        for r in self.procs:
            for e in self.entries(r):
                if e.get("kind") == "commit":
                    best = max(best, int(e["step"]))
        return best

    def stderr(self, rank: int) -> str:
        p = self.workdir / f"ddp{rank}.err"
        return p.read_text(errors="replace")[-2000:] if p.exists() else ""

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, sig)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        self.store = None
