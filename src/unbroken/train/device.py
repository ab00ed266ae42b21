"""Devices: choosing one, describing it, and computing on it while the state stays on the CPU.

The replicated state (parameters, buffers, optimizer) lives on the CPU on every node, so
replicas on different device kinds stay bit-identical: a GPU's optimizer kernels need not
round like a CPU's. A node with an accelerator keeps a compute copy there, refreshed from
the CPU state at each step (one host-to-device copy of the parameters), runs forward and
backward on it, and stages the gradients back to the CPU buffer that gloo all-reduces.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from unbroken.errors import ConfigError

T = TypeVar("T")
OutOfMemory: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
STATE_BYTES_PER_PARAM_BYTE = 4
"""Parameters, gradients and up to two optimizer moments: the memory the model itself takes."""
CPU_MEMORY_FRACTION = 0.5
"""Share of the host's available memory a CPU node plans to use by default."""


def resolve_device(spec: str) -> torch.device:
    """``auto`` picks the best available (cuda, then mps, then cpu); others are checked."""
    spec = spec.strip().lower()
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"--device {spec!r} is not a device: use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {spec} asked for CUDA but this torch build sees no CUDA device "
                f"(torch {torch.__version__}): install a CUDA build of torch, or use --device cpu"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        return torch.device("cuda", index)
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError(f"--device {spec}: MPS is not available on this machine; use --device cpu")
    elif device.type != "cpu":
        raise ConfigError(f"--device {spec}: device type {device.type!r} is not supported; use cpu, cuda or mps")
    return device


@dataclass(frozen=True)
class DeviceInfo:
    kind: str
    name: str
    memory_total: int
    memory_available: int
    memory_used: int


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _rss() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def describe(device: torch.device) -> DeviceInfo:
    """Kind, name and memory of the compute device (host memory for the CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
        return DeviceInfo(str(device), name, total, free, torch.cuda.memory_allocated(device))
    mem = _meminfo()
    total = mem.get("MemTotal", 0)
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = 0
    name = os.uname().machine if device.type == "cpu" else device.type
    if device.type == "cpu":
        name = f"{name}, {os.cpu_count() or 1} cores, {torch.get_num_threads()} threads"
    return DeviceInfo(str(device), name, total, mem.get("MemAvailable", total), _rss())


class ComputeReplica:
    """Where forward and backward run: the CPU model itself, or a copy on an accelerator."""

    def __init__(self, model: nn.Module, device: torch.device, *, separate: bool | None = None) -> None:
        self.master = model
        self.device = device
        self.separate = device.type != "cpu" if separate is None else separate
        self.model = copy.deepcopy(model).to(device) if self.separate else model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._master_tensors = list(model.parameters()) + list(model.buffers())
        self._tensors = list(self.model.parameters()) + list(self.model.buffers())

    def buffers(self) -> Iterator[torch.Tensor]:
        return (b for b in self.model.buffers() if b.dtype.is_floating_point or b.dtype == torch.int64)

    def pull(self) -> None:
        """Refresh the compute copy from the committed CPU state (no-op without a copy)."""
        if not self.separate:
            return
        with torch.no_grad():
            for dst, src in zip(self._tensors, self._master_tensors, strict=True):
                dst.copy_(src, non_blocking=True)

    def to_device(self, obj: T) -> T:
        if self.device.type == "cpu":  # (a sharded zone's model is not separate, yet on the device)
            return obj
        if isinstance(obj, torch.Tensor):
            return obj.to(self.device, non_blocking=True)  # type: ignore[return-value]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple (default_collate keeps them)
            return type(obj)(*(self.to_device(x) for x in obj))  # type: ignore[return-value]
        if isinstance(obj, list | tuple):
            return type(obj)(self.to_device(x) for x in obj)  # type: ignore[return-value]
        if isinstance(obj, dict):
            return {k: self.to_device(v) for k, v in obj.items()}  # type: ignore[return-value]
        return obj

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class Calibration:
    """A node's measured compute cost model and activation memory."""

    per_sample_s: float
    overhead_s: float
    activation_bytes_per_sample: int
    activation_bytes_fixed: int
    apart: bool = True
    """The passes told the two costs apart; False where the per-sample cost is only a floor
    (small passes bound by the fixed cost, as on a GPU): the fixed cost is then a bound."""


def calibrate(run: Callable[[int], float], saved_bytes: Callable[[int], int], k: int, repeats: int = 2) -> Calibration:
    """Fit ``t(n) = overhead + n * per_sample`` from two- and k-sample passes (best of ``repeats``).

    ``run(n)`` times one forward/backward of ``n`` samples; ``saved_bytes(n)`` measures the
    activations autograd keeps for them. Two samples, not one: batch statistics (BatchNorm)
    need more than one sample per micro-batch.
    """
    k = max(4, k)
    t2 = min(run(2) for _ in range(repeats))
    tk = min(run(k) for _ in range(repeats))
    slope, floor = (tk - t2) / (k - 2), tk / k * 0.05
    per_sample = max(slope, floor, 1e-9)
    overhead = max(t2 - 2 * per_sample, 0.0)
    b2, bk = saved_bytes(2), saved_bytes(k)
    per_sample_bytes = max((bk - b2) // (k - 2), 1)
    return Calibration(per_sample, overhead, per_sample_bytes, max(b2 - 2 * per_sample_bytes, 0), slope >= floor)


MAX_MICROBATCH = 2**31 - 1
"""A cap no batch reaches (a node that measured almost no activation memory says this much)."""


def microbatch_cap(cal: Calibration, model_bytes: int, budget: int, user_cap: int) -> int:
    """Largest micro-batch that fits ``budget`` bytes (0: no limit; -1: not even one sample)."""
    caps = []
    if budget > 0:
        room = budget - model_bytes * STATE_BYTES_PER_PARAM_BYTE - cal.activation_bytes_fixed
        fits = math.floor(room / cal.activation_bytes_per_sample) if room > 0 else 0
        if fits < 1:
            return -1
        caps.append(min(fits, MAX_MICROBATCH))
    if user_cap > 0:
        caps.append(user_cap)
    return min(caps) if caps else 0


class SavedBytes:
    """Counts the bytes autograd saves for backward while active (activation memory)."""

    def __init__(self) -> None:
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.total += t.numel() * t.element_size()
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start
