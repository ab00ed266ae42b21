"""Control messages: typed, validated at the boundary, refused with a clear ProtocolError."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from unbroken.control import messages as m
from unbroken.errors import ProtocolError

FINGERPRINT = [
    m.TensorSpec(name="w", shape=[2, 3], dtype="float32"),
    m.TensorSpec(name="b", shape=[3], dtype="float32"),
]

NODE_MESSAGES: list[BaseModel] = [
    m.Hello(
        job="j",
        job_identity="abc",
        fingerprint=FINGERPRINT,
        member_id="m1",
        name="node-1",
        batch_size=32,
        weight=2.5,
        step=7,
        host="h",
        pid=123,
        resume=m.Resume(epoch=3, members=["m1", "m2"], step=7),
        last_epoch=3,
        capabilities=m.Capabilities(
            device="cuda:0", device_name="H200", memory_total=1 << 40, per_sample_s=1e-3, max_microbatch=-1
        ),
        role="standby",
        evaluates=True,
    ),
    m.Hello(job="j", job_identity="abc", fingerprint=[], member_id="m1", name="n", batch_size=1),
    m.Heartbeat(seq=4, step=9),
    m.Progress(epoch=2, step=10, loss=0.5, wall_time=12.5, first_in_epoch=True, samples_per_s=100.0),
    m.Progress(epoch=2, step=11, loss=0.5, wall_time=13.0, compute_s=0.1, capabilities=m.Capabilities(rtt_s=0.01)),
    m.Validation(step=10, metrics={"loss": 1.5}, seconds=0.3),
    m.Fault(epoch=2, reason="peer reset"),
    m.Leave(reason="SIGTERM"),
    m.Leave(),
    m.Done(step=40, digest="ff" * 16, metrics={"val_loss": 0.25}),
]

COORDINATOR_MESSAGES: list[BaseModel] = [
    m.Welcome(lease_s=1.0, heartbeat_s=0.2, coordinator_id="c0ffee"),
    m.Refused(reason="model does not match"),
    m.Refused(reason="job finished", finished=True),
    m.Ack(seq=4),
    m.EpochOrder(epoch=5, members=["a", "b"], shares=[10, 20], urgent=True, reason="b failed"),
    m.EpochOrder(
        epoch=6,
        members=["a", "b"],
        shares=[30, 0],
        urgent=False,
        reason="r",
        roles=["trainer", "validator"],
        microbatches=[8, 0],
    ),
    m.Expel(reason="lease"),
    m.Finished(step=40),
]


def heartbeat(**fields: object) -> str:
    return json.dumps({"type": "heartbeat", "seq": 1, "step": 2, **fields})


@pytest.mark.parametrize("msg", NODE_MESSAGES, ids=lambda x: type(x).__name__)
def test_node_messages_round_trip(msg: BaseModel) -> None:
    text = m.encode(msg)
    back = m.parse_node_message(text)
    assert type(back) is type(msg)
    assert back == msg
    assert m.parse_node_message(text.encode()) == msg  # bytes are accepted too


@pytest.mark.parametrize("msg", COORDINATOR_MESSAGES, ids=lambda x: type(x).__name__)
def test_coordinator_messages_round_trip(msg: BaseModel) -> None:
    back = m.parse_coordinator_message(m.encode(msg))
    assert type(back) is type(msg)
    assert back == msg


def test_encoded_messages_carry_type_and_version() -> None:
    raw = json.loads(m.encode(m.Heartbeat(seq=1, step=2)))
    assert raw == {"v": m.PROTOCOL_VERSION, "type": "heartbeat", "seq": 1, "step": 2}


def test_coordinator_message_is_refused_by_the_node_parser_and_vice_versa() -> None:
    with pytest.raises(ProtocolError, match="does not match any of the expected tags"):
        m.parse_node_message(m.encode(m.Ack(seq=1)))
    with pytest.raises(ProtocolError, match="does not match any of the expected tags"):
        m.parse_coordinator_message(m.encode(m.Heartbeat(seq=1, step=1)))


@pytest.mark.parametrize("data", ["not json", "{", b"\xff\xfe\x00", ""])
def test_non_json_is_refused(data: str | bytes) -> None:
    with pytest.raises(ProtocolError, match="not valid JSON"):
        m.parse_node_message(data)


def test_unknown_type_is_refused_naming_the_type_and_the_known_ones() -> None:
    with pytest.raises(ProtocolError, match="'teleport'") as err:
        m.parse_node_message(json.dumps({"type": "teleport"}))
    assert "hello" in str(err.value) and "heartbeat" in str(err.value)


def test_missing_type_is_refused() -> None:
    with pytest.raises(ProtocolError, match="discriminator 'type'"):
        m.parse_node_message(json.dumps({"seq": 1}))


@pytest.mark.parametrize("data", ["[]", "3", '"hello"', "null"])
def test_non_object_json_is_refused(data: str) -> None:
    with pytest.raises(ProtocolError, match="invalid control message"):
        m.parse_node_message(data)


@pytest.mark.parametrize("version", [m.PROTOCOL_VERSION - 1, m.PROTOCOL_VERSION + 1, 0, str(m.PROTOCOL_VERSION)])
def test_unknown_protocol_version_is_refused_naming_the_version(version: object) -> None:
    with pytest.raises(ProtocolError, match="protocol version") as err:
        m.parse_node_message(heartbeat(v=version))
    assert repr(version) in str(err.value)
    assert f"speaks {m.PROTOCOL_VERSION}" in str(err.value)


def test_extra_field_is_refused_naming_it() -> None:
    with pytest.raises(ProtocolError, match=r"heartbeat\.surprise.*Extra inputs"):
        m.parse_node_message(heartbeat(surprise=1))


def test_extra_field_in_a_nested_model_is_refused() -> None:
    hello = json.loads(m.encode(NODE_MESSAGES[0]))
    hello["fingerprint"][0]["stride"] = [1]
    with pytest.raises(ProtocolError, match=r"fingerprint\.0\.stride"):
        m.parse_node_message(json.dumps(hello))


def test_missing_field_is_refused_naming_it() -> None:
    with pytest.raises(ProtocolError, match=r"heartbeat\.seq.*required"):
        m.parse_node_message(json.dumps({"type": "heartbeat", "step": 1}))


def test_oversized_message_is_refused_before_parsing() -> None:
    big = heartbeat(pad="x" * 2000)  # would also fail as an extra field; the size check comes first
    with pytest.raises(ProtocolError, match=r"exceeds the 1024-byte limit"):
        m.parse_node_message(big, limit=1024)


def test_message_at_the_limit_is_accepted() -> None:
    text = heartbeat()
    assert m.parse_node_message(text, limit=len(text)) == m.Heartbeat(seq=1, step=2)


def test_default_node_limit_is_one_mebibyte() -> None:
    with pytest.raises(ProtocolError, match="limit"):
        m.parse_node_message(" " * ((1 << 20) + 1))


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"seq": "abc"}, "heartbeat.seq"),
        ({"seq": [1]}, "heartbeat.seq"),
        ({"seq": None}, "heartbeat.seq"),
        ({"seq": 1.5}, "heartbeat.seq"),
        ({"seq": -1}, "heartbeat.seq"),
        ({"step": 2**60}, "heartbeat.step"),
        ({"step": {"a": 1}}, "heartbeat.step"),
    ],
)
def test_wrong_field_types_and_ranges_are_refused_naming_the_field(fields: dict[str, object], where: str) -> None:
    with pytest.raises(ProtocolError, match=rf"invalid control message at {where}"):
        m.parse_node_message(heartbeat(**fields))


@pytest.mark.parametrize(
    "fields",
    [
        {"seq": "3"},  # a string where an integer belongs
        {"seq": True},  # a boolean where an integer belongs
        {"v": True},  # `true` is not a protocol version
    ],
    ids=["string-for-int", "bool-for-int", "bool-version"],
)
def test_values_of_another_json_type_are_not_silently_coerced(fields: dict[str, object]) -> None:
    # The boundary is typed: a peer that sends the wrong JSON type speaks another protocol.
    with pytest.raises(ProtocolError):
        m.parse_node_message(heartbeat(**fields))


def test_hello_field_ranges_are_enforced() -> None:
    base = json.loads(m.encode(NODE_MESSAGES[1]))
    for field, bad in [("batch_size", 0), ("weight", 0), ("weight", -1.0), ("member_id", ""), ("job", "x" * 257)]:
        with pytest.raises(ProtocolError, match=f"hello.{field}"):
            m.parse_node_message(json.dumps({**base, field: bad}))


def test_a_node_name_with_an_escape_sequence_is_refused_at_its_knock_and_hello() -> None:
    # A name is shown in terminals and logs: an ESC in it would drive the operator's terminal.
    base = json.loads(m.encode(NODE_MESSAGES[1]))
    for field, bad in [("name", "ev\x1b[2Jil"), ("member_id", "ev\x9bil#1"), ("name", "a\u202eb")]:
        with pytest.raises(ProtocolError, match=f"hello.{field}: .*unprintable character") as err:
            m.parse_node_message(json.dumps({**base, field: bad}))
        assert str(err.value).isprintable(), str(err.value)  # the refusal shows it escaped
    with pytest.raises(ProtocolError, match=r"at member_id: .*unprintable character '\\x1b'"):
        m.parse_knock(m.encode(m.Knock(member_id="ok#1")).replace("ok#1", "o\\u001bk#1"))
    assert m.parse_node_message(json.dumps({**base, "name": "gpu-0 été 東京"})).name == "gpu-0 été 東京"  # type: ignore[union-attr]


def test_deeply_nested_json_is_refused_with_a_protocol_error() -> None:
    # 200 kB, well under the limit, but nested deeper than the JSON decoder can recurse.
    with pytest.raises(ProtocolError):
        m.parse_node_message("[" * 200_000)


def test_protocol_error_is_an_unbroken_error() -> None:
    from unbroken.errors import UnbrokenError

    with pytest.raises(UnbrokenError):
        m.parse_node_message("nope")
