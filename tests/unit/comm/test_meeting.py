"""A node's side of the rendezvous (`unbroken.comm.group.Meeting`) with real gloo builds."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from unbroken.comm.group import Meeting, build_group


class Leader:
    """Stands in for the leader: whatever one node publishes reaches every other node."""

    def __init__(self, size: int) -> None:
        self.nodes: list[Meeting] = []
        self.sent: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        for rank in range(size):
            self.nodes.append(Meeting(lambda e, k, v, rank=rank: self.publish(rank, e, k, v)))

    def publish(self, rank: int, epoch: int, key: str, value: bytes) -> None:
        with self.lock:
            self.sent.append((rank, key))
        for other, node in enumerate(self.nodes):
            if other != rank:
                node.deliver(epoch, {key: value})


def test_groups_meet_through_the_leader_and_each_rank_sends_only_its_own_entry():
    size = 3
    leader = Leader(size)
    wake = threading.Event()

    def one(rank: int) -> float:
        node = leader.nodes[rank]
        pg, _ = build_group(
            node.store(7), "world", rank, size, "127.0.0.1", 10.0, wake, lambda: None,
            lambda: node.publish(7),
        )  # fmt: skip
        t = torch.ones(2) * (rank + 1)
        pg.allreduce([t]).wait()
        return float(t[0])

    with ThreadPoolExecutor(size) as pool:
        assert list(pool.map(one, range(size))) == [6.0] * size
    assert sorted(leader.sent) == [(r, f"world/0/{r}") for r in range(size)], leader.sent


def test_republish_sends_only_what_this_node_wrote():
    sent: list[str] = []
    node = Meeting(lambda e, k, v: sent.append(k))
    node.deliver(1, {"world/0/1": b"theirs"})
    node.store(1).set("world/0/0", b"mine")
    node.publish(1)
    assert sent == ["world/0/0"]
    node.republish()
    assert sent == ["world/0/0", "world/0/0"]
    node.reset()
    node.republish()
    assert sent == ["world/0/0", "world/0/0"]
