"""A sharded zone's checkpoint files: each range written with its digest, on two disks where
asked (its primary's and its buddy's), checked when read, and gathered from the members' own
disks after one of them is lost."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from unbroken.cli.main import main
from unbroken.comm.shard_files import complete_steps, gather, prune_shards, read_shard, restore_shards, save_shard
from unbroken.errors import TransferError
from unbroken.state.shards import layout_for
from unbroken.testing.fake import FakeWorld
from unit.comm.test_sharded import (
    STEPS,
    Tiny,
    assert_matches,
    buddies_agree,
    even,
    member,
    reference,
    run,
    start,
    train_steps,
)
from unit.comm.test_sharded import train as train_one

pytestmark = pytest.mark.timeout(60)


def disks(tmp_path: Path, copies: bool) -> tuple[dict[str, Path], int]:
    """Four members train 3 steps and each writes step 3 to a disk of its own; the disks and
    the zone's element count."""
    members = ["a", "b", "c", "d"]
    zones, models, _ = start(members)
    train_steps(zones, models, members, range(3))
    out = {m: tmp_path / f"disk-{m}" for m in members}
    for m in members:
        save_shard(zones[m], out[m], 3, copies=copies)
    return out, zones["a"].layout.numel


def test_with_copies_every_range_lies_on_two_disks_and_losing_one_disk_loses_nothing(tmp_path: Path) -> None:
    out, numel = disks(tmp_path, copies=True)
    names = {m: sorted(f.name for f in d.iterdir()) for m, d in out.items()}
    every = [n for ns in names.values() for n in ns]
    assert len(set(every)) == 4 and all(every.count(n) == 2 for n in every), names  # a primary's and a buddy's
    for lost in out:  # any one disk
        into = tmp_path / f"gathered-without-{lost}"
        step, files, notes = gather([d for m, d in out.items() if m != lost], into, None)
        assert step == 3 and len(files) == 4 and not notes, (lost, files, notes)
    # Three new members of another size read the gathered files and train on as one process.
    layout = layout_for(numel, {"x": 1, "y": 3, "z": 2})
    world, stay = FakeWorld(3), ["x", "y", "z"]
    ranks = {m: i for i, m in enumerate(stay)}
    fresh = {m: Tiny() for m in stay}
    again = {m: member(fresh[m], layout, m, ranks, world) for m in stay}
    assert {restore_shards(again[m], tmp_path / "gathered-without-b", layout, m) for m in stay} == {3}
    buddies_agree(again)
    for step in range(3, STEPS):
        done = run(stay, lambda m, s=step: train_one(again[m], fresh[m], s, even(stay), m))
        assert not any(isinstance(v, BaseException) for v in done.values()), done
    assert_matches(again, reference(STEPS))


def test_without_copies_a_lost_disk_leaves_a_range_uncovered_and_says_which(tmp_path: Path) -> None:
    out, _ = disks(tmp_path, copies=False)
    b = next(out["b"].iterdir()).name
    with pytest.raises(TransferError, match=r"no good copy of \[\d"):
        gather([d for m, d in out.items() if m != "b"], tmp_path / "gathered", None)
    assert b.startswith("shard-000000003-")


def test_a_rotten_copy_fails_its_digest_and_the_other_copy_is_taken(tmp_path: Path) -> None:
    out, _ = disks(tmp_path, copies=True)
    victim = sorted(out["a"].iterdir())[0]
    data = torch.load(victim, weights_only=True)
    data["values"][0] += 1.0  # a flipped value the file's own container checks would not see
    torch.save(data, victim)
    with pytest.raises(TransferError, match="do not match the digest"):
        read_shard(victim)
    step, files, notes = gather(out.values(), tmp_path / "gathered", None)
    assert step == 3 and len(files) == 4
    assert any(victim.name in n and "digest" in n for n in notes), notes
    chosen = next(f for f in files if f.name == victim.name)
    other = next(d / victim.name for m, d in out.items() if m != "a" and (d / victim.name).exists())
    assert torch.equal(read_shard(chosen)["values"], read_shard(other)["values"])


def test_unbroken_restore_gathers_the_shard_files_with_the_replicated_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = disks(tmp_path, copies=True)
    torch.save({"step": 3}, out["c"] / "ckpt-000000003.pt")
    lost = out.pop("c")  # its shard files are lost, not the replicated checkpoint beside them
    for f in lost.glob("shard-*.pt"):
        f.unlink()
    to = tmp_path / "shared"
    args = [a for d in [*out.values(), lost] for a in ("--from", str(d))]
    assert main(["restore", *args, "--to", str(to)]) == 0, capsys.readouterr()
    assert len(list(to.glob("shard-000000003-*.pt"))) == 4 and (to / "ckpt-000000003.pt").exists()
    for f in to.glob("shard-*.pt"):
        read_shard(f)
    for f in lost.glob("ckpt-*.pt"):
        f.unlink()
    capsys.readouterr()
    code = main(["restore", *args, "--to", str(tmp_path / "other")])
    err = capsys.readouterr().err
    assert code != 0 and "step 3" in err, err


def test_a_members_own_disk_keeps_its_newest_steps_and_a_shared_one_its_newest_complete(tmp_path: Path) -> None:
    members = ["a", "b", "c", "d"]
    zones, models, _ = start(members)
    numel = zones["a"].layout.numel
    own, shared = tmp_path / "own-a", tmp_path / "shared"
    mine: list[tuple[int, list[Path]]] = []
    for step in range(1, 7):
        train_steps(zones, models, members, range(step - 1, step))
        mine.append((step, save_shard(zones["a"], own, step, copies=True)))
        if step == 2:  # a replicated checkpoint written at step 2 and none since (skipped: a slow disk)
            (own / "frag-000000002.json").write_text("{}")
        prune_shards(own, numel, 3, own=mine)
        for m in members if step != 6 else members[:2]:  # step 6's set is not whole yet
            save_shard(zones[m], shared, step)
        prune_shards(shared, numel, 3)
    steps = {int(f.name[6:15]) for f in own.glob("shard-*.pt")}
    assert steps == {2, 4, 5, 6}, "its three newest, and the step its replicated checkpoint is of"
    assert complete_steps(shared, numel) == [5, 4, 3], "the three newest complete steps, and step 6's part"
    assert {int(f.name[6:15]) for f in shared.iterdir()} == {3, 4, 5, 6}


def test_gather_tiles_ranges_of_two_layouts_and_passes_over_a_copy_that_cannot_be_copied(tmp_path: Path) -> None:
    out, numel = disks(tmp_path, copies=True)
    # Step 3 also written under another layout (three members: a re-shard after a crash).
    stay = ["x", "y", "z"]
    layout = layout_for(numel, {"x": 1, "y": 3, "z": 2})
    world = FakeWorld(3)
    ranks = {m: i for i, m in enumerate(stay)}
    again = {m: member(Tiny(), layout, m, ranks, world) for m in stay}
    gathered = tmp_path / "gathered"
    gather(out.values(), gathered, 3)
    for m in stay:
        restore_shards(again[m], gathered, layout, m)
    other = tmp_path / "other-layout"
    for m in stay:
        save_shard(again[m], other, 3)
    first = sorted(out["a"].glob("shard-*.pt"))[0]
    for d in out.values():  # every copy of one range of the first layout is unreadable
        if (d / first.name).exists():
            (d / first.name).write_bytes(b"rot")
    bad = tmp_path / "links"
    bad.mkdir()
    for f in sorted(other.iterdir())[:1]:  # a copy that reads well but is a link: not copied
        (bad / f.name).symlink_to(f)
    step, files, notes = gather([bad, *out.values(), other], tmp_path / "tiled", 3)
    assert step == 3 and complete_steps(tmp_path / "tiled", numel) == [3], (files, notes)
    spans = sorted((int(f.name[16:28]), int(f.name[29:41])) for f in files)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)) and spans[0][0] == 0 and spans[-1][1] == numel
    assert any("could not be copied" in n for n in notes) and any(first.name in n for n in notes), notes


def test_the_outer_momentum_of_a_range_is_saved_with_it_read_back_by_range_and_checked(tmp_path: Path) -> None:
    members = ["a", "b"]
    zones, models, _ = start(members)
    train_steps(zones, models, members, range(2))
    numel = zones["a"].layout.numel
    momentum = torch.arange(float(numel))  # sharded DiLoCo's, element by element
    for m in members:
        save_shard(zones[m], tmp_path, 2, momentum=lambda a, b: momentum[a:b].clone())
    layout = layout_for(numel, {"x": 1})
    alone = member(Tiny(), layout, "x", {"x": 0}, FakeWorld(1))
    read: dict[tuple[int, int], torch.Tensor] = {}
    assert restore_shards(alone, tmp_path, layout, "x", momentum=read) == 2
    assert len(read) == 2 and torch.equal(torch.cat([read[k] for k in sorted(read)]), momentum)
    path = sorted(tmp_path.glob("shard-*.pt"))[0]
    data = torch.load(path, weights_only=True)
    data["momentum"] += 1.0  # bit rot in the momentum alone
    torch.save(data, path)
    with pytest.raises(TransferError, match="do not match the digest"):
        read_shard(path)
