"""The Job loop's compute: forward and backward of this node's slice with the job's own
loss, in micro-batches the memory allows, and the speed measured before joining."""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import time
from typing import TYPE_CHECKING

import torch

from unbroken.errors import CollectiveFailed
from unbroken.train.device import OutOfMemory
from unbroken.train.step import Slice, StepProtocol

if TYPE_CHECKING:
    from unbroken.train.views import ComputeNode

log = logging.getLogger(__name__)


class JobCompute:
    """Computes a slice's gradient with `Job.microbatch_loss` (the Job loop's compute)."""

    def __init__(self, node: ComputeNode) -> None:
        self.node = node
        self.used_mb = 0
        """The micro-batch size the last slice was computed in (the commit log says it)."""

    def __call__(self, protocol: StepProtocol, sl: Slice) -> float:
        """The slice's loss (its part of the mean over B); gradients summed, scaled to the
        mean over B. Out of device memory, the micro-batch is halved and the slice computed
        again: the gradient is the same whatever the micro-batch size."""
        node = self.node
        meter = node.meter
        if node.zone is not None:
            protocol.prepare(sl)
            return self._sharded(protocol, sl)
        while True:
            mb = protocol.group.microbatch or meter.mb_cap or sl.share or 1
            if meter.oom_cap:
                mb = min(mb, meter.oom_cap)
            self.used_mb = mb if sl.indices else 0
            protocol.prepare(sl)
            try:
                return self._slice(protocol, sl, mb)
            except OutOfMemory:
                if mb <= 1:
                    raise
                if protocol.buckets.posted:
                    # Its peers sum the buckets sent: a retry would post them again, out of step.
                    meter.oom_cap = mb // 2
                    raise CollectiveFailed(
                        f"out of device memory at micro-batch {mb} after part of step {sl.step}'s gradient went out"
                    ) from None
                meter.oom_cap = mb // 2
                log.warning("%s: out of device memory at micro-batch %d; retrying at %d", node.name, mb, mb // 2)
                protocol.undo(sl)
                if node.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _slice(self, protocol: StepProtocol, sl: Slice, mb: int) -> float:
        node = self.node
        job, client = node.job, node.client
        model = node.replica.model
        model.train()
        B = job.batch_size
        scale = node.loss_scale
        total = 0.0
        start = time.perf_counter()
        n_micro = 0
        reads = sl.indices if sl.reads is None else sl.reads
        for first in range(0, sl.share, mb):
            client.touch()
            chunk = reads[first : first + mb]
            batch = node.replica.to_device(job.collate(job.samples(chunk)))
            t_mb = time.perf_counter()
            loss = job.microbatch_loss(model, batch)
            with protocol.backward() if first + mb >= sl.share else contextlib.nullcontext():
                (loss * (len(chunk) / B * scale)).backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach()) * len(chunk) / B
            node.throttle.stretch(time.perf_counter() - t_mb, sl.step, client.touch)
            n_micro += 1
        if sl.indices:
            node.meter.observe(sl.share, n_micro, time.perf_counter() - start)
        else:
            node.meter.last_compute_s = 0.0
        return total

    def _sharded(self, protocol: StepProtocol, sl: Slice) -> float:
        """A sharded zone's slice: every member makes as many passes as the member that
        makes the most (each pass gathers every block and sums its gradient over the zone, in
        the same order on every member); a pass with no samples of this member's computes
        the step's first sample at weight zero."""
        node = self.node
        job, client, g = node.job, node.client, protocol.group
        model = node.replica.model
        model.train()
        B = job.batch_size
        sizes = [g.microbatches[r] if g.microbatches and g.microbatches[r] else s for r, s in enumerate(g.shares)]
        passes = max([-(-s // mb) for s, mb in zip(g.shares, sizes, strict=True) if s] or [1])
        mb = sizes[g.rank] or 1
        reads = sl.indices if sl.reads is None else sl.reads
        self.used_mb = mb if sl.indices else 0
        total = 0.0
        start = time.perf_counter()
        for k in range(passes):
            client.touch()
            chunk = reads[k * mb : (k + 1) * mb]
            weight = len(chunk) / B
            batch = node.replica.to_device(job.collate(job.samples(chunk or node.data.indices(sl.step, 0, 1))))
            t_mb = time.perf_counter()
            loss = job.microbatch_loss(model, batch)
            (loss * weight).backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach()) * weight
            node.throttle.stretch(time.perf_counter() - t_mb, sl.step, client.touch)
        if sl.indices:
            node.meter.observe(sl.share, passes, time.perf_counter() - start)
        else:
            node.meter.last_compute_s = 0.0
        return total

    def calibrate(self) -> None:
        """Measure compute speed and activation memory before joining (on a model copy)."""
        node = self.node
        model_bytes = sum(t.numel() * t.element_size() for t in node.state.model.state_dict().values())
        node.meter.calibrate(
            self.probe_model(), model_bytes, node.config.memory_limit, node.config.max_microbatch, node.state.step
        )

    def measure_again(self) -> None:
        """Between two steps: a trainer whose steps disagree with its calibration measures
        again (`Meter.wants_probe`), on a copy, with random numbers of its own."""
        node = self.node
        if node.own_loop or node.zone is not None or not node.meter.wants_probe():
            return
        devices = [node.device] if node.device.type == "cuda" else []
        python_state = random.getstate()  # the job's code may draw from any generator
        numpy = sys.modules.get("numpy")
        numpy_state = numpy.random.get_state() if numpy is not None else None
        try:
            with torch.random.fork_rng(devices=devices):
                cal = node.meter.probe(self.probe_model(), node.state.step)
        except OutOfMemory as exc:
            log.info("%s: could not measure compute speed again: %s", node.name, exc)
            return
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)
        node.meter.probed(cal)
        log.info(
            "%s: its steps disagreed with its calibration; measured again: %.3f ms/sample + %.3f ms/micro-batch",
            node.name, cal.per_sample_s * 1e3, cal.overhead_s * 1e3,
        )  # fmt: skip

    def probe_model(self) -> torch.nn.Module:
        """A copy of the model on the compute device, for timing passes that must not touch the state."""
        node = self.node
        model = node.job.model()
        model.load_state_dict(node.state.model.state_dict())
        return model.to(node.device)
