"""Job tokens: who may join, and proof that the coordinator is the job's.

Mutual challenge-response over the control session, with HMAC-SHA256 keyed by the job's
token; the token itself never crosses the wire::

    coordinator → node   challenge {nonce_c}                       (fresh per session)
    node → coordinator   knock {nonce_n, proof_n = HMAC(token, "node" | nonce_c | nonce_n | member)}
    node → coordinator   hello                                     (sealed)
    coordinator → node   welcome {proof_c = HMAC(token, "coordinator" | nonce_c | nonce_n | member)}

A replayed knock fails: its proof is bound to another session's challenge. Nothing but the
knock (a few hundred bytes) is read before it is proven. A node checks ``proof_c`` before it
trusts any order, so an impostor coordinator cannot steer it. Every message after the
knock, both ways, is sealed (`Seal`): an HMAC under a key derived from the token and both
nonces, so the token protects the whole session even without TLS. The data plane's
rendezvous travels on these sessions (`unbroken.control.meeting`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from unbroken.errors import ConfigError, ProtocolError

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


MAC_CHARS = 32
"""Hex characters of the HMAC in front of every message of a session with a token (128 bits)."""


class Seal:
    """Authenticates a session's messages after its handshake, with or without TLS.

    Each message travels with an HMAC under a key derived from the job token and the
    handshake's two nonces, over the message, its direction and its number in the session:
    a message injected by anyone on the path, altered, replayed, reordered or sent back the
    other way fails, and the session is dropped (the peers reconnect). Encryption is TLS's
    job (``--tls-cert``); this makes the token protect every message, not the handshake alone.
    """

    def __init__(self, token: str, challenge: str, nonce: str, peer_id: str, *, sending: str) -> None:
        """``sending``: this side's direction, ``up`` (a node or relay to its leader) or ``down``."""
        material = "\0".join(("unbroken-session", challenge, nonce, peer_id)).encode()
        self._key = hmac.new(token.encode(), material, hashlib.sha256).digest()
        self._sending = sending
        self._receiving = "down" if sending == "up" else "up"
        self._sent = 0
        self._received = 0

    def seal(self, text: str) -> str:
        self._sent += 1
        return self._mac(self._sending, self._sent, text) + text

    def open(self, frame: str) -> str:
        """The message of ``frame``; raises `ProtocolError` when it fails its authentication."""
        self._received += 1
        mac, text = frame[:MAC_CHARS], frame[MAC_CHARS:]
        if len(mac) != MAC_CHARS or not same(mac, self._mac(self._receiving, self._received, text)):
            raise ProtocolError(
                "a message failed its authentication (injected, altered or replayed on the way): session dropped"
            )
        return text

    def _mac(self, direction: str, number: int, text: str) -> str:
        head = f"{direction}\0{number}\0".encode()
        return hmac.new(self._key, head + text.encode(), hashlib.sha256).hexdigest()[:MAC_CHARS]


def seal(token: str | None, challenge: str, nonce: str, peer_id: str, *, sending: str) -> Seal | None:
    """The session's `Seal`, or None for a job without a token (messages go as they are)."""
    return Seal(token, challenge, nonce, peer_id, sending=sending) if token else None


def sealed(s: Seal | None, text: str) -> str:
    return s.seal(text) if s is not None else text


def opened(s: Seal | None, frame: str) -> str:
    return s.open(frame) if s is not None else frame
