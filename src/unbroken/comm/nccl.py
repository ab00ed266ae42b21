"""A sharded zone's NCCL group: its environment, its build over the zone's gloo group, and its
reuse from one epoch to the next.

NCCL's members meet by an id rank 0 draws and writes to a store. Each member gives the
group a private in-memory store; rank 0's entries are carried to the others over the
zone's gloo group (`relay_entries`), so the id travels only among the epoch's admitted
members and no store listens on a port; each member checks what it reads (a malformed relay
fails the build, as a failed collective does). What rank 0's build came to travels the
same way: a build that fails on rank 0 would otherwise leave the others waiting, in NCCL's
own connect, for the whole deadline::

    rank 0                                   every other rank
    build on a helper thread                 build on a helper thread (waits for the id)
    relay: its id, or why it has none   -->  the id into its store, or fail now with rank 0's reason
    its build ends, ok or failed             wait: its own build, or rank 0's outcome
    outcome: "" or why it failed        -->  a failure fails it now with rank 0's reason

A build that fails here for a reason no peer has a part in (the device could not be set,
the group's constructor, rank 0's drawing of the id before it went out) raises
`NcclRefused`: this member's own NCCL refused. Anything else (a connect, a store that never
got rank 0's id, a relay or outcome lost with a peer, a deadline) may be a peer's doing
and is a plain `CollectiveFailed`.

A communicator costs a build (rank 0's id, every pair's connection) and some device
memory; a zone whose members and ranks did not change keeps the one it has (`Communicator`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any, NamedTuple

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator
from torch.distributed import HashStore, PrefixStore  # type: ignore[attr-defined]

from unbroken.comm.group import POLL_DEVICE_S, EpochScope, ProcessGroup, wait_all, wait_until
from unbroken.errors import CollectiveFailed, NcclRefused

log = logging.getLogger(__name__)

NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
"""Set at a GPU node's start (`nccl_environment`). A collective past the group's own
timeout makes torch's watchdog tear the whole process down by default (3); 2 aborts the
communicator and fails the work instead: the node lives on to the next epoch, as with gloo.
The heartbeat monitor would kill a process whose watchdog waits in an abort: off."""

OUTCOME_BYTES = 1024
"""The most of rank 0's failure that its outcome carries (`build_nccl`)."""

RELAY_BYTES = 64 << 10
"""The most a relay of rank 0's entries may take (`relay_entries`): NCCL's id is 128 bytes;
a longer length is a corrupt relay, not a buffer to allocate."""

_COSTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "a collective past its timeout may end this whole process, not only the epoch",
    "TORCH_NCCL_ENABLE_MONITORING": "torch's heartbeat monitor may end a process whose watchdog waits in an abort",
}
"""What a user's own setting of each costs (said when it is kept)."""

_environment_lock = threading.Lock()
_environment_set = False


def nccl_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put `NCCL_ENV` in the process's environment, once, before any NCCL group exists
    (torch reads them when a group is built). A setting the user gave is kept, and said:
    their choice, with what it costs. Returns the user's settings that differ from ours.
    ``environ``: the process's environment (another mapping in tests, set every call)."""
    global _environment_set
    target = os.environ if environ is None else environ
    with _environment_lock:
        if environ is None and _environment_set:
            return {}
        theirs = {k: target[k] for k, ours in NCCL_ENV.items() if target.get(k, ours) != ours}
        for key, ours in NCCL_ENV.items():
            target.setdefault(key, ours)
        if environ is None:
            _environment_set = True
    for key, value in theirs.items():
        log.warning(
            "%s=%s is set in the environment and kept over ours (%s): %s",
            key, value, NCCL_ENV[key], _COSTS[key],
        )  # fmt: skip
    return theirs


class Built(NamedTuple):
    """An NCCL group `build_nccl` built."""

    pg: Any
    seconds: float
    token: str
    """Names this communicator: a hash of rank 0's id, the same on each of its members and
    on no other build's (`Communicator`)."""


def relay_entries(
    store: Any,
    over: ProcessGroup,
    rank: int,
    scope: EpochScope,
    what: str,
    done: Callable[[], bool],
    failed: Callable[[], str | None] = lambda: None,
) -> dict[str, bytes]:
    """Copy what rank 0's build wrote to its ``store`` into every member's (its id, for
    NCCL): rank 0 waits for its first entry, then broadcasts them all over ``over``. Where
    rank 0's build ended (``done``) having written nothing, it broadcasts why (``failed``)
    instead, and every member raises that at once. Returns the entries.

    Raises:
        CollectiveFailed: rank 0's build failed before it wrote its entries (with its
            reason), the relay was malformed or longer than `RELAY_BYTES` (another
            version of unbroken on rank 0, or a corrupt relay), or the broadcast failed or
            ran past the deadline.
        EpochAborted: the epoch was abandoned meanwhile.
    """
    body: dict[str, Any] = {}
    if rank == 0:
        wait_until(lambda: store.num_keys() > 0 or done(), scope, what, poll_s=POLL_DEVICE_S)
        keys = store.list_keys()
        if keys:
            body["entries"] = {k: base64.b64encode(store.get(k)).decode() for k in keys}
        else:
            body["error"] = failed() or "it wrote no entry"
    sent = json.dumps(body).encode()
    if len(sent) > RELAY_BYTES:  # said to every member, not a length they would refuse
        too_long = f"its entries take {len(sent)} bytes, over the {RELAY_BYTES} a relay carries"
        sent = json.dumps({"error": too_long}).encode()
    relay = _read_relay(_broadcast_bytes(sent, over, rank, scope, what), scope, what)
    if relay.error is not None:
        raise CollectiveFailed(f"{what} failed on rank 0: {relay.error}").at(scope.where())
    entries = relay.entries or {}
    if rank != 0:
        for key, value in entries.items():
            store.set(key, value)
    return entries


def _unbase64(text: object) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"expected base64 text, got {type(text).__name__}")  # a ValueError: pydantic says it
    return base64.b64decode(text, validate=True)  # binascii.Error is a ValueError too


class _Relay(BaseModel):
    """What rank 0 relays (`relay_entries`): its store's entries (base64 in the JSON), or
    why it has none."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    entries: dict[str, Annotated[bytes, BeforeValidator(_unbase64)]] | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _one(self) -> _Relay:
        if self.error is None and not self.entries:
            raise ValueError("it carries neither an entry nor an error")
        if self.error is not None and self.entries is not None:
            raise ValueError("it carries entries and an error")
        return self


def _read_relay(data: bytes, scope: EpochScope, what: str) -> _Relay:
    """Rank 0's relay from its bytes, checked: a malformed one fails the build, not the node."""
    try:
        return _Relay.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        at = ".".join(str(p) for p in first["loc"]) or "the relay"
        detail = f"{at}: {first['msg']}"
    raise CollectiveFailed(
        f"{what}: rank 0's relay of its NCCL id is malformed ({detail}): a corrupt relay, or another unbroken "
        "version on rank 0 (run the same one on every node)"
    ).at(scope.where())


def _broadcast_bytes(body: bytes, over: ProcessGroup, rank: int, scope: EpochScope, what: str) -> bytes:
    """Rank 0's ``body`` on every member (its length, then its bytes)."""
    length = torch.tensor([len(body)], dtype=torch.int64)
    wait_all([over.broadcast(length, 0)], scope, what)
    size = int(length)
    if not 0 < size <= RELAY_BYTES:
        raise CollectiveFailed(
            f"{what}: rank 0's relay of its NCCL id says it takes {size} bytes, not 1 to {RELAY_BYTES}: a corrupt "
            "relay, or another unbroken version on rank 0 (run the same one on every node)"
        ).at(scope.where())
    data = torch.zeros(size, dtype=torch.uint8)
    if rank == 0:
        data.copy_(torch.frombuffer(bytearray(body), dtype=torch.uint8))
    wait_all([over.broadcast(data, 0)], scope, what)
    return bytes(data.tolist())


def build_nccl(over: ProcessGroup, name: str, rank: int, size: int, device: torch.device, scope: EpochScope) -> Built:
    """Build a ``ProcessGroupNCCL`` named ``name`` on ``device`` for the members of ``over``
    (a gloo group of the same members in the same rank order, already built from the epoch's
    rendezvous), connected now, not at its first collective (see the module's docstring).
    The build blocks until every rank has connected: it runs on a helper thread, as
    `unbroken.comm.group.build_group`'s; a build left behind ends at the store's timeout
    (the scope's) or NCCL's own.

    Raises:
        NcclRefused: this member's own NCCL refused, whatever its peers did (see the
            module's docstring; chained from its error).
        CollectiveFailed: the build failed here otherwise (chained from its error), or on
            rank 0 (with its reason), or the relay or outcome failed, or it ran past the
            scope's deadline.
        EpochAborted: the epoch was abandoned meanwhile.
    """
    from torch.distributed import ProcessGroupNCCL  # type: ignore[attr-defined]  # absent from CPU builds

    store = HashStore()
    store.set_timeout(timedelta(seconds=scope.timeout_s))
    result: dict[str, Any] = {}
    what = f"building group {name}"

    def build() -> None:
        connecting = False
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # its streams and communicator on this device
            opts = ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=scope.timeout_s)
            pg = ProcessGroupNCCL(PrefixStore(name, store), rank, size, opts)
            connecting = True
            pg.eager_connect_single_device(device)
            result["pg"] = pg
        except Exception as exc:  # reported to the waiting thread
            # Rank 0 draws the id and writes it before it dials anyone: a failure with the
            # store still empty is its own. Past that, or on another rank, a peer may be the cause.
            result["own"] = not connecting or (rank == 0 and store.num_keys() == 0)
            result["error"] = exc  # last: `ended` reads it
        finally:
            scope.wake.set()

    def ended() -> bool:
        return "pg" in result or "error" in result

    def failure(text: str) -> CollectiveFailed:
        """This member's build failed: its own NCCL refused, or maybe a peer's doing."""
        error = (NcclRefused if result.get("own") else CollectiveFailed)(text)
        error.at(scope.where())
        return error

    def reason() -> str | None:
        error = result.get("error")
        return None if error is None else str(error).splitlines()[0][:300]

    start = time.monotonic()
    threading.Thread(target=build, name=f"nccl-build-{name}", daemon=True).start()
    try:
        entries = relay_entries(store, over, rank, scope, what, ended, reason)
    except CollectiveFailed:
        if rank == 0 and "error" in result:  # its build's failure, relayed: said as its own
            raise failure(f"{what} failed: {reason()}") from result["error"]
        raise
    outcome = torch.zeros(OUTCOME_BYTES, dtype=torch.uint8)
    if rank == 0:
        wait_until(ended, scope, what)
        if said := (reason() or "").encode()[:OUTCOME_BYTES]:
            outcome[: len(said)] = torch.frombuffer(bytearray(said), dtype=torch.uint8)
        wait_all([over.broadcast(outcome, 0)], scope, what)
    else:
        work = over.broadcast(outcome, 0)
        heard = work.get_future()
        heard.add_done_callback(lambda _f: scope.wake.set())

        def rank_zero_failed() -> None:
            if not heard.done():
                return
            wait_all([work], scope, what)  # done: raises where the broadcast itself failed
            if theirs := bytes(outcome.tolist()).rstrip(b"\0").decode(errors="replace"):
                raise CollectiveFailed(f"{what} failed on rank 0: {theirs}").at(scope.where())

        wait_until(lambda: ended() or heard.done(), scope, what)
        rank_zero_failed()  # its own build may wait for rank 0 until NCCL gives up: not waited
        wait_until(ended, scope, what)
        if "error" not in result:  # connected: rank 0's outcome is on its way
            wait_until(heard.done, scope, what)
            rank_zero_failed()
    if "error" in result:
        raise failure(f"{what} failed: {reason()}") from result["error"]
    token = hashlib.sha256(json.dumps(sorted((k, v.hex()) for k, v in entries.items())).encode()).hexdigest()[:16]
    return Built(result["pg"], time.monotonic() - start, token)


@dataclass
class Communicator:
    """The NCCL group a member keeps from one epoch to the next, while its zone's members
    and their ranks stay as they are and nothing failed on it.

    Whether a zone reuses it must be the same on every member (one that builds anew waits
    for the others in the build's relay): each member says in its report the group it
    keeps (its `token`, empty where it keeps none), and the zone reuses it only where
    every member says the same token (`reusable`: a pure function of the reports). A member
    drops it (`drop`) on a failure any of its collectives saw, or work of it left unfinished
    in a step not applied: its stream may hold a collective the others never posted."""

    token: str = ""
    members: tuple[str, ...] = ()
    """The zone's members in rank order when it was built."""
    pg: Any = None

    def keep(self, built: Built, members: Sequence[str]) -> None:
        self.token, self.members, self.pg = built.token, tuple(members), built.pg

    def drop(self) -> None:
        self.token, self.members, self.pg = "", (), None

    def reusable(self, tokens: Sequence[str], members: Sequence[str]) -> Any:
        """This member's group where every member of the zone (``members``, in rank order)
        keeps it (``tokens``: what each said), else None."""
        if self.pg is None or tuple(members) != self.members or any(t != self.token for t in tokens):
            return None
        return self.pg
