"""`unbroken verify RUNDIR`: the logs are found by what they hold, read as streams, and the
command says OK / VIOLATED per promise with exit status 0 / 1, or 2 with what it expected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from unbroken.cli.main import main
from unbroken.errors import ConfigError
from unbroken.observe.rundir import find, verify
from unbroken.observe.verdict import Expect, Promise, Status
from unbroken.train.data import DataPlan

B, T = 4, 3
PLAN = DataPlan(40, B, 7)
JOB = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from unbroken import Job

def make(argv):
    return Job(name="v", model=lambda: nn.Linear(1, 1), optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
               dataset=TensorDataset(torch.zeros(40, 1), torch.zeros(40, 1)), loss=nn.functional.mse_loss,
               batch_size=int(argv[argv.index("--batch") + 1]), num_steps=3, seed=7)
"""


def node_log(offset: int, count: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"t": 0.5, "node": "x", "kind": "epoch", "epoch": 1, "term": 0, "step": 0}]
    for s in range(T):
        out.append({"t": 1.0 + s, "kind": "contrib", "epoch": 1, "step": s, "indices": PLAN.indices(s, offset, count)})
        out.append({"t": 1.5 + s, "kind": "commit", "epoch": 1, "step": s + 1, "loss": 1.0, "digest": f"d{s}"})
    return [*out, {"t": 9.0, "kind": "final", "step": T, "digest": f"d{T - 1}"}]


def write(path: Path, entries: list[dict[str, Any]], tail: str = "") -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries) + tail)


@pytest.fixture
def rundir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    write(d / "n1.jsonl", node_log(0, 2))
    write(d / "n2.jsonl", node_log(2, 2))
    event = {"seq": 1, "time": 9.5, "kind": "finished", "node": "n1", "member": "n1#a", "epoch": 1, "step": T,
             "reason": "final step 3 reached (2 agree on the state)"}  # fmt: skip
    write(d / "events.jsonl", [event])
    return d


def test_commit_logs_and_the_event_log_are_told_apart_by_what_they_hold(rundir: Path) -> None:
    (rundir / "metrics.jsonl").write_text('{"loss": 1.0}\n')
    run = find(rundir)
    assert sorted(run.logs) == ["n1", "n2"]
    assert [p.name for p in run.event_logs] == ["events.jsonl"]
    assert [p.name for p in run.others] == ["metrics.jsonl"]
    assert any("metrics.jsonl: neither a commit log nor an event log" in n for n in run.notes())


def test_each_log_is_streamed_twice_when_every_promise_held(rundir: Path) -> None:
    verdict, run = verify(rundir, Expect(num_steps=T, batch_size=B, plan=PLAN))
    assert verdict.ok, [c.evidence for c in verdict.violated]
    assert all(log._passes == 2 for log in run.logs.values())  # a first pass, the judging pass: no more


def test_a_line_cut_short_by_a_kill_is_left_out_and_said(rundir: Path) -> None:
    write(rundir / "n2.jsonl", node_log(2, 2)[:-1], tail='{"t": 9.0, "kind": "fin')
    verdict, _ = verify(rundir, Expect())
    assert any("n2.jsonl: its last line is cut short" in n for n in verdict.notes), verdict.notes
    assert verdict.check(Promise.FINAL).status is Status.OK  # one finisher is enough


def test_an_entry_no_node_writes_is_an_error_naming_its_file_and_line(rundir: Path) -> None:
    entries = node_log(0, 2)
    entries[3]["kind"] = "comit"
    write(rundir / "n1.jsonl", entries)
    with pytest.raises(ConfigError, match=r"n1\.jsonl:4: 'comit' is no kind of commit-log entry"):
        verify(rundir, Expect())
    entries[3] = {"t": 2.5, "kind": "commit", "epoch": 1}
    write(rundir / "n1.jsonl", entries)
    with pytest.raises(ConfigError, match=r"n1\.jsonl:4: a commit entry with no step"):
        verify(rundir, Expect())


def test_a_directory_without_commit_logs_says_what_was_expected(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "events.jsonl").write_text(
        '{"seq": 1, "time": 1.0, "kind": "join", "node": "a", "member": "a#1", "epoch": 0, "step": 0, "reason": "r"}\n'
    )
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no commit log" in err and "--commit-log" in err and "events.jsonl" in err
    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_the_command_says_ok_per_promise_and_exits_0(rundir: Path, capsys: Any) -> None:
    assert main(["verify", str(rundir)]) == 0
    out = capsys.readouterr().out
    for title in ("steps", "applied once", "samples", "replicas", "final model", "rollbacks", "halts", "quarantines"):
        assert any(line.startswith("OK") and f" {title} " in line for line in out.splitlines()), (title, out)
    assert "not checked: which samples each step read" in out
    assert out.rstrip().endswith("verdict: OK, every promise checked held")


def test_the_command_with_the_job_checks_the_plan_and_names_a_sample_read_twice(
    rundir: Path, tmp_path: Path, capsys: Any
) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    assert main(["verify", str(rundir), "--job", f"{job}:make", "--", "--batch", str(B)]) == 0
    assert "each of 3 committed steps read exactly its 4 planned samples" in capsys.readouterr().out
    entries = node_log(2, 2)
    entries[3]["indices"] = [PLAN.indices(0, 0, B)[0], entries[3]["indices"][1]]  # a sample of step 1, again
    write(rundir / "n2.jsonl", entries)
    assert main(["verify", str(rundir), "--job", f"{job}:make", "--", "--batch", str(B)]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("VIOLATED"))
    assert " samples " in line
    assert "node n1, n2, step 2, epoch 1: step 2 (epoch 1) consumed 4 samples from 2 slices" in out
    assert f"sample {PLAN.indices(0, 0, B)[0]} is not in its plan (read by n2)" in out
    assert out.rstrip().endswith("verdict: VIOLATED: samples")


def test_the_json_verdict_carries_every_promise_and_its_evidence(rundir: Path, capsys: Any) -> None:
    entries = node_log(2, 2)
    del entries[4]  # n2's commit of step 2: it goes from step 1 to step 3
    write(rundir / "n2.jsonl", entries)
    assert main(["verify", str(rundir), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False and d["violated"] == ["steps"]
    steps = next(c for c in d["checks"] if c["promise"] == "steps")
    assert steps["evidence"][0] | {"t": None} == {
        "node": "n2", "step": 3, "epoch": 1, "t": None, "text": "n2 committed step 3 right after step 1",
    }  # fmt: skip
    assert sorted(d["commit_logs"]) == ["n1", "n2"] and d["event_logs"][0].endswith("events.jsonl")
