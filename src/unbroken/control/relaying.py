"""The leader's side of relays (`unbroken.control.relay`): each relay's link, the batches it
sends up for its members, and its members' fate when it dies or falls silent.

A relay speaks for many members on one connection, and is trusted for none of them: every
member's hello carries the knock its key signed, checked here again (no relay speaks for a
key it never saw sign), and a member's invalid message drops that member, not its relay.
A relay that goes silent detaches its members rather than failing them: they reconnect
elsewhere within the grace their leases are extended by.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import TYPE_CHECKING

from unbroken.control import messages as m
from unbroken.control.batches import REPORT_EVERY_S
from unbroken.control.sessions import RelayedMember, RelayLink
from unbroken.errors import ProtocolError

if TYPE_CHECKING:
    from unbroken.control.coordinator import Coordinator
    from unbroken.control.membership import Membership

log = logging.getLogger(__name__)

SILENT_RELAY_GRACE = 3.5
"""Leases a silent relay's members keep, from when the leader finds it silent: they leave it
after two leases without an acknowledgement, then reconnect (50 fake members reconnecting
at once on a busy 2-core machine outlasted a margin of one lease)."""

ROUTINE_REPORTS_PER_S = 5000
"""Relayed members' routine progress reports the leader takes a second, whatever the group's
size: each costs it tens of microseconds (parsed, recorded, planned from), and at 100,000
members one a second from each would be several cores. Past 5,000 members their relays send
them less often (`Relays.report_s`); what a report carries that must not wait (a new
epoch's first commit, the loss curve, commitments) goes up as before."""


def heard_steps(ms: Membership, said: list[tuple[str, int]], now: float) -> None:
    """`Membership.heartbeat` for each (member, step) of ``said``, in one pass where it can
    (`Roster.heard_steps`)."""
    r = ms.roster
    for mid, step in r.heard_steps(said, now):
        ms.heartbeat(mid, step, now)
    if r.num_steps and r.step >= r.num_steps and r.ranks and not ms.finish.last_epoch:
        ms.finish.last_epoch = list(r.epoch_members)  # as `Membership.heartbeat` notes it


class Relays:
    """The relays connected to a coordinator, and the members their deaths detached."""

    def __init__(self, coord: Coordinator) -> None:
        self._coord = coord
        self.links: dict[str, RelayLink] = {}
        self.detached: set[str] = set()
        """Members whose relay's link ended: their leases run on until they are back."""

    def joined(self, link: RelayLink) -> None:
        old = self.links.get(link.relay_id)
        if old is not None:
            self.lost(old)
            old.session.close()
        self.links[link.relay_id] = link

    def up(self, link: RelayLink, up: m.Up) -> None:
        """A relay's batch: its members' liveness, what they said, whose session ended (in
        that order: a member's last words come before its session's end; a relay reports no
        end of a session that a new one, whose hello it forwarded, replaces)."""
        coord = self._coord
        ms = coord.membership
        r = ms.roster
        # Its summary: the members it holds were heard within ``heard_within`` before the
        # batch came, except those it names; their leases read it when they come due.
        within = min(up.heard_within, r.lease_s)
        link.vouched_at = link.heard_at - within
        link.unheard = frozenset(up.unheard)
        for mid, age in zip(up.unheard, up.unheard_s, strict=False):
            # No longer vouched for: counted heard when the relay last heard it, so its lease
            # lapses a lease after that, as a directly connected member's would.
            if (member := r.members.get(mid)) is not None and mid in link.members:
                member.last_seen = max(member.last_seen, link.heard_at - age)
        # A member named with its new step was heard since the relay's last batch: counted
        # heard as the summary says, not when the batch came (a frozen member's last words
        # would otherwise buy it a tenth of a lease more).
        heard = link.vouched_at
        held, last = link.members, r.num_steps
        # A step past the job's last is no step: alive, whatever it claims (`Membership.beyond`).
        steps = [(mid, step if not last or step <= last else 0) for mid, step in zip(up.alive, up.steps, strict=False)]
        heard_steps(ms, [x for x in steps if x[0] in held], heard)
        for said in up.said:
            session = coord.sessions.get(said.member)
            msg = said.msg
            if isinstance(msg, m.Hello):
                if said.member != msg.member_id:
                    raise ProtocolError(f"relay {link.relay_id} forwarded {msg.member_id}'s hello as {said.member}'s")
                # The relay checked the node's token proof (it holds the token); it proves
                # itself to the node with its own challenge. The node's key signed the
                # relay's challenge: checked here again, so no relay speaks for a key it
                # never saw sign.
                # The challenge it signed must be one of this link's, never used: a knock seen
                # once (on the wire, or by a relay it went through) cannot be shown again.
                ident = msg.identity
                why = (
                    link.fresh(ident.challenge)
                    or coord.check_key(ident.key, ident.signature, ident.challenge, ident.nonce, msg.member_id)
                    if ident is not None
                    else f"relay {link.relay_id} forwarded {msg.member_id}'s hello without its signed knock"
                )
                if why is not None:
                    coord.chronicle.refusal(link.relay_id, f"{msg.member_id} through relay {link.relay_id}: {why}")
                    link.session.send_text(m.down_text([msg.member_id], m.encode(m.Refused(reason=why))))
                    continue
                assert ident is not None
                joined = coord.join(msg, link.relay_id, partial(link.member, msg.member_id), "", ident.key)
                if isinstance(joined, m.Refused):
                    link.session.send_text(m.down_text([msg.member_id], m.encode(joined)))
            elif isinstance(session, RelayedMember) and session.link is link:
                member = r.members.get(said.member)
                before = member.last_seen if member is not None else 0.0
                try:
                    coord.dispatch(session, msg)
                    if isinstance(msg, m.Progress) and member is not None:
                        # A routine report waits up to `batches.REPORT_EVERY_S` at the relay:
                        # it renews the lease no further than the summary says it was heard.
                        member.last_seen = max(before, min(member.last_seen, heard))
                except ProtocolError as exc:  # that member's lie, not its relay's
                    coord.drop(session, f"sent an invalid message: {exc}")
                except Exception as exc:  # a bug met by one member's message: not its relay's fault
                    log.exception("message of %s through relay %s", said.member, link.relay_id)
                    coord.drop(session, f"its message could not be handled: {type(exc).__name__}: {exc}")
        for gone in up.gone:
            session = coord.sessions.get(gone.member)
            if isinstance(session, RelayedMember) and session.link is link:
                link.members.discard(gone.member)
                coord.session_ended(session)

    def report_s(self) -> float:
        """How often relays send their members' routine reports up (`m.Ack.report_s`)."""
        return max(REPORT_EVERY_S, len(self._coord.membership.members) / ROUTINE_REPORTS_PER_S)

    def vouched(self, member_id: str) -> float:
        """When the member was last heard, as its relay's newest summary says (-inf: no relay
        of the leader's vouches for it). A relay vouches only for members whose sessions it
        holds here, and only while its link is the one in force."""
        session = self._coord.sessions.get(member_id)
        if not isinstance(session, RelayedMember):
            return -math.inf
        link = session.link
        if self.links.get(link.relay_id) is not link or member_id not in link.members or member_id in link.unheard:
            return -math.inf
        return link.vouched_at

    def check(self, now: float) -> None:
        """A relay not heard from for half a lease (it sends ten batches a lease) is gone:
        its host died without closing the connection, or it froze, and its members' leases,
        renewed by its batches alone, would lapse with it. They get `SILENT_RELAY_GRACE`
        leases from now to come back instead (they leave a relay that stops acknowledging
        after two). A relay merely slow is dropped too: its members only reconnect."""
        coord = self._coord
        lease = coord.config.membership.lease_s
        for link in [r for r in self.links.values() if now - r.heard_at > lease / 2]:
            log.warning("relay %s silent for %.2f s: its members are detached", link.relay_id, now - link.heard_at)
            members = list(link.members)
            self.lost(link)
            link.session.close()
            coord.membership.extend(members, now + SILENT_RELAY_GRACE * lease)
        if self.detached:
            self.detached &= coord.membership.members.keys()

    def lost(self, link: RelayLink) -> None:
        """Its members are detached, not failed: they reconnect elsewhere within their lease."""
        if self.links.get(link.relay_id) is link:
            del self.links[link.relay_id]
        sessions = self._coord.sessions
        members = self._coord.membership.members
        for mid in link.members:
            session = sessions.get(mid)
            if isinstance(session, RelayedMember) and session.link is link:
                del sessions[mid]
                self.detached.add(mid)
                # Its lease was renewed by the relay's summaries, read when due. The last one
                # said it was heard at most ``heard_within`` before it came: it is counted
                # heard when that batch came, so its lease runs at least a lease from when
                # it was last heard, to reconnect within.
                if (member := members.get(mid)) is not None and mid not in link.unheard:
                    member.last_seen = max(member.last_seen, link.heard_at)
        link.members.clear()

    def pause(self, seconds: float) -> None:
        """The service was not listening for ``seconds``: no relay was silent then."""
        for link in self.links.values():
            link.heard_at += seconds

    def close(self) -> None:
        """A new term: every relay reconnects (to whoever leads)."""
        for link in list(self.links.values()):
            link.session.close()
        self.links.clear()
        self.detached.clear()
