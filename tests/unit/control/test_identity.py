"""Node identities: keys, signed knocks, member ids made from keys, the allow-list."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from unbroken.config import MembershipConfig
from unbroken.control import identity
from unbroken.control.membership import Membership
from unbroken.errors import ConfigError


def test_a_knock_proves_its_key_for_this_challenge_and_member_only() -> None:
    key = identity.ephemeral()
    mid = identity.member_id("a", key)
    knock = identity.knock(mid, "challenge-1", None, key)
    assert identity.verify(knock.key, knock.signature, "challenge-1", knock.nonce, mid) is None
    assert "another key, or a replay" in (
        identity.verify(knock.key, knock.signature, "challenge-2", knock.nonce, mid) or ""
    )
    other = identity.member_id("b", key)
    assert identity.verify(knock.key, knock.signature, "challenge-1", knock.nonce, other) is not None
    stranger = identity.public_text(identity.ephemeral())
    assert identity.verify(stranger, knock.signature, "challenge-1", knock.nonce, mid) is not None
    assert "malformed" in (identity.verify("ed25519:xyz", knock.signature, "challenge-1", knock.nonce, mid) or "")
    assert identity.verify(knock.key, "!!", "challenge-1", knock.nonce, mid) is not None


def test_a_member_id_is_its_keys_and_no_other_key_owns_it() -> None:
    a, b = identity.ephemeral(), identity.ephemeral()
    mid = identity.member_id("node", a)
    assert mid.startswith("node#") and identity.owns(identity.public_text(a), mid)
    assert not identity.owns(identity.public_text(b), mid)
    assert not identity.owns(identity.public_text(a), "node#deadbeef")
    assert identity.member_id("node", a) != mid, "a rejoin is a new member of the same key"


def test_a_key_file_is_made_once_private_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    made = identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert identity.public_text(identity.load_or_create(path)) == identity.public_text(made)
    with pytest.raises(ConfigError, match="never overwrites"):
        identity.create(path)
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "link.key").symlink_to(target)
    with pytest.raises(ConfigError, match="never overwrites"):
        identity.create(tmp_path / "link.key")
    assert target.read_text() == "keep"
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(ConfigError, match="is not a node key"):
        identity.load_or_create(tmp_path / "junk.key")
    os.chmod(path, 0o644)  # copied about carelessly: whoever reads it can join as this node
    with pytest.raises(ConfigError, match=r"mode 0644.*chmod 600"):
        identity.load_or_create(path)
    assert identity.public_text(identity.load_or_create(path, private=False)) == identity.public_text(made)
    os.chmod(path, 0o600)
    assert identity.public_text(identity.load_or_create(path)) == identity.public_text(made)


def test_the_allow_list_names_its_bad_line_and_is_read_again_when_it_changes(tmp_path: Path) -> None:
    a, b = (identity.public_text(identity.ephemeral()) for _ in range(2))
    path = tmp_path / "allowed"
    path.write_text(f"# the job's nodes\n{a}  node-a\n\n")
    allowed = identity.Allowed(path)
    assert allowed.admits(a) and not allowed.admits(b) and allowed.keys[a] == "node-a"
    path.write_text(f"{a}\n{b} node-b # added\n")
    os.utime(path, ns=(1, 1))  # another stamp, whatever the clock's resolution
    assert allowed.admits(b)
    path.write_text(f"{a}\nssh-ed25519 AAAA...\n")
    os.utime(path, ns=(2, 2))
    assert allowed.admits(b), "a bad edit keeps the keys read before"
    with pytest.raises(ConfigError, match=r"allowed:2: .* is not a node's public key"):
        identity.parse_allowed(path)


def test_a_member_id_bound_to_a_key_cannot_be_spoken_for_by_another() -> None:
    ms = Membership(MembershipConfig(lease_s=1.0), now=0.0)
    from unbroken.control.messages import Hello

    ka, kb = (identity.public_text(identity.ephemeral()) for _ in range(2))
    hello = Hello(job="j", job_identity="i", fingerprint=[], member_id="a#1", name="a", batch_size=4)
    assert ms.admit(hello, 0.0, key=ka).refuse is None
    assert "belongs to another node's key" in (ms.unbound("a#1", kb) or "")
    assert ms.unbound("a#1", ka) is None
    assert ms.unbound("c#1", ka) is None, "token mode: a key may be several members"
    assert "one member per key" in (ms.unbound("c#1", ka, one_per_key=True) or "")
    ms.tribunal.quarantined_keys.add(kb)
    assert "quarantined" in (ms.unbound("d#1", kb) or "")


def test_a_relayed_knock_is_good_on_its_link_once_and_a_relays_signature_is_no_nodes() -> None:
    from unittest.mock import MagicMock

    from unbroken.control.sessions import RelayLink

    async def links() -> None:
        link = RelayLink(MagicMock(), "relay#1", "", MagicMock())
        other = RelayLink(MagicMock(), "relay#2", "", MagicMock())
        first = f"{link.nonce}.1"
        assert link.fresh(first) is None
        assert "already used" in (link.fresh(first) or "")
        assert "no challenge of relay relay#2" in (other.fresh(first) or "")
        assert "no challenge" in (link.fresh("0" * 32) or "")
        assert "no challenge" in (link.fresh(f"{link.nonce}.x") or "")
        for s in (link.session, other.session):
            s.writer.cancel()

    asyncio.run(links())
    key = identity.ephemeral()
    rid = identity.member_id("relay", key)
    signature = identity.sign(key, "c", "n", rid, role="relay")
    assert identity.verify(identity.public_text(key), signature, "c", "n", rid, role="relay") is None
    assert identity.verify(identity.public_text(key), signature, "c", "n", rid) is not None


def test_members_whose_key_was_taken_off_are_expelled() -> None:
    from unbroken.control.messages import Hello

    ms = Membership(MembershipConfig(lease_s=1.0), now=0.0)
    ka, kb = (identity.public_text(identity.ephemeral()) for _ in range(2))
    for mid, key in (("a#1", ka), ("b#1", kb)):
        hello = Hello(job="j", job_identity="i", fingerprint=[], member_id=mid, name=mid[0], batch_size=4)
        assert ms.admit(hello, 0.0, key=key).refuse is None
    d = ms.revoke(lambda key: key == ka, 1.0)
    assert list(d.expel) == ["b#1"] and "taken off" in d.expel["b#1"] and list(ms.members) == ["a#1"]
