"""gloo's lazily connected group, modelled for unit tests (`Connections`): what the epoch's
world group is across zones, where a pair of ranks connects on its first use."""

from __future__ import annotations

import threading

import torch

from unbroken.testing.fake import FakeProcessGroup, FakeWork, FakeWorld


class Connections:
    """gloo's lazily connected group (the epoch's world group across zones), at its
    strictest: a pair of ranks has one connection per stream (a tag picks the stream), and
    the first use of a connection at either end blocks until the other end's first use of it
    (in gloo only the listening end waits, and which end listens depends on the ports)."""

    def __init__(self, streams: int, timeout_s: float = 10.0) -> None:
        self.streams = streams
        self.timeout_s = timeout_s
        self._arrived: dict[tuple[int, int, int], set[int]] = {}
        self._changed = threading.Condition()

    def use(self, me: int, peer: int, tag: int) -> None:
        key = (tag % self.streams, min(me, peer), max(me, peer))
        with self._changed:
            ends = self._arrived.setdefault(key, set())
            if me in ends:  # connected at its first use
                return
            ends.add(me)
            self._changed.notify_all()
            if not self._changed.wait_for(lambda: len(ends) == 2, self.timeout_s):
                raise RuntimeError(f"Connect timeout: rank {me} to {peer} on stream {key[0]} (tag {tag})")


class LazyGroup(FakeProcessGroup):
    def __init__(self, world: FakeWorld, rank: int, connections: Connections) -> None:
        super().__init__(world, rank)
        self.connections = connections

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> FakeWork:
        self.connections.use(self.rank(), dst, tag)
        return super().send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> FakeWork:
        self.connections.use(self.rank(), src, tag)
        return super().recv(tensors, src, tag)
