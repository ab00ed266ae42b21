"""What a node writes down and tells: its commit log, progress reports, events for the job's
log, and checkpoints (written after commits, and read back at a cold start)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.comm.group import EpochGroup
from unbroken.comm.reduce import Wire
from unbroken.control import messages as m
from unbroken.errors import (
    AuditMismatch,
    BadContribution,
    BadRequest,
    CollectiveFailed,
    ConfigError,
    Suspicion,
    TransferError,
)
from unbroken.events import Entry, Kind
from unbroken.state import layout
from unbroken.state.checkpoint import Checkpointer, Later, load_newest, set_aside
from unbroken.state.fragments import NotRebuilt, rebuild

if TYPE_CHECKING:
    from unbroken.train.views import RecordsNode

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.05
"""How often progress is reported until a coordinator says (`Welcome.report_s`)."""
PROGRESS_LOG_EVERY_S = 10.0
RECENT_MAX = 512
"""Steps kept for the next progress report (the message's limit)."""
LAY_OUT_AHEAD = 3
"""Commits before a checkpoint step from which its buffers are laid out (`Checkpointer.prepare`)."""


class Records:
    """A node's commit log (``--commit-log``), reports to the coordinator and checkpoints."""

    def __init__(self, node: RecordsNode, began: float | None = None) -> None:
        """``began``: when the node started to build the job (its imports done)."""
        self.node = node
        config = node.config
        self.checkpointer = Checkpointer(config.checkpoint_dir) if config.checkpoint_dir else None
        self.fragments: tuple[int, int] | None = None
        """Erasure-coded checkpoints (K data + M parity fragments), as the epoch order says."""
        self.restored_epoch: int | None = None
        """The epoch of the checkpoint this node cold-started from (`m.Hello.restored_epoch`)."""
        self.first_in_epoch = True
        self._fresh: dict[str, Any] | None = None
        """The state as built, while a restored checkpoint may still prove another run's."""
        self._corrupt: str | None = None
        """Why no checkpoint of the directory could be used, where every one is corrupt:
        settled once the node knows whether a group trains (`joined`)."""
        self._notes: list[tuple[Kind, str]] = []
        """Events for the job's log from before this node joined (sent once it has)."""
        self._checkpoint_failure: str | None = None
        """The checkpoint failure last reported (None: none, or writes succeed again)."""
        self._writing: int | None = None
        """The step of the last checkpoint this node started to write."""
        self._recent: list[m.StepPoint] = []
        """Steps committed since the last progress report (rank 0 sends them: the curves)."""
        self._commitments: list[m.Commitment] = []
        """This trainer's commitments since the last progress report (`train.checks`)."""
        self._last_progress = 0.0
        self._last_progress_log = time.monotonic()
        self._file = open(config.commit_log, "a", encoding="utf-8") if config.commit_log else None  # noqa: SIM115
        self.timeline: dict[str, float] | None = {}
        """When this node first got to each milestone of its way to its first commit (wall
        times, `mark`): written with that commit (None once written), as where a join's time
        goes (`bench/sharded_nodes.py`)."""
        if began is not None:
            self.timeline["began"] = began
        self.mark("built")

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self._file is not None:
            self._file.close()

    # ---------------------------------------------------------------- the log and reports

    def log(self, kind: Entry, fields: Mapping[str, object] | None = None) -> None:
        """One line of the commit log (what `unbroken.testing.promises` checks)."""
        if self._file is not None:
            entry = {"t": time.time(), "node": self.node.name, "kind": kind.value, **(fields or {})}
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    def mark(self, milestone: str) -> None:
        """This node got to ``milestone`` on its way to its first commit: ``began`` (its
        imports done), ``built`` (the job's model and optimizer), ``welcomed`` (the leader took its
        hello), ``ordered`` (the first epoch order that names it), ``formed`` (that epoch's
        groups built), ``synced`` (the replicated state in), ``reported`` (a sharded zone's
        members' reports of their ranges in), ``resharded`` (its ranges in), each noted the
        first time only."""
        if self.timeline is not None:
            self.timeline.setdefault(milestone, time.time())

    def report(self, kind: Kind, reason: str) -> None:
        """An event for the job's log at the coordinator (a checkpoint, a state transfer...)."""
        self.node.client.send(m.Report(kind=kind, step=self.node.state.step, reason=reason[:2000]))

    def note(self, kind: Kind, reason: str) -> None:
        """An event for the job's log from before joining: logged now, reported once joined."""
        log.warning("%s: %s", self.node.name, reason)
        self.log(Entry(kind.value), {"reason": reason, "step": self.node.state.step})
        self._notes.append((kind, reason))

    def commit(self, g: EpochGroup, step: int, loss: float, wire: Wire, digest: str | None, **more: Any) -> None:
        entry: dict[str, Any] = {"epoch": g.epoch, "step": step, "loss": loss, **more}
        if wire.last_inter:
            entry["wire"] = {"intra": wire.last_intra, "inter": wire.last_inter}
        if digest is not None:
            entry["digest"] = digest
        if self.timeline is not None:
            entry["timeline"], self.timeline = self.timeline, None
        self.log(Entry.COMMIT, entry)

    def committed_to(self, commitment: m.Commitment) -> None:
        """A commitment to a slice of a step just committed: it goes with the next report."""
        self._commitments.append(commitment)
        del self._commitments[: -m.COMMITMENTS_MAX]

    def progress(self, g: EpochGroup, step: int, loss: float, sps: float) -> None:
        node = self.node
        now = time.monotonic()
        finite = math.isfinite(loss)
        shown = loss if finite else -1.0
        self._recent.append(m.StepPoint(step=step, loss=shown, finite=finite, samples_per_s=sps, wall_time=time.time()))
        del self._recent[:-RECENT_MAX]
        steps = node.job.num_steps
        if now - self._last_progress_log >= PROGRESS_LOG_EVERY_S or step == steps:
            log.info("%s: step %d/%d, epoch %d, %d members, loss %.4f", node.name, step, steps, g.epoch, g.size, loss)
            self._last_progress_log = now
        welcome = node.client.welcome
        every = welcome.report_s if welcome is not None else PROGRESS_EVERY_S
        if not (self.first_in_epoch or now - self._last_progress >= every or step >= steps):
            return
        node.client.send(
            m.Progress(
                epoch=g.epoch,
                step=step,
                loss=loss if finite else -1.0,
                loss_finite=finite,
                recent=self._recent if g.rank == 0 else [],
                wall_time=time.time(),
                first_in_epoch=self.first_in_epoch,
                samples_per_s=sps,
                compute_s=min(node.meter.last_compute_s, 1e6),
                bytes_intra=node.wire.intra,
                bytes_inter=node.wire.inter,
                capabilities=node.capabilities(),
                commitments=self._commitments,
            )
        )
        self.first_in_epoch = False
        self._last_progress = now
        self._recent = []
        self._commitments = []

    # ---------------------------------------------------------------- checkpoints

    def maybe_checkpoint(self, g: EpochGroup) -> None:
        node = self.node
        ck, step = node.config.checkpoint_every, node.state.step
        if self.checkpointer is None or not ck:
            return
        if step % ck:
            writes = bool(self._fragments_of(g)) if self.fragments else g.rank == 0
            if not writes:
                self.checkpointer.release()
            elif ck - step % ck <= LAY_OUT_AHEAD and not self.checkpointer.has_buffers:
                # After a commit the optimizer's state exists: the checkpoint's layout.
                self.checkpointer.prepare(self.checkpoint_tree(), self.fragments[0] if self.fragments else None)
            return
        if node.zone is not None and node.config.checkpoint_dir is not None:
            self.save_shard(step)
        failure = self.checkpointer.failure
        if failure is not None and failure != self._checkpoint_failure:
            self.report(Kind.CHECKPOINT_FAILED, failure)
        elif failure is None and self._checkpoint_failure is not None:
            self.report(Kind.CHECKPOINT_OK, f"checkpoints are written to {node.config.checkpoint_dir} again")
        self._checkpoint_failure = failure
        if self.fragments is not None:
            k, m_ = self.fragments
            mine = self._fragments_of(g)
            if not mine:
                return
            what, where = f"fragments {mine} of {k}+{m_} of step {step}", ""
            in_digest = node.state.optimizer_in_digest
            started = self.checkpointer.save_fragments_async(
                self.checkpoint_tree(), k, m_, mine, in_digest, later=self._later()
            )
        else:
            if g.rank != 0:
                return
            what, where = f"checkpoint of step {step}", f" to {node.config.checkpoint_dir}"
            started = self.checkpointer.save_async(self.checkpoint_tree(), later=self._later())
        if started:
            self._writing = step
            self.report(Kind.CHECKPOINT, f"{what} being written{where}")
            return
        # Said, so that a disk too slow for --checkpoint-every shows before a restart needs the files.
        last = "the last one" if self._writing is None else f"the one of step {self._writing}"
        self.report(
            Kind.CHECKPOINT_SKIPPED,
            f"{what} skipped: {last} is still being written "
            f"({self.checkpointer.skipped} skipped so far; a faster disk or a longer --checkpoint-every)",
        )

    def _fragments_of(self, g: EpochGroup) -> list[int]:
        """The fragments this member writes (rank r: every fragment i with i mod size = r)."""
        assert self.fragments is not None
        k, m_ = self.fragments
        return [i for i in range(k + m_) if i % g.size == g.rank]

    def _later(self) -> Later | None:
        """The tensors only the next update changes (parameters, optimizer states): a
        capture copies them while the next step computes (`settle` before changing them).
        None where the state is not on the CPU (a user's own loop on a GPU): the capture
        copies it to the host at once anyway."""
        st = self.node.state
        if any(p.device.type != "cpu" for p in st.model.parameters()):
            return None
        ptrs = {p.data_ptr() for p in st.model.parameters()}
        for opt in (st.optimizer, st.outer):
            if opt is not None:  # on the CPU, `split` gives the tensors themselves
                ptrs |= {t.data_ptr() for t in layout.split(opt.state_dict())[1]}
        return lambda t: t.data_ptr() in ptrs

    def settle(self) -> None:
        """Before the state changes: the checkpoint being captured has its copy."""
        if self.checkpointer is not None:
            self.checkpointer.wait_captured()

    def save_shard(self, step: int) -> None:
        """A sharded member's primary range at ``step`` (every member writes its own, with
        each checkpoint; where checkpoints are erasure-coded against lost disks, the ranges it
        is buddy for too); a failure is reported, and training goes on."""
        node = self.node
        assert node.zone is not None and node.config.checkpoint_dir is not None
        try:
            node.zone.save(Path(node.config.checkpoint_dir), step, copies=self.fragments is not None)
        except OSError as exc:
            self.report(Kind.CHECKPOINT_FAILED, f"the range of step {step} could not be written: {exc}")

    def save_last(self) -> None:
        """The last member is going: keep what it committed since the last checkpoint."""
        node = self.node
        if node.zone is not None and node.config.checkpoint_dir is not None and node.zone.engine is not None:
            self.save_shard(node.state.step)  # (the last member holds every range)
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer.save_async(self.checkpoint_tree())

    def checkpoint_tree(self) -> dict[str, Any]:
        node = self.node
        tree = node.state.tree(local=True)  # the checkpointer copies it before the step goes on
        tree["epoch"] = node.group.epoch if node.group is not None else (self.restored_epoch or 0)
        tree["job"] = node.job.identity()
        return tree

    def restore_checkpoint(self) -> None:
        """A cold start from the newest usable checkpoint (or K of its fragments), if any."""
        node = self.node
        directory = node.config.checkpoint_dir
        if directory is None:
            return
        identity = node.job.identity()
        found = load_newest(directory, node.zone.restorable(Path(directory)) if node.zone is not None else None)
        newest = (found.path, found.snap) if found.path is not None and found.snap is not None else None
        for why in found.bad if newest else []:
            self.note(Kind.CHECKPOINT_FAILED, f"{why}: using an older one")
        if newest is not None and newest[1].get("job", identity) != identity:
            aside = self._set_aside(f"checkpoints of job {newest[1]['job']}, not of {identity}")
            self.note(
                Kind.CHECKPOINT_FAILED,
                f"{newest[0]} is another job's (job identity {newest[1]['job']}, this job {identity}: "
                f"name, batch size, steps, seed or dataset differ): not used, {aside}",
            )
            newest = None
        if newest is None:
            # Fragments in this directory (a shared one, or one `unbroken restore` did not
            # merge yet) rebuild the state when K of them are there.
            try:
                snap, manifest, notes = rebuild([directory])
            except NotRebuilt as exc:
                log.info("%s: %s", node.name, exc)
                # Corrupt, or none there, on both sides, and something corrupt: the job's
                # state is lost here, and starting over must be the operator's choice.
                plain = found.all_corrupt or not found.bad
                if (found.all_corrupt or exc.corrupt) and plain and (exc.corrupt or not exc.notes):
                    bad = "; ".join([*found.bad, *exc.notes])
                    self._corrupt = f"every checkpoint in --checkpoint-dir {directory} is corrupt: {bad}"
                return
            for why in notes:
                self.note(Kind.CHECKPOINT_FAILED, why)
            path = directory / f"frag-{manifest.step:09d}.json"
        else:
            path, snap = newest
        self._fresh = node.state.capture()  # until the group says this checkpoint is not ahead of it
        node.state.restore(snap)
        self.restored_epoch = int(snap.get("epoch", 0))
        node.restored()
        self.log(Entry.RESTORE, {"step": node.state.step, "path": str(path), "digest": node.state.digest()})
        log.info("%s: restored step %d from %s", node.name, node.state.step, path)

    def refused(self, order: m.EpochOrder, exc: CollectiveFailed | TransferError) -> None:
        """Tell the leader why ``order``'s epoch failed here (and whom the data blames, if anyone)."""
        node = self.node
        rank = exc.rank if isinstance(exc, (BadContribution, BadRequest)) else -1
        culprit = order.members[rank] if 0 <= rank < len(order.members) else None
        kind = Kind.BAD_REQUEST if isinstance(exc, BadRequest) else Kind.BAD_GRADIENT
        if isinstance(exc, (AuditMismatch, Suspicion)):
            kind = Kind.AUDIT if isinstance(exc, AuditMismatch) else Kind.SUSPECT
        self.log(Entry.REFUSED, {"step": node.state.step, "culprit": culprit, "reason": str(exc)})
        back = exc.rollback_to if isinstance(exc, AuditMismatch) else -1
        zone_only = isinstance(exc, BadContribution) and exc.zone_only
        fault = m.Fault(
            epoch=order.epoch, reason=str(exc)[:2000], culprit=culprit, kind=kind, rollback_to=back,
            zone_only=zone_only, step=node.state.step,
        )  # fmt: skip
        node.client.send(fault)

    def joined(self) -> None:
        """Once welcomed: drop a restored checkpoint that is ahead of the group (another run's:
        the group never moves to a step it did not commit), and send the notes."""
        node = self.node
        welcome = node.client.welcome
        if welcome is None:
            return
        if self._corrupt is not None:
            self._settle_corrupt(welcome.group_step)
        if self._fresh is not None:
            if welcome.group_step and node.state.step > welcome.group_step and node.config.checkpoint_dir:
                ahead = node.state.step
                node.state.restore(self._fresh, own=True)
                self.restored_epoch = None
                node.audits.checkpoint_epoch = -1
                node.restored()
                why = f"a checkpoint of step {ahead}, ahead of the group's step {welcome.group_step}"
                aside = self._set_aside(f"{why}: another run's")
                self.note(
                    Kind.CHECKPOINT_FAILED,
                    f"{why}: another run's? Not used ({aside}); this node joins with the group's state",
                )
            self._fresh = None
        for kind, reason in self._notes:
            self.report(kind, reason)
        self._notes.clear()

    def _settle_corrupt(self, group_step: int) -> None:
        """Every checkpoint in the directory is corrupt: this node joins a group that trains
        (its state comes from there), or trains from step 0 where the operator said so
        (``--start-fresh``); either way the corrupt files are set aside, so that they neither
        stop the next start nor outrank this run's checkpoints. Otherwise it stops: a job
        silently started over would lose every step it had.

        Raises:
            ConfigError: no group trains and ``--start-fresh`` was not given.
        """
        why, self._corrupt = self._corrupt, None
        assert why is not None
        if group_step:
            how = f"this node joins with the group's state (step {group_step})"
        elif self.node.config.start_fresh:
            how = "--start-fresh: this node trains from step 0"
        else:
            raise ConfigError(
                f"{why}. Not starting over from step 0 without being told: put a good checkpoint there (a copy, or "
                "`unbroken restore` of the nodes' fragments), or start this node with --start-fresh to train from "
                "step 0 (the corrupt files are then set aside)"
            )
        directory = self.node.config.checkpoint_dir
        assert directory is not None
        names = [  # not another writer's temporary file: its rename would fail
            p.name
            for p in directory.iterdir()
            if p.name.startswith(("ckpt-", "frag-")) and not p.name.endswith(".tmp") and p.is_file()
        ]
        self.note(Kind.CHECKPOINT_FAILED, f"{why}; {how}; the corrupt files are {self._set_aside(why, names)}")

    def _set_aside(self, why: str, names: list[str] | None = None) -> str:
        """Move the checkpoint directory's checkpoints (or ``names``) out of this run's way;
        where they went."""
        directory = self.node.config.checkpoint_dir
        assert directory is not None
        try:
            return f"moved to {set_aside(directory, why, names)}"
        except OSError as exc:
            return f"left in place: they could not be moved ({exc.strerror or exc})"
