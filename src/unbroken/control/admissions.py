"""Admissions: joins from a key or an address that keeps leaving before training wait.

Every join re-forms the epoch (the new member gets ranks, the group builds its process
groups again and syncs the newcomer's state), and a member's exit re-forms it once more. A
member that leaves or fails before the group committed a step in an epoch it belonged to
gave the group nothing for that cost: it *churned*. A token holder that rejoins under fresh
member ids as fast as it can (connect, hello, drop, repeat) held a job to 12 % of its commits
that way.

Each churn is a strike against the member's node key and its source address (the peer's
address, or the relay it came through). Strikes fade, one every `FADE_S`. A join whose key
or address holds more strikes than it is allowed for free is not refused: it waits, kept out
of the epochs, for a delay that doubles with each strike beyond (`BASE_S`, at most `CAP_S`),
and then joins as any other. Keys and addresses are both needed: with the token anyone may
bring a fresh key for each join (the address catches it), and a key may come from many
addresses (the key catches it; with ``--allowed-keys`` the keys are the job's to give).

What honest nodes do costs them nothing or a short wait:

* a node restarting after a crash (a new process: a new key, the same address) left a
  member that had trained, which is no churn; one that crashed while joining is one strike,
  within what an address is allowed;
* many nodes behind one address (a NAT, a host running several, a test on loopback) share
  the address's strikes: they join together at once, and after crashes while joining they
  only wait;
* nodes joining together, or a member leaving after it trained, strike nothing.

A sustained churner settles at about one churn per `FADE_S` (where its wait equals the time
a strike takes to fade), each costing the group two epoch changes. The decision is a pure
function of the strikes and the clock (`Admissions.wait`); `Membership` feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

FREE_PER_KEY = 1.0
"""Strikes a node key may hold before its joins wait (a node crashing while joining, once)."""
FREE_PER_SOURCE = 1.0
"""Strikes an address may hold before joins from it wait (a churner that stays in each epoch
until its lease nearly lapses holds the group's build that long: 3 free strikes and a first
wait of 1 s still let one take 63 % of a 2-node job's commits)."""
BASE_S = 2.0
"""The wait of the first strike beyond those allowed; each further strike doubles it."""
CAP_S = 30.0
"""The longest wait (an honest node behind the churner's address waits no longer)."""
FADE_S = 10.0
"""Seconds for one strike to fade."""
TRACKED = 4096
"""Keys and addresses remembered, each (the oldest strikes are forgotten first: fresh keys
cost an attacker nothing, and the memory must not grow with them)."""


@dataclass(frozen=True)
class Wait:
    """A join held back: until when, and why (the event's reason)."""

    until: float
    reason: str


class Strikes:
    """Fading strikes per name (a key or an address), the oldest forgotten past `TRACKED`."""

    def __init__(self, free: float) -> None:
        self.free = free
        self._level: dict[str, tuple[float, float]] = {}
        """Name → (strikes, when counted): they fade from then."""

    def level(self, name: str, now: float) -> float:
        level, at = self._level.get(name, (0.0, now))
        return max(0.0, level - max(0.0, now - at) / FADE_S)

    def add(self, name: str, now: float) -> float:
        level = self.level(name, now) + 1.0
        self._level.pop(name, None)  # re-inserted last: the dict's order is the age of the strike
        self._level[name] = (level, now)
        while len(self._level) > TRACKED:
            del self._level[next(iter(self._level))]
        return level

    def wait_s(self, name: str, now: float) -> float:
        """The wait of a join under ``name`` now: none within the free strikes, then `BASE_S`
        doubling with each strike beyond (continuously, as the strikes fade)."""
        over = self.level(name, now) - self.free
        return 0.0 if over <= 0 else min(CAP_S, BASE_S * 2.0 ** (over - 1.0))


class Admissions:
    """The churn of each key and address, and how long a join under them waits."""

    def __init__(self, free_per_key: float = FREE_PER_KEY, free_per_source: float = FREE_PER_SOURCE) -> None:
        self.keys = Strikes(free_per_key)
        self.sources = Strikes(free_per_source)

    def churned(self, key: str, source: str, now: float) -> None:
        """A member of ``key`` from ``source`` left before the group trained with it. An
        empty key or source is no one's (a test's member, an address unknown)."""
        if key:
            self.keys.add(key, now)
        if source:
            self.sources.add(source, now)

    def wait(self, key: str, source: str, now: float) -> Wait | None:
        """How long a join under ``key`` from ``source`` waits before an epoch takes it, or
        None: at once."""
        by_key = self.keys.wait_s(key, now) if key else 0.0
        by_source = self.sources.wait_s(source, now) if source else 0.0
        if by_key <= 0 and by_source <= 0:
            return None
        said = []
        if by_key > 0:
            said.append(f"members of its node key left before training {self.keys.level(key, now):.1f} times")
        if by_source > 0:
            said.append(f"members from {source} left before training {self.sources.level(source, now):.1f} times")
        wait = max(by_key, by_source)
        reason = (
            f"{' and '.join(said)} lately: it waits {wait:.1f} s before an epoch takes it (every join "
            f"re-forms the epoch; the wait doubles with each such exit, and one exit is forgotten every {FADE_S:g} s)"
        )
        return Wait(now + wait, reason)
