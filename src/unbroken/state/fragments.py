"""Erasure-coded checkpoints: k data and m parity fragments over the nodes' own disks.

Every replica holds the same state, so no fragment crosses the network: each node encodes
the whole committed state with `zfec` (Reed-Solomon over GF(2^8)) and keeps only its own
fragments (index i goes to the node of rank i mod n). Any k of the k+m fragments rebuild
the state, so the job survives losing the disks of m nodes. A manifest beside every
fragment lists the checksum (xxh3-128: bit rot, not forgery, is what it is for; whoever can
write a disk can rewrite its manifest too) of each fragment and of the whole: a corrupt or truncated
fragment is detected and the state rebuilt from the others.

The bytes must be identical on every node, so the state is packed here deterministically
(a JSON header describing the tree, then each tensor's bytes in tree order; no pickle, no
timestamps), without the RNG states (each process draws its own numbers) and without
node-local state (codec residuals).

    unbroken restore --from /disk/node1/ckpt --from /disk/node2/ckpt ... --to /shared/ckpt

rebuilds the newest step that has k good fragments into a plain checkpoint that any
number of nodes started with ``--checkpoint-dir /shared/ckpt`` resume from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
import zfec
from zfec import easyfec

from unbroken.errors import TransferError
from unbroken.state import layout

MAGIC = b"UBPACK01"
_MANIFEST = re.compile(r"^frag-(\d{9})\.json$")
KEEP = 3
"""Fragment sets kept per directory (older ones are deleted)."""
HASH = "xxh3-128"
"""The checksum of new manifests: 20x faster than SHA-256 on a state of hundreds of MB."""


# ---------------------------------------------------------------- deterministic packing


def pack(tree: Any) -> bytes:
    """Tensors, dicts (any key order: sorted), lists, tuples and JSON scalars, deterministically."""
    buf, size = pack_into(tree)
    return bytes(buf[:size])


def pack_into(tree: Any, pad_to: int = 1) -> tuple[bytearray, int]:
    """`pack` into a new buffer zero-padded to a multiple of ``pad_to``, and the packed size.

    The tensors are copied by torch, which lets go of the GIL: a checkpoint being packed on
    a background thread does not hold up the step loop (``bytes.join`` would, for as long as
    it takes to copy hundreds of MB)."""
    header, tensors = layout.split(tree)
    head = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    size = 16 + len(head) + sum(layout.byte_view(t).numel() for t in tensors)
    buf = bytearray(-(-size // pad_to) * pad_to)
    buf[:16] = MAGIC + struct.pack("<Q", len(head))
    buf[16 : 16 + len(head)] = head
    out = torch.frombuffer(buf, dtype=torch.uint8)
    at = 16 + len(head)
    for t in tensors:
        b = layout.byte_view(t)
        out[at : at + b.numel()].copy_(b)
        at += b.numel()
    return buf, size


def unpack(blob: bytes) -> Any:
    if blob[:8] != MAGIC:
        raise TransferError("not a packed state (bad magic)")
    (n,) = struct.unpack("<Q", blob[8:16])
    header = json.loads(blob[16 : 16 + n])
    offset = 16 + n
    tensors = []
    for slot in layout.slots(header):
        raw = bytearray(blob[offset : offset + slot.nbytes])
        if len(raw) != slot.nbytes:
            raise TransferError("packed state is truncated")
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors.append(flat.view(slot.dtype).reshape(slot.shape))
        offset += slot.nbytes
    return layout.join(header, tensors)


# ---------------------------------------------------------------- fragments


@dataclass(frozen=True)
class Manifest:
    step: int
    k: int
    m: int
    size: int
    """Length of the packed state in bytes."""
    checksum: str
    """Of the packed state."""
    fragments: tuple[str, ...]
    """The checksum of each of the k + m fragments."""
    digest: str
    """The state's replica digest (what the nodes compared when it was committed)."""
    hash: str = "sha256"
    """How the checksums were computed (``xxh3-128``; ``sha256`` in older manifests)."""


def encode(blob: bytes | bytearray, k: int, m: int) -> list[bytes | memoryview]:
    """The k data blocks (``blob`` cut in k, the last zero-padded) and m parity blocks. A
    blob already a multiple of k long is cut without copying (zfec encodes without the GIL)."""
    if len(blob) % k:
        blob = bytes(blob) + bytes(k - len(blob) % k)
    size = len(blob) // k
    view = memoryview(blob)
    return list(zfec.Encoder(k, k + m).encode([view[i * size : (i + 1) * size] for i in range(k)]))


def decode(blocks: dict[int, bytes], k: int, m: int, size: int) -> bytes:
    if len(blocks) < k:
        raise TransferError(f"{len(blocks)} good fragments, {k} needed")
    nums = sorted(blocks)[:k]
    pad = (k - size % k) % k
    return bytes(easyfec.Decoder(k, k + m).decode([blocks[i] for i in nums], nums, pad))


def write_fragments(
    directory: Path, snap: dict[str, Any], k: int, m: int, mine: Sequence[int], digest: str
) -> Manifest:
    """Encode a captured state and write the fragments ``mine`` (and the manifest) atomically."""
    padded, size = pack_into({key: v for key, v in snap.items() if key not in ("rng", "local")}, pad_to=k)
    blocks = encode(padded, k, m)
    manifest = Manifest(
        step=int(snap["step"]),
        k=k,
        m=m,
        size=size,
        checksum=_checksum(HASH, memoryview(padded)[:size]),
        fragments=tuple(_checksum(HASH, b) for b in blocks),
        digest=digest,
        hash=HASH,
    )
    directory.mkdir(parents=True, exist_ok=True)
    for i in mine:
        _atomic(directory / f"frag-{manifest.step:09d}.{i:03d}", blocks[i])
    _atomic(directory / f"frag-{manifest.step:09d}.json", json.dumps(manifest.__dict__).encode())
    _prune(directory)
    return manifest


def rebuild(directories: Iterable[Path], step: int | None = None) -> tuple[dict[str, Any], Manifest, list[str]]:
    """The newest state (or ``step``) that k good fragments in ``directories`` rebuild, its
    manifest, and what was wrong on the way (corrupt or missing fragments)."""
    manifests: dict[int, Manifest] = {}
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
                    manifests.setdefault(int(mt.group(1)), Manifest(**{**raw, "fragments": tuple(raw["fragments"])}))
                except (OSError, ValueError, TypeError):
                    continue
            elif p.name.startswith("frag-") and p.suffix[1:].isdigit():
                s, i = int(p.name[5:14]), int(p.suffix[1:])
                found.setdefault(s, {}).setdefault(i, []).append(p)
    notes: list[str] = []
    for s in sorted(manifests, reverse=True):
        if step is not None and s != step:
            continue
        man = manifests[s]
        good: dict[int, bytes] = {}
        for i, paths in sorted(found.get(s, {}).items()):
            for p in paths:
                data = p.read_bytes()
                if i < len(man.fragments) and _checksum(man.hash, data) == man.fragments[i]:
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


def _checksum(algo: str, data: bytes | bytearray | memoryview) -> str:
    if algo == "xxh3-128":
        return str(xxhash.xxh3_128(data).hexdigest())
    if algo == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise TransferError(f"unknown checksum {algo!r} in a fragment manifest")


def _atomic(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(directory: Path) -> None:
    steps = sorted({int(mt.group(1)) for p in directory.iterdir() if (mt := _MANIFEST.match(p.name))})
    for s in steps[:-KEEP]:
        for p in directory.glob(f"frag-{s:09d}.*"):
            p.unlink(missing_ok=True)
