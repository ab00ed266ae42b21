"""Each policy default has one home (`unbroken.specs`): the config, the wire and the CLI agree."""

from __future__ import annotations

import inspect
from typing import get_args

import pytest

from unbroken import specs
from unbroken.cli.main import _policy, build_parser
from unbroken.config import CoordinatorConfig
from unbroken.control import messages as m
from unbroken.errors import ConfigError


def test_diloco_defaults_are_the_same_in_the_config_the_epoch_order_and_the_cli() -> None:
    order = m.PolicyMsg.model_fields
    cli = build_parser().parse_args(["coordinator"])
    typed = specs.DiLoCoPolicy()
    for name, default in (
        ("inner_steps", specs.INNER_STEPS),
        ("outer_lr", specs.OUTER_LR),
        ("outer_momentum", specs.OUTER_MOMENTUM),
    ):
        assert getattr(typed, name) == order[name].default == getattr(cli, name) == default, name
    for name, default in (
        ("streams", specs.STREAMS),
        ("bucket_mb", specs.BUCKET_MB),
        ("audit_every", specs.AUDIT_EVERY),
    ):
        assert getattr(specs.Policy(), name) == order[name].default == getattr(cli, name) == default, name
    for name, default in (("codec", "none"), ("aggregate", "mean"), ("fragments", "")):
        assert order[name].default == getattr(cli, name) == default, name
    assert m.PolicyMsg().parsed() == specs.Policy() == CoordinatorConfig().policy
    assert tuple(m.PolicyMsg.model_fields) == specs.POLICY_FLAGS
    assert tuple(inspect.signature(specs.Policy.parse).parameters) == specs.POLICY_FLAGS
    assert all(hasattr(cli, name) for name in specs.POLICY_FLAGS)


def test_the_policy_is_parsed_once_and_carried_whole() -> None:
    policy = specs.Policy.parse(
        mode="diloco", codec="topk:0.05", aggregate="clip:3", fragments="3,2", outer_overlap=True
    )
    assert policy.mode is specs.Mode.DILOCO and policy.diloco == specs.DiLoCoPolicy(overlap=True)
    assert policy.codec == specs.CodecSpec("topk", 0.05) and policy.aggregate == specs.Rule("clip", 3.0)
    assert policy.fragments == specs.Fragments(3, 2)
    wire = m.PolicyMsg.model_validate_json(m.PolicyMsg.of(policy).model_dump_json())
    assert wire.parsed() == policy
    argv = ["coordinator", "--mode", "diloco", "--codec", "topk:0.05", "--aggregate", "clip:3", "--fragments", "3,2"]
    cli = build_parser().parse_args([*argv, "--outer-overlap"])
    assert specs.Policy.parse(**{name: getattr(cli, name) for name in specs.POLICY_FLAGS}) == policy


def test_roles_a_node_may_ask_for_are_the_same_everywhere() -> None:
    assert tuple(p.value for p in m.Hello.model_fields["role"].annotation) == specs.ROLES  # type: ignore[union-attr]
    assert {r.value for r in get_args(m.RoleName)[0]} == set(specs.ROLES) - {"auto"}
    node = next(a for a in build_parser()._actions if a.dest == "command").choices["node"]  # type: ignore[union-attr]
    role = next(a for a in node._actions if a.dest == "role")
    assert tuple(role.choices) == specs.ROLES  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--codec", "int3"], "--codec: codec 'int3' is not one of"),
        (["--aggregate", "median"], "--aggregate: aggregation 'median' is not one of"),
        (["--inner-steps", "0"], "--inner-steps = 0 is out of range"),
        (["--outer-momentum", "1"], "--outer-momentum = 1.0 is out of range"),
        (["--streams", "99"], "--streams = 99 is out of range"),
    ],
)
def test_a_bad_policy_flag_is_named_as_it_was_typed(argv: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _policy(build_parser().parse_args(["coordinator", *argv]))
    assert words in str(err.value)


def test_top_k_without_a_ratio_takes_the_default_one() -> None:
    assert specs.CodecSpec("topk") == specs.CodecSpec("topk", specs.TOPK_RATIO) == specs.CodecSpec.parse("topk")
