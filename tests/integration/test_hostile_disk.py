"""Hostile disks against live nodes (issue 39, every member is itself): whoever can write into
a node's --checkpoint-dir, or whatever a crash or bit rot leaves there, must neither make the
node write outside it, nor crash its start, nor start a job over silently.

Each test runs real node processes against a real coordinator and asserts the promises
(docs/design.md, promises 6 and 9) on what they logged.
"""

from __future__ import annotations

import json

import pytest
import torch

from integration.helpers import Pace, assert_promises, events_of
from unbroken.state import directio

pytestmark = pytest.mark.timeout(240)

CKPT = ["--checkpoint-every", "5"]


def test_links_planted_at_a_writers_temporary_names_redirect_no_checkpoint(make_cluster, tmp_path):
    """Links to files outside, planted at every temporary name the node's writer would have
    used (its pid and machine were all it took to predict them): every file outside is
    intact, and the checkpoints are whole files in the directory."""
    env = {"UB_TEST_STEPS": "40", "UB_TEST_DELAY_MS": "20"}
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    ckpt.mkdir()
    outside.mkdir()
    c = make_cluster(env=env, node_args=["--checkpoint-dir", str(ckpt), *CKPT])
    c.start_coordinator()
    node = c.start_node("n")
    writer = directio.temp_path(ckpt / "x").name.split("@", 1)[1]  # this machine's: the node's too
    victims = []
    for step in range(5, 45, 5):
        victim = outside / f"precious-{step}"
        victim.write_bytes(b"not the node's to write")
        (ckpt / f"ckpt-{step:09d}.pt.{node.proc.pid}@{writer}").symlink_to(victim)
        victims.append(victim)
    assert c.wait_exit(timeout=150) == {"n": 0}, c.diagnostics()
    assert all(v.read_bytes() == b"not the node's to write" for v in victims)
    written = sorted(ckpt.glob("ckpt-*.pt"))
    assert written and not any(p.is_symlink() for p in written), written
    assert all(torch.load(p, weights_only=True)["step"] == int(p.name[5:14]) for p in written)
    assert_promises(c, env, finishers=1)


def test_a_corrupt_newest_manifest_is_skipped_and_the_restart_restores_the_older_fragments(make_cluster, tmp_path):
    """Erasure-coded checkpoints (k=1, m=1: one node keeps both fragments); the node killed,
    the newest manifest rewritten with k=0 (zfec cannot decode that): the restart names the
    manifest, restores the older set, and finishes equal to the reference."""
    env = {"UB_TEST_STEPS": "80", "UB_TEST_DELAY_MS": "20"}
    ckpt = tmp_path / "ckpt"
    c = make_cluster(env=env, coordinator_args=["--fragments", "1,1"])
    c.start_coordinator()
    first = c.start_node("n", extra=["--checkpoint-dir", str(ckpt), *CKPT])
    c.wait_for(lambda: len(list(ckpt.glob("frag-*.json"))) >= 2, 120, "two fragment sets on disk")
    first.kill()
    first.wait(60)
    *_, older, newest = sorted(ckpt.glob("frag-*.json"))
    raw = json.loads(newest.read_text())
    newest.write_text(json.dumps(raw | {"k": 0, "m": 2}))
    again = c.start_node("n", extra=["--checkpoint-dir", str(ckpt), *CKPT])
    assert again.wait(150) == 0, c.diagnostics()
    assert "Traceback" not in again.stderr(), again.stderr()
    restores = [e for e in again.entries() if e["kind"] == "restore"]
    assert restores and restores[0]["path"] == str(older), (restores, older)
    reasons = " ".join(e["reason"] for e in events_of(c, "checkpoint-failed"))
    assert f"{newest}: not a valid fragment manifest" in reasons and "k = 0" in reasons, reasons
    assert_promises(c, env, finishers=1)


def corrupt_checkpoints(ckpt, steps=(20, 30)):
    ckpt.mkdir(parents=True, exist_ok=True)
    paths = [ckpt / f"ckpt-{s:09d}.pt" for s in steps]
    paths[0].write_bytes(b"PK\x03\x04 cut short by a full disk")
    paths[1].write_bytes(b"bit rot, not a checkpoint")
    return paths


def test_every_checkpoint_corrupt_stops_a_lone_node_until_it_is_told_to_start_fresh(make_cluster, tmp_path):
    """No group trains and every checkpoint in the directory is corrupt: the node stops with
    an error naming the directory and each file (it started over from step 0 silently);
    with --start-fresh it trains, the corrupt files are set aside (not deleted), and its own
    checkpoints are kept however the corrupt ones were numbered."""
    env = {"UB_TEST_STEPS": "30", "UB_TEST_DELAY_MS": "10"}
    ckpt = tmp_path / "ckpt"
    bad = corrupt_checkpoints(ckpt, (200, 300))
    c = make_cluster(env=env, node_args=["--checkpoint-dir", str(ckpt), *CKPT])
    c.start_coordinator()
    stopped = c.start_node("stopped")
    assert stopped.wait(120) == 2, c.diagnostics()
    err = stopped.stderr()
    assert f"every checkpoint in --checkpoint-dir {ckpt} is corrupt" in err, err
    assert all(str(p) in err for p in bad) and "--start-fresh" in err and "Traceback" not in err, err
    assert not [e for e in stopped.entries() if e["kind"] == "commit"], "it trained nothing"
    assert all(p.exists() for p in bad), "nothing is moved without the operator's word"
    fresh = c.start_node("fresh", extra=["--start-fresh"])
    assert fresh.wait(150) == 0, c.diagnostics()
    (aside,) = ckpt.glob("set-aside-*")
    assert sorted(p.name for p in aside.glob("ckpt-*.pt")) == [p.name for p in bad]
    # Its own newest (a checkpoint due while the last is being written is skipped: which
    # ones were written depends on the machine's load), none of them pushed out.
    kept = sorted(int(p.name[5:14]) for p in ckpt.glob("ckpt-*.pt"))
    assert len(kept) >= 2 and all(s % 5 == 0 and 5 <= s <= 30 for s in kept), kept
    assert torch.load(ckpt / f"ckpt-{kept[-1]:09d}.pt", weights_only=True)["step"] == kept[-1]
    reasons = " ".join(e["reason"] for e in events_of(c, "checkpoint-failed"))
    assert "--start-fresh: this node trains from step 0" in reasons, reasons


def test_a_node_whose_checkpoints_are_all_corrupt_joins_a_group_that_trains(make_cluster, tmp_path):
    """The group holds the state: a node with only corrupt checkpoints joins it, takes its
    state, and finishes with it (the corrupt files set aside)."""
    pace = Pace(tmp_path)  # paced until b trains with the group (its start took 4 s on a busy machine)
    env = {"UB_TEST_STEPS": "400", "UB_TEST_DELAY_MS": "20", **pace.env}
    ckpt = tmp_path / "ckpt"
    bad = corrupt_checkpoints(ckpt)
    c = make_cluster(env=env)
    c.start_coordinator()
    c.start_node("a")
    c.wait_step(10)
    b = c.start_node("b", extra=["--checkpoint-dir", str(ckpt)])
    c.wait_for(lambda: any(e["kind"] == "commit" for e in b.entries()), 90, "b committing with the group")
    pace.release()
    assert c.wait_exit(timeout=150) == {"a": 0, "b": 0}, c.diagnostics()
    reasons = " ".join(e["reason"] for e in events_of(c, "checkpoint-failed"))
    assert "this node joins with the group's state" in reasons and str(bad[0]) in reasons, reasons
    assert not any(p.exists() for p in bad) and len(list(ckpt.glob("set-aside-*/ckpt-*.pt"))) == 2
    assert_promises(c, env, finishers=2)
