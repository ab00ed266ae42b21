"""The job's training policy (`Policy`: mode, codec, aggregation rule, checkpoint fragments,
DiLoCo), typed and parsed without torch.

A coordinator is given it typed (`CoordinatorConfig.policy`; the command line's flags are
parsed by `Policy.parse`), each part checking itself, and every epoch order carries it whole
(`unbroken.control.messages.PolicyMsg`, parsed again where a node receives it: a
coordinator's word is checked too); the nodes build the codec and combine gradients from it.
Parsing here keeps torch out of the coordinator's process, whose start-up
is on the recovery path of every coordinator restart (importing torch alone takes over a
second of CPU, many seconds on a machine busy with training).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from unbroken.errors import ConfigError
from unbroken.events import StrEnum

CODECS = ("none", "fp16", "bf16", "int8", "int4", "int2", "int1", "topk")
TOPK_RATIO = 0.01
"""Fraction of elements top-k sends by default."""

STREAMS = 4
"""Connections one inter-zone hop is spread over by default (one TCP window caps a long link)."""
MAX_STREAMS = 16
"""Most TCP connections one inter-zone hop is spread over (`Policy.streams`)."""
BUCKET_MB = 25.0
"""Gradient buckets summed while backward runs, by default (DDP's size)."""
MAX_BUCKET_MB = 1024.0
"""The largest gradient bucket summed while backward runs (`Policy.bucket_mb`)."""

RULES = {"mean": 0.0, "clip": 2.0, "trimmed": 0.25, "checked": 0.0}
"""Each aggregation rule with its default parameter."""

AUDIT_EVERY = 100
"""Steps between consistency audits by default."""


class Role(str, enum.Enum):
    """What a member does each step. Transitions are the plan's, decided at every epoch::

    trainer ◀──(cost model: it helps; or trainers failed)──▶ validator | standby
    """

    TRAINER = "trainer"
    VALIDATOR = "validator"
    STANDBY = "standby"


class Preference(str, enum.Enum):
    """What the operator asked for with ``--role``."""

    AUTO = "auto"
    """The cost model decides."""
    TRAINER = "trainer"
    """Always train (unless it cannot: no memory for one sample)."""
    VALIDATOR = "validator"
    """Never trains; evaluates committed state and checks the trainers' work."""
    STANDBY = "standby"
    """A hot spare: stays out of training until a trainer fails or leaves."""


ROLES = tuple(p.value for p in Preference)
"""What a node may ask to be (``auto``: the cost model decides)."""

INNER_STEPS = 50
"""DiLoCo's default inner steps per round (H)."""
OUTER_LR = 0.7
"""DiLoCo's default outer learning rate (SGD with Nesterov momentum)."""
OUTER_MOMENTUM = 0.9
"""DiLoCo's default outer momentum."""


@dataclass(frozen=True)
class CodecSpec:
    """The inter-zone codec (`unbroken.comm.codecs`): its name, and top-k's ratio."""

    name: str = "none"
    ratio: float = 0.0
    """Top-k's fraction of elements sent (0 for the others; top-k given 0 takes `TOPK_RATIO`)."""

    def __post_init__(self) -> None:
        if self.name == "topk" and self.ratio == 0.0:
            object.__setattr__(self, "ratio", TOPK_RATIO)
        if self.name not in CODECS:
            raise ConfigError(f"CodecSpec.name = {self.name!r} is not one of {', '.join(CODECS)}")
        if self.name == "topk" and not 0 < self.ratio <= 1:
            raise ConfigError(f"CodecSpec.ratio = {self.ratio!r}: top-k's ratio must be in (0, 1] (e.g. 0.01)")

    def __str__(self) -> str:
        return f"topk:{self.ratio:g}" if self.name == "topk" else self.name

    @classmethod
    def parse(cls, spec: str) -> CodecSpec:
        """See `parse_codec`; raises ValueError."""
        return cls(*parse_codec(spec))


def parse_codec(spec: str) -> tuple[str, float]:
    """``none``, ``fp16``, ``bf16``, ``int8``, ``int4``, ``int2``, ``int1``, ``topk`` or ``topk:RATIO``
    (e.g. ``topk:0.05``): the codec's name and its ratio (top-k only; 0 for the others). Raises ValueError."""
    name, _, arg = spec.strip().lower().partition(":")
    if name in CODECS and name != "topk" and not arg:
        return name, 0.0
    if name == "topk":
        try:
            ratio = float(arg) if arg else TOPK_RATIO
        except ValueError:
            raise ValueError(f"codec {spec!r}: {arg!r} is not a number (e.g. topk:0.01)") from None
        if not 0 < ratio <= 1:
            raise ValueError(f"codec {spec!r}: top-k ratio = {ratio} must be in (0, 1]")
        return name, ratio
    raise ValueError(f"codec {spec!r} is not one of {', '.join(CODECS)} (top-k takes a ratio: topk:0.01)")


@dataclass(frozen=True)
class Rule:
    """How a step's contributions are combined (`unbroken.comm.robust`)."""

    kind: str
    """``mean``, ``checked``, ``clip`` or ``trimmed``."""
    value: float = 0.0
    """``clip``: the norm bound as a multiple of the median norm; ``trimmed``: the fraction cut at each end."""

    def __post_init__(self) -> None:
        if self.kind not in RULES:
            raise ConfigError(f"Rule.kind = {self.kind!r} is not one of {', '.join(RULES)}")
        if self.kind in ("clip", "trimmed") and self.value == 0.0:
            object.__setattr__(self, "value", RULES[self.kind])
        if self.kind == "clip" and not self.value >= 1.0:
            raise ConfigError(f"Rule.value = {self.value!r}: the clip bound must be at least 1 (times the median norm)")
        if self.kind == "trimmed" and not 0.0 < self.value < 0.5:
            raise ConfigError(f"Rule.value = {self.value!r}: the trimmed fraction must be between 0 and 0.5")

    @property
    def robust(self) -> bool:
        return self.kind != "mean"

    def __str__(self) -> str:
        return self.kind if self.kind in ("mean", "checked") else f"{self.kind}:{self.value:g}"


def parse_rule(spec: str) -> Rule:
    """``mean``, ``clip[:C]`` (C ≥ 1) or ``trimmed[:F]`` (0 < F < 0.5)."""
    kind, _, value = spec.strip().partition(":")
    if kind not in RULES or (kind in ("mean", "checked") and value):
        raise ConfigError(
            f"aggregation {spec!r} is not one of mean, checked, clip[:C], trimmed[:F] (e.g. clip:2, trimmed:0.25)"
        )
    try:
        v = float(value) if value else RULES[kind]
    except ValueError:
        raise ConfigError(f"aggregation {spec!r}: {value!r} is not a number") from None
    if kind == "clip" and not v >= 1.0:
        raise ConfigError(f"aggregation {spec!r}: the clip bound must be at least 1 (times the median norm)")
    if kind == "trimmed" and not 0.0 < v < 0.5:
        raise ConfigError(f"aggregation {spec!r}: the trimmed fraction must be between 0 and 0.5")
    return Rule(kind, v)


class Fragments(NamedTuple):
    """Checkpoints as erasure-coded fragments: any ``data`` of ``data + parity`` rebuild one."""

    data: int
    parity: int

    def __str__(self) -> str:
        return f"{self.data},{self.parity}"


def parse_fragments(spec: str) -> Fragments:
    """``K,M`` (e.g. ``3,2``): K data and M parity fragments."""
    try:
        k, m = (int(x) for x in spec.split(","))
    except ValueError:
        raise ConfigError(
            f"fragments {spec!r} is not K,M (e.g. 3,2: any 3 of 5 fragments rebuild a checkpoint)"
        ) from None
    if not (1 <= k <= 128 and 0 <= m <= 128 and k + m <= 256):
        raise ConfigError(f"fragments {spec!r}: need 1 <= K <= 128, 0 <= M <= 128 and K + M <= 256")
    return Fragments(k, m)


class Mode(StrEnum):
    SYNC = "sync"
    """One all-reduce per step: exact synchronous training."""
    DILOCO = "diloco"
    """Zones train alone for ``inner_steps``, then exchange pseudo-gradients."""


def check_range(owner: str, name: str, value: float, low: float, high: float | None = None) -> None:
    """Raise a ConfigError naming ``owner.name`` unless ``low <= value <= high``."""
    if not value >= low or (high is not None and not value <= high):  # also refuses NaN
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ConfigError(f"{owner}.{name} = {value!r} is out of range: it must be {bound}")


@dataclass(frozen=True)
class DiLoCoPolicy:
    """DiLoCo's outer loop (`unbroken.train.diloco`)."""

    inner_steps: int = INNER_STEPS
    """Inner steps per round (H; ``--inner-steps``)."""
    outer_lr: float = OUTER_LR
    """Learning rate of the outer optimizer, SGD with Nesterov momentum (``--outer-lr``)."""
    outer_momentum: float = OUTER_MOMENTUM
    """Momentum of the outer optimizer, Nesterov's (``--outer-momentum``; 0: plain SGD)."""
    overlap: bool = False
    """A round's exchange between zones runs during the next round and is applied at its
    end, one round late: compute never waits for the slow links, and a failure then costs
    up to two rounds (``--outer-overlap``)."""

    def __post_init__(self) -> None:
        check_range("DiLoCoPolicy", "inner_steps", self.inner_steps, 1, 1_000_000)
        check_range("DiLoCoPolicy", "outer_lr", self.outer_lr, 1e-6, 100)
        check_range("DiLoCoPolicy", "outer_momentum", self.outer_momentum, 0, 0.999)


POLICY_FLAGS = (
    "codec", "aggregate", "fragments", "audit_every", "streams", "bucket_mb",
    "mode", "inner_steps", "outer_lr", "outer_momentum", "outer_overlap",
)  # fmt: skip
"""The policy as flags and the wire spell it: `Policy.parse`'s arguments, the fields of
`unbroken.control.messages.PolicyMsg`, ``unbroken coordinator``'s options."""


@dataclass(frozen=True)
class Policy:
    """How the group trains, as the coordinator's operator set it (`CoordinatorConfig.policy`;
    from flags or the wire: `Policy.parse`)."""

    codec: CodecSpec = field(default_factory=CodecSpec)
    """The codec of the inter-zone hop (``--codec``)."""
    aggregate: Rule = field(default_factory=lambda: Rule("mean"))
    """How the members' contributions are combined: the exact mean, or a rule robust to a
    faulty node (``--aggregate``; `unbroken.comm.robust`)."""
    fragments: Fragments | None = None
    """Nodes write checkpoints as K data + M parity fragments on their own disks (any K
    rebuild one: `unbroken restore`); None: rank 0 writes whole files (``--fragments``)."""
    audit_every: int = AUDIT_EVERY
    """Steps between consistency audits: a replica whose digest differs from the majority's
    (silent corruption) is named and repaired (0: never; synchronous mode only)."""
    streams: int = STREAMS
    """TCP connections each inter-zone hop and cross-zone state transfer is spread over, in
    parallel: one connection's window caps what it carries over a long link."""
    bucket_mb: float = BUCKET_MB
    """Gradient buckets of about this many MB are summed while backward still runs, as
    DDP's (0: the gradient goes out in one piece after backward)."""
    diloco: DiLoCoPolicy | None = None
    """DiLoCo's outer loop (None: synchronous training, one all-reduce per step)."""

    def __post_init__(self) -> None:
        check_range("Policy", "audit_every", self.audit_every, 0, 1_000_000)
        check_range("Policy", "streams", self.streams, 1, MAX_STREAMS)
        check_range("Policy", "bucket_mb", self.bucket_mb, 0, MAX_BUCKET_MB)
        if self.fragments is not None:
            parse_fragments(str(self.fragments))  # a NamedTuple checks nothing itself

    @property
    def mode(self) -> Mode:
        return Mode.SYNC if self.diloco is None else Mode.DILOCO

    @classmethod
    def parse(
        cls,
        *,
        codec: str = "none",
        aggregate: str = "mean",
        fragments: str = "",
        audit_every: int = AUDIT_EVERY,
        streams: int = STREAMS,
        bucket_mb: float = BUCKET_MB,
        mode: str = "sync",
        inner_steps: int = INNER_STEPS,
        outer_lr: float = OUTER_LR,
        outer_momentum: float = OUTER_MOMENTUM,
        outer_overlap: bool = False,
    ) -> Policy:
        """The policy as flags and the wire spell it (each argument is its flag's); raises a
        ConfigError naming the value that does not parse."""
        try:
            spec = CodecSpec.parse(codec)
        except ValueError as exc:
            raise ConfigError(f"Policy.codec: {exc}") from None
        if mode not in set(Mode):
            raise ConfigError(f"Policy.mode = {mode!r}: choose 'sync' or 'diloco' (--mode)")
        try:
            rule = parse_rule(aggregate)
        except ConfigError as exc:
            raise ConfigError(f"Policy.aggregate: {exc}") from None
        outer = DiLoCoPolicy(inner_steps, outer_lr, outer_momentum, outer_overlap)  # checked in either mode
        return cls(
            codec=spec,
            aggregate=rule,
            fragments=parse_fragments(fragments) if fragments else None,
            audit_every=audit_every,
            streams=streams,
            bucket_mb=bucket_mb,
            diloco=outer if mode == Mode.DILOCO else None,
        )


@dataclass(frozen=True)
class Throttle:
    """Speed factors by step: ``schedule`` is ``((from_step, factor), ...)`` in step order.

    Emulated slow devices (``unbroken node --throttle``): heterogeneous groups on one machine.
    ``--throttle 0.25`` makes a node compute at a quarter of its speed: after each forward and
    backward pass that took ``t`` seconds it idles ``t * (1/0.25 - 1)`` more, so its measured
    throughput, its step time and the plan built on them are those of a 4x slower device
    (without the CPU contention a busy loop would add to the other nodes on the machine).
    A schedule changes the speed at given steps, deterministically::

        --throttle 0.25                # a quarter of its speed, throughout
        --throttle 1,40:0.25,80:1      # full speed; a quarter from step 40; full again from step 80
    """

    schedule: tuple[tuple[int, float], ...] = ((0, 1.0),)

    def __post_init__(self) -> None:
        steps = [s for s, _ in self.schedule]
        if steps != sorted(steps) or len(set(steps)) != len(steps):
            raise ConfigError(f"throttle schedule {self.schedule} must list each step once, in order")
        for _, f in self.schedule:
            if not 0 < f <= 1:
                raise ConfigError(f"throttle factor {f!r} must be greater than 0 and at most 1 (1 = full speed)")

    def factor(self, step: int) -> float:
        current = 1.0
        for start, f in self.schedule:
            if step >= start:
                current = f
        return current

    @property
    def active(self) -> bool:
        return any(f < 1 for _, f in self.schedule)

    def stretch(self, elapsed_s: float, step: int, touch: Callable[[], None] = lambda: None) -> float:
        """Idle so that ``elapsed_s`` of work takes as long as on the emulated device; returns the idle time."""
        extra = elapsed_s * (1 / self.factor(step) - 1)
        end = time.monotonic() + extra
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
            touch()
        return max(extra, 0.0)


def parse_throttle(text: str) -> Throttle:
    """Parse ``F`` or ``F,STEP:F,...`` (see the module docstring)."""
    text = text.strip()
    if not text:
        return Throttle()
    schedule: list[tuple[int, float]] = []
    for i, part in enumerate(text.split(",")):
        step_s, sep, factor_s = part.strip().rpartition(":")
        try:
            step = int(step_s) if sep else 0
            factor = float(factor_s)
        except ValueError:
            raise ConfigError(
                f"--throttle {text!r}: {part!r} is not FACTOR or STEP:FACTOR (e.g. 0.25 or 1,40:0.25,80:1)"
            ) from None
        if i == 0 and sep and step != 0:
            schedule.append((0, 1.0))
        if step < 0:
            raise ConfigError(f"--throttle {text!r}: step {step} must be non-negative")
        schedule.append((step, factor))
    return Throttle(tuple(schedule))
