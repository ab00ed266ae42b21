"""Node identities: an Ed25519 key per node, and the keys a job admits.

Every node signs the coordinator's challenge with its own key at the knock (`sign`); the
coordinator checks the signature (`verify`) and binds the member id to the key for the
life of the member: a later hello with that member id (a reconnect) must be signed by the
same key, so a token holder cannot take over another member's session, nor speak for it
(`unbroken.control.membership`). The job token stays the simplest way to admit nodes:
with it alone, any holder may bring a key of its own. A job that names its nodes gives
the coordinator ``--allowed-keys FILE``, one public key a line, as ``unbroken keygen``
prints them; then only those keys join, and each key is one member at a time::

    unbroken keygen node-a.key            # writes the key (mode 0600), prints its public line
    echo "ed25519:…  node-a" >> allowed   # on the coordinator's machine
    unbroken coordinator --allowed-keys allowed ...
    unbroken node job.py --key node-a.key ...

The file is read again whenever it changes, so admitting a node needs no restart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from unbroken.control import auth
from unbroken.control import messages as m
from unbroken.errors import ConfigError

log = logging.getLogger(__name__)

SCHEME = "ed25519:"
KEY_CHARS = len(SCHEME) + 43
"""A public key's text: the scheme and 32 bytes in unpadded base64url."""
SIGNATURE_CHARS = 86
"""A signature's text: 64 bytes in unpadded base64url."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def public_text(key: Ed25519PrivateKey) -> str:
    """``ed25519:`` and the public key (what an allow-list holds, and a knock carries)."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return SCHEME + _b64(raw)


def key_id(public: str) -> str:
    """A name of a public key (32 hex characters of its SHA-256), for member ids and logs."""
    return hashlib.sha256(public.encode()).hexdigest()[:32]


OWNER_CHARS = 24
"""Hex characters of the key's id a member id carries (96 bits: no key is found to match
another's by trying keys; 48 would be days on GPUs)."""


def member_id(name: str, key: Ed25519PrivateKey) -> str:
    """A new member id for a session of this node: its name, its key's id and a few random
    characters (a node that rejoins is a new member, of the same key)."""
    return f"{name}#{key_id(public_text(key))[:OWNER_CHARS]}.{secrets.token_hex(2)}"


def owns(public: str, member_id: str) -> bool:
    """Whether ``member_id`` was made from this key (`member_id`): whoever says hello as a
    member id must hold its key, so no session speaks as another member, whatever the
    coordinator remembers (a new leader knows no member ids yet)."""
    owner = member_id.rpartition("#")[2].partition(".")[0]
    return owner == key_id(public)[:OWNER_CHARS]


def _message(role: str, challenge: str, nonce: str, member_id: str, public: str) -> bytes:
    return "\0".join(("unbroken-identity", role, challenge, nonce, member_id, public)).encode()


def sign(key: Ed25519PrivateKey, challenge: str, nonce: str, member_id: str, role: str = "node") -> str:
    """The signature of this session's challenge, the signer's own nonce, its id and its
    ``role`` (``node`` or ``relay``: a relay's signed hello is no node's knock)."""
    return _b64(key.sign(_message(role, challenge, nonce, member_id, public_text(key))))


def knock(member_id: str, challenge: str, token: str | None, key: Ed25519PrivateKey) -> m.Knock:
    """A node's first message of a session: its token proof and its key's signature."""
    nonce = auth.new_nonce()
    proof = auth.node_proof(token, challenge, nonce, member_id) if token else ""
    signature = sign(key, challenge, nonce, member_id)
    return m.Knock(member_id=member_id, nonce=nonce, proof=proof, key=public_text(key), signature=signature)


def verify(public: str, signature: str, challenge: str, nonce: str, member_id: str, role: str = "node") -> str | None:
    """Why ``signature`` does not prove that the holder of ``public`` answered ``challenge``
    as ``member_id`` (a malformed key, or a signature by another key or of another session),
    or None."""
    try:
        if not public.startswith(SCHEME) or len(public) != KEY_CHARS:
            raise ValueError("not an ed25519 key")
        pub = Ed25519PublicKey.from_public_bytes(_unb64(public[len(SCHEME) :]))
        pub.verify(_unb64(signature), _message(role, challenge, nonce, member_id, public))
    except (ValueError, binascii.Error):
        return f"its node key {public[:60]!r} or its signature is malformed"
    except InvalidSignature:
        return "its signature is not its key's answer to this session's challenge (another key, or a replay)"
    return None


def load_or_create(path: Path, *, private: bool = True) -> Ed25519PrivateKey:
    """The node key in ``path``, written there first (mode 0600, never over another file)
    where there is none. ``private``: refused where others than its owner may read it (as
    ssh refuses such a key: whoever reads it can join as this node)."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read()
    except FileNotFoundError:
        return create(path)
    except OSError as exc:
        raise ConfigError(f"cannot read the node key {path}: {exc.strerror or exc}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except ValueError as exc:
        raise ConfigError(
            f"{path} is not a node key (an unencrypted PEM Ed25519 key, as `unbroken keygen` writes): {exc}"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path} holds a {type(key).__name__}, not an Ed25519 key: make one with `unbroken keygen`")
    if private and mode & 0o077:
        raise ConfigError(
            f"the node key {path} may be read by others than its owner (mode {stat.S_IMODE(mode):04o}): whoever "
            f"reads it can join as this node. Make it private with `chmod 600 {path}` (and make a new key, "
            "taking the old one off --allowed-keys, if others may have read it)"
        )
    return key


def create(path: Path) -> Ed25519PrivateKey:
    """A new key, written to ``path`` readable by its owner alone; an existing file is refused."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path} exists: `unbroken keygen` never overwrites a key (`unbroken keygen --show {path}` prints "
            "its public line)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot write the node key {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public = public_text(key)
    log.info("made a new node key %s: %s (id %s; in no allow-list yet)", path, public, key_id(public))
    return key


def ephemeral() -> Ed25519PrivateKey:
    """A key for this process alone (a node given no ``--key``: a job admitting by token)."""
    return Ed25519PrivateKey.generate()


@dataclass
class Allowed:
    """The keys a job admits (``--allowed-keys``): ``ed25519:… [name]`` a line, ``#`` comments.

    Read again when the file changes; a file that cannot be read or parsed keeps the keys
    read before (a half-written edit admits nobody new, and expels nobody)."""

    path: Path
    keys: dict[str, str] = field(default_factory=dict)
    """Public key → the name the file gives it ("" where none)."""
    _stamp: tuple[int, int] = (-1, -1)

    def __post_init__(self) -> None:
        self.keys = parse_allowed(self.path)  # a bad file at start is a configuration error
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int]:
        try:
            st = self.path.stat()
        except OSError:
            return (-1, -1)
        return (st.st_mtime_ns, st.st_size)

    def admits(self, public: str) -> bool:
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.keys = parse_allowed(self.path)
                log.info("read %d allowed keys from %s", len(self.keys), self.path)
            except ConfigError as exc:
                log.warning("the allowed keys were not read again (the keys read before stand): %s", exc)
        return public in self.keys


def parse_allowed(path: Path) -> dict[str, str]:
    """The allow-list's keys (with their names), or a `ConfigError` naming the bad line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the allowed keys {path}: {exc.strerror or exc}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        public, name = words[0], " ".join(words[1:])
        if not public.startswith(SCHEME) or len(public) != KEY_CHARS:
            raise ConfigError(
                f"{path}:{number}: {public[:60]!r} is not a node's public key (`unbroken keygen FILE` prints one: "
                f"{SCHEME}… followed by 43 characters)"
            )
        try:
            Ed25519PublicKey.from_public_bytes(_unb64(public[len(SCHEME) :]))
        except (ValueError, binascii.Error):
            raise ConfigError(f"{path}:{number}: {public[:60]!r} is not a valid Ed25519 public key") from None
        keys[public] = name
    return keys
