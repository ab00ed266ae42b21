"""Work for members without a share of the batch: validation, checks and speed probes.

A validator or standby takes part in every step's all-reduce (so it holds the committed
state) but computes no gradient. Its idle compute runs here, on a thread of its own with a
model copy, so the step loop never waits for it, one piece of work at a time (each seeds
or draws from torch's generator as it needs), in this order:

- validation: evaluate the job's held-out metric on the state committed at step s and
  report it (the coordinator turns it into an event and the dashboard's curve);
- checks: recompute a trainer's slice of a committed step (`train.checks`);
- probes: time a few forward/backward passes, so the plan learns when a slow node has
  become fast enough to train again.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from unbroken.job import Job
from unbroken.train.device import Calibration

log = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0


def copy_model(model: torch.nn.Module, job: Job) -> torch.nn.Module:
    """A copy of ``model``; the job's model afresh where it cannot be copied (a module
    holding something `copy.deepcopy` refuses)."""
    try:
        return copy.deepcopy(model)
    except Exception as exc:  # any failure of a user's module to copy: build one instead
        log.info("the model could not be copied (%s): building one for the sidecar", exc)
        return job.model()


class Sidecar:
    """A named worker thread with a shutdown; `submit` hands it the newest committed state."""

    def __init__(
        self,
        job: Job,
        name: str,
        model: torch.nn.Module,
        device: torch.device,
        probe: Callable[[torch.nn.Module], Calibration],
        on_probe: Callable[[Calibration], None],
        on_validation: Callable[[int, dict[str, float], float], None],
        factor: Callable[[], float],
    ) -> None:
        self.job = job
        self.device = device
        self._probe = probe
        self._on_probe = on_probe
        self._on_validation = on_validation
        self._factor = factor
        # Made here, on the caller's thread: building a model afresh draws from the global
        # RNG, which the step loop re-seeds each step and must not share with a concurrent
        # thread. A copy of the node's own model draws nothing and costs a memory copy
        # (building a 50M-param one took about 0.5 s); the CPU copy only where there is a
        # metric to evaluate with it.
        self._models = {"probe": copy_model(model, job).to(device)}
        if job.evaluate is not None:
            self._models["cpu"] = copy_model(model, job).to("cpu")
        self._cond = threading.Condition()
        self._work: tuple[int, dict[str, Any]] | None = None
        self._checks: collections.deque[Callable[[], None]] = collections.deque()
        self._probing = False
        self._closed = False
        self._busy = False
        self._in_probe = False
        self.validations_since_check = 0
        """Validations done since the last check (`train.checks` takes turns with them)."""
        self._thread = threading.Thread(target=self._run, name=f"sidecar-{name}", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._busy and self._work is None and not self._checks

    def set_probing(self, on: bool, wait_s: float = 30.0) -> None:
        """Start or stop probing; stopping waits for a probe in flight (it draws random numbers)."""
        with self._cond:
            self._probing = on
            self._cond.notify()
            if not on:
                self._cond.wait_for(lambda: not self._in_probe, timeout=wait_s)

    def submit(self, step: int, state: dict[str, Any]) -> None:
        with self._cond:
            self._work = (step, state)
            self._cond.notify()

    def submit_check(self, check: Callable[[], None]) -> None:
        """Queue a check (`train.checks`): after any validation due, before probes."""
        with self._cond:
            self._checks.append(check)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        next_probe = time.monotonic()
        while True:
            with self._cond:
                while (
                    not self._closed
                    and self._work is None
                    and not self._checks
                    and not (self._probing and time.monotonic() >= next_probe)
                ):
                    timeout = max(next_probe - time.monotonic(), 0.01) if self._probing else None
                    self._cond.wait(timeout)
                if self._closed:
                    return
                work, self._work = self._work, None
                check = self._checks.popleft() if work is None and self._checks else None
                self._busy = True
            try:
                if work is not None:
                    self._validate(*work)
                    self.validations_since_check += 1
                elif check is not None:
                    check()
                    self.validations_since_check = 0
                elif self._probing:
                    start = time.monotonic()
                    with self._cond:
                        self._in_probe = self._probing
                    if self._in_probe:
                        self._on_probe(self._probe(self._models["probe"]))
                    # At most half of this node's time goes to probing.
                    next_probe = time.monotonic() + max(PROBE_EVERY_S, time.monotonic() - start)
            except Exception:  # a failing evaluation must not take the node down
                log.exception("sidecar work failed")
            finally:
                with self._cond:
                    self._busy = self._in_probe = False
                    self._cond.notify_all()

    def _validate(self, step: int, state: dict[str, Any]) -> None:
        evaluate = self.job.evaluate
        if evaluate is None:
            return
        model = self._models["cpu"]  # evaluate sees a CPU model, as at the end of the job
        model.load_state_dict(state)
        model.eval()
        start = time.perf_counter()
        with torch.no_grad():
            metrics = evaluate(model)
        took = time.perf_counter() - start
        factor = self._factor()
        if factor < 1:  # the emulated slow device evaluates slowly too
            time.sleep(took * (1 / factor - 1))
        self._on_validation(step, metrics, time.perf_counter() - start)
