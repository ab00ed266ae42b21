"""Across zones, a DiLoCo pseudo-gradient is its zone leader's word alone: the zone's sum
leaves the head out (a member cannot speak into its leader's row), and each leader's row is
measured on arrival, so a verdict on it names the leader."""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import HashStore, PrefixStore, ProcessGroupGloo

from unbroken.comm.codecs import Codec, Identity, make_codec
from unbroken.comm.group import EpochScope
from unbroken.comm.reduce import VOTE_SLOTS, Reducer
from unbroken.sched.zones import Zones

K = 6
NORMS_AT = K + VOTE_SLOTS
ZONES = Zones(("A", "A", "B", "B"))


def _group(store: Any, name: str, rank: int, size: int) -> Any:
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timedelta(seconds=30)
    opts._devices = [ProcessGroupGloo.create_default_device()]
    return ProcessGroupGloo(PrefixStore(name, store), rank, size, opts)


def _exchange(
    heads: dict[int, torch.Tensor], codecs: dict[int, Codec] | None = None, silent: frozenset[int] = frozenset()
) -> dict[int, torch.Tensor]:
    """Each of 4 ranks (zones A A B B) sums its flat tensor with ``heads[rank]`` at its head
    (``silent`` ranks lead a zone without a share)."""
    store = HashStore()
    out: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            zone = ZONES.of_rank[rank]
            world = _group(store, "world", rank, 4)
            zone_pg = _group(store, f"zone-{zone}", ZONES.members(zone).index(rank), 2)
            leaders = _group(store, "leaders", ZONES.leaders.index(rank), 2) if rank in ZONES.leaders else None
            reducer = Reducer(
                rank, ZONES, world, zone_pg=zone_pg, leaders_pg=leaders,
                codec=(codecs or {}).get(rank) or Identity(), compressed=K, norms_at=NORMS_AT,
            )  # fmt: skip
            flat = torch.zeros(NORMS_AT + 4)
            flat[:K] = heads[rank]
            flat[K] = 1.0  # its vote
            reducer.allreduce(
                flat,
                EpochScope(threading.Event(), lambda: None, 30.0),
                "outer step",
                own_head=True,
                silent=rank in silent,
            )
            out[rank] = flat
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_a_member_cannot_speak_into_its_leaders_row_and_every_row_is_measured() -> None:
    a, b = torch.arange(1.0, K + 1), torch.full((K,), -2.0)
    junk = torch.full((K,), float("nan"))  # rank 1 follows leader 0 and should send nothing
    out = _exchange({0: a, 1: junk, 2: b, 3: torch.zeros(K)})
    for flat in out.values():  # the same on every member
        assert torch.equal(flat[:K], a + b), "the member's junk stays out of the sum"
        assert flat[K] == 4.0, "the votes are everyone's"
        norms = flat[NORMS_AT:].tolist()
        assert math.isclose(norms[0], float(a.norm())) and math.isclose(norms[2], float(b.norm()))
        assert norms[1] == norms[3] == 0.0


def test_a_leaders_bad_row_is_measured_as_its_own() -> None:
    a = torch.arange(1.0, K + 1)
    out = _exchange({0: a, 1: torch.zeros(K), 2: torch.full((K,), float("nan")), 3: torch.zeros(K)})
    for flat in out.values():
        norms = flat[NORMS_AT:].tolist()
        assert math.isclose(norms[0], float(a.norm())) and math.isnan(norms[2]), norms


def test_a_zone_without_a_share_sends_nothing_and_keeps_its_codecs_residual() -> None:
    # Zone B trained last round (its int8 codec holds a residual) and has no share now:
    # its leader's row must be zero (a row without a share names its sender), and the
    # residual must wait for a round it sends in.
    codecs = {r: make_codec("int8") for r in range(4)}
    codecs[2].encode(torch.linspace(-1.0, 1.0, K) * 3.3)
    held = codecs[2].residual.clone()  # type: ignore[attr-defined]
    assert held.abs().sum() > 0
    a = torch.arange(1.0, K + 1)
    out = _exchange({0: a, 1: torch.zeros(K), 2: torch.zeros(K), 3: torch.zeros(K)}, codecs, frozenset({2}))
    for flat in out.values():
        assert flat[NORMS_AT + 2] == 0.0, "the idle zone's row carried something"
        assert torch.allclose(flat[:K], a, atol=0.05)
    assert torch.equal(codecs[2].residual, held)  # type: ignore[attr-defined]
    # Without ``silent`` the residual goes out: that row is not zero.
    codecs = {r: make_codec("int8") for r in range(4)}
    codecs[2].encode(torch.linspace(-1.0, 1.0, K) * 3.3)
    out = _exchange({0: a, 1: torch.zeros(K), 2: torch.zeros(K), 3: torch.zeros(K)}, codecs)
    assert out[0][NORMS_AT + 2] > 0.0
