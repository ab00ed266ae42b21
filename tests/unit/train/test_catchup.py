"""What a member claims of its --checkpoint-dir when the group's holders are gone: the
newest checkpoint in the range asked that it read whole itself, and why each newer one in
that range was not used."""

from __future__ import annotations

from pathlib import Path

import torch

from unbroken.state.ckpt_files import checkpoint_path
from unbroken.train.catchup import newest_readable


def save(directory: Path, step: int, job: str = "j", **more: object) -> None:
    torch.save({"step": step, "cursor": 4 * step, "model": {"w": torch.ones(2)}, "job": job, **more},
               checkpoint_path(directory, step))  # fmt: skip


def test_the_newest_readable_checkpoint_in_range_is_claimed_and_the_others_named(tmp_path: Path) -> None:
    for step in (5, 10, 20):
        save(tmp_path, step)
    save(tmp_path, 30)  # above the group's step: another run's, passed over without a word
    save(tmp_path, 24, job="other")
    checkpoint_path(tmp_path, 25).write_bytes(b"not a checkpoint")
    torch.save({"step": 23, "cursor": 0}, checkpoint_path(tmp_path, 23))  # no training state
    torch.save({"step": 21, "cursor": 0, "model": {}, "job": "j"}, checkpoint_path(tmp_path, 22))  # another step's
    step, path, snap, bad = newest_readable(tmp_path, "j", above=8, upto=26)
    assert (step, path) == (20, checkpoint_path(tmp_path, 20))
    assert snap is not None and snap["step"] == 20 and snap["cursor"] == 80
    assert [b.split(" ")[0] for b in bad] == [str(checkpoint_path(tmp_path, s)) for s in (25, 24, 23, 22)], bad
    assert "does not load" in bad[0] and "another job's" in bad[1] and "no training state of step 23" in bad[2]


def test_nothing_above_the_state_held_is_claimed(tmp_path: Path) -> None:
    save(tmp_path, 10)
    assert newest_readable(tmp_path, "j", above=10, upto=26)[0] == -1
    assert newest_readable(tmp_path, "j", above=8, upto=9)[0] == -1
    assert newest_readable(None, "j", above=0, upto=26) == (-1, None, None, [])
    assert newest_readable(tmp_path / "absent", "j", above=0, upto=26)[0] == -1
