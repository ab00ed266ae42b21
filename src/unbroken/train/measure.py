"""What a node knows of its own speed and memory, for the coordinator's plan.

Calibrated before joining (on a model copy: one small and one larger forward/backward,
activation bytes counted), then followed step by step: each step's compute time over the
time the calibration predicts for its share and micro-batches is a factor, and the median
factor of the last nine steps gives the time a step takes now. Where the calibration told
its fixed and per-sample costs apart, both are scaled by it (a calibration that processes
starting together on one machine slowed is put right by the first steps, with no pass of
its own); where its small passes could not (bound by the fixed cost), its fixed cost is a
bound and the steps say the per-sample cost. So a few slow steps are ignored and a lasting
change shows within five. Steps of one share cannot tell fixed from per-sample cost, though:
where they disagree with the calibration by more than `RESHAPE_FACTOR`, the disturbance
was not even (one pass slowed, the other not) and its proportion is suspect too, so the
trainer measures again between two steps (`Meter.wants_probe`); a node given one sample by
a calibration a hundred times off would otherwise keep its one sample. The factors' spread
is reported with it, so the plan can tell a difference between nodes from noise. A member
without a share keeps its figures fresh with probes from its sidecar thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from unbroken.control import messages as m
from unbroken.errors import JobFailed
from unbroken.job import Job
from unbroken.train.commitment import arithmetic
from unbroken.train.device import (
    Calibration,
    ComputeReplica,
    OutOfMemory,
    SavedBytes,
    calibrate,
    describe,
    microbatch_cap,
)
from unbroken.train.throttle import Throttle

log = logging.getLogger(__name__)

CALIBRATION_SAMPLES = 8
RECENT_STEPS = 9
"""Steps whose median speed factor the reported cost model follows: a process descheduled
for a few steps of a few milliseconds moves it little, a lasting slowdown shows within five."""
RESHAPE_FACTOR = 2.0
RESHAPE_EVERY_S = 10.0
"""At most one measurement again per this many seconds at first, twice as long after each
(steps that differ from probes for good, real data against the probe's, would otherwise
cost a probe every few seconds for ever)."""


def relative_error(values: Sequence[float], median: float) -> float:
    """The standard error of ``median`` (the median of ``values``) relative to it, from the
    values' median absolute deviation: how far apart two nodes' figures may be by chance."""
    if len(values) < 3 or median <= 0:
        return 0.0
    mad = statistics.median(abs(v - median) for v in values)
    return 1.4826 * mad * 1.2533 / math.sqrt(len(values)) / median


class Meter:
    """A node's compute cost model and memory cap; shared by the step loop and the sidecar."""

    def __init__(self, job: Job, replica: ComputeReplica, throttle: Throttle, name: str) -> None:
        self.job = job
        self.replica = replica
        self.throttle = throttle
        self.name = name
        self.calibration: Calibration | None = None
        """The cost model reported: the `shape`, scaled by the median of the recent steps."""
        self.shape: Calibration | None = None
        """The last full measurement (calibration or probe): fixed and per-sample cost in proportion."""
        self.mb_cap = 0
        """Largest micro-batch memory allows (0: no limit; -1: not one sample)."""
        self.oom_cap = 0
        """A lower cap learnt from an out-of-memory error (0: none)."""
        self.last_compute_s = 0.0
        self.last_comm_s = 0.0
        self.measurements = 0
        self.noise = 0.0
        """Relative standard error of the step time the reported cost model gives (0: fewer than 3 steps)."""
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self._shaped_at = time.monotonic()
        self._reshape_every = RESHAPE_EVERY_S
        self._lock = threading.Lock()

    def calibrate(self, model: torch.nn.Module, model_bytes: int, memory_limit: int, user_cap: int, step: int) -> None:
        """Measure speed and activation memory before joining; set the micro-batch cap."""
        k = max(4, min(CALIBRATION_SAMPLES, self.job.batch_size, self.job.num_samples or CALIBRATION_SAMPLES))
        with torch.random.fork_rng(devices=[]):
            try:
                self.calibration = self.probe(model, step, k)
            except OutOfMemory as exc:  # the plan then assumes a median node until steps are measured
                log.warning("%s: could not measure compute speed before joining: %s", self.name, exc)
                self.calibration = Calibration(0.0, 0.0, 1, 0)
            except Exception as exc:  # the job's code: it would fail every step the same way
                where = "".join(traceback.format_exception(exc)).rstrip()
                raise JobFailed(
                    f"the job's code raised on its first {k} samples (measured before joining), so it "
                    f"cannot train: {type(exc).__name__}: {exc}\n{where}"
                ) from exc
        self.shape = self.calibration
        self._shaped_at = time.monotonic()
        info = describe(self.replica.device)
        fraction = 0.9 if self.replica.device.type == "cuda" else 0.5
        budget = memory_limit or int(info.memory_available * fraction)
        self.mb_cap = microbatch_cap(self.calibration, model_bytes, budget, user_cap)
        cal = self.calibration
        log.info(
            "%s: %s (%s): %.3f ms/sample + %.3f ms/micro-batch, %.1f KB activations/sample, micro-batch cap %s%s",
            self.name, info.kind, info.name, cal.per_sample_s * 1e3, cal.overhead_s * 1e3,
            cal.activation_bytes_per_sample / 1e3, self.mb_cap or "none",
            f", throttled to {self.throttle.factor(step)}" if self.throttle.active else "",
        )  # fmt: skip

    def probe(self, model: torch.nn.Module, step: int, k: int = CALIBRATION_SAMPLES) -> Calibration:
        """Time two- and k-sample passes of ``model`` (throttle included) and count activations."""
        model.train()
        job, replica = self.job, self.replica

        def batch(n: int) -> Any:
            return replica.to_device(job.collate(job.samples(list(range(n)))))

        def run(n: int) -> float:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            job.microbatch_loss(model, batch(n)).backward()  # type: ignore[no-untyped-call]
            replica.synchronize()
            took = time.perf_counter() - start
            return took + self.throttle.stretch(took, step)

        def saved(n: int) -> int:
            b = batch(n)
            with SavedBytes() as counter:
                out = job.microbatch_loss(model, b)
            del out
            return counter.total

        return calibrate(run, saved, max(4, min(k, job.num_samples or k)))

    def observe(self, share: int, n_micro: int, seconds: float) -> None:
        """Fold one step's compute time into the cost model."""
        self.last_compute_s = seconds
        with self._lock:
            cal = self.calibration
            if cal is None or seconds <= 0 or share <= 0:
                return
            shape = self.shape
            if shape is None or shape.per_sample_s <= 0:  # nothing measured before: this step is the shape
                shape = self.shape = dataclasses.replace(cal, per_sample_s=seconds / share, overhead_s=0.0, apart=False)
            predicted = n_micro * shape.overhead_s + share * shape.per_sample_s
            self._recent.append(seconds / predicted)
            self.measurements += 1
            factor = statistics.median(self._recent)
            self.noise = relative_error(self._recent, factor)
            if shape.apart:  # the proportion is known: the steps say the level
                per_sample, overhead = shape.per_sample_s * factor, shape.overhead_s * factor
            else:  # the fixed cost is a bound (the steps' own, if lower): the rest is per sample
                typical = factor * predicted
                overhead = min(shape.overhead_s, 0.95 * typical / n_micro)
                per_sample = (typical - n_micro * overhead) / share
            self.calibration = dataclasses.replace(shape, per_sample_s=per_sample, overhead_s=overhead)

    def probed(self, cal: Calibration) -> None:
        """A probe's result (from the sidecar thread): the new shape, its steps to come."""
        with self._lock:
            self.calibration = self.shape = cal
            self._recent.clear()
            self._shaped_at = time.monotonic()
            self.measurements += 1

    def wants_probe(self, now: float | None = None) -> bool:
        """A full window of steps says the shape is off by more than `RESHAPE_FACTOR`."""
        with self._lock:
            if len(self._recent) < RECENT_STEPS or self.shape is None or self.shape.per_sample_s <= 0:
                return False
            if (time.monotonic() if now is None else now) - self._shaped_at < self._reshape_every:
                return False
            factor = statistics.median(self._recent)
            if 1 / RESHAPE_FACTOR <= factor <= RESHAPE_FACTOR:
                return False
            self._reshape_every *= 2
            return True

    def capabilities(self, rtt_s: float, step: int) -> m.Capabilities:
        info = describe(self.replica.device)
        with self._lock:
            cal, measurements, noise = self.calibration, self.measurements, self.noise
        return m.Capabilities(
            device=info.kind,
            device_name=info.name[:256],
            memory_total=info.memory_total,
            memory_used=info.memory_used,
            per_sample_s=min(cal.per_sample_s, 1e6) if cal else 0.0,
            overhead_s=min(cal.overhead_s, 1e6) if cal else 0.0,
            measurements=measurements,
            noise=min(noise, 10.0),
            max_microbatch=self.oom_cap if self.oom_cap and self.mb_cap >= 0 else self.mb_cap,
            comm_s=min(self.last_comm_s, 1e6),
            rtt_s=min(rtt_s, 1e6),
            throttle=self.throttle.factor(step),
            arithmetic=arithmetic(self.replica.device),
        )
