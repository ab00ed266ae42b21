"""The parts of a sharded zone's model (`unbroken.comm.sharded`): which modules are gathered
together (blocks) and their spans of the flat space, the pieces of the ranges a member
holds, and the tensor plumbing: a parameter's storage freed between uses and refilled with
its version counter left alone (the tensors autograd saved of it stay valid).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from unbroken.comm.group import EpochScope, ProcessGroup, wait_all
from unbroken.errors import ConfigError, TransferError
from unbroken.state.shards import Purpose


@dataclass
class Block:
    """Modules whose parameters are gathered together, and their span of the flat space."""

    module: nn.Module
    params: list[nn.Parameter]
    start: int
    end: int
    offsets: list[int]
    """Each parameter's start in the flat space."""
    gathered: bool = False
    waiting: int = 0
    """Gradients of this backward still to come before the block's sum."""
    fetch: tuple[Any, list[list[torch.Tensor]], list[tuple[str, int, int]]] | None = None
    """Its gather, posted ahead of its use (work, outputs, pieces): `ShardedModel._gather`
    waits for it."""


@dataclass
class Piece:
    """The part of one parameter inside a held range: a tensor the optimizer steps."""

    param: int
    """Index of the parameter (in flat order)."""
    start: int
    end: int
    """Its span in the flat space."""
    tensor: torch.Tensor


@dataclass
class Holding:
    """A range this member holds, primary or buddy copy, in pieces (one per parameter)."""

    start: int
    end: int
    purpose: Purpose
    pieces: list[Piece] = field(default_factory=list)


def blocks_of(model: nn.Module, blocks: Sequence[nn.Module] | None) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Each block with the parameters it owns (a parameter of a nested block belongs to that
    block); the model itself is the last block, owning what no other block does."""
    chosen = list(blocks) if blocks is not None else [m for m in model.children() if any(True for _ in m.parameters())]
    owner: dict[int, int] = {}
    out: list[tuple[nn.Module, list[nn.Parameter]]] = []
    for i, block in enumerate(chosen):
        if block is model:
            raise ConfigError("the model itself cannot be one of its blocks: give its sub-modules")
        for p in block.parameters():
            owner.setdefault(id(p), i)
    for i, block in enumerate(chosen):
        out.append((block, [p for p in block.parameters() if owner.get(id(p)) == i]))
    rest = [p for p in model.parameters() if id(p) not in owner]
    out.append((model, rest))
    return [(m, ps) for m, ps in out if ps]


def refuse_running_statistics(model: nn.Module) -> None:
    """A sharded zone keeps buffers whole on every member and never sums them: a module that
    changes its own in forward (BatchNorm's running statistics) is refused.

    Raises:
        ConfigError: naming the first such module."""
    if tracking := [n for n, mod in model.named_modules() if getattr(mod, "track_running_stats", False)]:
        raise ConfigError(
            f"a sharded zone does not sum buffers that forward passes change yet: {tracking[0]!r} keeps "
            "running statistics (BatchNorm); use LayerNorm or train it unsharded"
        )


def per_element(value: Any, like: torch.Tensor) -> bool:
    """State with one value per parameter element (Adam's moments), not shared (its step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == like.shape


def as_flat(value: Any, n: int) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) and value.numel() == n else torch.zeros(n)


def tensors_of(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        yield from itertools.chain.from_iterable(tensors_of(x) for x in output)
    elif isinstance(output, Mapping):
        yield from itertools.chain.from_iterable(tensors_of(x) for x in output.values())


def restore_storage(model: nn.Module) -> None:
    """Give a sharded model's freed parameters their bytes back, on the CPU (their values are
    garbage): where a new zone's ranges are read from."""
    for p in model.parameters():
        if p.device.type != "cpu":
            p.data = torch.empty(p.shape, dtype=p.dtype)
        elif p.untyped_storage().nbytes() == 0:
            p.untyped_storage().resize_(p.numel() * p.element_size())


def broadcast_model(model: nn.Module, group: ProcessGroup, root: int, scope: EpochScope) -> None:
    """Every member's ``model`` parameters become ``root``'s (before a new zone's ranges are
    read from it), one parameter at a time: nothing larger than the largest is allocated."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            if not flat.is_contiguous():
                raise ConfigError(f"parameter {name} is not contiguous: a sharded zone needs contiguous parameters")
            wait_all([group.broadcast(flat, root)], scope, f"agreeing on the initial {name}")


def move_model(model: nn.Module, device: torch.device) -> None:
    """Put ``model`` where it computes: its parameters as empty tensors there (their values
    live in the zone's ranges and are filled in at each gather), its buffers copied. The
    same tensor objects: hooks, the job's optimizer and the zone's buffer check keep them."""
    for p in model.parameters():
        if p.device != device:
            p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
    for b in model.buffers():
        if b.device != device:
            b.data = b.data.to(device)


def free(p: torch.Tensor) -> None:
    """Free a parameter's bytes, keeping its shape (and the tensors autograd saved of it)."""
    p.untyped_storage().resize_(0)


def fill(p: torch.Tensor, values: torch.Tensor) -> None:
    """Give a freed parameter its bytes back, with ``values``; its version counter is left as
    it was, so the tensors autograd saved of it in forward stay valid for backward."""
    p.untyped_storage().resize_(p.numel() * p.element_size())
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):  # type: ignore[attr-defined]
        p.copy_(values.view_as(p))


def sum_of_squares(norms: list[torch.Tensor]) -> float:
    """The sum of the squares of ``norms`` (0-d tensors on one device), read in one copy and
    added in float64 in their order."""
    if not norms:
        return 0.0
    total = 0.0
    for n in torch.stack(norms).tolist():
        total += n**2
    return total


def collect(
    holdings: Sequence[Holding],
    optimizer: torch.optim.Optimizer,
    start: int,
    end: int,
    me: str,
    with_state: bool,
    device: torch.device,
) -> dict[str, Any]:
    """The values (and, ``with_state``, the optimizer state) of ``[start, end)`` from
    ``holdings`` (member ``me``'s), as flat tensors on ``device``.

    Raises:
        TransferError: the holdings cover only part of it."""
    values = torch.full((end - start,), float("nan"), device=device)
    state: dict[str, Any] = {}
    covered = 0
    for h in holdings:
        for piece in h.pieces:
            a, b = max(piece.start, start), min(piece.end, end)
            if a >= b:
                continue
            values[a - start : b - start] = piece.tensor.detach()[a - piece.start : b - piece.start]
            covered += b - a
            if not with_state:
                continue
            for key, value in optimizer.state.get(piece.tensor, {}).items():
                if per_element(value, piece.tensor):
                    flat = state.setdefault(key, torch.full((end - start,), float("nan"), device=device))
                    flat[a - start : b - start] = value[a - piece.start : b - piece.start]
                else:
                    state.setdefault(key, value.to(device, copy=True) if isinstance(value, torch.Tensor) else value)
    if covered != end - start:
        raise TransferError(f"{me} holds {covered:,} of the {end - start:,} elements of [{start}, {end})")
    return {"values": values, "state": state}
