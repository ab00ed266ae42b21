"""`unbroken verify` on a real run: three nodes, one SIGKILLed in an all-reduce, every promise
OK; then copies of the run's directory with a commit line dropped from one node's log, and
with a sample read twice in one step: each is VIOLATED, named, with exit status 1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from integration.helpers import fired
from jobs import mlp

pytestmark = pytest.mark.timeout(240)

ENV = {"UB_TEST_STEPS": "40", "UB_TEST_DELAY_MS": "20"}
JOB = f"{Path(mlp.__file__)}:job"
TITLES = ("steps", "applied once", "samples", "replicas", "final model", "rollbacks", "halts", "quarantines")


def verify(rundir: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | ENV | {"UB_TEST_DELAY_MS": "0"}  # the job's pacing changes no sample
    cmd = [sys.executable, "-m", "unbroken", "verify", str(rundir), "--job", JOB]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def rewrite(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps(e) + "\n" for e in edit(entries)))


def test_verify_passes_a_real_run_with_a_kill_and_names_what_a_corrupted_copy_breaks(make_cluster, tmp_path):
    c = make_cluster(env=ENV, min_nodes=3, node_args=["--digest-every", "1"])
    c.start_coordinator()
    c.start_node("n1")
    victim = c.start_node("n2", fault="kill@allreduce:15")
    c.start_node("n3")
    codes = c.wait_exit(timeout=150)
    assert fired(victim, "kill") and codes == {"n1": 0, "n2": -signal.SIGKILL, "n3": 0}, c.diagnostics()

    r = verify(c.workdir)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for title in TITLES:
        assert any(x.startswith("OK") and f" {title} " in x for x in lines), (title, r.stdout)
    assert "each of 40 committed steps read exactly its 30 planned samples" in r.stdout
    assert lines[-1] == "verdict: OK, every promise checked held", r.stdout

    # n1's commit of step 20 dropped: it went from step 19 to step 21.
    dropped = tmp_path / "dropped"
    shutil.copytree(c.workdir, dropped, ignore=shutil.ignore_patterns("*.pt"))
    rewrite(dropped / "n1.jsonl", lambda es: [e for e in es if not (e["kind"] == "commit" and e["step"] == 20)])
    r = verify(dropped)
    assert r.returncode == 1, r.stdout + r.stderr
    assert any(x.startswith("VIOLATED") and " steps " in x for x in r.stdout.splitlines()), r.stdout
    assert "node n1, step 21" in r.stdout and "n1 committed step 21 right after step 19" in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1] == "verdict: VIOLATED: steps", r.stdout

    # n3's slice of step 30 reads one of n1's samples of that step instead of its own first.
    doubled = tmp_path / "doubled"
    shutil.copytree(c.workdir, doubled, ignore=shutil.ignore_patterns("*.pt"))
    theirs = next(e for e in c.nodes["n1"].entries() if e["kind"] == "contrib" and e["step"] == 29)
    stolen = theirs["indices"][0]

    def steal(entries):  # type: ignore[no-untyped-def]
        for e in entries:
            if e["kind"] == "contrib" and e["step"] == 29 and e["epoch"] == theirs["epoch"]:
                e["indices"][0] = stolen
        return entries

    rewrite(doubled / "n3.jsonl", steal)
    r = verify(doubled)
    assert r.returncode == 1, r.stdout + r.stderr
    assert any(x.startswith("VIOLATED") and " samples " in x for x in r.stdout.splitlines()), r.stdout
    assert f"sample {stolen} read 2 times (n1, n3)" in r.stdout or f"sample {stolen} read 2 times (n3, n1)" in r.stdout
    assert "never read" in r.stdout and "step 30" in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1] == "verdict: VIOLATED: samples", r.stdout
