"""Helpers shared by the benchmarks (not a benchmark itself): progress line, tables,
log reading, results as JSON (`write_results`), and the plain-DDP baseline launcher (`run_ddp`).

Every child process is reaped: `DDPRun.close` (used as a context manager) SIGCONTs and
SIGKILLs whatever is still running, and `unbroken.testing.LocalCluster.close` does the same
for coordinator and nodes.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
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
# Where `write_results` puts a bench's JSON; tests that run a bench point it elsewhere, and
# an empty value writes nothing, so that a test run leaves the committed results as they are.
RESULTS_ENV = "UB_BENCH_RESULTS"

# Taken when a bench imports this module, i.e. as it starts: this machine is shared, and
# the load beside a run is part of reading its figures.
_LOAD_AT_START = os.getloadavg()
_STARTED_AT = datetime.datetime.now(datetime.timezone.utc)
# Every table a bench printed, in order: its results file holds the very strings it printed.
_TABLES: list[dict[str, Any]] = []


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
    _TABLES.append(
        {"title": title, "columns": list(columns), "rows": [[str(x) for x in r] for r in rows], "caption": caption}
    )
    t = Table(title=escape(title), caption=escape(caption) or None, caption_justify="left")
    for i, c in enumerate(columns):
        t.add_column(escape(c), justify="left" if i == 0 else "right", overflow="fold")
    for r in rows:
        t.add_row(*[escape(str(x)) for x in r])
    console().print(t)


def machine() -> dict[str, Any]:
    """Cores, memory and CPU model of this machine, and the versions that shape a figure."""
    model, mem_kb = "", 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
                break
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = ""
    return {
        "cores": os.cpu_count(),
        "memory_gb": round(mem_kb / 1024**2, 1),
        "cpu_model": model,
        "python": sys.version.split()[0],
        "torch": torch_version,
    }


def load() -> dict[str, list[float]]:
    """The machine's load averages when this bench started and now (a figure measured on a
    busy machine says so)."""
    return {"start": [round(x, 2) for x in _LOAD_AT_START], "end": [round(x, 2) for x in os.getloadavg()]}


def write_results(series: dict[str, Any] | None = None, name: str | None = None) -> Path | None:
    """Write this run's results to ``bench/results/<name>.json`` (``name``: the script's).

    Holds the command line, the date, the machine and its load at start and end, every table
    printed so far (the same strings), and ``series``: the raw figures behind the plots
    `bench/render.py` draws. ``UB_BENCH_RESULTS`` names another directory; set empty, nothing
    is written.
    """
    where = os.environ.get(RESULTS_ENV)
    if where == "":
        return None
    out_dir = Path(where) if where else HERE / "results"
    name = name or Path(sys.argv[0]).stem
    data = {
        "bench": name,
        "command": "python " + " ".join(shlex.quote(a) for a in ["bench/" + Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": _STARTED_AT.isoformat(timespec="seconds"),
        "duration_s": round((datetime.datetime.now(datetime.timezone.utc) - _STARTED_AT).total_seconds(), 1),
        "machine": machine(),
        "load": load(),
        "tables": _TABLES,
        "series": series or {},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    print(f"results: {path}", flush=True)
    return path


def _jsonable(x: Any) -> Any:
    # Figures arrive as numpy or torch scalars, tuples as dict keys are flattened by the callers.
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"write_results: {type(x).__name__} is not JSON: pass numbers, strings, lists or dicts")


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
