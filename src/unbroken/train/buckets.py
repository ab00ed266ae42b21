"""The gradient summed while backward still runs: parameters in buckets, as DDP does.

Backward produces the last layers' gradients first. The step's flat tensor holds the
gradient in parameter order, so its buckets are contiguous ranges taken from the end, each
up to the epoch's bucket size. There is no small first bucket as DDP has (1 MB): every
collective more costs a round of latency, 2.5 ms on 3 processes sharing 2 cores, and a
small model split in two ran 1.32x DDP's step, 0.98x in one piece (`bench/steady_state.py`).
A hook on each parameter copies its accumulated gradient into ``flat`` on the last
micro-batch's backward; a bucket whose parameters are all in is prepared (the loss scale,
the norm: `StepProtocol`) and its sum posted on the reducer's first hop, always in bucket
order, whatever order autograd runs in: every member posts the same collectives in the same
order. The tail (buffer deltas,
vote, samples, norms) is posted right after the last bucket (the first parameters, which
backward reaches last), once backward is done (`Reducer.allreduce`); a model of one
bucket sends it with the tail in one collective (the tail follows it in ``flat``), as
without buckets. What backward did not reach (unused parameters, a member with no
samples, a loop that never armed the hooks) goes out then, in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Bucket:
    lo: int
    hi: int
    """Its range of the flat gradient."""
    params: tuple[int, ...]
    """Indices of its parameters."""


def layout(numels: list[int], cap_bytes: int) -> list[Bucket]:
    """Buckets of float32 gradients in posting order: the last parameters first, each bucket
    closed once it holds ``cap_bytes``, and a parameter never split. The same parameters,
    the same buckets, on every member."""
    ends = [0]
    for n in numels:
        ends.append(ends[-1] + n)
    out: list[Bucket] = []
    hi, members = ends[-1], []
    for i in range(len(numels) - 1, -1, -1):
        members.append(i)
        if 4 * (hi - ends[i]) >= cap_bytes or i == 0:
            out.append(Bucket(ends[i], hi, tuple(members)))
            hi, members = ends[i], []
    return out


@dataclass
class Buckets:
    """One epoch's buckets over ``flat``'s gradient (see the module's docstring)."""

    params: Sequence[torch.Tensor]
    flat: torch.Tensor
    buckets: list[Bucket]
    post: Callable[[torch.Tensor], Any]
    """Posts a range's sum on the first hop; returns the work to wait on."""
    prepare: Callable[[torch.Tensor], None]
    """Readies a range of this member's gradient before it goes out (in posting order)."""
    works: list[Any] = field(default_factory=list)
    in_backward: int = 0
    """Buckets of this step that went out while backward ran."""
    _done: int = 0
    """Buckets readied (and posted, unless there is one)."""
    _pending: list[int] = field(default_factory=list)
    _copied: list[bool] = field(default_factory=list)
    _bucket_of: dict[int, int] = field(default_factory=dict)
    _offsets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.params}
        self._offsets = [0]
        for p in self.params[:-1]:
            self._offsets.append(self._offsets[-1] + p.numel())
        self.reset()

    @property
    def end(self) -> int:
        """Where the part of ``flat`` left to the reducer starts: the tail, or with one bucket
        that bucket and the tail."""
        return self.buckets[0].hi if len(self.buckets) > 1 else 0

    @property
    def posted(self) -> int:
        """Buckets whose sums are in flight."""
        return len(self.works)

    def reset(self) -> None:
        """A new step: nothing copied, nothing posted."""
        self.works = []
        self.in_backward = self._done = 0
        self._pending = [len(b.params) for b in self.buckets]
        self._copied = [False] * len(self.params)

    @contextlib.contextmanager
    def during_backward(self) -> Iterator[None]:
        """Hooks that copy and post while the backward run inside this block accumulates the
        step's last gradients (a micro-batch before them would post partial sums). None with
        one bucket: it goes out with the tail anyway."""
        if len(self.buckets) <= 1:
            yield
            return
        handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))  # type: ignore[misc, no-untyped-call]
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self.in_backward = self.posted

    def complete(self) -> list[Any]:
        """Ready and post what backward did not, in order (a single bucket is readied, not
        posted: it goes with the tail); every posted bucket's work."""
        for b in range(self._done, len(self.buckets)):
            for i in self.buckets[b].params:
                self._copy(i)
            self._next()
        return self.works

    def _ready(self, i: int) -> None:
        if self._copied[i]:  # a second backward through the same parameters: sent already
            return
        self._copy(i)
        self._pending[self._bucket_of[i]] -= 1
        while self._done < len(self.buckets) and self._pending[self._done] == 0:
            self._next()

    def _copy(self, i: int) -> None:
        if self._copied[i]:
            return
        self._copied[i] = True
        p = self.params[i]
        lo = self._offsets[i]
        view = self.flat[lo : lo + p.numel()]
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad.detach().reshape(-1))  # from the device: the CPU staging copy

    def _next(self) -> None:
        bucket = self.buckets[self._done]
        piece = self.flat[bucket.lo : bucket.hi]
        self.prepare(piece)
        self._done += 1
        if len(self.buckets) > 1:
            self.works.append(self.post(piece))
