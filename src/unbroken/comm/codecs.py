"""Gradient codecs for slow links: one small interface, seven lossy encodings and the identity.

A codec turns a flat float32 tensor into a fixed-size byte payload and back. Fixed size
because the payloads travel through gloo's all-gather, which needs equal sizes on every
rank; every receiver decodes every payload to float32 and sums them in rank order, so the
sum of many nodes neither overflows (int8) nor depends on who computes it (replicas stay
bit-identical).

Error feedback (top-k, int4, int2, int1, and int8 if asked): what a node's payload failed to carry is kept
as a residual and added to its next tensor, so nothing is lost, only delayed. Residuals are
node-local state (`Codec.state_dict`), saved with the node's own checkpoint, never
replicated.

    codec = make_codec("int8")
    payload = codec.encode(grad)          # uint8 tensor of codec.payload_bytes(grad.numel())
    approx = codec.decode(payload, grad.numel())
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from unbroken.comm.robust import all_finite
from unbroken.specs import TOPK_RATIO, CodecSpec

INT8_CHUNK = 256
"""Elements sharing one int8 scale: small chunks keep the quantization error local."""


class Codec(ABC):
    """Encode a flat float32 tensor to a fixed-size uint8 payload; decode it back."""

    name: str = ""
    lossless: ClassVar[bool] = False
    """Decoding gives back exactly what was encoded (a sum's norm is bounded by its parts')."""

    @abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Bytes on the wire for a tensor of ``numel`` elements."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """A uint8 tensor of `payload_bytes` bytes (updates any residual)."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 tensor a payload stands for."""

    def encode_nothing(self, numel: int) -> torch.Tensor:
        """The payload of a sender with nothing to send (a zone without a share this round):
        zeros, with any residual kept for a round it sends in."""
        return self.encode(torch.zeros(numel, dtype=torch.float32))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def reset(self) -> None:
        """Forget residuals (after this node's state was replaced by a peer's)."""
        self.load_state_dict({})


class _WithResidual(Codec):
    """A codec with error feedback: its residual is node-local state."""

    residual: torch.Tensor | None = None

    def encode_nothing(self, numel: int) -> torch.Tensor:
        held, self.residual = self.residual, None
        try:
            return super().encode_nothing(numel)
        finally:
            self.residual = held

    def state_dict(self) -> dict[str, Any]:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residual = state.get("residual")


class Identity(Codec):
    """float32 as is: the exact, uncompressed baseline."""

    name = "none"
    lossless = True

    def payload_bytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(torch.float32).contiguous().view(torch.uint8).clone()

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return payload.view(torch.float32)[:numel].clone()


class HalfPrecision(Codec):
    """fp16 or bf16: half the bytes. fp16 saturates beyond ±65504 (clamped, not inf)."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"half precision is float16 or bfloat16, not {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().to(torch.float32)
        if self.dtype == torch.float16:
            big = torch.finfo(torch.float16).max
            x = x.clamp(-big, big)
        return x.to(self.dtype).contiguous().view(torch.uint8).clone()

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return payload.view(self.dtype)[:numel].to(torch.float32)


class Int8(_WithResidual):
    """Symmetric int8 with one float32 scale per chunk of `INT8_CHUNK` elements.

    Payload: ``ceil(n / chunk)`` float32 scales, then ``n`` int8 values (padded to the chunk).
    With ``error_feedback`` the rounding error is carried into the next tensor.
    """

    name = "int8"

    def __init__(self, chunk: int = INT8_CHUNK, error_feedback: bool = True) -> None:
        if chunk < 1:
            raise ValueError(f"int8 chunk = {chunk} must be positive")
        self.chunk = chunk
        self.error_feedback = error_feedback
        self.residual: torch.Tensor | None = None

    def _chunks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.chunk))

    def payload_bytes(self, numel: int) -> int:
        c = self._chunks(numel)
        return 4 * c + c * self.chunk

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = _with_residual(self, x) if self.error_feedback else x.detach().to(torch.float32)
        n, c = x.numel(), self._chunks(x.numel())
        padded = torch.zeros(c * self.chunk, dtype=torch.float32)
        padded[:n] = x
        blocks = padded.view(c, self.chunk)
        scales = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        if self.error_feedback:
            _keep(self, x, x - (q.to(torch.float32) * scales[:, None]).reshape(-1)[:n], scales)
        out = torch.empty(4 * c + c * self.chunk, dtype=torch.uint8)
        out[: 4 * c] = scales.contiguous().view(torch.uint8)
        out[4 * c :] = q.reshape(-1).view(torch.uint8)
        return out

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        c = self._chunks(numel)
        scales = _scales(payload[: 4 * c], self.name)
        q = payload[4 * c :].view(torch.int8).to(torch.float32).view(c, self.chunk)
        return (q * scales[:, None]).reshape(-1)[:numel]


class LowBit(_WithResidual):
    """4, 2 or 1 bits an element, with error feedback: DiLoCo's pseudo-gradients, which
    cross between zones once a round, in 7.8, 15 or 28 times fewer bytes than float32
    (scales included).

    One float32 scale per chunk of `INT8_CHUNK` elements, then the levels, packed
    ``8 / bits`` to a byte. int4 has the 15 levels -7..7 of the chunk's largest magnitude;
    int2 the three -1, 0, 1 (ternary) of 1.5 times its mean magnitude, which for normally
    spread values is near the least-squares choice (the largest would round almost every
    element to 0); int1 the sign alone, times the mean magnitude (the scale that keeps the
    chunk's L1 mass; zero counts as positive). What a payload does not carry stays in the
    residual and goes with the next one.
    """

    def __init__(self, bits: int, chunk: int = INT8_CHUNK) -> None:
        if bits not in (1, 2, 4):
            raise ValueError(f"low-bit codecs have 1, 2 or 4 bits, not {bits}")
        if chunk < 1 or chunk * bits % 8:
            raise ValueError(f"a chunk of {chunk} elements does not fill whole bytes at {bits} bits")
        self.bits, self.chunk, self.name = bits, chunk, f"int{bits}"
        self.levels = (1 << (bits - 1)) - 1
        self.residual: torch.Tensor | None = None

    def _chunks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.chunk))

    def payload_bytes(self, numel: int) -> int:
        c = self._chunks(numel)
        return 4 * c + c * self.chunk * self.bits // 8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = _with_residual(self, x)
        n, c = x.numel(), self._chunks(x.numel())
        blocks = torch.zeros(c * self.chunk, dtype=torch.float32)
        blocks[:n] = x
        blocks = blocks.view(c, self.chunk)
        magnitude = blocks.abs()
        if self.levels > 1:
            scales = magnitude.amax(dim=1) / self.levels
        else:  # of the mean of the chunk's own elements (the last chunk is padded with zeros)
            real = torch.full((c,), float(self.chunk))
            real[-1] = n - (c - 1) * self.chunk
            scales = magnitude.sum(dim=1) / real * (1.5 if self.levels else 1.0)
        if self.levels:
            safe = torch.where(scales > 0, scales, torch.ones_like(scales))
            q = torch.round(blocks / safe[:, None]).clamp_(-self.levels, self.levels)
            u = (q + self.levels).to(torch.uint8)
        else:
            u = (blocks >= 0).to(torch.uint8)
            q = u.to(torch.float32) * 2 - 1
        _keep(self, x, x - (q * scales[:, None]).reshape(-1)[:n], scales)
        u = u.view(-1, 8 // self.bits)
        packed = torch.zeros(u.shape[0], dtype=torch.uint8)
        for k in range(8 // self.bits):
            packed |= u[:, k] << (k * self.bits)
        return torch.cat([scales.contiguous().view(torch.uint8), packed])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        c = self._chunks(numel)
        scales = _scales(payload[: 4 * c], self.name)
        packed = payload[4 * c :]
        mask = (1 << self.bits) - 1
        u = torch.stack([(packed >> (k * self.bits)) & mask for k in range(8 // self.bits)], dim=1)
        if self.levels and int(u.max()) > 2 * self.levels:
            raise ValueError(f"{self.name} payload has a level above {self.levels}")
        q = u.reshape(c, self.chunk).to(torch.float32)
        q = q - self.levels if self.levels else q * 2 - 1
        return (q * scales[:, None]).reshape(-1)[:numel]


class TopK(_WithResidual):
    """The largest-magnitude ``ratio`` of elements as (int32 index, float32 value) pairs, with
    error feedback: the elements not sent accumulate in the residual until they are large."""

    name = "topk"

    def __init__(self, ratio: float = TOPK_RATIO) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio = {ratio} must be in (0, 1]")
        self.ratio = ratio
        self.residual: torch.Tensor | None = None

    def k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(numel * self.ratio)))

    def payload_bytes(self, numel: int) -> int:
        return 8 * self.k(numel)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = _with_residual(self, x)
        k = self.k(x.numel())
        idx = torch.topk(x.abs(), k, sorted=False).indices.to(torch.int32)
        idx, _ = torch.sort(idx)  # a canonical order: equal inputs give equal payloads
        values = x[idx.long()]
        rest = x.clone()
        rest[idx.long()] = 0.0
        _keep(self, x, rest)
        out = torch.empty(8 * k, dtype=torch.uint8)
        out[: 4 * k] = idx.contiguous().view(torch.uint8)
        out[4 * k :] = values.contiguous().view(torch.uint8)
        return out

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        k = self.k(numel)
        idx = payload[: 4 * k].clone().view(torch.int32).long()
        values = payload[4 * k :].clone().view(torch.float32)
        if not all_finite(values):
            raise ValueError("top-k payload has values that are not finite")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
            raise ValueError(f"top-k payload names element {int(idx.max())} of a {numel}-element tensor")
        out = torch.zeros(numel, dtype=torch.float32)
        out[idx] = values
        return out


def _scales(raw: torch.Tensor, name: str) -> torch.Tensor:
    """A payload's float32 scales, refused unless finite and not negative (a peer's payload
    is checked before anything is computed from it)."""
    scales = raw.clone().view(torch.float32)
    if not all_finite(scales) or bool((scales < 0).any()):
        raise ValueError(f"{name} payload has scales that are negative or not finite")
    return scales


def _keep(
    codec: Int8 | LowBit | TopK, x: torch.Tensor, residual: torch.Tensor, scales: torch.Tensor | None = None
) -> None:
    """Carry ``residual`` into the next payload, unless this input was not finite, or so
    large that a chunk's ``scales`` overflowed: the step it belongs to is refused, and a NaN
    kept in the residual would spoil every later one."""
    finite = all_finite(x) and (scales is None or all_finite(scales))
    codec.residual = residual if finite else None


def _with_residual(codec: Int8 | LowBit | TopK, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().to(torch.float32).reshape(-1)
    r = codec.residual
    if r is not None and r.numel() == x.numel():
        return x + r
    return x.clone()


def make_codec(spec: CodecSpec | str) -> Codec:
    """The codec a `CodecSpec` names, or its text: ``none``, ``fp16``, ``bf16``, ``int8``,
    ``int4``, ``int2``, ``int1``, ``topk`` or ``topk:RATIO`` (e.g. ``topk:0.05``; raises
    ValueError for another)."""
    parsed = CodecSpec.parse(spec) if isinstance(spec, str) else spec
    name, ratio = parsed.name, parsed.ratio
    if name == "none":
        return Identity()
    if name in ("fp16", "bf16"):
        return HalfPrecision(torch.float16 if name == "fp16" else torch.bfloat16)
    if name == "int8":
        return Int8()
    if name in ("int4", "int2", "int1"):
        return LowBit(int(name[3:]))
    return TopK(ratio)


def reduce_payloads(codec: Codec, payloads: list[torch.Tensor], numel: int) -> torch.Tensor:
    """Decode every rank's payload and sum in rank order, in float32."""
    total = torch.zeros(numel, dtype=torch.float32)
    for p in payloads:
        total += codec.decode(p, numel)
    return total
