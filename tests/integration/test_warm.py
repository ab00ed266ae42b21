"""Nodes started warm (forked from a parent that imported torch once) are real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from unbroken.config import READY_PREFIX
from unbroken.testing import warm

pytestmark = pytest.mark.timeout(120)


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def test_a_warm_process_has_its_own_pid_env_log_signals_and_exit_code(tmp_path):
    env = dict(os.environ, UB_PROBE="42")
    bad = warm.start(["no-such-command"], env, tmp_path / "bad.log")
    assert bad.wait(60) == 2
    assert "invalid choice: 'no-such-command'" in (tmp_path / "bad.log").read_text()

    log = tmp_path / "coordinator.log"
    procs = [warm.start(["coordinator", "--port", "0"], env, log) for _ in range(2)]
    deadline = time.monotonic() + 60

    def said() -> str:  # the warm children open the log themselves, on a busy machine late
        return log.read_text() if log.exists() else ""

    while said().count(READY_PREFIX) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert said().count(READY_PREFIX) == 2, said()
    a, b = procs
    assert len({a.pid, b.pid, os.getpid()}) == 3 and a.poll() is None and b.poll() is None
    # Neighbours come from different parents, so their hash seeds differ as cold starts' do.
    assert parent_of(a.pid) != parent_of(b.pid)
    with pytest.raises(subprocess.TimeoutExpired):
        a.wait(0.2)
    a.send_signal(signal.SIGTERM)
    b.kill()
    assert b.wait(30) == -signal.SIGKILL
    assert a.wait(30) in (0, -signal.SIGTERM)
    assert a.poll() is not None
    a.kill()  # a no-op once it exited: no signal reaches a recycled pid


def test_a_warm_script_sees_the_environment_given_and_the_threads_asked_for(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys, torch\n"
        "preloaded = 'torch._dynamo' in sys.modules\n"
        "print(json.dumps({'env': dict(os.environ), 'threads': torch.get_num_threads(), 'argv': sys.argv,\n"
        "                  'preloaded': preloaded}))\n"
    )
    # A coordinator address that nobody dials: the script never joins.
    env = dict(os.environ, UB_PROBE="42", OMP_NUM_THREADS="2", UNBROKEN_COORDINATOR="127.0.0.1:9")
    env.pop("GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", None)
    env.pop("PYTHONUNBUFFERED", None)  # the parents have it
    log = tmp_path / "probe.log"
    assert warm.start(["run", str(script), "--", "--flag"], env, log).wait(60) == 0
    seen = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("{")))
    # What was given, plus what the imports set (gloo's options), as a cold start has.
    assert seen["env"]["UB_PROBE"] == "42" and seen["env"]["GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"] == "1"
    assert "PYTHONUNBUFFERED" not in seen["env"]
    assert seen["threads"] == 2 and seen["argv"] == [str(script), "--flag"]
    # What torch loads on a job's first optimizer is in the parent already, not imported by
    # every node again (most of a warm start, when it was).
    assert seen["preloaded"], "torch._dynamo was not preloaded by the warm parent"
