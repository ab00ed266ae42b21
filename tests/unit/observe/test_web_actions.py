"""Operator actions need the job's token; a job without one takes none unless the operator
started the coordinator with ``--open-control``, and then from its machine only."""

from __future__ import annotations

from unbroken.observe.web import control_refusal

TOKEN = "s3cret-operator-token"


def test_with_a_token_an_action_needs_it() -> None:
    assert control_refusal(TOKEN, False, "10.0.0.9", f"Bearer {TOKEN}") is None
    for given in ("", "Bearer wrong-token-00000", TOKEN, f"Basic {TOKEN}"):
        why = control_refusal(TOKEN, False, "127.0.0.1", given)
        assert why is not None and "Authorization: Bearer" in why, given


def test_without_a_token_actions_are_off_and_the_refusal_says_how_to_turn_them_on() -> None:
    why = control_refusal(None, False, "127.0.0.1", "")
    assert why is not None and "--token-file" in why and "--open-control" in why


def test_open_control_takes_actions_from_this_machine_only() -> None:
    assert control_refusal(None, True, "127.0.0.1", "") is None
    assert control_refusal(None, True, "::1", "") is None
    why = control_refusal(None, True, "192.168.1.7", "")
    assert why is not None and "coordinator's machine" in why
