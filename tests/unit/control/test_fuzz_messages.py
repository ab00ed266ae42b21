"""Fuzzing the message boundary: whatever arrives, parsing returns a valid message or raises
ProtocolError, never anything else (no crash, no partially trusted object)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.control import messages as m
from unbroken.errors import ProtocolError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
VALID = [
    m.Hello(job="j", job_identity="i", fingerprint=[], member_id="a#1", name="a", batch_size=8).model_dump(),
    m.Heartbeat(seq=1, step=2).model_dump(),
    m.Progress(epoch=1, step=2, loss=0.5, wall_time=1.0).model_dump(),
    m.Fault(epoch=1, reason="x", culprit="b#2").model_dump(),
    m.Validation(step=3, metrics={"loss": 1.0}, seconds=0.1).model_dump(),
]


def step_by_step(data: str | bytes) -> object:
    """What the parser made of ``data`` before it read JSON and validated it in one pass:
    ``json.loads``, then a strict validation of the Python objects (None: refused)."""
    try:
        return m._node_adapter.validate_python(json.loads(data), strict=True)
    except (ValueError, RecursionError):  # JSON's errors and pydantic's are ValueErrors
        return None


def accept_or_refuse(data: str | bytes) -> None:
    try:
        msg = m.parse_node_message(data)
    except ProtocolError:
        assert step_by_step(data) is None, "refused in one pass, accepted step by step"
        return
    assert msg.type in {"hello", "heartbeat", "progress", "fault", "leave", "done", "validation"}
    assert msg == step_by_step(data), "read otherwise in one pass than step by step"


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(JSON)
def test_any_json_is_accepted_or_refused_cleanly(value: object) -> None:
    accept_or_refuse(json.dumps(value))


@settings(max_examples=200)
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_any_bytes_are_accepted_or_refused_cleanly(data: bytes | str) -> None:
    accept_or_refuse(data)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID), st.data())
def test_mutated_valid_messages_are_accepted_or_refused_cleanly(base: dict, data: st.DataObject) -> None:
    msg = dict(base)
    key = data.draw(st.sampled_from([*msg, "extra"]))
    msg[key] = data.draw(JSON)
    accept_or_refuse(json.dumps(msg))


HEARTBEAT = f'{{"v": {m.PROTOCOL_VERSION}, "type": "heartbeat", "seq": '


@pytest.mark.parametrize(
    "data",
    [
        "[" * 100_000 + "]" * 100_000,
        HEARTBEAT + "9" * 5000 + ', "step": 0}',
        HEARTBEAT + "9" * 20 + ', "step": 0}',  # past the counters' range
    ],
)
def test_deep_nesting_and_huge_numbers_are_refused(data: str) -> None:
    with pytest.raises(ProtocolError):
        m.parse_node_message(data)
    assert m.parse_node_message(HEARTBEAT + '9, "step": 0}').type == "heartbeat"


@pytest.mark.parametrize("field, value", [("seq", "5"), ("seq", True), ("step", 2.0), ("step", "2")])
def test_what_a_lax_reading_would_coerce_is_refused_in_one_pass_as_step_by_step(field: str, value: object) -> None:
    msg = {**m.Heartbeat(seq=1, step=2).model_dump(), field: value}
    with pytest.raises(ProtocolError, match=field):
        m.parse_node_message(json.dumps(msg))
    accept_or_refuse(json.dumps(msg))
