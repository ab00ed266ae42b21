"""What a job keeps in etcd, sealed by its writer and checked by every reader before use.

etcd holds two records per job: the leader key (who leads, under the leader's lease) and the
newest epoch published. Anyone who can write under the job's prefix can change them, so
nothing read there is acted on before it passes `leader_problem` or `epoch_problem`.

Why an HMAC under the job token, and not the coordinators' Ed25519 keys: a reader would
need the keys of every legitimate coordinator, which no flag lists today (candidates are
started on demand by nodes, `--coordinate`), whereas every coordinator, node and relay of a
job with a token already holds the token. A record sealed under a key derived from it
proves that a holder of the job's token wrote it, for this key of this prefix; a leader
record also names the lease it was written under, so an old genuine record written back
later (a replay) does not match the key's lease. Without a token, records cannot be
authenticated: they are still checked for shape, lease and bounds, and etcd itself must
keep outsiders out (``--etcd-cacert/--etcd-cert/--etcd-key``; docs/ops/coordinators.md).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
from typing import Any

from unbroken.config import parse_address
from unbroken.control.etcd import KeyValue
from unbroken.errors import ConfigError

log = logging.getLogger(__name__)

MAC_FIELD = "mac"
EPOCH_CEILING = 2**30
"""The highest epoch a published record may name. Epochs are capped at 2**31 on the wire
(`messages.EpochNo`); a record above half of that was not reached by counting epochs (a
job would need a billion membership changes) and would leave a new leader no room to
number its own, so it is ignored."""


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def _mac(token: str, key: bytes, record: dict[str, Any]) -> str:
    # A key of its own: a record's MAC can never be taken for a session's proof or seal.
    sealing = hmac.new(token.encode(), b"unbroken-etcd-record", hashlib.sha256).digest()
    return hmac.new(sealing, key + b"\0" + _canonical(record), hashlib.sha256).hexdigest()


def seal(token: str | None, key: bytes, record: dict[str, Any]) -> bytes:
    """``record`` as the value to write at ``key``: with its MAC when the job has a token."""
    body = {k: v for k, v in record.items() if k != MAC_FIELD}
    if token:
        body[MAC_FIELD] = _mac(token, key, body)
    return _canonical(body)


def opened(token: str | None, kv: KeyValue) -> tuple[dict[str, Any] | None, str]:
    """The record at ``kv`` without its MAC, or None and why it cannot be used."""
    try:
        data = json.loads(kv.value)
    except (ValueError, UnicodeDecodeError):
        return None, "is not JSON"
    if not isinstance(data, dict):
        return None, "is not a JSON object"
    mac = data.pop(MAC_FIELD, None)
    if token and not (isinstance(mac, str) and hmac.compare_digest(mac.encode(), _mac(token, kv.key, data).encode())):
        return None, (
            "is not sealed with the job token (written by someone without it: a forgery, or a "
            "coordinator of another job with the same --etcd-prefix)"
        )
    return data, ""


def leader_problem(kv: KeyValue, token: str | None) -> str | None:
    """Why the leader key's record must not be followed (None: it may be)."""
    if kv.lease == 0:
        # A key without a lease never expires: it would name a leader for ever after it died.
        return "has no lease (an elected leader's key always has one; this one was overwritten)"
    record, why = opened(token, kv)
    if record is None:
        return why
    if str(record.get("lease", "")) != str(kv.lease):
        return f"was written for lease {str(record.get('lease'))[:24]!r}, not the key's lease {kv.lease} (replayed)"
    try:
        parse_address(str(record.get("address", "")))
    except ConfigError:
        return f"names no usable address ({str(record.get('address'))[:60]!r})"
    if not isinstance(record.get("coordinator_id"), str):
        return "names no coordinator id"
    return None


def epoch_problem(kv: KeyValue, token: str | None) -> str | None:
    """Why the published epoch record must not be believed (None: it may be)."""
    record, why = opened(token, kv)
    if record is None:
        return why
    epoch, term = record.get("epoch"), record.get("term")
    if type(epoch) is not int or not 0 <= epoch <= EPOCH_CEILING:
        return f"names epoch {str(epoch)[:24]}, outside 0..{EPOCH_CEILING}"
    # The record was written under a term, i.e. after the leader key was created at revision
    # `term`: a term at or above the record's own revision was never held.
    if type(term) is not int or not 0 < term < kv.mod_revision:
        return f"names term {str(term)[:24]}, which no leader held before it was written (revision {kv.mod_revision})"
    return None


_WARNED: collections.OrderedDict[tuple[bytes, int], None] = collections.OrderedDict()


def warn_ignored(kv: KeyValue, why: str) -> None:
    """Log once per version of a key (readers poll it ten times a second) that it is ignored."""
    seen = (kv.key, kv.mod_revision)
    if seen in _WARNED:
        return
    _WARNED[seen] = None
    while len(_WARNED) > 64:
        _WARNED.popitem(last=False)
    log.warning(
        "ignoring the etcd record %s (revision %d): it %s", kv.key.decode(errors="replace"), kv.mod_revision, why
    )


def leader(kv: KeyValue | None, token: str | None) -> dict[str, Any] | None:
    """The leader record at ``kv`` when it may be followed; a forged one is warned of and None."""
    if kv is None:
        return None
    why = leader_problem(kv, token)
    if why is not None:
        warn_ignored(kv, why)
        return None
    return opened(token, kv)[0]


def epoch(kv: KeyValue | None, token: str | None) -> dict[str, Any] | None:
    """The published epoch record when it may be believed; a forged one is warned of and None."""
    if kv is None:
        return None
    why = epoch_problem(kv, token)
    if why is not None:
        warn_ignored(kv, why)
        return None
    return opened(token, kv)[0]
