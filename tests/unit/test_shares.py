"""The fair-share decisions (issue 35), as tables: job documents per owner, a job token's
store prefix, and requests and long-polls per principal with the admins' reserve."""

from __future__ import annotations

import pytest

from elasticd.shares import (
    ConnectionShares,
    JobShare,
    Usage,
    job_share_problem,
    prefix_share_problem,
)

SHARE = JobShare(max_jobs=3, max_bytes=1000)


@pytest.mark.parametrize(
    ("usage", "new", "expected"),
    [
        (Usage(0, 0), 10, None),
        (Usage(2, 900), 100, None),  # exactly at both shares
        (Usage(3, 0), 10, (429, "owner_max_jobs")),
        (Usage(2, 901), 100, (413, "owner_max_job_bytes")),
        (Usage(0, 0), 1001, (413, "its share of 1000 bytes")),
    ],
)
def test_job_documents_per_owner(usage: Usage, new: int, expected: tuple[int, str] | None) -> None:
    problem = job_share_problem("alice", usage, new, SHARE)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem[0] == expected[0] and expected[1] in problem[1]
        assert "alice" in problem[1]


@pytest.mark.parametrize(
    ("held", "documents", "refused"), [(0, 3, False), (1, 3, True), (0, 4, True)]
)
def test_a_job_of_replica_groups_counts_each_groups_document(
    held: int, documents: int, refused: bool
) -> None:
    """A job of N replica groups writes N+1 documents: all of them count."""
    problem = job_share_problem("alice", Usage(held, 0), 10, SHARE, documents)
    assert (problem is not None) is refused
    if problem is not None:
        assert problem[0] == 429 and f"this job writes {documents}" in problem[1]


def test_no_share_bounds_nothing_and_an_identitys_setting_is_named() -> None:
    assert job_share_problem("a", Usage(10**6, 10**12), 10**6, JobShare(None, None)) is None
    named = JobShare(1, None, jobs_setting="max_jobs of ci-bot")
    problem = job_share_problem("ci-bot", Usage(1, 0), 1, named)
    assert problem is not None and "max_jobs of ci-bot" in problem[1]


@pytest.mark.parametrize(
    ("usage", "new_key", "old", "new", "expected"),
    [
        (Usage(0, 0), True, 0, 100, None),
        (Usage(4, 900), True, 0, 100, None),  # the fifth key, the last byte
        (Usage(5, 0), True, 0, 1, (429, "job_store_max_keys")),
        (Usage(5, 500), False, 100, 200, None),  # an overwrite adds no key
        (Usage(5, 1000), False, 100, 50, None),  # shrinking is always allowed
        (Usage(1, 950), False, 10, 100, (413, "job_store_max_bytes")),
    ],
)
def test_a_job_tokens_store_prefix(
    usage: Usage, new_key: bool, old: int, new: int, expected: tuple[int, str] | None
) -> None:
    problem = prefix_share_problem(
        "jobs/j/", usage, new_key=new_key, old_bytes=old, new_bytes=new, max_keys=5, max_bytes=1000
    )
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem[0] == expected[0] and expected[1] in problem[1]


def test_requests_and_long_polls_per_principal_keep_the_admins_reserve() -> None:
    shares = ConnectionShares(per_principal=3, long_polls=2, total=10, reserved=4)
    assert shares.admit("a", privileged=False, long_poll=True) is None
    assert shares.admit("a", privileged=False, long_poll=True) is None
    refused = shares.admit("a", privileged=False, long_poll=True)
    assert refused is not None and "principal_max_long_polls" in refused
    assert shares.admit("a", privileged=False, long_poll=False) is None
    refused = shares.admit("a", privileged=False, long_poll=False)
    assert refused is not None and "principal_max_connections" in refused
    for who in ("b", "c"):  # 5 in flight, then 6: the rest is the reserve
        assert shares.admit(who, privileged=False, long_poll=False) is None
    assert shares.admit("d", privileged=False, long_poll=False) is None
    refused = shares.admit("e", privileged=False, long_poll=False)
    assert refused is not None and "admin_reserved_connections" in refused
    for _ in range(4):  # the admin and the cluster still get in, past every share
        assert shares.admit("admin", privileged=True, long_poll=True) is None
    shares.release("a", long_poll=True)
    assert shares.admit("a", privileged=False, long_poll=True) is not None  # still busy: reserve
    for _ in range(4):
        shares.release("admin", long_poll=True)
    assert shares.admit("a", privileged=False, long_poll=True) is None
    assert shares.in_flight["a"] == 3 and shares.polling["a"] == 2 and "admin" not in shares.polling


@pytest.mark.parametrize(
    ("path", "query", "accept", "long"),
    [
        ("/store/watch", b"", b"", True),
        ("/jobs/j/events", b"wait=60", b"", True),
        ("/jobs/j/events", b"w%61it=60", b"", True),  # decoded as the route decodes it
        ("/jobs/j/events", b"", b"text/event-stream", True),
        ("/jobs/j/events", b"after=3", b"", False),
        ("/jobs/j/logs", b"follow=true", b"", True),
        ("/jobs/j/logs", b"follow=1", b"", True),
        ("/jobs/j/logs", b"rank=0", b"", False),
        ("/jobs", b"wait=60", b"", False),
    ],
)
def test_what_counts_as_a_long_poll(path: str, query: bytes, accept: bytes, long: bool) -> None:
    """Every spelling the routes accept counts (was: ``w%61it`` and ``follow=1`` did not)."""
    from api.shares import is_long_poll

    scope = {"path": path, "query_string": query, "headers": [(b"accept", accept)]}
    assert is_long_poll(scope) is long  # type: ignore[arg-type]
