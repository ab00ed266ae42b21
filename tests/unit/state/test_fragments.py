"""Erasure-coded checkpoints: deterministic packing, any k of k+m fragments rebuild the state,
corrupt fragments are detected and routed around."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from unbroken.errors import ConfigError, TransferError
from unbroken.specs import parse_fragments
from unbroken.state.fragments import (
    Packed,
    decode,
    encode,
    pack,
    rebuild,
    unpack,
    write_fragments,
)
from unbroken.state.snapshot import TrainState


def trained_state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    state = TrainState(model, torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99)))
    for _ in range(3):
        state.optimizer.zero_grad()
        model(torch.randn(8, 6)).square().mean().backward()
        state.optimizer.step()
    state.step, state.cursor = 3, 24
    return state


def spread(tmp_path: Path, k: int, m: int, names: str = "n") -> tuple[list[Path], str, dict[str, Any]]:
    """Every one of k + m nodes writes its own fragment of one trained state to its disk."""
    state = trained_state()
    snap, digest = state.capture(), state.digest()
    disks = [tmp_path / f"{names}{i}" for i in range(k + m)]
    for rank, disk in enumerate(disks):
        write_fragments(disk, snap, k, m, [rank], digest)
    return disks, digest, snap


def test_packing_is_deterministic_and_round_trips() -> None:
    a, b = trained_state(), trained_state()
    snap_a = {k: v for k, v in a.capture().items() if k != "rng"}
    snap_b = {k: v for k, v in b.capture().items() if k != "rng"}
    assert pack(snap_a) == pack(snap_b)  # two replicas, the same bytes
    back = unpack(pack(snap_a))
    c = trained_state(seed=1)
    c.model.load_state_dict(back["model"])
    c.optimizer.load_state_dict(back["optimizer"])
    c.step, c.cursor = back["step"], back["cursor"]
    assert c.digest() == a.digest()


def test_packing_keeps_types_and_odd_values() -> None:
    tree = {2: (1.5, float("inf")), "x": [None, True, "s", torch.arange(3, dtype=torch.int64)], 1: torch.empty(0)}
    back = unpack(pack(tree))
    assert back[2] == (1.5, float("inf")) and back["x"][:3] == [None, True, "s"]
    assert torch.equal(back["x"][3], tree["x"][3]) and back[1].numel() == 0


@pytest.mark.parametrize("k", [1, 3, 7])
def test_a_state_packed_for_k_fragments_is_the_same_bytes_cut_in_whole_pages(k: int) -> None:
    snap = {key: v for key, v in trained_state().capture().items() if key != "rng"}
    packed = Packed.of(snap, k)
    blob = pack(snap)
    buf = memoryview(packed.buffer)
    assert packed.size == len(blob) and bytes(buf[: packed.size]) == blob and not any(buf[packed.size :])
    assert packed.block % 4096 == 0 and len(buf) == packed.block * k
    blocks = encode(buf, k, 2)
    assert all(len(b) == packed.block for b in blocks)
    assert decode(dict(enumerate(blocks[-k:], start=2)), k, 2, len(blob)) == blob
    assert [bytes(b) for b in encode(buf, k, 2, [k + 1, 0])] == [bytes(blocks[k + 1]), bytes(blocks[0])]


def test_a_packed_buffer_is_reused_for_a_state_of_the_same_layout() -> None:
    state = trained_state()
    snap = {key: v for key, v in state.capture().items() if key != "rng"}
    from unbroken.state import layout

    header, tensors = layout.split(snap)
    packed = Packed(header, 2)
    packed.fill(header, tensors)
    first = pack(snap)
    state.step, state.cursor = 123456, 987654  # a longer header, the same pages
    later = {key: v for key, v in state.capture().items() if key != "rng"}
    later_header, later_tensors = layout.split(later)
    assert packed.fits(later_header, 2) and not packed.fits(later_header, 3)
    tree = packed.fill(later_header, [t + 1 if t.is_floating_point() else t for t in later_tensors])
    assert packed.blob() != first and tree["step"] == 123456 == packed.step
    assert packed.blob() == Packed.of(layout.join(later_header, tree_tensors(tree))).blob()
    state.step, state.cursor = 3, 24  # a shorter header again: the same bytes as packed afresh
    again = {key: v for key, v in state.capture().items() if key != "rng"}
    h, t = layout.split(again)
    assert packed.fits(h, 2)
    packed.fill(h, t)
    assert packed.blob() == pack(again) == first


def tree_tensors(tree: Any) -> list[torch.Tensor]:
    from unbroken.state import layout

    return layout.split(tree)[1]


def test_a_state_packed_back_to_back_before_alignment_still_unpacks() -> None:
    import json
    import struct

    from unbroken.state import layout

    tree = {"step": 4, "w": torch.arange(5, dtype=torch.float32), "n": torch.tensor([1, 2], dtype=torch.int16)}
    header, tensors = layout.split(tree)
    head = json.dumps(header, separators=(",", ":")).encode()
    blob = b"UBPACK01" + struct.pack("<Q", len(head)) + head + b"".join(t.numpy().tobytes() for t in tensors)
    back = unpack(blob)
    assert back["step"] == 4 and torch.equal(back["w"], tree["w"]) and torch.equal(back["n"], tree["n"])
    blocks = encode(blob, 3, 1)  # fragments of it, padded to k as they were
    assert decode({1: blocks[1], 2: blocks[2], 3: blocks[3]}, 3, 1, len(blob)) == blob


def test_the_state_most_manifests_describe_is_rebuilt_and_a_malformed_manifest_is_ignored(tmp_path: Path) -> None:
    import json

    disks, _, _ = spread(tmp_path, 2, 1)
    manifest = disks[0] / "frag-000000003.json"
    raw = json.loads(manifest.read_text())
    raw["checksum"] = "0" * 32  # one node's manifest describes another state
    manifest.write_text(json.dumps(raw))
    short = disks[1] / "frag-000000003.json"
    raw = json.loads(short.read_text())
    raw["fragments"] = raw["fragments"][:1]
    short.write_text(json.dumps(raw))
    _, man, _ = rebuild(disks)
    assert man.step == 3 and man.checksum != "0" * 32


@pytest.mark.parametrize(("k", "m"), [(1, 0), (3, 2), (2, 3), (4, 1)])
def test_any_k_fragments_rebuild_the_blob(k: int, m: int) -> None:
    blob = bytes(range(256)) * 7 + b"tail"
    blocks = encode(blob, k, m)
    assert len(blocks) == k + m
    for chosen in itertools.combinations(range(k + m), k):
        assert decode({i: blocks[i] for i in chosen}, k, m, len(blob)) == blob
    with pytest.raises(TransferError, match="needed"):
        decode({i: blocks[i] for i in range(k - 1)}, k, m, len(blob))


def test_five_disks_two_lost_one_corrupt_byte_still_restores_bit_identical(tmp_path: Path) -> None:
    disks, digest, snap = spread(tmp_path, 3, 2, names="node")
    for disk in disks[:2]:  # two nodes' disks are gone
        for p in disk.iterdir():
            p.unlink()
    frag = next(p for p in disks[2].iterdir() if p.suffix == ".002")
    data = bytearray(frag.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit on a third
    frag.write_bytes(bytes(data))
    with pytest.raises(TransferError, match="2 good fragments of 5, 3 needed"):
        rebuild(disks)
    # With a sixth fragment holder (a spare copy of fragment 0), three good ones remain.
    write_fragments(tmp_path / "spare", snap, 3, 2, [0], digest)
    tree, manifest, notes = rebuild([*disks, tmp_path / "spare"])
    assert any("checksum mismatch" in n for n in notes)
    back = trained_state(seed=9)
    back.model.load_state_dict(tree["model"])
    back.optimizer.load_state_dict(tree["optimizer"])
    back.step, back.cursor = tree["step"], tree["cursor"]
    assert back.digest() == digest == manifest.digest


def test_k3_m2_survives_any_two_lost_disks(tmp_path: Path) -> None:
    disks, _, _ = spread(tmp_path, 3, 2)
    for lost in itertools.combinations(range(5), 2):
        _, manifest, _ = rebuild([d for i, d in enumerate(disks) if i not in lost])
        assert manifest.step == 3


def test_the_newest_rebuildable_step_wins_and_old_sets_are_pruned(tmp_path: Path) -> None:
    state = trained_state()
    for step in (10, 20, 30, 40):
        state.step = step
        write_fragments(tmp_path, state.capture(), 2, 1, [0, 1, 2], state.digest())
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [f"frag-0000000{s}.json" for s in (20, 30, 40)]
    (tmp_path / "frag-000000040.000").unlink()
    (tmp_path / "frag-000000040.001").unlink()  # step 40: one fragment left of the 2 needed
    _, manifest, notes = rebuild([tmp_path])
    assert manifest.step == 30 and any("step 40" in n for n in notes)


def test_a_node_computes_only_the_parity_it_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import zfec

    state = trained_state()
    snap, digest = state.capture(), state.digest()
    asked: list[tuple[int, ...]] = []
    real = zfec.Encoder

    class Counting:
        def __init__(self, k: int, n: int) -> None:
            self.inner = real(k, n)

        def encode(self, blocks: Any, wanted: tuple[int, ...]) -> Any:
            asked.append(wanted)
            return self.inner.encode(blocks, wanted)

    monkeypatch.setattr(zfec, "Encoder", Counting)
    disks = [tmp_path / f"n{i}" for i in range(5)]
    for rank, disk in enumerate(disks):
        write_fragments(disk, snap, 3, 2, [rank], digest)
    assert asked == [(3,), (4,)], "data fragments need no encoding; each parity is made once, where it is kept"
    write_fragments(tmp_path / "k1", snap, 1, 2, [0, 1, 2], digest)
    assert len(asked) == 2, "with one data fragment every parity is a copy"
    _, manifest, notes = rebuild([disks[3], disks[4], disks[0]])
    assert manifest.step == 3 and not notes


def test_a_fragment_write_that_fails_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unbroken.state import directio

    state = trained_state()
    real = directio.pwrite_all

    def full_disk(fd: int, view: memoryview, offset: int) -> None:
        real(fd, view[:10], offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(directio, "pwrite_all", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_fragments(tmp_path, state.capture(), 1, 1, [0, 1], state.digest())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec", ["3", "3,2,1", "0,2", "a,b", "200,100"])
def test_bad_fragment_specs(spec: str) -> None:
    with pytest.raises(ConfigError, match="fragments"):
        parse_fragments(spec)


def test_a_manifest_of_sha256s_written_before_xxh3_still_rebuilds(tmp_path: Path) -> None:
    import hashlib
    import json

    state = trained_state()
    snap, digest = state.capture(), state.digest()
    write_fragments(tmp_path, snap, 2, 1, [0, 1, 2], digest)
    path = next(tmp_path.glob("frag-*.json"))
    raw = json.loads(path.read_text())
    assert raw.pop("hash") == "xxh3-128"
    del raw["checksum"]
    blob = pack({k: v for k, v in snap.items() if k not in ("rng", "local")})
    raw["sha256"] = hashlib.sha256(blob).hexdigest()
    raw["fragments"] = [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp_path.glob("frag-*.00*"))]
    path.write_text(json.dumps(raw))
    tree, manifest, notes = rebuild([tmp_path])
    assert manifest.hash == "sha256" and not notes and tree["step"] == 3


# ---------------------------------------------------------------- manifests not to be believed


def two_sets(directory: Path) -> None:
    """Whole fragment sets (k=1, m=1: each fragment is the state) of steps 3 and 6."""
    state = trained_state()
    for step in (3, 6):
        state.step = step
        write_fragments(directory, state.capture(), 1, 1, [0, 1], state.digest())


BAD_MANIFESTS: dict[str, Any] = {
    "k=0": lambda raw: raw | {"k": 0, "m": 2},
    "k=1 m=300": lambda raw: raw | {"m": 300, "fragments": raw["fragments"] + [""] * 299},
    "missing size": lambda raw: {key: v for key, v in raw.items() if key != "size"},
    "k a string": lambda raw: raw | {"k": "1"},
    "k a bool": lambda raw: raw | {"k": True},
    "a checksum a number": lambda raw: raw | {"fragments": [1, raw["fragments"][1]]},
    "another step than its name": lambda raw: raw | {"step": 3},
    "an unknown hash": lambda raw: raw | {"hash": "md5"},
    "an unknown field": lambda raw: raw | {"exec": "rm -rf"},
    "not an object": lambda raw: [raw],
}


@pytest.mark.parametrize("bad", sorted(BAD_MANIFESTS))
def test_an_invalid_newest_manifest_is_skipped_with_a_note_and_the_older_set_rebuilt(tmp_path: Path, bad: str) -> None:
    import json

    two_sets(tmp_path)
    newest = tmp_path / "frag-000000006.json"
    newest.write_text(json.dumps(BAD_MANIFESTS[bad](json.loads(newest.read_text()))))
    tree, manifest, notes = rebuild([tmp_path])
    assert manifest.step == 3 and tree["step"] == 3
    assert any(str(newest) in n for n in notes) or any("step 6" in n for n in notes), notes


@pytest.mark.parametrize("bad", ["k=0", "k=1 m=300", "missing size", "k a string"])
def test_unbroken_restore_skips_an_invalid_manifest_and_restores_the_older_step(
    tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from unbroken.cli.main import main
    from unbroken.state.checkpoint import checkpoint_path, load_checkpoint

    two_sets(tmp_path / "disk")
    newest = tmp_path / "disk" / "frag-000000006.json"
    newest.write_text(json.dumps(BAD_MANIFESTS[bad](json.loads(newest.read_text()))))
    assert main(["restore", "--from", str(tmp_path / "disk"), "--to", str(tmp_path / "out")]) == 0
    assert load_checkpoint(checkpoint_path(tmp_path / "out", 3))["step"] == 3
    assert f"{newest}: not a valid fragment manifest" in capsys.readouterr().err


def test_unbroken_restore_of_only_invalid_manifests_is_an_error_that_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from unbroken.cli.main import main

    two_sets(tmp_path / "disk")
    for p in (tmp_path / "disk").glob("frag-*.json"):
        p.write_text(json.dumps(json.loads(p.read_text()) | {"k": 0}))
    assert main(["restore", "--from", str(tmp_path / "disk"), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "unbroken restore: error: no checkpoint can be rebuilt" in err and "frag-000000003.json" in err
    assert "k = 0 is out of range" in err


def test_every_manifest_corrupt_is_told_apart_from_fragments_on_other_disks(tmp_path: Path) -> None:
    import json

    from unbroken.state.fragments import NotRebuilt

    two_sets(tmp_path / "a")
    for p in (tmp_path / "a").glob("frag-*.json"):
        p.write_text("{")
    with pytest.raises(NotRebuilt) as corrupt:
        rebuild([tmp_path / "a"])
    assert corrupt.value.corrupt
    disks, _, _ = spread(tmp_path, 3, 2)
    with pytest.raises(NotRebuilt) as short:
        rebuild(disks[:1])  # one node's own disk: its fragment alone
    assert not short.value.corrupt
    raw = json.loads((disks[0] / "frag-000000003.json").read_text())
    assert raw["k"] == 3


def test_a_fragment_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    two_sets(tmp_path / "d")
    for p in (tmp_path / "d").glob("frag-000000006.00*"):
        p.rename(tmp_path / p.name)
        p.symlink_to(tmp_path / p.name)
    _, manifest, notes = rebuild([tmp_path / "d"])
    assert manifest.step == 3 and any("symbolic link" in n for n in notes)


def test_pruning_fragments_never_counts_an_invalid_manifest(tmp_path: Path) -> None:
    (tmp_path / "frag-000000900.json").write_text('{"k": 0}')
    state = trained_state()
    for step in (10, 20, 30, 40):
        state.step = step
        write_fragments(tmp_path, state.capture(), 1, 1, [0, 1], state.digest())
    valid = sorted(p.name for p in tmp_path.glob("frag-0000000*.json"))
    assert valid == [f"frag-0000000{s}.json" for s in (20, 30, 40)]
    _, manifest, _ = rebuild([tmp_path])
    assert manifest.step == 40
