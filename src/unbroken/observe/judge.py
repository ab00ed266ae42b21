"""A finished job's verdict: its nodes' commit logs and its events against the promises.

Each node appends its commit log (``--commit-log``, one `unbroken.events.Entry` a line);
the coordinator appends the job's events (``--event-log``). `judge` reads them and says,
for each promise a user of the final model relies on, whether it held, with the evidence
(node, step, epoch) where it did not:

- ``steps``: every step 1..T was committed, and no node went from step s to another than s + 1.
- ``applied-once``: no committed step was lost or applied twice. A step committed again in
  a later epoch is allowed after a rollback to before it, or when every member that applied
  it first died (or was expelled) with it before it took part in a later epoch: that was the
  step in flight, which the survivors commit again with the same samples.
- ``samples``: each committed step read exactly the samples the data plan gives it (given
  the plan); without it, only that every step read the same number B (a step that spans the
  end of a pass over the data may read a sample twice: only the plan tells it from a fault).
- ``replicas``: every digest logged for one step (commits with ``--digest-every``, audits,
  state received or restored) is the same.
- ``final``: every node that finished holds the group's final digest, at the last step.
- ``rollbacks``: each failed audit's rollback and each restart from a checkpoint that made
  the group redo committed steps, with how many; and committed steps lost with the only
  members that held them (more than the one step in flight: a run of them), trained again
  from an older state with no restore. The group going back to one step twice on
  failed audits is a divergence that came back after its repair: the job had to stop.
- ``halts``, ``quarantines``: from the events.

How the logs are read: each node's log twice, as a stream: a first pass checks every line
and finds the steps each node took with it when it died or was expelled; the second merges
the nodes' logs by wall time (the nodes' clocks must roughly agree) and judges. A third pass
reads the samples of the few steps that broke the data promise, to name them. Per step only
a little is kept: the epoch that committed it, when, by whom, a fingerprint of the samples
of each (epoch, step), and digests where they were logged.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from unbroken.events import Entry, Kind, Recorded
from unbroken.observe.passes import MASK, First, Logs, fingerprint, first_pass, merged, ranges, short, slices
from unbroken.observe.verdict import Check, Evidence, Expect, Promise, Status, Verdict

KEPT = 100
"""Pieces of evidence kept per promise (the rest are counted)."""
DETAILED = 20
"""Steps whose samples are named when they broke the data promise (a pass over the logs)."""


def judge(logs: Logs, expect: Expect, events: Iterable[Recorded] | None = None, *, legacy: bool = False) -> Verdict:
    """The verdict on a run from its nodes' logs and (None: no event log) its events.
    ``legacy``: also word the broken promises as `check_promises` always has (`Verdict.problems`),
    and leave the digests of audits out of the replicas' (as it does).

    Raises:
        ConfigError: an entry is not one a node writes (names the node, the line and what is wrong).
    """
    firsts = {node: first_pass(node, read) for node, read in logs.items()}
    j = _Judge(expect, firsts, legacy=legacy)
    if events is not None:
        for r in events:
            j.event(r)
    for node, e in merged(logs):
        j.entry(node, e)
    return j.finish(lambda keys: slices(logs, keys), events is not None)


@dataclass
class _Rollback:
    t: float
    step: int
    """The step the group went back to."""
    why: str
    audit: bool
    epoch: int | None
    top: int
    """The highest step committed anywhere before it."""
    nodes: list[str]
    redone: int = 0
    """Steps committed before it above its step that were committed again after it."""

    def __str__(self) -> str:
        who = ", ".join(self.nodes)
        if self.audit:
            return f"a {self.why} took {who} back from step {self.top} to step {self.step}: {self.redone} steps redone"
        return (
            f"{who} restarted from {self.why} (step {self.step}) after the group had reached step {self.top}: "
            f"{self.redone} steps redone"
        )


class _Judge:
    def __init__(self, expect: Expect, firsts: dict[str, First], *, legacy: bool) -> None:
        self.expect = expect
        self.firsts = firsts
        self.legacy = legacy
        self.num_steps = expect.num_steps or max(
            [f.final_step or 0 for f in firsts.values()] + [0]
        )  # raised at `finish` to what the events and the commits say, where the nodes never finished
        self.found: dict[Promise, list[Evidence]] = defaultdict(list)
        self.total: Counter[Promise] = Counter()
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.samples: dict[tuple[int, int], list[int]] = {}
        """(epoch, step) → [samples, fingerprint, slices] of the contributions logged."""
        self.digests: dict[int, dict[str, str]] = defaultdict(dict)
        self.digest_epochs: dict[tuple[int, str], int] = {}
        self.first_digest: dict[tuple[int, int], str] = {}
        """(step, epoch) → the digest its first commit in that epoch logged."""
        self.commits: dict[int, tuple[float, int, frozenset[str]]] = {}
        """Step index s → when and in which epoch it was (last) first committed, and by whom then."""
        self.others: dict[tuple[int, int], frozenset[str]] = {}
        """(s, epoch) → who committed s in an epoch not the one `commits` holds."""
        self._sets: dict[frozenset[str], frozenset[str]] = {}
        self.last: dict[str, int] = {}
        self.epoch_of: dict[str, int] = {}
        self.restores: list[tuple[float, int]] = []
        self.rollbacks: list[_Rollback] = []
        self.trained: set[str] = set()
        """Nodes that committed a step since they last restored a state."""
        self.lost: dict[int, tuple[frozenset[str], int, float, int]] = {}
        """Step index s → who took it with them, and the epoch and time of their commit of it:
        committed again later, after its first committers died with it, with no restore since
        (a run of them is more than the step in flight)."""
        self.final_digests: dict[str, str] = {}
        self.final_at: dict[str, tuple[int, float]] = {}
        self.top = 0
        self.counts: Counter[str] = Counter()
        self.events: dict[Kind, list[Evidence]] = defaultdict(list)
        self.finished_step = 0

    def _found(self, promise: Promise, text: str, *, legacy: str | None = "", **where: Any) -> None:
        """Evidence against ``promise``; ``legacy``: how `check_promises` words it ("": the
        same; None: it does not check this)."""
        self.total[promise] += 1
        if len(self.found[promise]) < KEPT:
            self.found[promise].append(Evidence(text, **where))
        if self.legacy and legacy is not None:
            self.problems.append(legacy or text)

    def _set(self, nodes: frozenset[str]) -> frozenset[str]:
        return self._sets.setdefault(nodes, nodes)

    # ------------------------------------------------------------ events

    def event(self, r: Recorded) -> None:
        if r.kind in (Kind.HALTED, Kind.QUARANTINE, Kind.AUDIT):
            self.events[r.kind].append(Evidence(r.reason, node=r.node, step=r.step, epoch=r.epoch, t=r.time))
        elif r.kind is Kind.FINISHED:
            self.finished_step = max(self.finished_step, r.step)

    # ------------------------------------------------------------ entries

    def entry(self, node: str, e: dict[str, Any]) -> None:
        kind, t = Entry(e["kind"]), float(e.get("t", 0.0))
        self.counts[kind.value] += 1
        if "epoch" in e:
            self.epoch_of[node] = int(e["epoch"])
        if kind is Entry.CONTRIB:
            self._contrib(node, e)
        elif kind is Entry.RESTORE:
            # The allowed rollbacks: every node died and the group resumed from a checkpoint,
            # or a failed consistency audit took the group back to its last audited state.
            step = int(e["step"])
            self.restores.append((t, step))
            for s in [s for s in self.digests if s > step]:
                del self.digests[s]
            self.last[node] = step
            self.digests[step][f"{node}:restore"] = e["digest"]
            self._rollback(node, t, step, e)
        elif kind is Entry.SYNC:
            self.last[node] = int(e["step"])
            self.digests[int(e["step"])][f"{node}:sync"] = e["digest"]
        elif kind is Entry.COMMIT:
            self._commit(node, t, e)
        elif kind is Entry.AUDIT and e.get("ok") is not False and not self.legacy:
            # A failed audit's digests differ by definition: it is reported with its rollback.
            step = int(e["step"])
            self.digests[step][f"{node}:audit"] = e["digest"]
            if node in self.epoch_of:
                self.digest_epochs[(step, f"{node}:audit")] = self.epoch_of[node]
        elif kind is Entry.FINAL:
            self.final_digests[node] = e["digest"]
            self.final_at[node] = (int(e["step"]), t)
            if int(e["step"]) != self.num_steps:
                self._found(
                    Promise.FINAL,
                    f"{node} finished at step {e['step']}, not {self.num_steps}",
                    node=node,
                    step=int(e["step"]),
                    epoch=self.epoch_of.get(node),
                    t=t,
                )
        elif kind is Entry.EXPELLED:
            self.last.pop(node, None)

    def _contrib(self, node: str, e: dict[str, Any]) -> None:
        key = (int(e["epoch"]), int(e["step"]))
        indices = e["indices"]
        # Without the plan to compare with, the count alone.
        count, total = fingerprint(indices) if self.expect.plan is not None else (len(indices), 0)
        fp = self.samples.setdefault(key, [0, 0, 0])
        fp[0] += count
        fp[1] = (fp[1] + total) & MASK
        fp[2] += 1

    def _commit(self, node: str, t: float, e: dict[str, Any]) -> None:
        step, epoch = int(e["step"]), int(e["epoch"])
        s = step - 1
        where: dict[str, Any] = {"node": node, "step": step, "epoch": epoch, "t": t}
        if node in self.last and step != self.last[node] + 1:
            text = f"{node} committed step {step} right after step {self.last[node]}"
            self._found(Promise.ONCE if step <= self.last[node] else Promise.STEPS, text, **where)
        self.last[node] = step
        self.top = max(self.top, step)
        self.trained.add(node)
        prev = self.commits.get(s)
        if prev is not None and prev[1] != epoch:
            # This epoch's committers of s so far, apart from the first epoch's.
            self.others[(s, epoch)] = self._set(self.others.get((s, epoch), frozenset()) | {node})
            rolled_back = any(prev[0] < rt < t and r <= s for rt, r in self.restores)
            gone = prev[2]
            if all(self.firsts[n].took(s) for n in gone):
                if not rolled_back:
                    self.lost[s] = (gone, prev[1], prev[0], epoch)
                # The step in flight: its first committers died with it; their later digests
                # were of a state nobody else ever held.
                for later in [x for x in self.digests if x > s]:
                    for n in gone:
                        for label in (n, f"{n}:audit"):
                            if self.digest_epochs.get((later, label)) == prev[1]:
                                self.digests[later].pop(label, None)
            elif not rolled_back:
                text = f"step {step} committed in epoch {prev[1]} and again in epoch {epoch}"
                first, now = self.first_digest.get((step, prev[1])), e.get("digest")
                how = ""
                if first is not None and now is not None:
                    how = " with the same result" if first == now else f": digest {short(first)}, then {short(now)}"
                who = ", ".join(sorted(gone))
                self._found(Promise.ONCE, f"{text}{how} ({who} applied it first and lived on)", legacy=text, **where)
            self.others[(s, prev[1])] = prev[2]
            self.commits[s] = (t, epoch, self.others.pop((s, epoch)))
        elif prev is None:
            self.commits[s] = (t, epoch, self._set(frozenset({node})))
        else:
            self.commits[s] = (prev[0], epoch, self._set(prev[2] | {node}))
        if "digest" in e:
            self.digests[step][node] = e["digest"]
            self.digest_epochs[(step, node)] = epoch
            self.first_digest.setdefault((step, epoch), e["digest"])

    def _rollback(self, node: str, t: float, step: int, e: dict[str, Any]) -> None:
        audit = "path" not in e
        why = str(e.get("why") or "failed audit") if audit else f"a checkpoint, {e['path']}"
        if not audit and e.get("why"):  # a sharded zone's ranges lost in every zone, while members lived
            why += f" ({e['why']})"
        trained = node in self.trained
        self.trained.discard(node)
        for rb in reversed(self.rollbacks):
            if rb.step == step and rb.audit == audit:
                if node not in rb.nodes:  # another member of the same rollback
                    rb.nodes.append(node)
                    return
                if not trained:  # went back to this state again before it committed anything: the same
                    return
                break  # it went back to this step, trained on from there, and went back again: another
        self.rollbacks.append(_Rollback(t, step, why, audit, self.epoch_of.get(node), self.top, [node]))

    # ------------------------------------------------------------ the verdict

    def finish(
        self, slices: Callable[[set[tuple[int, int]]], dict[tuple[int, int], list[tuple[str, list[int]]]]], logged: bool
    ) -> Verdict:
        """``slices``: the slices logged for some (epoch, step)s (another pass over the logs);
        ``logged``: whether there was an event log."""
        if self.expect.num_steps is None and not self.final_digests:
            self.num_steps = max(self.finished_step, self.top)
            self.notes.append(f"no node finished: the job's last step is taken to be {self.num_steps}, the last seen")
        T = self.num_steps
        # In the order `check_promises` has always listed its problems in.
        checks = {c.promise: c for c in (self._steps(T), self._once(), self._replicas(), self._final(T))}
        checks[Promise.SAMPLES] = self._samples(slices)
        checks[Promise.ROLLBACKS] = self._rollbacks()
        checks[Promise.HALTS] = self._from_events(Promise.HALTS, Kind.HALTED, logged)
        checks[Promise.QUARANTINES] = self._from_events(Promise.QUARANTINES, Kind.QUARANTINE, logged)
        return Verdict(
            [checks[p] for p in Promise],
            T,
            sorted(self.firsts),
            {s: c[1] for s, c in sorted(self.commits.items())},
            self.final_digests,
            self.problems,
            self.notes,
        )

    def _check(self, promise: Promise, ok: str, bad: str, unchecked: str = "") -> Check:
        total = self.total[promise]
        status = Status.VIOLATED if total else Status.OK
        return Check(promise, status, bad if total else ok, self.found.get(promise, []), total, unchecked)

    def _steps(self, T: int) -> Check:
        missing = [s + 1 for s in range(T) if s not in self.commits]
        if missing and self.legacy:
            self.problems.append(f"steps never committed: {missing[:10]}{'...' if len(missing) > 10 else ''}")
        for lo, hi in ranges(missing):
            text = f"step {lo} never committed" if lo == hi else f"steps {lo}-{hi} never committed"
            self._found(Promise.STEPS, text, legacy=None, step=lo)
        epochs = len({c[1] for c in self.commits.values()})
        return self._check(
            Promise.STEPS,
            f"every step 1-{T} committed, none skipped ({_n(self.counts['commit'], 'commit')} "
            f"in {_n(epochs, 'epoch')})",
            f"{len(missing)} of {T} steps never committed" if missing else "a node skipped steps",
        )

    def _once(self) -> Check:
        return self._check(
            Promise.ONCE,
            "no committed step lost or applied twice",
            f"{_n(self.total[Promise.ONCE], 'step')} applied twice (a committed step lost, then redone)",
        )

    def _replicas(self) -> Check:
        compared = 0
        for step, by_node in sorted(self.digests.items()):
            compared += len(by_node)
            if len(set(by_node.values())) <= 1:
                continue
            if self.legacy:
                self.problems.append(f"replicas differ after step {step}: {by_node}")
            groups: dict[str, list[str]] = defaultdict(list)
            for label, digest in by_node.items():
                groups[digest].append(label)
            ordered = sorted(groups.items(), key=lambda g: -len(g[1]))
            odd = ordered[-1][1][0].split(":")[0]
            text = f"replicas differ after step {step}: " + "; ".join(
                f"{', '.join(labels)} {short(d)}" for d, labels in ordered
            )
            c = self.commits.get(step - 1)
            self._found(Promise.REPLICAS, text, legacy=None, node=odd, step=step, epoch=c[1] if c else None)
        if not compared:
            return Check(
                Promise.REPLICAS,
                Status.NOT_CHECKED,
                "no entry carries a digest",
                unchecked="no commit, audit or state transfer logged a digest: nodes log one every N commits "
                "with --digest-every N (audits, every --audit-every steps, log theirs)",
            )
        return self._check(
            Promise.REPLICAS,
            f"{_n(compared, 'digest')} logged at {_n(len(self.digests), 'step')} agree",
            f"replicas differ at {_n(self.total[Promise.REPLICAS], 'step')}",
        )

    def _final(self, T: int) -> Check:
        finals = self.final_digests
        if len(set(finals.values())) > 1 and self.legacy:
            self.problems.append(f"final digests differ: {finals}")
        if len(finals) < self.expect.finishers:
            text = f"only {len(finals)} nodes finished, expected {self.expect.finishers}"
            self._found(Promise.FINAL, text if finals else "no node finished the job (no final entry)", legacy=text)
        group, source = self._group_final(T)
        for node, digest in finals.items():
            if group is not None and digest != group:
                step, t = self.final_at[node]
                self._found(
                    Promise.FINAL,
                    f"{node} finished with digest {short(digest)}, the group's final is {short(group)} ({source})",
                    legacy=None,
                    node=node,
                    step=step,
                    epoch=self.epoch_of.get(node),
                    t=t,
                )
        ok = f"{_n(len(finals), 'node')} finished at step {T} with the group's digest {short(group or '')} ({source})"
        return self._check(Promise.FINAL, ok, "not every node ended with the group's final model")

    def _group_final(self, T: int) -> tuple[str | None, str]:
        last = self.commits.get(T - 1)
        if last is not None:
            at_t = [d for label, d in self.digests.get(T, {}).items() if ":" not in label]
            if at_t:
                return Counter(at_t).most_common(1)[0][0], f"its commit of step {T} in epoch {last[1]}"
        if not self.final_digests:
            return None, "none"
        (top, n), *rest = Counter(self.final_digests.values()).most_common()
        return top, "most finishers'" if not rest or rest[0][1] < n else "no majority: the first finisher's"

    def _samples(self, slices: Callable[[set[tuple[int, int]]], dict[Any, list[tuple[str, list[int]]]]]) -> Check:
        plan, B = self.expect.plan, self.expect.batch_size
        committed = sorted((s, c[1]) for s, c in self.commits.items())
        if not self.samples or not committed:
            if plan is not None and self.legacy:  # every committed step read nothing
                for s, epoch in committed:
                    self.problems.append(
                        f"step {s + 1} (epoch {epoch}) consumed 0 samples from 0 slices; "
                        f"expected exactly the {B} planned ones"
                    )
            why = "no contribution logged its samples" if committed else "no step was committed"
            return Check(Promise.SAMPLES, Status.NOT_CHECKED, why, unchecked=why)
        if B is None:  # the job's B is fixed, whoever was up: what most steps read
            B = Counter(self.samples.get((ep, s), [0])[0] for s, ep in committed).most_common(1)[0][0]
        bad: list[tuple[int, int, int, int]] = []  # s, epoch, samples read, slices
        for s, epoch in committed:
            count, total, parts = self.samples.get((epoch, s), [0, 0, 0])
            if (plan is not None and (count, total) != fingerprint(plan.indices(s, 0, B))) or count != B:
                bad.append((s, epoch, count, parts))
        named = slices({(ep, s) for s, ep, _, _ in bad[:DETAILED]}) if bad else {}
        for s, epoch, count, parts in bad:
            legacy = (
                f"step {s + 1} (epoch {epoch}) consumed {count} samples from {parts} slices; "
                f"expected exactly the {B} planned ones"
            )
            found = named.get((epoch, s), [])
            detail = _which(found, plan.indices(s, 0, B) if plan is not None else None)
            text = legacy if plan is not None else f"step {s + 1} (epoch {epoch}) read {count} samples, not B = {B}"
            node = ", ".join(sorted({n for n, _ in found})) or None
            self._found(
                Promise.SAMPLES,
                text + (f": {detail}" if detail else ""),
                legacy=legacy,
                node=node,
                step=s + 1,
                epoch=epoch,
            )
        if plan is not None:
            ok = f"each of {len(committed)} committed steps read exactly its {B} planned samples"
            return self._check(Promise.SAMPLES, ok, "steps that did not read exactly their planned samples")
        return self._check(
            Promise.SAMPLES,
            f"each of {len(committed)} committed steps read {B} samples",
            "steps that did not read B samples",
            unchecked="which samples each step read (none left out, none read twice or in two steps): the data "
            "plan is the job's, give it with --job FILE.py:ATTR",
        )

    def _rollbacks(self) -> Check:
        for rb in self.rollbacks:
            rb.redone = sum(1 for s in range(rb.step, rb.top) if (c := self.commits.get(s)) and c[0] > rb.t)
        shown = [rb for rb in self.rollbacks if rb.audit or rb.redone]
        twice: dict[int, list[_Rollback]] = defaultdict(list)
        for rb in shown:
            if rb.audit:
                twice[rb.step].append(rb)
        for step, rbs in twice.items():
            if len(rbs) > 1:
                self._found(
                    Promise.ROLLBACKS,
                    f"failed audits took the group back to step {step} {len(rbs)} times: a divergence that came back "
                    "after its repair must stop the job (promise 9), not be rolled back again",
                    legacy=None,
                    node=rbs[-1].nodes[0],
                    step=step,
                    epoch=rbs[-1].epoch,
                    t=rbs[-1].t,
                )
        if self.total[Promise.ROLLBACKS]:
            return self._check(Promise.ROLLBACKS, "", "a divergence came back after its repair")
        lost = self._lost()
        noted = sorted(
            [Evidence(str(rb), node=rb.nodes[0], step=rb.step, epoch=rb.epoch, t=rb.t) for rb in shown]
            + lost
            + [Evidence(f"audit verdict: {e.text}", e.node, e.step, e.epoch, e.t) for e in self.events[Kind.AUDIT]],
            key=lambda e: e.t or 0.0,
        )
        if not noted:
            return Check(Promise.ROLLBACKS, Status.OK, "none")
        redone = sum(rb.redone for rb in shown)
        gone = f", {_n(len(lost), 'run')} of committed steps lost" if lost else ""
        return Check(
            Promise.ROLLBACKS,
            Status.NOTED,
            f"{_n(len(shown), 'rollback')}, {'each ' if len(shown) > 1 else ''}a repair "
            f"({_n(redone, 'committed step')} redone){gone}, "
            f"{_n(len(self.events[Kind.AUDIT]), 'audit verdict')}",
            noted[:KEPT],
            len(noted),
        )

    def _lost(self) -> list[Evidence]:
        """Runs of committed steps lost with the only members that held them and trained
        again from an older state (`lost`): consecutive steps trained again in one epoch, one
        incident whoever first committed each (a pair dying one after the other, each step
        its own, lost two). One step alone is the step in flight."""
        runs: list[tuple[int, int, frozenset[str], int, float, int]] = []
        for s in sorted(self.lost):
            who, epoch, t, again = self.lost[s]
            if runs and runs[-1][1] == s - 1 and runs[-1][5] == again:
                lo, _, held, first, at, _ = runs[-1]
                runs[-1] = (lo, s, held | who, first, at, again)
            else:
                runs.append((s, s, who, epoch, t, again))
        out = []
        for lo, hi, who, epoch, t, _ in runs:
            if hi > lo:
                names = ", ".join(sorted(who))
                text = (
                    f"{names} died holding steps {lo + 1}-{hi + 1}, which no other member held, and no checkpoint "
                    f"was restored: {hi - lo + 1} committed steps lost and trained again"
                )
                out.append(Evidence(text, node=names, step=lo + 1, epoch=epoch, t=t))
        return out

    def _from_events(self, promise: Promise, kind: Kind, logged: bool) -> Check:
        if not logged:
            why = "no event log: the coordinator writes one with --event-log (give it with --event-log FILE)"
            return Check(promise, Status.NOT_CHECKED, "no event log", unchecked=why)
        found = self.events[kind]
        if not found:
            return Check(promise, Status.OK, "none")
        if kind is Kind.HALTED:
            return Check(promise, Status.VIOLATED, "the job stopped on an error", found[:KEPT], len(found))
        nodes = sorted({e.node or "?" for e in found})
        summary = f"{_n(len(nodes), 'node')} benched: {', '.join(nodes)}"
        return Check(promise, Status.NOTED, summary, found[:KEPT], len(found))


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _which(parts: list[tuple[str, list[int]]], planned: list[int] | None) -> str:
    """Which samples a step's slices read more often than its plan says (a step that spans the
    end of a pass may plan one twice), fewer times, or though its plan has none of them."""
    if planned is None:
        return ""
    if not parts:
        return "no slice logged"
    readers: dict[int, list[str]] = defaultdict(list)
    for node, indices in parts:
        for i in indices:
            readers[i].append(node)
    want = Counter(planned)
    over = [(i, nodes) for i, nodes in readers.items() if len(nodes) > want[i] > 0]
    under = [(i, len(readers.get(i, ()))) for i in want if len(readers.get(i, ())) < want[i]]
    extra = [(i, nodes) for i, nodes in readers.items() if want[i] == 0]
    said = [f"sample {i} read {len(nodes)} times ({', '.join(nodes)})" for i, nodes in over[:5]]
    said += [f"sample {i} never read" if not n else f"sample {i} read {n} of {want[i]} times" for i, n in under[:5]]
    said += [f"sample {i} is not in its plan (read by {', '.join(nodes)})" for i, nodes in extra[:5]]
    return "; ".join(said)
