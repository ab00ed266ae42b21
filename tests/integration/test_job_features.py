"""A job written like real training code (`tests/jobs/features.py`: AdamW parameter groups,
warmup + cosine schedule, global-gradient clipping, an EMA as extra replicated state, its
own command-line arguments) on three real nodes with a kill and a join: every promise holds
and the final model, EMA, schedule and optimizer match single-process training."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from integration.helpers import ATOL, fired
from unbroken.job import load_job
from unbroken.testing import check_promises
from unbroken.testing.promises import reference_tree

pytestmark = pytest.mark.timeout(240)

REF = str(Path(__file__).parent.parent / "jobs" / "features.py") + ":make"
ARGS = ["--lr", "0.02", "--steps", "400", "--clip", "0.3"]


def test_scheduler_hooks_extra_state_and_job_arguments_survive_a_kill_and_a_join(make_cluster):
    c = make_cluster(job=REF, env={"UB_TEST_DELAY_MS": "25"}, min_nodes=3, node_args=["--digest-every", "1"])
    c.start_coordinator()
    c.start_node("n1", job_args=ARGS)
    victim = c.start_node("n2", fault="kill@compute:25", job_args=ARGS)
    c.start_node("n3", job_args=ARGS)
    c.wait_step(40)
    joiner = c.start_node("n4", job_args=ARGS)
    codes = c.wait_exit(timeout=200)
    assert fired(victim, "kill") and codes == {"n1": 0, "n2": -signal.SIGKILL, "n3": 0, "n4": 0}, c.diagnostics()
    assert next(e["kind"] for e in joiner.entries() if e["kind"] != "epoch") == "sync", "the joiner got the state"

    job = load_job(REF, ARGS)
    logs = {name: n.entries() for name, n in c.nodes.items()}
    report = check_promises(logs, job, finishers=3)
    assert report.ok, "\n".join(report.problems) + "\n" + c.diagnostics()
    ref = reference_tree(job)
    for name in ("n1", "n3", "n4"):
        got = torch.load(c.nodes[name].final_state, weights_only=False)
        for part in ("model", "extra"):
            for k, v in _flat(ref[part]).items():
                diff = (_flat(got[part])[k] - v).abs().max().item()
                assert diff <= ATOL, f"{name}: {part} {k} differs from single-process training by {diff:.2e}"
        assert got["scheduler"]["last_epoch"] == ref["scheduler"]["last_epoch"] == 400
        lrs = [g["lr"] for g in got["optimizer"]["param_groups"]]
        assert lrs == pytest.approx([g["lr"] for g in ref["optimizer"]["param_groups"]])


def test_a_node_given_other_job_arguments_is_refused(make_cluster):
    c = make_cluster(job=REF, env={"UB_TEST_DELAY_MS": "10"}, min_nodes=1)
    c.start_coordinator()
    c.start_node("n1", job_args=ARGS)
    c.wait_step(2)
    other = c.start_node("n2", job_args=["--lr", "0.5", "--steps", "150"])
    assert other.wait(timeout=60) != 0
    assert "this coordinator runs job" in other.stderr(), other.stderr()


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}/")
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out
