"""Token proofs and token loading."""

from __future__ import annotations

import pytest

from unbroken.control import auth
from unbroken.errors import ConfigError


def test_proofs_depend_on_every_input_and_on_the_role() -> None:
    p = auth.node_proof("t" * 16, "c", "n", "m")
    assert p == auth.node_proof("t" * 16, "c", "n", "m")
    for other in (
        auth.node_proof("u" * 16, "c", "n", "m"),
        auth.node_proof("t" * 16, "c2", "n", "m"),
        auth.node_proof("t" * 16, "c", "n2", "m"),
        auth.node_proof("t" * 16, "c", "n", "m2"),
        auth.coordinator_proof("t" * 16, "c", "n", "m"),
    ):
        assert not auth.same(p, other)
    assert "t" * 16 not in p


def test_tokens_load_from_flag_file_or_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(auth.ENV_TOKEN, raising=False)
    assert auth.load_token() is None
    assert auth.load_token("a" * 16) == "a" * 16
    f = tmp_path / "token"
    f.write_text("b" * 20 + "\n")
    assert auth.load_token(token_file=str(f)) == "b" * 20
    monkeypatch.setenv(auth.ENV_TOKEN, "c" * 16)
    assert auth.load_token() == "c" * 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token": "short"}, "use at least 16"),
        ({"token": "a" * 16, "token_file": "x"}, "not both"),
        ({"token_file": "/no/such/file"}, "cannot read the token file"),
    ],
)
def test_bad_tokens_are_clear_errors(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        auth.load_token(**kwargs)
