"""A trainer's commitment to its slice of a step, and what its bits depend on.

The commitment is a digest of the gradient the trainer contributed, parameter by parameter
in parameter order (its pieces go out bucket by bucket, last parameters first, and a
validator recomputing it has no buckets: each parameter's digest is taken as its piece goes
out), and of the slice's positions. `unbroken.train.checks` says who makes and who checks it.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import platform
from collections.abc import Sequence

import numpy as np
import torch
import xxhash


class GradientDigest:
    """Digests of a flat gradient's parameters, added piece by piece in any order (each
    piece whole parameters, as a bucket is), and the commitment they make with positions."""

    def __init__(self, numels: Sequence[int]) -> None:
        self._starts = list(itertools.accumulate(numels, initial=0))
        self._parts = np.zeros(len(numels), dtype=np.uint64)

    def reset(self) -> None:
        self._parts[:] = 0

    def add(self, lo: int, piece: torch.Tensor) -> None:
        """The gradient's elements ``[lo, lo + piece.numel())`` (a CPU float32 tensor)."""
        data = piece.detach().reshape(-1).numpy()
        hi = lo + len(data)
        i = bisect.bisect_left(self._starts, lo)
        while i < len(self._parts) and self._starts[i] < hi:
            a, b = self._starts[i] - lo, self._starts[i + 1] - lo
            self._parts[i] = xxhash.xxh3_64_intdigest(memoryview(data[a:b]))  # type: ignore[arg-type]
            i += 1

    def commitment(self, positions: Sequence[int]) -> str:
        """The digest of the gradient added and of the slice's ``positions`` (its samples)."""
        h = xxhash.xxh3_64()
        h.update(np.asarray(positions, dtype=np.int64).tobytes())
        h.update(self._parts.tobytes())
        return h.hexdigest()


@functools.cache
def _cpu_model() -> str:
    """The CPU's vendor and model, not only its instruction set: BLAS libraries pick other
    kernels (other summation orders) for Intel and AMD chips that report the same AVX level."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{platform.machine()} {line.split(':', 1)[1].strip()}"[:120]
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}".strip()[:120]


@functools.cache
def _build() -> str:
    """torch's build configuration (compilers, BLAS, CPU kernels built in), in short."""
    return hashlib.blake2b(torch.__config__.show().encode(), digest_size=4).hexdigest()


def arithmetic(device: torch.device) -> str:
    """What a gradient computed on ``device`` depends on besides the data and the state: the
    device kind, the CPU kernels torch dispatches to (AVX2 and AVX-512 sum in other orders),
    the number of threads (a reduction is split among them), the torch build. Two nodes that
    say the same compute the same bits; a GPU's kernels need not (atomics), so a GPU's never
    equals a CPU's, on which validators recompute."""
    build = f"torch {torch.__version__} ({_build()})"
    if device.type == "cpu":
        capability = torch.backends.cpu.get_cpu_capability()
        return f"cpu {_cpu_model()} {capability}, {torch.get_num_threads()} threads, {build}"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{device.type} {name}, {build}"
