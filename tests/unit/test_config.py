"""NodeConfig, CoordinatorConfig's sections and parse_address: errors that name the field and the range."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from unbroken.config import CoordinatorConfig, MembershipConfig, NodeConfig, ServiceConfig, parse_address
from unbroken.errors import ConfigError
from unbroken.specs import CodecSpec, DiLoCoPolicy, Fragments, Policy, Rule

ADDR = (("127.0.0.1", 29400),)


def test_defaults_are_valid() -> None:
    c = CoordinatorConfig()
    assert (c.service.host, c.service.port, c.membership.lease_s, c.membership.min_nodes) == (
        "127.0.0.1",
        29400,
        1.0,
        1,
    )
    assert c.policy == Policy()
    n = NodeConfig(coordinators=ADDR)
    assert n.weight == 1.0 and n.checkpoint_dir is None


@pytest.mark.parametrize(
    ("owner", "field", "value", "range_words"),
    [
        (ServiceConfig, "port", -1, "between 0 and 65535"),
        (ServiceConfig, "port", 65536, "between 0 and 65535"),
        (ServiceConfig, "max_message_bytes", 100, "at least 1024"),
        (MembershipConfig, "build_deadline_s", 0.1, "between 0.5 and 3600"),
        (MembershipConfig, "lease_s", 0.01, "between 0.05 and 3600"),
        (MembershipConfig, "lease_s", 7200.0, "between 0.05 and 3600"),
        (MembershipConfig, "recovery_window_s", -1.0, "between 0 and 3600"),
        (MembershipConfig, "min_nodes", 0, "between 1 and 100000"),
        (Policy, "streams", 0, "between 1 and 16"),
        (Policy, "bucket_mb", -1.0, "between 0 and 1024.0"),
        (Policy, "audit_every", -1, "between 0 and 1000000"),
        (DiLoCoPolicy, "inner_steps", 0, "between 1 and 1000000"),
        (DiLoCoPolicy, "outer_lr", float("nan"), "between 1e-06 and 100"),
        (DiLoCoPolicy, "outer_momentum", 1.0, "between 0 and 0.999"),
        (CodecSpec, "name", "int3", "is not one of none, fp16"),
    ],
)
def test_coordinator_config_errors_name_the_section_field_value_and_range(
    owner: type, field: str, value: float, range_words: str
) -> None:
    with pytest.raises(ConfigError) as err:
        owner(**{field: value})
    msg = str(err.value)
    assert f"{owner.__name__}.{field} = {value!r}" in msg
    assert range_words in msg


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"codec": "int3"}, "Policy.codec: codec 'int3' is not one of"),
        ({"mode": "async"}, "Policy.mode = 'async': choose 'sync' or 'diloco'"),
        ({"aggregate": "median"}, "Policy.aggregate: aggregation 'median' is not one of"),
        ({"fragments": "3"}, "fragments '3' is not K,M"),
        ({"inner_steps": 0}, "DiLoCoPolicy.inner_steps = 0"),  # refused in synchronous mode too
    ],
)
def test_a_policy_spelled_as_flags_names_what_does_not_parse(flags: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        Policy.parse(**flags)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "range_words"),
    [
        ("max_microbatch", -1, "at least 0"),
        ("checkpoint_every", -5, "at least 0"),
        ("connect_timeout_s", 0.0, "between 0.1 and 86400"),
        ("connect_timeout_s", 1e6, "between 0.1 and 86400"),
        ("collective_timeout_s", 0.5, "between 1 and 86400"),
        ("digest_every", -1, "at least 0"),
    ],
)
def test_node_config_errors_name_the_field_value_and_range(field: str, value: float, range_words: str) -> None:
    with pytest.raises(ConfigError) as err:
        NodeConfig(coordinators=ADDR, **{field: value})  # type: ignore[arg-type]
    msg = str(err.value)
    assert f"NodeConfig.{field} = {value!r}" in msg
    assert range_words in msg


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan")])
def test_node_weight_must_be_positive(weight: float) -> None:
    with pytest.raises(ConfigError, match=r"NodeConfig\.weight = .* must be greater than 0"):
        NodeConfig(coordinators=ADDR, weight=weight)


def test_a_node_needs_a_coordinator_and_says_how_to_give_one() -> None:
    with pytest.raises(ConfigError, match=r"NodeConfig\.coordinators is empty") as err:
        NodeConfig()
    assert "--coordinator" in str(err.value) and "UNBROKEN_COORDINATOR" in str(err.value)


def test_checkpoint_every_needs_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        NodeConfig(coordinators=ADDR, checkpoint_every=10)
    assert NodeConfig(coordinators=ADDR, checkpoint_every=10, checkpoint_dir=tmp_path).checkpoint_every == 10


def test_forwarding_says_what_it_needs() -> None:
    token = "a-job-token-0123456789"
    with pytest.raises(ConfigError, match="needs the job's token"):
        NodeConfig(coordinators=ADDR, no_inbound=True, forwarders=(("10.0.0.5", 7800),))
    with pytest.raises(ConfigError, match="needs the job's token"):
        NodeConfig(coordinators=ADDR, offer_forwarding=("0.0.0.0", 7800))
    n = NodeConfig(coordinators=ADDR, forwarders=(("10.0.0.5", 7800),), token=token)
    assert not n.no_inbound, "a forwarder alone: used where it finds this node unreachable"
    assert NodeConfig(coordinators=ADDR, no_inbound=True, token=token).forwarders == (), "members may offer one"


def test_a_node_name_must_be_printable_and_the_error_shows_it_escaped() -> None:
    with pytest.raises(ConfigError, match=r"NodeConfig\.name 'ev\\x1b\[31mil' holds the unprintable character '\\x1b'"):
        NodeConfig(coordinators=ADDR, name="ev\x1b[31mil")
    assert NodeConfig(coordinators=ADDR, name="gpu été 東京").display_name == "gpu été 東京"


def test_display_name_defaults_to_host_and_pid() -> None:
    assert NodeConfig(coordinators=ADDR, name="gpu-box").display_name == "gpu-box"
    assert "-" in NodeConfig(coordinators=ADDR).display_name


@pytest.mark.parametrize(
    ("cls", "field"),
    [
        (MembershipConfig, "lease_s"),
        (MembershipConfig, "recovery_window_s"),
        (NodeConfig, "connect_timeout_s"),
        (NodeConfig, "collective_timeout_s"),
    ],
)
def test_nan_is_out_of_every_range(cls: type, field: str) -> None:
    # NaN compares false with everything; a NaN lease would never expire anyone.
    kwargs: dict[str, object] = {"coordinators": ADDR} if cls is NodeConfig else {}
    with pytest.raises(ConfigError, match=field):
        cls(**kwargs, **{field: float("nan")})


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:29400", ("127.0.0.1", 29400)),
        (" node7:1 ", ("node7", 1)),
        ("example.org:65535", ("example.org", 65535)),
        ("[::1]:8080", ("::1", 8080)),
    ],
)
def test_parse_address(text: str, want: tuple[str, int]) -> None:
    assert parse_address(text) == want


@pytest.mark.parametrize(
    "text", ["", "host", "host:", ":29400", "host:0", "host:65536", "host:port", "host:-1", "host:80 80", "host:²"]
)
def test_parse_address_errors_show_the_expected_form(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_address(text)
    assert repr(text) in str(err.value)
    assert "HOST:PORT" in str(err.value) and "127.0.0.1:29400" in str(err.value)


@pytest.mark.parametrize(
    ("policy", "words"),
    [
        (lambda: Policy(aggregate=Rule("clip", 0.5)), "the clip bound must be at least 1"),
        (lambda: Policy(aggregate=Rule("bogus")), "Rule.kind = 'bogus' is not one of"),
        (lambda: Policy(fragments=Fragments(0, 0)), "fragments '0,0': need 1 <= K <= 128"),
    ],
)
def test_a_typed_policy_checks_its_parts_as_the_flags_are(policy: Callable[[], Policy], words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        policy()


def test_robust_rules_without_a_value_take_their_default() -> None:
    assert Rule("clip") == Rule("clip", 2.0) and Rule("trimmed") == Rule("trimmed", 0.25)


def test_the_security_line_says_who_may_join_and_warns_where_anyone_may(tmp_path: Path) -> None:
    assert "anyone on this machine" in ServiceConfig().security()
    wide = ServiceConfig(host="0.0.0.0").security()
    assert "ANYONE who reaches 0.0.0.0:29400" in wide and "--token-file" in wide and "plain TCP" in wide
    allowed = tmp_path / "allowed"
    tight = ServiceConfig(host="0.0.0.0", token="s3cret", allowed_keys=allowed).security()
    assert "token" in tight and str(allowed) in tight and "ANYONE" not in tight and "with the token" in tight
    assert "s3cret" not in tight
    assert "unauthenticated" in ServiceConfig(etcd=("http://127.0.0.1:2379",)).security()
    assert "listed keys alone" in ServiceConfig(host="0.0.0.0", allowed_keys=allowed).security()
    assert "this machine" in ServiceConfig(host="127.0.1.1").security()
