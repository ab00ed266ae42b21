"""The coordinator's view as JSON: what ``/api/state`` serves, the dashboard draws and
``unbroken status`` prints. It reads the membership and the service's records and decides
nothing; built here so that what is shown changes without touching the coordinator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unbroken.events import ALARMS

if TYPE_CHECKING:
    from unbroken.control.coordinator import Coordinator
    from unbroken.control.membership import Membership


def members_json(ms: Membership, now: float) -> list[dict[str, Any]]:
    """Each member as the dashboard shows it: its place in the plan, its measurements, its flags."""
    rows = []
    zones = dict(zip(ms.members, ms.zones_of(list(ms.members.values())), strict=True))
    for mid, mem in ms.members.items():
        rank = ms.rank_of(mid)
        rows.append(
            {
                "id": mid,
                "name": mem.name,
                "state": mem.state.value,
                "rank": rank,
                "share": ms.shares[rank] if rank is not None and rank < len(ms.shares) else 0,
                "weight": mem.weight,
                "role": mem.role.value if mem.role else None,
                "preference": mem.preference.value,
                "microbatch": ms.plan.microbatches[rank] if ms.plan and rank is not None else 0,
                "host": mem.host,
                "pid": mem.pid,
                "step": mem.step,
                "loss": mem.loss,
                "samples_per_s": mem.samples_per_s,
                "compute_s": list(mem.compute_times)[-1:] or None,
                "capabilities": mem.caps.model_dump(),
                "validation": mem.validation,
                "zone": zones[mid] or "default",
                "refused_gradients": mem.flags,
                "quarantined": mem.quarantined,
                "checkpoint_error": mem.checkpoint_error,
                "bytes_sent": {"intra_zone": mem.bytes_intra, "inter_zone": mem.bytes_inter},
                "last_seen_s": round(now - ms.roster.leases.heard_at(mem, now), 3),
            }
        )
    return rows


def plan_json(ms: Membership) -> dict[str, Any]:
    """The plan in force: the epoch's members with their shares, roles and micro-batches."""
    return {
        "epoch": ms.epoch,
        "members": ms.epoch_members,
        "shares": ms.shares,
        "roles": [r.value for r in ms.plan.roles] if ms.plan else [],
        "microbatches": list(ms.plan.microbatches) if ms.plan else [],
        "predicted_step_s": ms.plan.step_s if ms.plan else None,
        "batch_size": ms.batch_size,
        "balance": "throughput" if ms.balance else "weights",
        "codec": str(ms.policy.codec),
        "aggregate": str(ms.policy.aggregate),
        "mode": ms.policy.mode.value,
    }


def state_json(coord: Coordinator) -> dict[str, Any]:
    """The coordinator's whole view (`Coordinator.snapshot`), on its event loop."""
    ms = coord.membership
    now = coord.clock()
    return {
        "job": ms.job,
        "coordinator_id": coord.coordinator_id,
        "leadership": coord.office.state(),
        "epoch": ms.epoch,
        "step": ms.step,
        "finished": ms.finished,
        "recovering": ms.recovering_until is not None,
        "members": members_json(ms, now),
        "plan": plan_json(ms),
        "events": [r.to_json() for r in coord.events.last(200)],
        "alarms": sorted(k.value for k in ALARMS),
        "recoveries": coord.recoveries,
        "final_digests": ms.final_digests,
        "final_metrics": ms.final_metrics,
        "loop_lag_s": round(coord.loop_lag_s, 3),
        "event_log": coord.events.health(),
        "outsiders": coord.guard.state(),
        "relays": [
            {
                "relay_id": r.relay_id,
                "zone": r.zone,
                "members": len(r.members),
                "heard_s": round(now - r.heard_at, 3),
            }
            for r in coord.relays.links.values()
        ],
    }
