"""The quorum decision, pure: ``decide(state, now, settings) -> Decision``.

torchft's rules (its ``src/lighthouse.rs``), with the safety checks applied to every quorum:

* A replica is **healthy** while the leader saw its heartbeat (or a quorum request) change
  less than ``heartbeat_timeout`` ago, on the leader's own monotonic clock (``last_seen``).
* The **candidates** are the healthy replicas with a pending quorum request, sorted by
  replica id; when any of them asks ``shrink_only``, only members of the previous quorum.
* **Never** a quorum of fewer than ``min_replicas`` candidates, or of no more than half of
  the healthy replicas (split brain: two halves cannot both have more than half). torchft's
  fast quorum skips both checks; here it only skips the wait below, so a fast quorum of
  one after a quorum of one is still refused when ``min_replicas`` is 2.
* A **fast quorum**: every member of the previous quorum is a candidate; it forms at once.
* Otherwise it forms once every healthy replica asks, or ``join_timeout`` after the first
  candidate's request was seen (stragglers get that long).
* ``quorum_id`` rises by one when the members (their replica ids) differ from the previous
  quorum's, or a candidate reports ``commit_failures``; it never goes back, and one id
  never names two memberships.

The decision is a :class:`NewQuorum` (the caller compare-and-sets it into the store), or
:class:`Wait` with the time something may change by itself (a straggler's join timeout, a
heartbeat going stale), its ``until`` None when only a new request or heartbeat can.
Nothing here reads a clock or does IO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elasticd.lighthouse.proto import QuorumMember

__all__ = ["Decision", "NewQuorum", "Pending", "Settings", "State", "Wait", "decide"]

#: The largest quorum id (int64, as the protocol carries it).
MAX_QUORUM_ID = (1 << 63) - 1


@dataclass(frozen=True)
class Settings:
    """A job's quorum rules (seconds)."""

    min_replicas: int = 1
    join_timeout: float = 60.0
    heartbeat_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be at least 1, not {self.min_replicas}")
        if not self.join_timeout >= 0:
            raise ValueError(f"join_timeout must be >= 0, not {self.join_timeout}")
        if not self.heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be > 0, not {self.heartbeat_timeout}")


@dataclass(frozen=True)
class Pending:
    """A replica's quorum request not yet granted: what it said, and when it was first seen."""

    member: QuorumMember
    joined: float


@dataclass(frozen=True)
class State:
    """What the leader knows: the last quorum, the pending requests, when each replica
    was last seen (all by replica id, times on the leader's monotonic clock)."""

    quorum_id: int = 0
    previous: tuple[str, ...] | None = None
    pending: Mapping[str, Pending] | None = None
    last_seen: Mapping[str, float] | None = None


@dataclass(frozen=True)
class NewQuorum:
    quorum_id: int
    participants: tuple[QuorumMember, ...]
    reason: str


@dataclass(frozen=True)
class Wait:
    """No quorum yet; decide again at ``until`` (monotonic) unless something changes first.

    ``until`` None: nothing changes by itself; only a new request or heartbeat can help."""

    until: float | None
    reason: str


Decision = NewQuorum | Wait


def healthy_replicas(last_seen: Mapping[str, float], now: float, timeout: float) -> set[str]:
    """Seen less than ``timeout`` ago; written as ``now < seen + timeout`` so that the time a
    replica goes stale (``seen + timeout``, a decision's ``until``) is stale to the bit."""
    return {r for r, seen in last_seen.items() if now < seen + timeout}


def decide(state: State, now: float, settings: Settings) -> Decision:
    """The next quorum, or why not and when to decide again (see the module)."""
    pending = state.pending or {}
    last_seen = state.last_seen or {}
    timeout = settings.heartbeat_timeout
    healthy = healthy_replicas(last_seen, now, timeout)
    # Whenever a healthy replica goes stale, the majority and the stragglers change.
    stale_at = min((last_seen[r] + timeout for r in healthy), default=None)
    asking = {r: p for r, p in pending.items() if r in healthy}
    shrink_only = any(p.member.shrink_only for p in asking.values())
    candidates = sorted(asking)
    if shrink_only and state.previous is not None:
        before = set(state.previous)
        candidates = [r for r in candidates if r in before]
    info = (
        f"[{len(candidates)} candidates, {len(asking)}/{len(pending)} requests healthy, "
        f"{len(healthy)} healthy][shrink_only={shrink_only}]"
    )

    def wait(reason: str, until: float | None) -> Wait:
        return Wait(until, f"{reason} {info}")

    if len(candidates) < settings.min_replicas:
        # Time only makes candidates stale: nothing but a new request helps.
        return wait(f"{len(candidates)} of min_replicas {settings.min_replicas}", None)
    if len(candidates) * 2 <= len(healthy):
        return wait(f"{len(candidates)} is not a majority of {len(healthy)} healthy", stale_at)
    fast = state.previous is not None and all(r in asking for r in state.previous)
    if not fast and len(asking) < len(healthy):
        first = min(asking[r].joined for r in candidates)
        until = first + settings.join_timeout
        if now < until:
            if stale_at is not None:
                until = min(until, stale_at)
            return wait(f"waiting for {len(healthy) - len(asking)} healthy stragglers", until)
    members = tuple(asking[r].member for r in candidates)
    changed = state.previous is None or tuple(candidates) != tuple(state.previous)
    failures = any(m.commit_failures > 0 for m in members)
    quorum_id = state.quorum_id + 1 if changed or failures else state.quorum_id
    if quorum_id > MAX_QUORUM_ID:
        return wait("the quorum id is at int64's maximum", None)
    why = "fast quorum" if fast else "quorum"
    why += " (members changed)" if changed else " (commit failures)" if failures else ""
    return NewQuorum(quorum_id, members, f"{why} {info}")
