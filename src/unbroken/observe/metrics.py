"""``GET /metrics``: the job in Prometheus' text format (`prometheus_client` renders it).

Made fresh from the coordinator's state at every scrape (a custom collector: no metric
objects to keep in step with the state). Counters count since the coordinator started.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from unbroken.events import Kind
from unbroken.observe.history import History

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Job(Collector):
    def __init__(self, snapshot: dict[str, Any], counts: Mapping[Kind, int], history: History) -> None:
        self.snapshot, self.counts, self.history = snapshot, counts, history

    def collect(self) -> Iterator[Metric]:
        s, job = self.snapshot, {"job": str(self.snapshot.get("job") or "")}
        labels = ["job"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([job["job"]], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([job["job"]], value)
            return c

        yield gauge("unbroken_step", "Highest committed step.", s.get("step") or 0)
        yield gauge("unbroken_epoch", "Current membership epoch.", s.get("epoch") or 0)
        lead = s.get("leadership") or {}
        yield gauge(
            "unbroken_coordinator_leading",
            "1 when this coordinator leads the job (always, without etcd); 0 for a standby.",
            0 if lead.get("role") == "standby" else 1,
        )
        yield gauge("unbroken_leader_term", "The leader's term (its etcd election revision; 0 without etcd).",
                    lead.get("term") or 0)  # fmt: skip
        yield counter("unbroken_epoch_changes", "Epochs formed (membership or plan changes).", s.get("epoch") or 0)
        points = self.history.points()
        last = points[-1] if points else None
        if last is not None and last.loss is not None:
            yield gauge("unbroken_loss", "Training loss at the last committed step.", last.loss)
        if len(points) >= 2:
            a, b = points[-2], points[-1]
            if b.step > a.step and b.time > a.time:
                yield gauge(
                    "unbroken_step_seconds",
                    "Time per step over the last two reports.",
                    (b.time - a.time) / (b.step - a.step),
                )
        yield gauge("unbroken_steps_per_second", "Committed steps per second (last 10 s).", self.history.step_rate())
        yield gauge("unbroken_samples_per_second", "The group's throughput.", last.samples_per_s if last else 0.0)
        members = GaugeMetricFamily("unbroken_members", "Members by state and role.", labels=["job", "state", "role"])
        tally: dict[tuple[str, str], int] = {}
        for m in s.get("members", []):
            key = (str(m.get("state")), str(m.get("role") or "none"))
            tally[key] = tally.get(key, 0) + 1
        for (state, role), n in sorted(tally.items()):
            members.add_metric([job["job"], state, role], n)
        yield members
        node_rate = GaugeMetricFamily(
            "unbroken_node_samples_per_second",
            "Each node's own rate (its share / its compute time).",
            labels=["job", "node"],
        )
        sent = CounterMetricFamily(
            "unbroken_node_bytes_sent", "Bytes each node sent, per link class.", labels=["job", "node", "link"]
        )
        for m in s.get("members", []):
            name = str(m.get("name"))
            compute = (m.get("compute_s") or [0.0])[-1]
            node_rate.add_metric([job["job"], name], m["share"] / compute if compute else 0.0)
            wire = m.get("bytes_sent") or {}
            sent.add_metric([job["job"], name, "intra_zone"], wire.get("intra_zone", 0))
            sent.add_metric([job["job"], name, "inter_zone"], wire.get("inter_zone", 0))
        yield node_rate
        yield sent
        events = CounterMetricFamily(
            "unbroken_events", "Events by kind (joins, failures, rebalances...).", labels=["job", "kind"]
        )
        for kind, n in sorted(self.counts.items()):
            events.add_metric([job["job"], kind.value], n)
        yield events
        yield counter(
            "unbroken_failures", "Members lost to a crash, hang or cut link.", self.counts.get(Kind.FAILURE, 0)
        )
        recoveries = [r["duration_s"] for r in s.get("recoveries", [])]
        yield counter("unbroken_recoveries", "Failures followed by a commit of the new group.", len(recoveries))
        summary = SummaryMetricFamily(
            "unbroken_recovery_seconds", "Failure detected -> the new group's first commit.", labels=labels
        )
        summary.add_metric([job["job"]], count_value=len(recoveries), sum_value=sum(recoveries))
        yield summary


def render(snapshot: dict[str, Any], counts: Mapping[Kind, int], history: History) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Job(snapshot, counts, history))
    return generate_latest(registry)
