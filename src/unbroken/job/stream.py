"""Data read in order: streams whose position is the committed step.

A map-style dataset is read by index through a seeded permutation (`unbroken.job.data`).
A stream has no length to permute: its samples come in the order it yields them, endlessly
(a finite one starts over). Step ``s`` still owns positions ``[s*B, (s+1)*B)``, so the
position of the data is the committed step itself: a retried step reads the same positions
again, a joiner reads from where the group is, and nothing is read twice or skipped, as with
a map-style dataset. A stream only has to give the samples at any positions (`Stream.read`);
reading forward from where it was is the cheap case, and the one training makes.

    Job(..., dataset=IterableStream(MyIterableDataset()), ...)
    Job(..., dataset=ShardStream("/data/shards", decode=json.loads), ...)
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from unbroken.errors import ConfigError


@runtime_checkable
class Stream(Protocol):
    """A data source read in order (`Job.dataset`)."""

    def identity(self) -> str:
        """What nodes of one job must agree on (another corpus, another job)."""
        ...

    def read(self, start: int, count: int) -> list[Any]:
        """The samples at positions ``[start, start + count)`` of the endless stream."""
        ...


class StreamPlan:
    """`DataPlan` for a stream: a step's slice is its positions, in order."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def indices(self, step: int, offset: int, count: int) -> list[int]:
        if not 0 <= offset <= offset + count <= self.batch_size:
            raise ValueError(f"slice [{offset}, {offset + count}) is outside a batch of {self.batch_size}")
        start = step * self.batch_size + offset
        return list(range(start, start + count))


class IterableStream:
    """Any iterable (a `torch.utils.data.IterableDataset`, a generator function's result
    made again by ``make``) as a `Stream`. It must yield the same samples in the same order
    each time it is iterated: shuffle with a fixed seed, not per run.

    ``source``: the iterable itself, or a function of no arguments returning a fresh one.
    Reading forward from the last position costs only the samples skipped (other nodes'
    slices); reading backward (a retried step) starts the iteration over."""

    HEAD = 256
    """The first samples, kept: speed probes read positions 0..k, and must not make the
    stream start over when training is far into it."""

    def __init__(self, source: Iterable[Any] | Callable[[], Iterable[Any]], name: str = "") -> None:
        if not callable(source) and iter(source) is source:
            raise ConfigError(
                f"IterableStream was given a one-shot iterator ({type(source).__name__}): a retried step must "
                "read its samples again; give the iterable (an IterableDataset) or a function that makes it anew"
            )
        self._make: Callable[[], Iterable[Any]] = source if callable(source) else (lambda: source)  # type: ignore[assignment]
        self._name = name or type(source).__name__
        self._it: Iterator[Any] | None = None
        self._pos = 0
        """Samples the current iteration has yielded (a position within the pass)."""
        self._pass_length: int | None = None
        self._head: list[Any] = []
        self._lock = threading.Lock()

    def identity(self) -> str:
        return f"iterable:{self._name}"

    def read(self, start: int, count: int) -> list[Any]:
        with self._lock:
            if self._pass_length is not None:
                start %= self._pass_length  # a finite stream starts over: positions wrap
            if start + count <= len(self._head):
                return self._head[start : start + count]
            if self._it is None or start < self._pos:
                self._restart()
            self._skip(start - self._pos)
            return [self._next() for _ in range(count)]

    def _restart(self) -> None:
        self._it, self._pos = iter(self._make()), 0

    def _next(self) -> Any:
        assert self._it is not None
        try:
            sample = next(self._it)
        except StopIteration:
            if self._pos == 0:
                raise ConfigError(f"stream {self._name} yielded no samples") from None
            self._pass_length = self._pos
            self._restart()
            sample = next(self._it)
        if self._pos == len(self._head) and self._pos < self.HEAD:
            self._head.append(sample)
        self._pos += 1
        return sample

    def _skip(self, n: int) -> None:
        for _ in range(n):
            self._next()


class ShardStream:
    """A directory of shard files as a `Stream`: each line of each file (in the files' name
    order) is a sample, given to ``decode`` (``json.loads`` for JSON lines). Positions are
    found by seeking, not by reading what comes before: each shard's line offsets are
    indexed once, when it is first read."""

    def __init__(self, directory: str | Path, pattern: str = "*", decode: Callable[[str], Any] = str.rstrip) -> None:
        self.directory = Path(directory)
        self.files = sorted(p for p in self.directory.glob(pattern) if p.is_file())
        if not self.files:
            raise ConfigError(f"no shard matches {pattern!r} in {self.directory}: check the directory and pattern")
        self.decode = decode
        self._counts = [_count_lines(p) for p in self.files]
        if not any(self._counts):
            raise ConfigError(f"the shards in {self.directory} are empty")
        self._starts = [sum(self._counts[:i]) for i in range(len(self.files))]
        self.length = sum(self._counts)
        self._offsets: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        h = hashlib.blake2b(digest_size=8)
        for path, count in zip(self.files, self._counts, strict=True):
            h.update(f"{path.name}:{path.stat().st_size}:{count};".encode())
        self._identity = f"shards:{h.hexdigest()}"  # as found at the start: a shard growing later is not another job

    def identity(self) -> str:
        return self._identity

    def read(self, start: int, count: int) -> list[Any]:
        out = []
        for pos in range(start, start + count):
            shard, line = self._locate(pos % self.length)
            out.append(self.decode(self._line(shard, line)))
        return out

    def _locate(self, pos: int) -> tuple[int, int]:
        shard = bisect.bisect_right(self._starts, pos) - 1
        while not self._counts[shard]:  # an empty shard starts where the next one does
            shard += 1
        return shard, pos - self._starts[shard]

    def _line(self, shard: int, line: int) -> str:
        with self._lock:
            offsets = self._offsets.get(shard)
            if offsets is None:
                offsets = self._offsets[shard] = _line_offsets(self.files[shard])
        with open(self.files[shard], "rb") as f:
            f.seek(offsets[line])
            return f.readline().decode()


def _count_lines(path: Path) -> int:
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def _line_offsets(path: Path) -> list[int]:
    offsets, pos = [], 0
    with open(path, "rb") as f:
        for raw in f:
            offsets.append(pos)
            pos += len(raw)
    return offsets
