"""The process group of a member alone in its zone: every collective is over at once.

A sharded zone of one member still gathers its blocks and sums its gradients through its
zone's group (`unbroken.train.sharding`); alone, that group has nothing to wait for.
"""

from __future__ import annotations

from typing import Any

import torch


class Done:
    """A collective that completed when it was posted."""

    def __init__(self, value: Any = None) -> None:
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(value)

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class Solo:
    """`unbroken.comm.group.ProcessGroup` of one rank: a sum or a broadcast leaves the
    tensor as it is, a gather copies it to the only output; there is no peer to send to."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def allreduce(self, tensors: list[torch.Tensor]) -> Done:
        return Done(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Done:
        outputs[0][0].copy_(inputs[0])
        return Done(outputs)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> Done:
        return Done([tensor])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Done:
        raise ValueError(f"a group of one rank has no rank {dst} to send to")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Done:
        raise ValueError(f"a group of one rank has no rank {src} to receive from")
