"""A state tree as a JSON header and a list of tensors: the deterministic form that
checkpoint fragments (bytes on disk) and incremental resync (chunks on the wire) share.

The header describes the tree (dicts with keys in sorted order, lists, tuples, JSON
scalars) with each tensor replaced by ``{"t": index, "dtype": ..., "shape": [...]}``;
the tensors come in index order. Equal trees give equal headers and equal tensor lists on
every node: no pickle, no memory addresses, no timestamps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.errors import TransferError


@dataclass(frozen=True)
class Slot:
    """Where one tensor of a tree sits, and what it is."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


def split(tree: Any, as_they_are: bool = False) -> tuple[Any, list[torch.Tensor]]:
    """The header and the tensors (contiguous, on the CPU; views of the tree's own tensors
    where they already are, so a donor does not copy its state to send it). ``as_they_are``:
    the tensors themselves, wherever they are (meta tensors: a file's layout without its data)."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = x if as_they_are else x.detach().cpu().contiguous()
            tensors.append(t)
            return {"t": len(tensors) - 1, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        if isinstance(x, dict):
            items = sorted(x.items(), key=lambda kv: (type(kv[0]).__name__, str(kv[0])))
            return {"d": [[k, walk(v)] for k, v in items]}
        if isinstance(x, list | tuple):
            return {"l" if isinstance(x, list) else "u": [walk(v) for v in x]}
        if x is None or isinstance(x, bool | int | float | str):
            return {"v": x}
        raise TypeError(f"cannot pack a {type(x).__name__}")

    return walk(tree), tensors


def slots(header: Any) -> list[Slot]:
    """Each tensor's path, dtype and shape, in index order; refuses a malformed header."""
    found: dict[int, Slot] = {}

    def walk(x: Any, path: str) -> None:
        if not isinstance(x, dict):
            raise TransferError(f"malformed state header at {path or '/'}")
        if "t" in x:
            dtype = getattr(torch, str(x.get("dtype")), None)
            shape = x.get("shape")
            if (
                not isinstance(dtype, torch.dtype)
                or not isinstance(shape, list)
                or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(x["t"], int)
                or x["t"] in found
            ):
                raise TransferError(f"malformed tensor entry in state header at {path}")
            found[x["t"]] = Slot(path, dtype, tuple(shape))
        for key in ("l", "u"):
            for i, v in enumerate(x.get(key, [])):
                walk(v, f"{path}/{i}")
        for pair in x.get("d", []):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise TransferError(f"malformed dict entry in state header at {path}")
            walk(pair[1], f"{path}/{pair[0]}")

    walk(header, "")
    if sorted(found) != list(range(len(found))):
        raise TransferError("state header's tensor indices are not 0..n-1")
    return [found[i] for i in range(len(found))]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def join(header: Any, tensors: list[torch.Tensor]) -> Any:
    """The tree back from its header and tensors (the tensors are used, not copied)."""

    def build(x: Any) -> Any:
        if "t" in x:
            return tensors[x["t"]]
        if "d" in x:
            return {k: build(v) for k, v in x["d"]}
        if "l" in x:
            return [build(v) for v in x["l"]]
        if "u" in x:
            return tuple(build(v) for v in x["u"])
        return x["v"]

    return build(header)


def copy(tree: Any, into: Any = None) -> Any:
    """``tree`` with every tensor copied (to the CPU). ``into``: an earlier copy of the same
    layout whose tensors are overwritten instead (no allocation: a fresh 400 MB one costs
    six times the copy, and it lands on the step that asked for it)."""
    header, tensors = split(tree)
    if into is not None:
        old_header, old = split(into)
        if slots(old_header) == slots(header):
            for dst, src in zip(old, tensors, strict=True):
                dst.copy_(src)
            return join(header, old)
    return join(header, [t.clone() for t in tensors])
