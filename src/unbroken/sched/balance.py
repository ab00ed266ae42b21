"""The plan: who trains, how many samples each trainer computes, in micro-batches of what size.

A node's compute time for a share of ``s`` samples is modelled as::

    t(s) = overhead_s * ceil(s / microbatch) + s * per_sample_s

Trainers get shares that finish together by this model: proportional to their measured
throughput (1 / per_sample_s) when fixed costs are small, whole samples summing to B (or
split by the operators' weights when that predicts a step within `REBALANCE_MARGIN` of
it: then the difference is noise). A node whose presence
lengthens the predicted step more than it adds (a one-sample share takes longer than the
step of the others, or its rounding leaves it nothing) gets another role instead:
``validator`` (evaluates committed state, and checks the trainers' work by recomputing
sampled slices: `unbroken.train.checks`) or ``standby`` (keeps a warm replica). Every
member, whatever its role, takes part in the step's all-reduce and applies the committed
step, so a standby holds the current state and can be promoted to trainer without a
transfer.

Everything here is pure: the coordinator calls it with the nodes' reports.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from unbroken.sched.shares import split_batch
from unbroken.specs import Preference as Preference  # the plan's vocabulary, kept where it is decided
from unbroken.specs import Role as Role

REBALANCE_MARGIN = 0.10
"""A new plan replaces the current one only if its predicted step is this much shorter..."""
NOISE_Z = 3.0
"""...even where each node's speed is off by this many of its standard errors against it
(`Profile.noise`): on a shared machine a few milliseconds of descheduling in steps of a few
milliseconds make identical nodes look unequal, and shares that follow that noise only
move back and forth."""
UNSETTLED_NOISE = 0.25
"""The relative error assumed of a start-up estimate (processes starting together on one
machine disturb each other's first measurement): with `NOISE_Z`, a node that only
calibrated is taken for its peers' equal unless it is more than e^0.75 (2.1) times faster
or slower than their median; two such nodes alone, unless 4.5 times apart."""


@dataclass(frozen=True)
class Profile:
    """What the plan knows of one node (its latest report)."""

    name: str
    per_sample_s: float
    """Marginal compute time per sample (seconds); 0 means not measured yet."""
    overhead_s: float = 0.0
    """Fixed compute time per micro-batch (seconds)."""
    max_microbatch: int = 0
    """Largest micro-batch its memory allows (0: no limit; -1: not even one sample fits)."""
    weight: float = 1.0
    """The operator's relative share, used when throughput is not balanced or not known."""
    preference: Preference = Preference.AUTO
    evaluates: bool = False
    """The job has an evaluation function this node can run."""
    benched: bool = False
    """Its gradient was refused recently (non-finite or far out of range): it does not train."""
    settled: bool = True
    """Its speed comes from real steps or probes, not only the start-up estimate (which other
    processes starting on the same machine disturb): only settled nodes are moved out of
    training for speed."""
    noise: float = 0.0
    """Relative standard error of ``per_sample_s`` (an unsettled node's is at least
    `UNSETTLED_NOISE`)."""

    def time_for(self, share: int) -> float:
        """Predicted compute time for ``share`` samples (0 for none)."""
        if share <= 0:
            return 0.0
        mb = self.max_microbatch if self.max_microbatch > 0 else share
        return self.overhead_s * math.ceil(share / mb) + share * self.per_sample_s


@dataclass(frozen=True)
class Plan:
    """Shares, micro-batch sizes and roles of an epoch's members, in rank order."""

    shares: tuple[int, ...]
    microbatches: tuple[int, ...]
    roles: tuple[Role, ...]
    step_s: float
    """Predicted compute time of the step (its slowest trainer)."""
    reasons: tuple[str, ...]
    """Why each member has its role, for events and the dashboard."""

    def trainers(self) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r is Role.TRAINER]


def _filled(profiles: Sequence[Profile]) -> list[Profile]:
    """Unmeasured nodes are assumed as fast as the median measured one, scaled by weight, its
    fixed cost too: a newcomer taken for free of it would look many times faster than every
    measured node, and take the whole batch from them."""
    known = sorted((p for p in profiles if p.per_sample_s > 0), key=lambda p: p.per_sample_s * p.weight)
    if not known:
        return [_replace_speed(p, 1.0 / p.weight, 0.0) for p in profiles]
    median = known[len(known) // 2]
    per_sample = median.per_sample_s * median.weight
    return [p if p.per_sample_s > 0 else _replace_speed(p, per_sample / p.weight, median.overhead_s) for p in profiles]


def _replace_speed(p: Profile, per_sample_s: float, overhead_s: float) -> Profile:
    # Not `dataclasses.replace`, which builds the copy field by field through ``__init__``
    # (about 7 µs): a plan copies every unmeasured member's profile, thousands at a fleet's
    # admission. A shallow copy with the two speeds set is the same profile.
    q = copy.copy(p)
    object.__setattr__(q, "per_sample_s", per_sample_s)
    object.__setattr__(q, "overhead_s", overhead_s)
    return q


def _towards(x: float, centre: float, z: float) -> float:
    """``x`` moved towards ``centre`` by a factor of up to e^z (no further than ``centre``)."""
    if x <= 0 or centre <= 0:
        return x
    gap = math.log(x / centre)
    return centre * math.exp(math.copysign(max(0.0, abs(gap) - z), gap))


def _denoised(ps: Sequence[Profile], share: float) -> list[Profile]:
    """Each node's speed moved towards the members' median by ``NOISE_Z`` of its relative
    errors: what is left of a difference between nodes once noise could explain it.

    Speeds are compared by the time each node takes for ``share`` samples (its fixed and
    per-sample costs together: a node's probes may split them otherwise than its peers'
    steps do, and only the sum matters), and a node's costs are scaled as one. Decisions to
    move shares are judged on these; the shares themselves follow the measured speeds."""
    if len(ps) < 2:
        return list(ps)
    n = max(1, round(share))
    times = [p.time_for(n) for p in ps]
    centre = float(np.median(times))
    out = []
    for p, t in zip(ps, times, strict=True):
        z = NOISE_Z * (p.noise if p.settled else max(p.noise, UNSETTLED_NOISE))
        f = _towards(t, centre, z) / t if t > 0 else 1.0
        # Most nodes are within noise of the median, or at it: copied only when moved.
        out.append(p if f == 1.0 else _replace_speed(p, p.per_sample_s * f, p.overhead_s * f))
    return out


def _split(batch_size: int, profiles: Sequence[Profile], trainers: Sequence[int], by_weight: bool) -> list[int]:
    shares = [0] * len(profiles)
    if not by_weight:
        for i, s in zip(trainers, _level([profiles[i] for i in trainers], batch_size), strict=True):
            shares[i] = s
        return shares
    for i, s in zip(trainers, split_batch(batch_size, [profiles[i].weight for i in trainers]), strict=True):
        shares[i] = s
    return shares


def _capacity(p: Profile, t: float) -> int:
    """The most samples ``p`` computes within ``t`` seconds."""
    c, o = p.per_sample_s, p.overhead_s
    if t < o + c:
        return 0
    if p.max_microbatch <= 0:
        return int((t - o) / c)
    full = o + p.max_microbatch * c
    k = int(t / full)
    rest = t - k * full
    extra = min(p.max_microbatch - 1, int((rest - o) / c)) if rest >= o + c else 0
    return k * p.max_microbatch + extra


def _capacities(profiles: Sequence[Profile]) -> Callable[[float], np.ndarray]:
    """`_capacity` of every profile at once (the level search asks at 64 levels: with
    thousands of nodes a loop over them per level is what the plan would cost)."""
    c = np.array([p.per_sample_s for p in profiles], dtype=np.float64)
    o = np.array([p.overhead_s for p in profiles], dtype=np.float64)
    mb = np.array([p.max_microbatch for p in profiles], dtype=np.int64)
    limited = mb > 0
    full = o + np.where(limited, mb, 1) * c

    def at(t: float) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            free = np.floor((t - o) / c)
            k = np.floor(t / full)
            rest = t - k * full
            extra = np.where(rest >= o + c, np.minimum(mb - 1, np.floor((rest - o) / c)), 0)
            caps = np.where(limited, k * mb + extra, free)
        return np.where(t < o + c, 0, caps).astype(np.int64)

    return at


def _level(profiles: Sequence[Profile], batch_size: int) -> list[int]:
    """Shares that finish together: the lowest time level at which the nodes' capacities
    cover B (fixed costs per micro-batch included), then the surplus taken back from the
    nodes that would finish last. With no fixed costs this is the proportional split."""
    if batch_size == 0:
        return [0] * len(profiles)
    capacities = _capacities(profiles)
    lo, hi = 0.0, min(p.time_for(batch_size) for p in profiles)
    for _ in range(64):
        mid = (lo + hi) / 2
        if int(capacities(mid).sum()) >= batch_size:
            hi = mid
        else:
            lo = mid
    shares: list[int] = np.minimum(capacities(hi), batch_size).tolist()
    if sum(shares) < batch_size:  # float edge: give the rest to the fastest finisher
        best = min(range(len(profiles)), key=lambda i: (profiles[i].time_for(shares[i] + 1), i))
        shares[best] += batch_size - sum(shares)
    # Take the surplus back one sample at a time from whoever finishes last (ties: the
    # highest index): a heap, so thousands of nodes cost N log N, not N per sample.
    excess = sum(shares) - batch_size
    heap = [(-profiles[i].time_for(shares[i]), -i) for i in range(len(profiles))]
    heapq.heapify(heap)
    for _ in range(excess):
        _, neg = heap[0]
        last = -neg
        shares[last] -= 1
        heapq.heapreplace(heap, (-profiles[last].time_for(shares[last]), neg))
    return shares


def _step_time(profiles: Sequence[Profile], shares: Sequence[int]) -> float:
    return max((p.time_for(s) for p, s in zip(profiles, shares, strict=True)), default=0.0)


def plan(
    batch_size: int,
    profiles: Sequence[Profile],
    *,
    balance: bool = True,
    spares_wanted: int = 0,
    overhead_s: float = 0.0,
    denoise: bool = True,
) -> Plan:
    """The plan for these members (rank order), deterministic for equal inputs.

    ``balance=False`` splits by the operators' weights and never demotes a node for speed.
    ``spares_wanted`` is how many hot spares (``--role standby``) must train to replace
    trainers that failed or left; the earliest in rank order are promoted. ``overhead_s`` is
    the part of a step that does not depend on the split (the all-reduce): gains are judged
    against the whole step. ``denoise=False`` takes the speeds as exact (`Profile.noise`
    ignored).
    """
    if not profiles:
        raise ValueError("cannot plan for zero members")
    ps = _filled(profiles)
    reasons = [""] * len(ps)
    candidates = []
    spares = [
        i for i, p in enumerate(ps) if p.preference is Preference.STANDBY and p.max_microbatch >= 0 and not p.benched
    ]
    promoted = set(spares[:spares_wanted])
    for i, p in enumerate(ps):
        if p.max_microbatch < 0:
            reasons[i] = "not even one sample fits in its memory"
        elif p.benched:
            reasons[i] = "benched: its gradient was refused, or its work found wrong"
        elif p.preference is Preference.VALIDATOR:
            reasons[i] = "asked to validate (--role validator)"
        elif p.preference is Preference.STANDBY and i not in promoted:
            reasons[i] = "hot spare (--role standby)"
        else:
            candidates.append(i)
            if i in promoted:
                reasons[i] = "hot spare promoted: a trainer failed or left"
    if not candidates:
        # Never stop while a node lives: the most capable node trains whatever it was asked.
        able = [i for i, p in enumerate(ps) if p.max_microbatch >= 0 and not p.benched] or list(range(len(ps)))
        first = min(able, key=lambda i: (ps[i].time_for(batch_size), i))
        candidates = [first]
        reasons[first] = "the only node able to train"
    trainers = list(candidates)
    calm = _denoised(ps, batch_size / len(trainers)) if denoise else ps
    if all(c is p for c, p in zip(calm, ps, strict=True)):
        calm = ps  # no speed moved by noise: each split of ``calm`` is one of ``ps`` already
    splits: dict[tuple[int, bool, tuple[int, ...]], list[int]] = {}

    def split(speeds: Sequence[Profile], who: list[int], by_weight: bool) -> list[int]:
        # The same split is asked for up to four times (with and without noise, before and
        # after dropping nodes); at thousands of members each costs milliseconds.
        key = (id(speeds), by_weight, tuple(who))
        if key not in splits:
            splits[key] = _split(batch_size, speeds, who, by_weight)
        return list(splits[key])

    if balance and len(trainers) > 1:
        # A node the levelled split leaves without a sample would only lengthen the step
        # (and would even were its speed only noise away from the others').
        shares = split(ps, trainers, by_weight=False)
        step = _step_time(ps, shares)
        calm_shares = split(calm, trainers, by_weight=False)
        dropped: set[int] = set()
        for i in [i for i in trainers if shares[i] == 0 and calm_shares[i] == 0]:
            if ps[i].preference is Preference.TRAINER or not ps[i].settled or len(trainers) - len(dropped) == 1:
                continue
            reasons[i] = (
                f"predicted step {step * 1e3:.1f} ms without it; one sample takes it {ps[i].time_for(1) * 1e3:.1f} ms"
            )
            dropped.add(i)
        trainers = [i for i in trainers if i not in dropped]
    shares = split(ps, trainers, by_weight=not balance)
    if balance:
        # Where the nodes differ by no more than noise, or compute hardly depends on the share
        # (a fixed cost per micro-batch dominates), levelled shares follow measurement noise;
        # the operators' weights are as good then, and they do not move.
        by_weight = split(ps, trainers, by_weight=True)
        levelled = split(calm, trainers, by_weight=False)
        for speeds, best in ((ps, shares), (calm, levelled)):
            if _step_time(speeds, by_weight) + overhead_s <= (_step_time(speeds, best) + overhead_s) * (
                1 + REBALANCE_MARGIN
            ):
                shares = by_weight
                break
    # A node asked to train, or not measured on real steps yet (its start-up estimate may be
    # off), gets at least one sample, taken from the largest share (ties: the lowest index).
    needy = [i for i in trainers if shares[i] == 0 and (ps[i].preference is Preference.TRAINER or not ps[i].settled)]
    donors = [(-shares[j], j) for j in trainers]
    heapq.heapify(donors)
    for i in needy:
        neg, donor = donors[0]
        if -neg <= 1:
            break  # no share left to split; later needy nodes would find none either
        shares[donor] -= 1
        shares[i] = 1
        heapq.heapreplace(donors, (-shares[donor], donor))
        heapq.heappush(donors, (-1, i))
    # Validators: the nodes that asked for it, else one: the first that can evaluate, else
    # the first that can check the trainers' work (one sample's gradient fits in its memory)
    # and was not asked to stand by. Never one benched: its findings would be worth nothing.
    training = {i for i in trainers if shares[i] > 0}
    able = [i for i, p in enumerate(ps) if i not in training and not p.benched]
    asked = {
        i for i in able if ps[i].preference is Preference.VALIDATOR and (ps[i].evaluates or ps[i].max_microbatch >= 0)
    }
    checkers = [i for i in able if ps[i].preference is Preference.AUTO and ps[i].max_microbatch >= 0]
    validators = asked or set(([i for i in able if ps[i].evaluates] or checkers)[:1])
    roles = []
    chosen = set(trainers)
    for i, p in enumerate(ps):
        if i in training:
            roles.append(Role.TRAINER)
            if not reasons[i]:
                reasons[i] = f"{shares[i]} of {batch_size} samples, predicted {p.time_for(shares[i]) * 1e3:.1f} ms"
        elif i in validators:
            roles.append(Role.VALIDATOR)
        else:
            roles.append(Role.STANDBY)
        if i in chosen and shares[i] == 0:
            reasons[i] = reasons[i] or "its share of the batch rounds to zero samples"
    micro = tuple(min(s, p.max_microbatch) if p.max_microbatch > 0 else s for s, p in zip(shares, ps, strict=True))
    return Plan(tuple(shares), micro, tuple(roles), _step_time(ps, shares), tuple(reasons))


def adopt(profiles: Sequence[Profile], shares: Sequence[int], roles: Sequence[Role]) -> Plan:
    """The plan already in force (reported by the nodes after a coordinator restart)."""
    ps = _filled(profiles)
    micro = tuple(min(s, p.max_microbatch) if p.max_microbatch > 0 else s for s, p in zip(shares, ps, strict=True))
    reasons = tuple("in force before the coordinator restarted" for _ in ps)
    return Plan(tuple(shares), micro, tuple(roles), _step_time(ps, shares), reasons)


def rebalance(
    batch_size: int,
    current: Sequence[int],
    profiles: Sequence[Profile],
    *,
    spares_wanted: int = 0,
    overhead_s: float = 0.0,
    wander: Sequence[float] = (),
) -> tuple[Plan, str] | None:
    """A better plan for the same members, if it shortens the predicted step enough.

    ``current`` is the shares in force; the returned reason compares the two predictions.
    Hysteresis (`REBALANCE_MARGIN` of the whole step, ``overhead_s`` included, judged on
    speeds with their noise taken out: `NOISE_Z`) keeps measurement noise from flapping the
    plan. ``wander``: how far each node's speed strays by itself over a longer time, also
    counted as noise in that judgement (only there: the plan follows the measured speeds).
    """
    ps = _filled(profiles)
    now_s = _step_time(ps, current)
    new = plan(batch_size, profiles, spares_wanted=spares_wanted, overhead_s=overhead_s)
    if list(new.shares) == list(current) or not new.step_s + overhead_s < (now_s + overhead_s) * (1 - REBALANCE_MARGIN):
        return None
    # The gain must remain once noise could explain the differences between the nodes.
    noisy = [dataclasses.replace(p, noise=max(p.noise, w)) for p, w in zip(ps, wander, strict=True)] if wander else ps
    calm = _denoised(noisy, batch_size / max(1, len(new.trainers())))
    best = plan(batch_size, calm, spares_wanted=spares_wanted, overhead_s=overhead_s, denoise=False)
    before = (_step_time(calm, current) + overhead_s) * (1 - REBALANCE_MARGIN)
    if not best.step_s + overhead_s < before:
        return None
    if wander and not _step_time(calm, new.shares) + overhead_s < before:
        return None  # the plan proposed would gain only on speeds its nodes' wander could explain
    slowest = max(range(len(ps)), key=lambda i: ps[i].time_for(current[i]))
    reason = (
        f"rebalance: predicted step {now_s * 1e3:.1f} ms -> {new.step_s * 1e3:.1f} ms "
        f"({ps[slowest].name} at {ps[slowest].per_sample_s * 1e3:.2f} ms/sample held the step); "
        f"shares {list(current)} -> {list(new.shares)}"
    )
    return new, reason
