"""Erasure-coded checkpoints: k data and m parity fragments over the nodes' own disks.

Every replica holds the same state, so no fragment crosses the network: each node encodes
the whole committed state with `zfec` (Reed-Solomon over GF(2^8)) and keeps only its own
fragments (index i goes to the node of rank i mod n). Any k of the k+m fragments rebuild
the state, so the job survives losing the disks of m nodes. A manifest beside every
fragment lists the checksum (xxh3-128: bit rot, not forgery, is what it is for; whoever can
write a disk can rewrite its manifest too) of each fragment and of the whole: a corrupt or truncated
fragment is detected and the state rebuilt from the others. A manifest is checked field by
field before it is believed (`read_manifest`): one that is not a manifest, or describes a
code zfec cannot decode or fragments unlike the files present, is skipped with a note, as a
corrupt checkpoint is, and older ones are tried.

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

import dataclasses
import errno
import hashlib
import itertools
import json
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
MAX_FRAGMENTS = 256
"""k + m at most: zfec's Reed-Solomon code is over GF(2^8)."""
MANIFEST_MAX = 1 << 20
"""Bytes a manifest may have (256 checksums and a few fields take under 40 kB)."""
HASHES = ("xxh3-128", "sha256")
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
        directio.write_file(directory / f"frag-{manifest.step:09d}.{i:03d}", blocks[i], direct)
    directio.write_file(directory / f"frag-{manifest.step:09d}.json", json.dumps(manifest.__dict__).encode(), False)
    _prune(directory)
    return manifest


class NotRebuilt(TransferError):
    """No state can be rebuilt from the fragments found; ``notes`` says what was wrong with
    each, and ``corrupt`` whether everything found was corrupt (a manifest that is not one, a
    fragment that fails its checksum), not merely short of fragments (a node's own disk
    holds only its fragments: the others are on their disks)."""

    def __init__(self, notes: list[str], corrupt: bool) -> None:
        super().__init__("no checkpoint can be rebuilt: " + ("; ".join(notes) or "no fragments found"))
        self.notes, self.corrupt = notes, corrupt


def _count(raw: dict[str, Any], name: str, least: int, most: int | None = None) -> int:
    value = raw.get(name)
    if type(value) is not int:  # bool is an int to isinstance
        raise ValueError(f"{name} is {type(value).__name__} {value!r:.40}, not an integer")
    if value < least or (most is not None and value > most):
        raise ValueError(f"{name} = {value} is out of range [{least}, {'...' if most is None else most}]")
    return value


def _text(raw: dict[str, Any], name: str) -> str:
    value = raw.get(name)
    if not isinstance(value, str) or len(value) > 256:
        raise ValueError(f"{name} is {type(value).__name__} {value!r:.40}, not a checksum")
    return value


def read_manifest(path: Path) -> Manifest:
    """The manifest in ``path`` (``frag-<step>.json``), every field checked: the step of its
    name, 1 <= k, 0 <= m, k + m <= 256 (zfec's limit), a checksum for each fragment, a
    known checksum algorithm, nothing else.

    Raises:
        ValueError: it is not such a manifest (the message says why).
        OSError: it cannot be read (a link: not followed).
    """
    mt = _MANIFEST.match(path.name)
    if mt is None:
        raise ValueError("not named frag-<step>.json")
    raw = json.loads(directio.read_file(path, MANIFEST_MAX))
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON {type(raw).__name__}, not an object")
    if "sha256" in raw:  # written before the checksum became xxh3
        raw["checksum"], raw["hash"] = raw.pop("sha256"), "sha256"
    fields = {f.name for f in dataclasses.fields(Manifest)}
    if unknown := sorted(set(raw) - fields):
        raise ValueError(f"unknown fields {', '.join(map(str, unknown))[:200]}")
    if missing := sorted(fields - set(raw) - {"hash"}):
        raise ValueError(f"missing {', '.join(missing)}")
    step = _count(raw, "step", 0)
    if step != int(mt.group(1)):
        raise ValueError(f"it describes step {step}, its name step {int(mt.group(1))}")
    k = _count(raw, "k", 1, MAX_FRAGMENTS)
    m = _count(raw, "m", 0, MAX_FRAGMENTS - k)
    size = _count(raw, "size", 0)
    hash_ = raw.get("hash", "sha256")
    if hash_ not in HASHES:
        raise ValueError(f"hash {hash_!r:.40} is none of {', '.join(HASHES)}")
    fragments = raw["fragments"]
    if not isinstance(fragments, list) or len(fragments) != k + m:
        raise ValueError(f"fragments is not a list of k + m = {k + m} checksums")
    if not all(isinstance(c, str) and len(c) <= 256 for c in fragments):
        raise ValueError("fragments holds something other than checksums")
    return Manifest(
        step=step,
        k=k,
        m=m,
        size=size,
        checksum=_text(raw, "checksum"),
        fragments=tuple(fragments),
        digest=_text(raw, "digest"),
        hash=hash_,
    )


def _block_bytes(man: Manifest) -> tuple[int, int]:
    """The fewest and most bytes one fragment of ``man`` has: its share of the state, padded
    at most to whole pages (`Packed`; the first packed form padded to k only)."""
    least = -(-man.size // man.k)
    return least, directio.pages(least)


def rebuild(directories: Iterable[Path], step: int | None = None) -> tuple[dict[str, Any], Manifest, list[str]]:
    """The newest state (or ``step``) that k good fragments in ``directories`` rebuild, its
    manifest, and what was wrong on the way (invalid manifests, corrupt or missing fragments).

    Raises:
        NotRebuilt: no state can be rebuilt (its notes say why, step by step).
    """
    manifests: dict[int, list[Manifest]] = {}
    found: dict[int, dict[int, list[Path]]] = {}
    notes: list[str] = []
    corrupt = short = 0
    for d in directories:
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if _MANIFEST.match(p.name):
                try:
                    man = read_manifest(p)
                except (OSError, ValueError) as exc:
                    notes.append(f"{p}: not a valid fragment manifest ({_why(exc)}), ignored")
                    corrupt += 1
                    continue
                manifests.setdefault(man.step, []).append(man)
            elif p.name.startswith("frag-") and p.suffix[1:].isdigit() and p.name[5:14].isdigit():
                s, i = int(p.name[5:14]), int(p.suffix[1:])
                found.setdefault(s, {}).setdefault(i, []).append(p)
    candidates = [(at, man) for at in sorted(manifests, reverse=True) for man in _agreed(manifests[at])]
    for s, man in candidates:
        if step is not None and s != step:
            continue
        least, most = _block_bytes(man)
        good: dict[int, bytes] = {}
        bad_here = 0
        for i, paths in sorted(found.get(s, {}).items()):
            for p in paths:
                if i >= len(man.fragments) or not man.fragments[i]:
                    notes.append(f"{p}: no manifest found lists its checksum, ignored")
                    continue
                try:
                    data = directio.read_file(p, most)
                except OSError as exc:
                    notes.append(f"{p}: cannot be read ({_why(exc)}), ignored")
                    bad_here += 1
                    continue
                if not least <= len(data) <= most:
                    notes.append(f"{p}: {len(data):,} bytes, not the {least:,} to {most:,} its manifest says, ignored")
                    bad_here += 1
                elif _checksum(man.hash, data) == man.fragments[i]:
                    if good and len(data) != len(next(iter(good.values()))):
                        notes.append(f"{p}: not as long as the other fragments of step {s}, ignored")
                        bad_here += 1
                        continue
                    good[i] = data
                    break
                else:
                    notes.append(f"{p}: checksum mismatch (corrupt), ignored")
                    bad_here += 1
        if len(good) < man.k:
            notes.append(f"step {s}: {len(good)} good fragments of {man.k + man.m}, {man.k} needed")
            # Corrupt where the corrupt ones would have made up k; short of fragments
            # otherwise (a node's own disk holds its fragments only: the others are elsewhere).
            corrupt, short = (corrupt + 1, short) if len(good) + bad_here >= man.k else (corrupt, short + 1)
            continue
        try:
            blob = decode(good, man.k, man.m, man.size)
            if _checksum(man.hash, blob) != man.checksum:
                raise TransferError("the rebuilt state fails its checksum")
            return unpack(blob), man, notes
        except Exception as exc:  # zfec's, json's or torch's error on bytes a manifest vouched for
            notes.append(f"step {s}: cannot be rebuilt ({_why(exc)})")
            corrupt += 1
    raise NotRebuilt(notes, corrupt=corrupt > 0 and short == 0)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return "a symbolic link: not followed"
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else 'no detail'}"


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


def _prune(directory: Path) -> None:
    """Delete the fragment sets older than the `KEEP` newest whose manifest is valid: a
    manifest that is not one is not counted, so it never pushes out a good set (it is left
    in place with its fragments: `rebuild` skips it, with a note that names it)."""
    valid = []
    for p in directory.iterdir():
        if (mt := _MANIFEST.match(p.name)) is None:
            continue
        try:
            read_manifest(p)
        except (OSError, ValueError):
            continue
        valid.append(int(mt.group(1)))
    for s in sorted(set(valid))[:-KEEP]:
        for p in directory.glob(f"frag-{s:09d}.*"):
            p.unlink(missing_ok=True)
