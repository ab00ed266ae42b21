"""Erasure-coded checkpoints: k data and m parity fragments over the nodes' own disks.

Every replica holds the same state, so no fragment crosses the network: each node encodes
the whole committed state with `zfec` (Reed-Solomon over GF(2^8)) and keeps only its own
fragments (index i goes to the node of rank i mod n). Any k of the k+m fragments rebuild
the state, so the job survives losing the disks of m nodes. A manifest beside every
fragment lists the checksum (xxh3-128: bit rot, not forgery, is what it is for; whoever can
write a disk can rewrite its manifest too) of each fragment and of the whole: a corrupt or truncated
fragment is detected and the state rebuilt from the others.

The bytes must be identical on every node, so the state is packed here deterministically
(a JSON header describing the tree, then each tensor's bytes in tree order at aligned
offsets; no pickle, no timestamps), without the RNG states (each process draws its own
numbers) and without node-local state (codec residuals). A node computes only the parity
it keeps, and writes its fragments from the packed buffer by direct I/O (`directio`).

    unbroken restore --from /disk/node1/ckpt --from /disk/node2/ckpt ... --to /shared/ckpt

rebuilds the newest step that has k good fragments into a plain checkpoint that any
number of nodes started with ``--checkpoint-dir /shared/ckpt`` resume from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash
import zfec
from zfec import easyfec

from unbroken.errors import TransferError
from unbroken.state import directio, layout

MAGIC = b"UBPACK01"
"""The first packed form: tensors back to back after the header (still read)."""
ALIGNED = b"UBPACK02"
"""The packed form written now: the header, then each tensor at a 64-byte-aligned offset
from the first page boundary after it (zeros between), so a capture copies straight into
it (`Packed`) and its blocks go to the disk by direct I/O."""
ALIGN = 64
"""Where a tensor of a packed buffer may start (any dtype's alignment divides it)."""
_MANIFEST = re.compile(r"^frag-(\d{9})\.json$")
KEEP = 3
"""Fragment sets kept per directory (older ones are deleted)."""
HASH = "xxh3-128"
"""The checksum of new manifests: 20x faster than SHA-256 on a state of hundreds of MB."""
SHARED_ONLY = ("rng", "local")
"""What a fragment leaves out of a state: each process's own random streams, node-local state."""


def shared(tree: dict[str, Any]) -> dict[str, Any]:
    """What fragments hold of a state: all but `SHARED_ONLY`."""
    return {key: v for key, v in tree.items() if key not in SHARED_ONLY}


# ---------------------------------------------------------------- deterministic packing


def _head(header: Any) -> bytes:
    return json.dumps(header, separators=(",", ":"), allow_nan=True).encode()


def _offsets(start: int, slots: Sequence[layout.Slot]) -> tuple[list[int], int]:
    """Where each tensor of the aligned form starts, and the packed size."""
    offsets, at = [], start
    for slot in slots:
        offsets.append(at)
        at += directio.round_up(slot.nbytes, ALIGN)
    return offsets, at


class Packed:
    """A state in the aligned packed form, in a page-aligned buffer kept from one checkpoint
    to the next: a capture copies into its tensor views (`fill`), and its fragments are cut
    from the buffer as it is (the buffer is padded to ``k`` whole-page blocks)."""

    def __init__(self, header: Any, k: int) -> None:
        self.slots = layout.slots(header)
        self.k = k
        self.start = directio.pages(16 + len(_head(header)))
        offsets, self.size = _offsets(self.start, self.slots)
        self.block = directio.pages(-(-self.size // k))
        """Bytes per fragment: whole pages."""
        self.buffer = directio.buffer(self.block * k)
        self.step = 0
        """The step of the state last filled in."""
        self.views = [
            torch.frombuffer(self.buffer, dtype=torch.uint8, count=s.nbytes, offset=at).view(s.dtype).view(s.shape)
            if s.nbytes
            else torch.empty(s.shape, dtype=s.dtype)
            for s, at in zip(self.slots, offsets, strict=True)
        ]

    @classmethod
    def of(cls, tree: Any, k: int = 1) -> Packed:
        """``tree`` packed (copied) into a new buffer."""
        header, tensors = layout.split(tree)
        packed = cls(header, k)
        packed.fill(header, tensors)
        return packed

    def fits(self, header: Any, k: int) -> bool:
        return (
            k == self.k and directio.pages(16 + len(_head(header))) == self.start and layout.slots(header) == self.slots
        )

    def fill(self, header: Any, tensors: Sequence[torch.Tensor]) -> Any:
        """``header`` and ``tensors`` (copied) in this buffer; the tree of its views."""
        head = _head(header)
        memory = memoryview(self.buffer)
        memory[:16] = ALIGNED + struct.pack("<Q", len(head))
        memory[16 : 16 + len(head)] = head
        memory[16 + len(head) : self.start] = bytes(self.start - 16 - len(head))
        for dst, src in zip(self.views, tensors, strict=True):
            dst.copy_(src)
        tree = layout.join(header, self.views)
        self.step = int(tree["step"]) if isinstance(tree, dict) and "step" in tree else 0
        return tree

    def blob(self) -> bytes:
        return bytes(memoryview(self.buffer)[: self.size])


def pack(tree: Any) -> bytes:
    """Tensors, dicts (any key order: sorted), lists, tuples and JSON scalars, deterministically."""
    return Packed.of(tree).blob()


def unpack(blob: bytes | bytearray | memoryview) -> Any:
    blob = memoryview(blob)
    magic = bytes(blob[:8])
    if magic not in (MAGIC, ALIGNED):
        raise TransferError("not a packed state (bad magic)")
    (n,) = struct.unpack("<Q", blob[8:16])
    header = json.loads(bytes(blob[16 : 16 + n]))
    slots = layout.slots(header)
    if magic == ALIGNED:
        offsets, _ = _offsets(directio.pages(16 + n), slots)
    else:
        offsets = list(itertools.accumulate((s.nbytes for s in slots[:-1]), initial=16 + n))
    tensors = []
    for slot, at in zip(slots, offsets, strict=True):
        raw = bytearray(blob[at : at + slot.nbytes])
        if len(raw) != slot.nbytes:
            raise TransferError("packed state is truncated")
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors.append(flat.view(slot.dtype).reshape(slot.shape))
    return layout.join(header, tensors)


# ---------------------------------------------------------------- fragments


@dataclasses.dataclass(frozen=True)
class Manifest:
    step: int
    k: int
    m: int
    size: int
    """Length of the packed state in bytes."""
    checksum: str
    """Of the packed state."""
    fragments: tuple[str, ...]
    """The checksum of each of the k + m fragments ("" for a parity fragment its node did
    not compute: each node computes only the parity it keeps; `rebuild` merges manifests)."""
    digest: str
    """The state's replica digest (what the nodes compared when it was committed)."""
    hash: str = "sha256"
    """How the checksums were computed (``xxh3-128``; ``sha256`` in older manifests)."""


def encode(
    blob: bytes | bytearray | memoryview, k: int, m: int, wanted: Sequence[int] | None = None
) -> list[bytes | memoryview]:
    """The k data blocks (``blob`` cut in k, the last zero-padded) and m parity blocks, or
    only the ``wanted`` ones (in that order). A blob already a multiple of k long is cut
    without copying (zfec encodes without the GIL); with k = 1 every block is the blob
    itself (the code is a repetition: nothing to compute)."""
    if len(blob) % k:
        blob = bytes(blob) + bytes(k - len(blob) % k)
    size = len(blob) // k
    view = memoryview(blob)
    data = [view[i * size : (i + 1) * size] for i in range(k)]
    nums = list(range(k + m)) if wanted is None else list(wanted)
    parity = sorted({i for i in nums if i >= k})
    if k == 1:
        return [data[0] for _ in nums]
    made = dict(zip(parity, zfec.Encoder(k, k + m).encode(data, tuple(parity)), strict=True)) if parity else {}
    return [data[i] if i < k else made[i] for i in nums]


def decode(blocks: dict[int, bytes], k: int, m: int, size: int) -> bytes:
    """The blob of ``size`` bytes back from any k of its blocks (however far they were padded)."""
    if len(blocks) < k:
        raise TransferError(f"{len(blocks)} good fragments, {k} needed")
    nums = sorted(blocks)[:k]
    pad = k * len(blocks[nums[0]]) - size
    return bytes(easyfec.Decoder(k, k + m).decode([blocks[i] for i in nums], nums, pad))


def write_fragments(
    directory: Path,
    state: dict[str, Any] | Packed,
    k: int,
    m: int,
    mine: Sequence[int],
    digest: str,
    direct: bool = True,
) -> Manifest:
    """Write the fragments ``mine`` of a captured state (or of one already `Packed` for k),
    and the manifest, atomically (``direct``: past the page cache, `directio`). Only the
    parity this node keeps is computed; the manifest has the checksums of every data
    fragment and of the fragments written here."""
    packed = state if isinstance(state, Packed) else Packed.of(shared(state), k)
    if packed.k != k:
        raise ValueError(f"a state packed for {packed.k} data fragments cannot be cut into {k}")
    memory = memoryview(packed.buffer)[: packed.block * k]
    wanted = sorted({*range(k), *mine})
    blocks = dict(zip(wanted, encode(memory, k, m, wanted), strict=True))
    manifest = Manifest(
        step=packed.step,
        k=k,
        m=m,
        size=packed.size,
        checksum=_checksum(HASH, memory[: packed.size]),
        fragments=tuple(_checksum(HASH, blocks[i]) if i in blocks else "" for i in range(k + m)),
        digest=digest,
        hash=HASH,
    )
    directory.mkdir(parents=True, exist_ok=True)
    for i in mine:
        _atomic(directory / f"frag-{manifest.step:09d}.{i:03d}", blocks[i], direct)
    _atomic(directory / f"frag-{manifest.step:09d}.json", json.dumps(manifest.__dict__).encode())
    _prune(directory)
    return manifest


def rebuild(directories: Iterable[Path], step: int | None = None) -> tuple[dict[str, Any], Manifest, list[str]]:
    """The newest state (or ``step``) that k good fragments in ``directories`` rebuild, its
    manifest, and what was wrong on the way (corrupt or missing fragments)."""
    manifests: dict[int, list[Manifest]] = {}
    found: dict[int, dict[int, list[Path]]] = {}
    for d in directories:
        if not d.is_dir():
            continue
        for p in d.iterdir():
            mt = _MANIFEST.match(p.name)
            if mt:
                try:
                    raw = json.loads(p.read_text())
                    if "sha256" in raw:  # written before the checksum became xxh3
                        raw["checksum"], raw["hash"] = raw.pop("sha256"), "sha256"
                    man = Manifest(**{**raw, "fragments": tuple(raw["fragments"])})
                    if len(man.fragments) != man.k + man.m:
                        raise ValueError("a checksum for each fragment")
                    manifests.setdefault(int(mt.group(1)), []).append(man)
                except (OSError, ValueError, TypeError):
                    continue
            elif p.name.startswith("frag-") and p.suffix[1:].isdigit():
                s, i = int(p.name[5:14]), int(p.suffix[1:])
                found.setdefault(s, {}).setdefault(i, []).append(p)
    notes: list[str] = []
    candidates = [(at, man) for at in sorted(manifests, reverse=True) for man in _agreed(manifests[at])]
    for s, man in candidates:
        if step is not None and s != step:
            continue
        good: dict[int, bytes] = {}
        for i, paths in sorted(found.get(s, {}).items()):
            for p in paths:
                if i >= len(man.fragments) or not man.fragments[i]:
                    notes.append(f"{p}: no manifest found lists its checksum, ignored")
                    continue
                data = p.read_bytes()
                if _checksum(man.hash, data) == man.fragments[i]:
                    good[i] = data
                    break
                notes.append(f"{p}: checksum mismatch (corrupt), ignored")
        if len(good) < man.k:
            notes.append(f"step {s}: {len(good)} good fragments of {man.k + man.m}, {man.k} needed")
            continue
        blob = decode(good, man.k, man.m, man.size)
        if _checksum(man.hash, blob) != man.checksum:
            notes.append(f"step {s}: rebuilt state fails its checksum")
            continue
        return unpack(blob), man, notes
    raise TransferError("no checkpoint can be rebuilt: " + ("; ".join(notes) or "no fragments found"))


def _agreed(found: list[Manifest]) -> list[Manifest]:
    """One step's manifests from several nodes, as one per state they describe (the state
    most of them describe first), each with the fragment checksums any of them knows (a
    node lists only the parity it computed)."""
    groups: dict[tuple[Any, ...], list[Manifest]] = {}
    for man in found:
        groups.setdefault((man.k, man.m, man.size, man.checksum, man.hash, man.digest), []).append(man)
    merged = []
    for same in sorted(groups.values(), key=len, reverse=True):
        known = tuple(next((c for c in column if c), "") for column in zip(*(m.fragments for m in same), strict=True))
        merged.append(dataclasses.replace(same[0], fragments=known))
    return merged


def _checksum(algo: str, data: bytes | bytearray | memoryview) -> str:
    if algo == "xxh3-128":
        return str(xxhash.xxh3_128(data).hexdigest())
    if algo == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise TransferError(f"unknown checksum {algo!r} in a fragment manifest")


def _atomic(path: Path, data: bytes | memoryview, direct: bool = False) -> None:
    tmp = directio.temp_path(path)
    try:
        directio.write_file(tmp, data, direct)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            tmp.unlink(missing_ok=True)
        raise


def _prune(directory: Path) -> None:
    steps = sorted({int(mt.group(1)) for p in directory.iterdir() if (mt := _MANIFEST.match(p.name))})
    for s in steps[:-KEEP]:
        for p in directory.glob(f"frag-{s:09d}.*"):
            p.unlink(missing_ok=True)
