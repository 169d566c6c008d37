"""The identity model's decisions: authorize() as a table, the identities file, local callers."""

from __future__ import annotations

import pytest

from elasticd.identity import (
    ADMIN,
    CLUSTER,
    Action,
    Allow,
    Authenticator,
    Deny,
    IdentityTable,
    JobFacts,
    JobTokens,
    LocalPolicy,
    Principal,
    PrincipalKind,
    authorize,
    hash_token,
)

ALICE = Principal("alice", PrincipalKind.LOCAL, users=("alice",), max_priority=0, uid=1001)
BOB_TOKEN = Principal(
    "bob",
    PrincipalKind.TOKEN,
    users=("bob", "shared"),
    max_priority=10,
    may_preempt=False,
    slot_quota=8,
)
NOBODY_USERS = Principal("robot", PrincipalKind.TOKEN, users=())
JOB = Principal("job:j1", PrincipalKind.JOB, job_id="j1")

ALICES_JOB = JobFacts(owner="alice", user="alice", priority=0, job_id="a1")
ADMINS_JOB = JobFacts(owner=None, user=None, priority=0, job_id="old")
J1 = JobFacts(owner="bob", user="bob", job_id="j1")


def submit(user: str | None = None, priority: int = 0) -> JobFacts:
    return JobFacts(owner=None, user=user, priority=priority)


@pytest.mark.parametrize(
    ("principal", "action", "job", "expected"),
    [
        # Submitting: who a job runs as is the identity's to say.
        (ALICE, Action.SUBMIT, submit(), Allow("alice")),
        (ALICE, Action.SUBMIT, submit("alice"), Allow("alice")),
        (ALICE, Action.SUBMIT, submit("root"), Deny),
        (ALICE, Action.SUBMIT, submit("bob"), Deny),
        (ALICE, Action.SUBMIT, submit(priority=1), Deny),
        (BOB_TOKEN, Action.SUBMIT, submit(), Allow("bob")),
        (BOB_TOKEN, Action.SUBMIT, submit("shared"), Allow("shared")),
        (BOB_TOKEN, Action.SUBMIT, submit("daemon"), Deny),
        (BOB_TOKEN, Action.SUBMIT, submit(priority=10), Allow("bob")),
        (BOB_TOKEN, Action.SUBMIT, submit(priority=1000), Deny),
        (NOBODY_USERS, Action.SUBMIT, submit(), Deny),
        (ADMIN, Action.SUBMIT, submit(), Allow(None)),  # the node's run_as
        (ADMIN, Action.SUBMIT, submit("daemon", 1000), Allow("daemon")),  # node's policy next
        (JOB, Action.SUBMIT, submit(), Deny),
        # Anyone may list and see state and owner.
        (ALICE, Action.LIST, None, Allow()),
        (BOB_TOKEN, Action.READ, ALICES_JOB, Allow()),
        # The rest of a job is its owner's or an admin's.
        (ALICE, Action.READ_DETAIL, ALICES_JOB, Allow()),
        (ALICE, Action.CANCEL, ALICES_JOB, Allow()),
        (ALICE, Action.DELETE, ALICES_JOB, Allow()),
        (BOB_TOKEN, Action.READ_DETAIL, ALICES_JOB, Deny),
        (BOB_TOKEN, Action.CANCEL, ALICES_JOB, Deny),
        (BOB_TOKEN, Action.DELETE, ALICES_JOB, Deny),
        (ALICE, Action.CANCEL, ADMINS_JOB, Deny),  # a job from before identities: admin's
        (ADMIN, Action.CANCEL, ALICES_JOB, Allow()),
        (ADMIN, Action.READ_DETAIL, ADMINS_JOB, Allow()),
        (CLUSTER, Action.READ_DETAIL, ALICES_JOB, Allow()),  # a peer daemon's proxied read
        # The store: daemons and admins; a job's token under its prefix (checked per key).
        (ALICE, Action.STORE, None, Deny),
        (BOB_TOKEN, Action.STORE, None, Deny),
        (ADMIN, Action.STORE, None, Allow()),
        (CLUSTER, Action.STORE, None, Allow()),
        (JOB, Action.STORE, None, Allow()),
        # A job's token reads its own job and nothing else.
        (JOB, Action.READ, J1, Allow()),
        (JOB, Action.READ, ALICES_JOB, Deny),
        (JOB, Action.LIST, None, Deny),
        (JOB, Action.CANCEL, J1, Deny),
        (JOB, Action.READ_DETAIL, J1, Deny),
        # Re-executing the daemon (POST /reload): an admin's only.
        (ADMIN, Action.RELOAD, None, Allow()),
        (ALICE, Action.RELOAD, None, Deny),
        (BOB_TOKEN, Action.RELOAD, None, Deny),
        (CLUSTER, Action.RELOAD, None, Allow()),  # the cluster identity is an admin
        (JOB, Action.RELOAD, None, Deny),
    ],
)
def test_authorize_table(
    principal: Principal, action: Action, job: JobFacts | None, expected: object
) -> None:
    """Each (identity, action, job) row gets the decision the identity model states."""
    decision = authorize(principal, action, job)
    if expected is Deny:
        assert isinstance(decision, Deny), decision
        assert decision.reason  # always says why
    else:
        assert decision == expected


def test_a_denial_names_the_owner_and_the_fix() -> None:
    """A refused cancel says whose job it is; a refused priority says the cap."""
    refused = authorize(BOB_TOKEN, Action.CANCEL, ALICES_JOB)
    assert isinstance(refused, Deny) and "alice's" in refused.reason
    capped = authorize(ALICE, Action.SUBMIT, submit(priority=5))
    assert isinstance(capped, Deny) and "max_priority" in capped.reason


def test_local_callers_of_a_root_daemon_are_themselves_and_root_is_admin() -> None:
    """On a root daemon every uid is served as itself; uid 0 is an admin; on a user's own
    daemon only that user is served (and is its admin)."""
    root_daemon = LocalPolicy(daemon_uid=0, max_priority=3)
    alice = root_daemon.principal(1001, "alice", None)
    assert alice is not None and alice.users == ("alice",) and not alice.admin
    assert alice.max_priority == 3 and not alice.may_preempt
    root = root_daemon.principal(0, "root", None)
    assert root is not None and root.admin and root.users == ()  # the node's run_as
    own = LocalPolicy(daemon_uid=1001)
    assert own.principal(1002, "bob", None) is None
    me = own.principal(1001, "alice", None)
    assert me is not None and me.admin


def test_the_identities_file_is_parsed_and_checked() -> None:
    """Token identities by hash, unix-user overrides, [local]; every mistake names the entry."""
    digest = hash_token("s3cret")
    table = IdentityTable.parse(
        {
            "local": {"max_priority": 1, "max_jobs": 7},
            "identity": [
                {
                    "name": "bob",
                    "token_sha256": digest,
                    "users": ["bob"],
                    "max_priority": 10,
                    "slot_quota": 4,
                    "max_jobs": 5000,
                    "max_job_bytes": 1 << 30,
                },
                {"name": "carol", "unix_user": "carol", "may_preempt": True},
            ],
        },
        daemon_uid=0,
        where="f",
    )
    bob = table.for_token("s3cret")
    assert bob is not None and bob.name == "bob" and bob.slot_quota == 4
    assert (bob.max_jobs, bob.max_job_bytes) == (5000, 1 << 30)  # a share raised (issue 35)
    dave = table.local.principal(1004, "dave", None)
    assert dave is not None and (dave.max_jobs, dave.max_job_bytes) == (7, None)
    assert table.for_token("wrong") is None
    carol = table.local.principal(1003, "carol", table.by_unix_user["carol"])
    assert carol is not None and carol.may_preempt and carol.users[0] == "carol"
    bad = [
        {"identity": [{"name": "x y", "token_sha256": digest}]},
        {"identity": [{"name": "x", "token_sha256": "plain-token"}]},
        {"identity": [{"name": "x"}]},
        {"identity": [{"name": "admin", "token_sha256": digest}]},
        {"identity": [{"name": "x", "token_sha256": digest, "max_priority": 5000}]},
        {"identity": [{"name": "x", "token_sha256": digest, "root": True}]},
        {"identity": [{"name": "x", "token_sha256": digest, "max_jobs": -1}]},
        {"local": {"max_job_bytes": "lots"}},
        {
            "identity": [
                {"name": "a", "token_sha256": digest},
                {"name": "b", "token_sha256": digest},
            ]
        },
        {"nodes": {}},
    ]
    for data in bad:
        with pytest.raises(ValueError, match="f"):
            IdentityTable.parse(data, daemon_uid=0, where="f")


def test_tokens_name_their_principal_and_a_job_token_is_revoked_with_its_job() -> None:
    """The admin token, the cluster credential, an identity's and a job's; unknown: None."""
    jobs = JobTokens()
    auth = Authenticator(
        admin_token="admin-secret",
        cluster_token="cluster-secret",
        table=IdentityTable.parse(
            {"identity": [{"name": "bob", "token_sha256": hash_token("bob-secret")}]},
            daemon_uid=0,
            where="f",
        ),
        jobs=jobs,
    )
    job_token = jobs.mint("j1")
    assert auth.from_token("admin-secret") == ADMIN
    assert auth.from_token("cluster-secret") == CLUSTER
    bob = auth.from_token("bob-secret")
    assert bob is not None and bob.name == "bob"
    job = auth.from_token(job_token)
    assert job is not None and job.store_prefix == "jobs/j1/"
    assert auth.from_token("nope") is None and auth.from_token("") is None
    again = jobs.mint("j1")  # a new token replaces the old one
    assert auth.from_token(job_token) is None and auth.from_token(again) is not None
    jobs.revoke("j1")
    assert auth.from_token(again) is None


def test_elasticd_identity_prints_an_entry_the_daemon_accepts(tmp_path, capsys) -> None:
    """`elasticd identity` writes the token 0600 and prints an entry holding only its hash."""
    import tomllib

    from elasticd.cli import main

    token_file = tmp_path / "cfg" / "token"
    assert (
        main(
            [
                "identity",
                "ci",
                "--user",
                "alice",
                "--max-priority",
                "5",
                "--token-file",
                str(token_file),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    token = token_file.read_text().strip()
    assert token_file.stat().st_mode & 0o777 == 0o600 and token not in out
    table = IdentityTable.parse(tomllib.loads(out), daemon_uid=0, where="out")
    ci = table.for_token(token)
    assert ci is not None and ci.users == ("alice",) and ci.max_priority == 5
    assert main(["identity", "no spaces"]) == 2


@pytest.mark.parametrize("action", [Action.READ_DETAIL, Action.CANCEL, Action.DELETE])
def test_a_local_user_and_an_identity_of_the_same_name_are_different_owners(
    action: Action,
) -> None:
    """A Unix user called `admin` (Debian's cloud images have one) is not the admin: the
    admin's jobs (and those from before identities) are not its; a local user and a token
    identity that share a name never own each other's jobs; each owns its own."""
    policy = LocalPolicy(daemon_uid=0)
    local_admin = policy.principal(1500, "admin", None)
    local_bob = policy.principal(1501, "bob", None)
    assert local_admin is not None and local_bob is not None
    assert local_admin.unix_named and not local_admin.admin
    admins = JobFacts(owner="admin", user=None, job_id="a")  # as jobs.facts_of makes it
    bob_identitys = JobFacts(owner="bob", owner_unix_named=False, user="bob", job_id="b")
    bob_locals = JobFacts(owner="bob", owner_unix_named=True, user="bob", job_id="c")
    assert isinstance(authorize(local_admin, action, admins), Deny)
    assert isinstance(authorize(local_admin, action, ADMINS_JOB), Deny)
    assert isinstance(authorize(local_bob, action, bob_identitys), Deny)
    assert isinstance(authorize(BOB_TOKEN, action, bob_locals), Deny)
    assert authorize(local_bob, action, bob_locals) == Allow()
    assert authorize(BOB_TOKEN, action, bob_identitys) == Allow()
    assert authorize(ADMIN, action, bob_locals) == Allow()
