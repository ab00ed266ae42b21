"""Erasure-coded checkpoints: five nodes write k=3 + m=2 fragments of every checkpoint to
their own disks while training goes on; all die; two disks are lost and one byte of a third
is corrupted; `unbroken restore` rebuilds the state bit-identically, and two nodes (not
five) resume from it with exactly-once data and finish equal to the reference."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from integration.helpers import assert_promises
from unbroken.state.fragments import rebuild
from unbroken.state.snapshot import snapshot_digest

ENV = {"UB_TEST_STEPS": "60", "UB_TEST_DELAY_MS": "20"}


def held(disks: Iterable[Path]) -> list[int]:
    """The checkpoint steps every one of ``disks`` holds its whole fragment of (its manifest
    is written last), oldest first."""
    steps = [{int(p.name[5:14]) for p in d.glob("frag-*.json")} for d in disks]
    return sorted(set.intersection(*steps)) if steps else []


def test_two_lost_disks_and_a_corrupt_fragment_then_a_cold_start_on_fewer_nodes(make_cluster, tmp_path):
    c = make_cluster(env=ENV, min_nodes=5, coordinator_args=["--fragments", "3,2"], node_args=["--digest-every", "1"])
    c.start_coordinator()
    disks = {f"n{i}": tmp_path / f"disk{i}" for i in range(1, 6)}
    first = [
        c.start_node(name, extra=["--checkpoint-dir", str(d), "--checkpoint-every", "10"]) for name, d in disks.items()
    ]
    c.wait_step(34, timeout=120)
    # Writes may lag the steps on a busy machine: kill once every disk holds its fragment of
    # two checkpoints (the newest, and one to fall back to).
    c.wait_for(lambda: len(held(disks.values())) >= 2, timeout=60, what="every disk's fragments of two checkpoints")
    for n in first:
        n.kill()
    for n in first:
        n.wait(60)  # a node in the middle of writing its fragment dies once the write returns
    # Each disk holds only its node's fragment (rank i keeps fragment i): nothing whole anywhere.
    for d in disks.values():
        assert not list(d.glob("ckpt-*.pt")) and len(list(d.glob("frag-*.0*"))) >= 1
    for name in ("n1", "n2"):  # two disks lost
        for p in disks[name].iterdir():
            p.unlink()
    # Any three of five: the newest checkpoint the three disks left hold is whole again, bit
    # for bit (its digest is the one every replica logged when it committed that step).
    tree, manifest, _ = rebuild(disks.values())
    newest = manifest.step
    assert newest % 10 == 0 and newest >= 20, newest
    older = [s for s in held(disks[name] for name in ("n3", "n4", "n5")) if s < newest]
    assert older, f"no checkpoint before step {newest} is whole on the three disks left"
    previous = older[-1]
    committed = {e["digest"] for n in first for e in n.entries() if e["kind"] == "commit" and e["step"] == newest}
    assert manifest.step == newest and committed == {manifest.digest} == {snapshot_digest(tree)}, committed
    victim = next(p for p in disks["n3"].iterdir() if p.name.startswith(f"frag-{newest:09d}.0"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x10
    victim.write_bytes(bytes(data))
    # Then one byte of a third disk's fragment flips: two good fragments of the newest step
    # are left, fewer than k (no code can rebuild that); the corruption is detected, and the
    # checkpoint before, whole on all three disks, is restored.
    shared = tmp_path / "shared"
    out = subprocess.run(
        [sys.executable, "-m", "unbroken", "restore", *[a for d in disks.values() for a in ("--from", str(d))],
         "--to", str(shared)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "checksum mismatch" in out.stderr and f"step {newest}: 2 good fragments" in out.stderr, out.stderr
    restored = torch.load(next(shared.glob("ckpt-*.pt")), weights_only=True)
    assert restored["step"] == previous
    # Two nodes resume from it: exactly-once data from there on, equal to the reference. A
    # fresh coordinator waits for both, so neither finishes the job before the other joins.
    c.kill_coordinator()
    c.min_nodes = 2
    c.start_coordinator()
    resumed = [
        c.start_node(name, extra=["--checkpoint-dir", str(shared), "--checkpoint-every", "0"]) for name in ("r1", "r2")
    ]
    codes = c.wait_exit([n.name for n in resumed], timeout=120)
    assert codes == {"r1": 0, "r2": 0}, c.diagnostics()
    starts = [e for n in resumed for e in n.entries() if e["kind"] == "restore"]
    assert starts and all(e["step"] == previous for e in starts), starts
    # Every promise over the whole history: the dead group's steps after the checkpoint are
    # redone (the only rollback: every node died), each sample counted once, replicas equal,
    # the final model equal to single-process training.
    assert_promises(c, ENV, finishers=2)
