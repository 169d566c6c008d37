"""Fair shares: what one principal may hold of what every principal needs (issue 35).

Every resource a caller can grow has a bound per principal, decided here by
pure functions and enforced by one caller each (docs/hardening.md, "Fair
shares", has the whole table):

* **Job documents** per owner (:func:`job_share_problem`): at most
  ``owner_max_jobs`` documents and ``owner_max_job_bytes`` bytes of them,
  ended jobs counted while they are retained. Checked at submission
  (:meth:`elasticd.node.jobs.JobService.submit`) against the documents the
  node's job watch holds.
* **A job token's store prefix** (``jobs/<id>/``, :func:`prefix_share_problem`):
  at most ``job_store_max_keys`` keys and ``job_store_max_bytes`` bytes.
  Checked by :class:`elasticd.store.scoped.ScopedStore` on every write.
* **Connections and long-polls** per principal (:class:`ConnectionShares`):
  at most ``principal_max_connections`` requests in flight and
  ``principal_max_long_polls`` long-polls (store watches, event waits, SSE
  and log follows) of one principal, with ``admin_reserved_connections`` of
  the daemon's connections kept for admins and the cluster identity.

The admin and the cluster identity have no share (they are the operator and
the daemons' own traffic). An identity of the identities file, or its
``[local]`` section, may raise or lower a share for its principals
(``max_jobs``, ``max_job_bytes``). Past a share the caller gets 429 (a count)
or 413 (bytes), and the message names the limit and the setting to raise.

Standard library only: the store layer and the API import it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = [
    "ConnectionShares",
    "JobShare",
    "Usage",
    "job_share_problem",
    "prefix_share_problem",
]


@dataclass(frozen=True)
class JobShare:
    """An owner's share of job documents: ``None`` is no bound (the admin's)."""

    max_jobs: int | None
    max_bytes: int | None
    jobs_setting: str = "owner_max_jobs"
    bytes_setting: str = "owner_max_job_bytes"


@dataclass(frozen=True)
class Usage:
    """What an owner (or a prefix) holds now: documents (keys) and their bytes."""

    count: int = 0
    nbytes: int = 0


def job_share_problem(
    owner: str, usage: Usage, new_bytes: int, share: JobShare, documents: int = 1
) -> tuple[int, str] | None:
    """``(status, message)`` when ``documents`` new job documents of ``new_bytes`` in all
    (a job of replica groups writes one per group besides its own) would take ``owner``
    past its ``share`` (429 for the count, 413 for the bytes); None when it fits (pure)."""
    if share.max_jobs is not None and usage.count + documents > share.max_jobs:
        adds = "" if documents == 1 else f" (this job writes {documents}: one per replica group)"
        return 429, (
            f"owner {owner} keeps {usage.count} job documents{adds}, its share is {share.max_jobs} "
            f"({share.jobs_setting}; ended jobs count until they are deleted or expire): "
            "delete jobs it no longer needs (DELETE /jobs/<id>), or ask the operator to raise "
            f"{share.jobs_setting} (or max_jobs of its identity)"
        )
    if share.max_bytes is not None and usage.nbytes + new_bytes > share.max_bytes:
        return 413, (
            f"owner {owner}'s job documents hold {usage.nbytes} bytes; this one "
            f"({new_bytes} bytes) would pass its share of {share.max_bytes} bytes "
            f"({share.bytes_setting}): delete jobs it no longer needs, make the spec smaller "
            f"(env, args), or ask the operator to raise {share.bytes_setting} (or max_job_bytes "
            "of its identity)"
        )
    return None


def prefix_share_problem(
    prefix: str,
    usage: Usage,
    *,
    new_key: bool,
    old_bytes: int,
    new_bytes: int,
    max_keys: int,
    max_bytes: int,
) -> tuple[int, str] | None:
    """``(status, message)`` when a write under a job token's ``prefix`` would pass its
    share; ``usage`` is what the prefix holds before the write, ``old_bytes`` what the
    written key held (0 for a new key). None when it fits (pure)."""
    if new_key and usage.count + 1 > max_keys:
        return 429, (
            f"the job's store prefix {prefix} holds {usage.count} keys, its share is "
            f"{max_keys} (job_store_max_keys): delete keys it no longer needs, or ask the "
            "operator to raise job_store_max_keys"
        )
    after = usage.nbytes - old_bytes + new_bytes
    if new_bytes > old_bytes and after > max_bytes:
        return 413, (
            f"the job's store prefix {prefix} holds {usage.nbytes} bytes; this write would "
            f"make it {after}, past its share of {max_bytes} bytes (job_store_max_bytes): "
            "keep less in the store (it is for coordination, not data), or ask the operator "
            "to raise job_store_max_bytes"
        )
    return None


@dataclass
class ConnectionShares:
    """Requests in flight and long-polls per principal, and the admins' reserve (pure state).

    ``admit`` and ``release`` are the only changes; the API's middleware calls
    them around each request (:mod:`api.shares`). ``total`` is the daemon's
    connection cap: a principal that is not privileged may not use the last
    ``reserved`` of them, so the admin's ``/healthz`` and the cluster's
    keep-alives are served whatever the others hold.
    """

    per_principal: int
    long_polls: int
    total: int
    reserved: int
    in_flight: dict[Hashable, int] = field(default_factory=dict)
    polling: dict[Hashable, int] = field(default_factory=dict)
    busy: int = 0

    def admit(self, who: Hashable, *, privileged: bool, long_poll: bool) -> str | None:
        """Count one more request of ``who``; the reason it is refused (429), or None."""
        if not privileged:
            if self.in_flight.get(who, 0) >= self.per_principal:
                return (
                    f"this caller already has {self.per_principal} requests in flight, its "
                    "share (principal_max_connections); finish some first"
                )
            if long_poll and self.polling.get(who, 0) >= self.long_polls:
                return (
                    f"this caller already holds {self.long_polls} long-polls (watches, event "
                    "waits, streams), its share (principal_max_long_polls); close some first"
                )
            reserve = min(self.reserved, self.total // 2)  # a small cap keeps half for others
            if self.busy >= self.total - reserve:
                return (
                    f"the daemon serves {self.busy} requests; the last {reserve} of its "
                    f"{self.total} connections are kept for the admin and the cluster "
                    "(admin_reserved_connections): try again shortly"
                )
        self.in_flight[who] = self.in_flight.get(who, 0) + 1
        if long_poll:
            self.polling[who] = self.polling.get(who, 0) + 1
        self.busy += 1
        return None

    def release(self, who: Hashable, *, long_poll: bool) -> None:
        """Count one request of ``who`` as done (exactly once per admitted request)."""
        self.busy -= 1
        _drop(self.in_flight, who)
        if long_poll:
            _drop(self.polling, who)


def _drop(counts: dict[Hashable, int], who: Hashable) -> None:
    left = counts.get(who, 0) - 1
    if left > 0:
        counts[who] = left
    else:
        counts.pop(who, None)
