"""Job tokens: who may join, and proof that the coordinator is the job's.

Mutual challenge-response over the control session, with HMAC-SHA256 keyed by the job's
token; the token itself never crosses the wire::

    coordinator → node   challenge {nonce_c}                       (fresh per session)
    node → coordinator   hello {nonce_n, proof_n = HMAC(token, "node" | nonce_c | nonce_n | member)}
    coordinator → node   welcome {proof_c = HMAC(token, "coordinator" | nonce_c | nonce_n | member),
                                  rendezvous key}

A replayed hello fails: its proof is bound to another session's challenge. A node checks
``proof_c`` before it trusts any order, so an impostor coordinator cannot steer it. The
rendezvous key (random per coordinator) is part of every process-group prefix, so only
admitted members know where in the store the groups meet.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from unbroken.errors import ConfigError

ENV_TOKEN = "UNBROKEN_TOKEN"
MIN_TOKEN_CHARS = 16


def new_nonce() -> str:
    return secrets.token_hex(16)


def _mac(token: str, role: str, challenge: str, nonce: str, member_id: str) -> str:
    message = "\0".join((role, challenge, nonce, member_id)).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def node_proof(token: str, challenge: str, nonce: str, member_id: str) -> str:
    return _mac(token, "unbroken-node", challenge, nonce, member_id)


def coordinator_proof(token: str, challenge: str, nonce: str, member_id: str) -> str:
    return _mac(token, "unbroken-coordinator", challenge, nonce, member_id)


def same(a: str, b: str) -> bool:
    """Constant-time comparison (no timing oracle on the proof)."""
    return hmac.compare_digest(a.encode(), b.encode())


def unproven(
    token: str | None, challenge: str, nonce: str, member_id: str, proof: str, *, who: str, checker: str
) -> str | None:
    """Why a ``who`` (node, relay) did not prove it holds the job token to its ``checker``
    (coordinator, relay) in answer to ``challenge`` (missing, wrong or replayed), or None."""
    if token is None:
        return None
    if not proof:
        return (
            f"this job requires a token: start the {who} with --token, --token-file or ${ENV_TOKEN} "
            f"set to the {checker}'s"
        )
    if not same(node_proof(token, challenge, nonce, member_id), proof):
        return f"the job token does not match the {checker}'s (or the handshake was replayed)"
    return None


def load_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The job token from ``--token``, ``--token-file`` or ``$UNBROKEN_TOKEN`` (in that order)."""
    if token and token_file:
        raise ConfigError("give the job token once: --token or --token-file, not both")
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {token_file}: {exc.strerror or exc}") from None
        if not token:
            raise ConfigError(f"the token file {token_file} is empty")
    token = token or os.environ.get(ENV_TOKEN) or None
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"the job token is {len(token)} characters long; use at least {MIN_TOKEN_CHARS} "
            "(e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)"
        )
    return token
