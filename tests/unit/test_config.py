"""NodeConfig, CoordinatorConfig and parse_address: errors that name the field and the range."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.config import CoordinatorConfig, NodeConfig, parse_address
from unbroken.errors import ConfigError

ADDR = (("127.0.0.1", 29400),)


def test_defaults_are_valid() -> None:
    c = CoordinatorConfig()
    assert (c.host, c.port, c.lease_s, c.min_nodes) == ("127.0.0.1", 29400, 1.0, 1)
    n = NodeConfig(coordinators=ADDR)
    assert n.weight == 1.0 and n.checkpoint_dir is None


@pytest.mark.parametrize(
    ("field", "value", "range_words"),
    [
        ("port", -1, "between 0 and 65535"),
        ("port", 65536, "between 0 and 65535"),
        ("build_deadline_s", 0.1, "between 0.5 and 3600"),
        ("lease_s", 0.01, "between 0.05 and 3600"),
        ("lease_s", 7200.0, "between 0.05 and 3600"),
        ("recovery_window_s", -1.0, "between 0 and 3600"),
        ("min_nodes", 0, "between 1 and 100000"),
        ("max_message_bytes", 100, "at least 1024"),
    ],
)
def test_coordinator_config_errors_name_the_field_value_and_range(field: str, value: float, range_words: str) -> None:
    with pytest.raises(ConfigError) as err:
        CoordinatorConfig(**{field: value})  # type: ignore[arg-type]
    msg = str(err.value)
    assert f"CoordinatorConfig.{field} = {value!r}" in msg
    assert range_words in msg


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


def test_display_name_defaults_to_host_and_pid() -> None:
    assert NodeConfig(coordinators=ADDR, name="gpu-box").display_name == "gpu-box"
    assert "-" in NodeConfig(coordinators=ADDR).display_name


@pytest.mark.parametrize(
    ("cls", "field"),
    [
        (CoordinatorConfig, "lease_s"),
        (CoordinatorConfig, "recovery_window_s"),
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
