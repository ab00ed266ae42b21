"""parse_faults and FaultPlan: deterministic fault injection specs."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from unbroken.errors import ConfigError
from unbroken.testing import faults as faults_mod
from unbroken.testing.faults import Fault, FaultPlan, parse_faults
from unbroken.train.hooks import Record


def into(entries: list[dict[str, object]]) -> Record:
    """A commit log that keeps its entries as the file's lines read back."""
    return lambda kind, fields: entries.append({"kind": kind.value, **fields})


def test_one_fault() -> None:
    assert parse_faults("kill@allreduce:12") == [Fault("kill", "allreduce", 12)]


def test_several_faults_with_spaces_and_a_trailing_comma() -> None:
    assert parse_faults(" kill@compute:3 , stop@allreduce:4,term@compute:0,") == [
        Fault("kill", "compute", 3),
        Fault("stop", "allreduce", 4),
        Fault("term", "compute", 0),
    ]


@pytest.mark.parametrize("spec", ["", " ", ",", " , "])
def test_empty_spec_means_no_faults(spec: str) -> None:
    assert parse_faults(spec) == []


@pytest.mark.parametrize(
    "spec",
    [
        "kill",
        "kill@compute",
        "kill@compute:",
        "kill@compute:x",
        "kill@compute:-1",
        "kill@compute:1.5",
        "kill@compute:1:2",
        "hup@compute:1",
        "KILL@compute:1",
        "kill@backward:1",
        "kill:compute@1",
        "@compute:1",
        "kill@compute:1,stop",
        "kill@compute:²",  # a unicode digit is no step number
    ],
)
def test_invalid_specs_raise_a_config_error_naming_the_syntax(spec: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_faults(spec)
    msg = str(err.value)
    assert "SIGNAL@PHASE:STEP" in msg
    assert "kill" in msg and "stop" in msg and "term" in msg
    assert "compute" in msg and "allreduce" in msg


def test_the_error_names_the_bad_part_only() -> None:
    with pytest.raises(ConfigError, match="'boom@compute:1'") as err:
        parse_faults("kill@compute:1,boom@compute:1")
    assert "'kill@compute:1'" not in str(err.value)


def test_signal_names_map_to_the_documented_signals() -> None:
    assert faults_mod.SIGNALS == {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}


@pytest.fixture
def harmless_signals(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Deliver real signals to this process, but harmless ones, and record which arrived."""
    received: list[str] = []
    harmless = {"kill": signal.SIGUSR1, "stop": signal.SIGUSR2, "term": signal.SIGWINCH}
    monkeypatch.setattr(faults_mod, "SIGNALS", harmless)
    old = {sig: signal.signal(sig, lambda _s, _f, name=name: received.append(name)) for name, sig in harmless.items()}
    try:
        yield received
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def test_fault_plan_fires_each_fault_once_at_its_phase_and_step(harmless_signals: list[str]) -> None:
    records: list[dict[str, Any]] = []
    plan = FaultPlan(parse_faults("stop@allreduce:2,kill@compute:2"), into(records))
    plan.maybe_fire("compute", 1)
    plan.maybe_fire("allreduce", 1)
    assert harmless_signals == [] and records == []
    plan.maybe_fire("allreduce", 2)
    assert harmless_signals == ["stop"]
    assert records[0]["kind"] == "fault" and records[0]["signal"] == "stop" and records[0]["step"] == 2
    plan.maybe_fire("allreduce", 2)  # fired already
    assert harmless_signals == ["stop"]
    plan.maybe_fire("compute", 2)
    assert harmless_signals == ["stop", "kill"]
    assert [r["phase"] for r in records] == ["allreduce", "compute"]


def test_the_fault_is_recorded_before_the_signal(harmless_signals: list[str]) -> None:
    seen_at_record: list[list[str]] = []
    plan = FaultPlan([Fault("term", "compute", 0)], lambda _k, _f: seen_at_record.append(list(harmless_signals)))
    plan.maybe_fire("compute", 0)
    assert seen_at_record == [[]]
    assert harmless_signals == ["term"]


def test_a_flip_poisons_its_step_and_every_later_one() -> None:
    recorded: list[dict[str, object]] = []
    plan = FaultPlan(parse_faults("flip@grad:3"), into(recorded))
    assert [plan.corruption(s) for s in range(6)] == [None, None, None, -10.0, -10.0, -10.0]
    assert len(recorded) == 1 and recorded[0]["signal"] == "flip"


def test_a_shrink_and_a_shifted_loader_hold_from_their_step_on() -> None:
    recorded: list[dict[str, object]] = []
    plan = FaultPlan(parse_faults("shrink@grad:3,shift@data:4"), into(recorded))
    assert [plan.corruption(s) for s in range(6)] == [None, None, None, 0.9, 0.9, 0.9]
    assert [plan.wrong_samples(s) for s in range(7)] == [False] * 4 + [True] * 3
    assert [(r["signal"], r["phase"], r["step"]) for r in recorded] == [("shrink", "grad", 3), ("shift", "data", 4)]
    for bad in ("shrink@outer:3", "shift@grad:3", "shift@data:x"):
        with pytest.raises(ConfigError):
            parse_faults(bad)


def test_an_outer_lie_holds_from_its_step_on_and_only_for_pseudo_gradients() -> None:
    recorded: list[dict[str, Any]] = []
    plan = FaultPlan(parse_faults("hide-nan@outer:19"), into(recorded))
    assert plan.lie(25, "grad") is None, "an outer lie does not spoil inner steps"
    assert plan.lie(9, "outer") is None and recorded == []
    assert plan.lie(19, "outer") == plan.lie(29, "outer") == plan.lie(39, "outer") == "hide-nan"
    assert [(r["signal"], r["phase"], r["step"]) for r in recorded] == [("hide-nan", "outer", 19)]
    assert parse_faults("hide-spike@outer:5")[0].phase == "outer"
    with pytest.raises(ConfigError, match="forge-slot@outer"):
        parse_faults("forge-slot@outer:5")
