"""Who is asking, and what they may do: principals, the identities file and :func:`authorize`.

Every request the daemon serves has a :class:`Principal`; there is no
anonymous caller and no "loopback is trusted":

Local callers (the unix socket)
    The kernel names the peer's uid and gid (``SO_PEERCRED``, read once per
    connection by :mod:`api.protocol`). The caller is that Unix user: its jobs
    run as itself. uid 0 is an admin. A daemon that does not run as root
    serves its own user only (another uid is refused: it could only run jobs
    as the daemon's user, that is, as someone else).
Token callers (TCP)
    A bearer token names an identity. The daemon's ``--token-file`` token is
    the **admin** identity (its jobs run as ``run_as``, as before). Other
    identities live in the identities file (``identities_file``), stored as
    the SHA-256 of their token, each with the Unix users its jobs may run as
    (the first is the default), its highest priority, whether it may preempt,
    an optional slot quota, and whether it is an admin.
The cluster
    Daemons talk to each other and to the store with the cluster credential
    (``cluster_token_file``; by default the admin token). It may use
    ``/store``; it is never a user's.
A job's workers
    Each job gets a token of its own on each node (:class:`JobTokens`), in a
    file only its user can read (``ELASTICD_TOKEN_FILE``): it reaches the
    store only under the job's own ``jobs/<id>/`` keys, and reads its own job.

:func:`authorize` is the one decision: a pure function of the principal, the
action and the job, returning :class:`Allow` or :class:`Deny` with the reason.
It is tested as a table (``tests/unit/test_identity.py``).

Standard library only (and :mod:`tomllib`): the CLI imports it to make tokens.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import re
import secrets
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ADMIN",
    "CLUSTER",
    "Action",
    "Allow",
    "Authenticator",
    "Deny",
    "IdentityTable",
    "JobFacts",
    "JobTokens",
    "LocalPolicy",
    "Principal",
    "PrincipalKind",
    "authorize",
    "hash_token",
    "new_token",
]

#: An identity's name: what `owner` shows.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
#: The priority bounds of a job spec (elasticd.models).
MAX_PRIORITY = 1000


class PrincipalKind(enum.Enum):
    """How the caller proved who it is."""

    LOCAL = "local"
    """A process on this node, on the unix socket: its uid, from the kernel."""
    TOKEN = "token"
    """A bearer token of the identities file."""
    ADMIN = "admin"
    """The daemon's own token (``--token-file``): the operator."""
    CLUSTER = "cluster"
    """Another daemon, with the cluster credential."""
    JOB = "job"
    """A job's workers, with the token the daemon made for that job."""


@dataclass(frozen=True)
class Principal:
    """Who a request comes from, and the rights of that identity."""

    name: str
    kind: PrincipalKind
    users: tuple[str, ...] = ()
    """Unix users its jobs may run as; the first is the default. ``()``: the node's default."""
    max_priority: int = 0
    may_preempt: bool = False
    slot_quota: int | None = None
    max_jobs: int | None = None
    """Its share of job documents (:mod:`elasticd.shares`); None: the node's ``owner_max_jobs``."""
    max_job_bytes: int | None = None
    """Its share of job-document bytes; None: the node's ``owner_max_job_bytes``."""
    admin: bool = False
    uid: int | None = None
    """For a local caller: its uid."""
    job_id: str | None = None
    """For a job's workers: their job."""
    unix_named: bool = False
    """Named by its Unix user (a local caller no identity names): its name is in the
    name space of Unix users, never the same owner as an identity, the admin or the
    cluster of the same name (a local user called ``admin`` is not the admin)."""

    @property
    def may_use_store(self) -> bool:
        """The whole store: daemons and admins (a job's workers only under their prefix)."""
        return self.kind is PrincipalKind.CLUSTER or self.admin

    @property
    def store_prefix(self) -> str | None:
        """The only keys a job's workers may touch; None for the whole store or none of it."""
        return f"jobs/{self.job_id}/" if self.kind is PrincipalKind.JOB else None


#: The admin identity of the daemon's own token.
ADMIN = Principal(
    "admin",
    PrincipalKind.ADMIN,
    max_priority=MAX_PRIORITY,
    may_preempt=True,
    admin=True,
)
#: Another daemon, or the store's client.
CLUSTER = Principal(
    "cluster", PrincipalKind.CLUSTER, max_priority=MAX_PRIORITY, may_preempt=True, admin=True
)


class Action(enum.Enum):
    """What a request does to a job (or to the node)."""

    SUBMIT = "submit"
    LIST = "list"
    """List jobs with their state and owner; read the queue and the nodes."""
    READ = "read"
    """A job's state and owner (its spec's env and args are the owner's)."""
    READ_DETAIL = "read_detail"
    """A job's spec, events, workers and logs."""
    CANCEL = "cancel"
    DELETE = "delete"
    STORE = "store"
    RELOAD = "reload"
    """Re-execute the daemon in place (``POST /reload``): admins only."""
    DRAIN = "drain"
    """Quarantine a node or release it (``POST /nodes/{name}/drain``, ``undrain``): admins
    only; the daemon writes the node's health record on the admin's behalf."""


@dataclass(frozen=True)
class JobFacts:
    """What :func:`authorize` needs of a job: who owns it, who it runs as, its priority."""

    owner: str | None
    """The owner's name; None for a job from before identities (the admin's)."""
    owner_unix_named: bool = False
    """Whether ``owner`` names a local Unix user (:attr:`Principal.unix_named`)."""
    user: str | None = None
    """The Unix user it asks to run as (None: the node's default)."""
    priority: int = 0
    job_id: str | None = None


@dataclass(frozen=True)
class Allow:
    user: str | None = None
    """For SUBMIT: the Unix user the job is to run as (None: the node's default)."""

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class Deny:
    reason: str
    status: int = 403

    def __bool__(self) -> bool:
        return False


def authorize(principal: Principal, action: Action, job: JobFacts | None = None) -> Allow | Deny:
    """Whether ``principal`` may do ``action`` (to ``job``). Pure: no IO, no clock."""
    if principal.kind is PrincipalKind.JOB:
        if action is Action.READ and job is not None and job.job_id == principal.job_id:
            return Allow()
        if action is Action.STORE:
            return Allow()  # under its own prefix only: the store route checks every key
        return Deny(f"a job's token may only read its own job and its keys ({action.value})")
    if action is Action.STORE:
        if principal.may_use_store:
            return Allow()
        return Deny("the store is for the daemons and admins only")
    if action is Action.RELOAD:
        return Allow() if principal.admin else Deny("only an admin may reload the daemon")
    if action is Action.DRAIN:
        return Allow() if principal.admin else Deny("only an admin may drain or undrain a node")
    if action in (Action.LIST, Action.READ):
        return Allow()
    if action is Action.SUBMIT:
        return _submit(principal, job or JobFacts(owner=principal.name))
    assert job is not None, f"{action.value} needs a job"
    if principal.admin or (
        job.owner is not None
        and job.owner == principal.name
        and job.owner_unix_named == principal.unix_named
    ):
        return Allow()
    whose = f"{job.owner}'s" if job.owner is not None else "the admin's"
    return Deny(f"this job is {whose}: only its owner or an admin may {_VERBS[action]} it")


_VERBS = {
    Action.READ_DETAIL: "read the spec, events, workers and logs of",
    Action.CANCEL: "cancel",
    Action.DELETE: "delete",
}


def _submit(principal: Principal, job: JobFacts) -> Allow | Deny:
    if job.priority > principal.max_priority:
        return Deny(
            f"priority {job.priority} is above what {principal.name} may ask for "
            f"({principal.max_priority}); ask an admin to raise max_priority"
        )
    requested = job.user
    if requested is None:
        default = principal.users[0] if principal.users else None
        if default is None and not principal.admin:
            return Deny(f"{principal.name} may not run jobs as any user (its users list is empty)")
        return Allow(default)
    if requested in principal.users:
        return Allow(requested)
    if principal.admin:
        return Allow(requested)  # the node's allowed_users and allow_root still apply
    may = ", ".join(principal.users) or "none"
    return Deny(f"{principal.name} may not run jobs as {requested!r} (it may run as: {may})")


# -- tokens ---------------------------------------------------------------------------


def new_token() -> str:
    """A fresh bearer token: 32 random bytes, URL-safe text."""
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """What the identities file keeps of a token: its SHA-256, hex.

    A token is 32 random bytes, so a plain hash cannot be brute-forced; a slow
    password hash would only slow every request down.
    """
    return hashlib.sha256(token.strip().encode()).hexdigest()


@dataclass(frozen=True)
class LocalPolicy:
    """The rights of local (unix-socket) callers that no identity names."""

    daemon_uid: int
    max_priority: int = 0
    may_preempt: bool = False
    slot_quota: int | None = None
    max_jobs: int | None = None
    max_job_bytes: int | None = None
    serves_others: bool | None = None
    """Whether other uids are served, each as itself. None: a root daemon does (``elasticd
    serve``); an embedded one (``elasticd run`` as root) and a user's own daemon do not."""

    def principal(
        self, uid: int, user: str | None, overrides: Principal | None
    ) -> Principal | None:
        """The principal of a socket peer with ``uid``; None when this daemon does not serve it."""
        others = self.daemon_uid == 0 if self.serves_others is None else self.serves_others
        if not others and uid != self.daemon_uid:
            return None  # a user's own daemon serves that user only
        admin = uid == 0 or uid == self.daemon_uid
        name = user if user is not None else f"uid-{uid}"
        if overrides is not None:
            return Principal(
                overrides.name,
                PrincipalKind.LOCAL,
                users=(name, *(u for u in overrides.users if u != name)),
                max_priority=overrides.max_priority,
                may_preempt=overrides.may_preempt,
                slot_quota=overrides.slot_quota,
                max_jobs=overrides.max_jobs,
                max_job_bytes=overrides.max_job_bytes,
                admin=overrides.admin or admin,
                uid=uid,
            )
        return Principal(
            name,
            PrincipalKind.LOCAL,
            # root is the node's admin: its jobs run as the node's run_as, as the admin
            # token's do (root itself only where it asks and the node allows root).
            users=() if uid == 0 else (name,),
            max_priority=MAX_PRIORITY if admin else self.max_priority,
            may_preempt=True if admin else self.may_preempt,
            slot_quota=None if admin else self.slot_quota,
            max_jobs=self.max_jobs,
            max_job_bytes=self.max_job_bytes,
            admin=admin,
            uid=uid,
            unix_named=True,
        )


@dataclass
class IdentityTable:
    """The token identities of the identities file, by token hash, and per-user overrides."""

    by_hash: dict[str, Principal] = field(default_factory=dict)
    by_unix_user: dict[str, Principal] = field(default_factory=dict)
    local: LocalPolicy = field(default_factory=lambda: LocalPolicy(daemon_uid=os.geteuid()))

    def for_token(self, token: str) -> Principal | None:
        return self.by_hash.get(hash_token(token))

    @classmethod
    def parse(cls, data: Mapping[str, Any], *, daemon_uid: int, where: str) -> IdentityTable:
        """The table of a parsed identities file; ``ValueError`` naming the entry otherwise."""
        known = {"identity", "local"}
        stray = set(data) - known
        if stray:
            raise ValueError(
                f"{where}: unknown section(s) {sorted(stray)} (known: {sorted(known)})"
            )
        local_raw = data.get("local", {})
        if not isinstance(local_raw, Mapping):
            raise ValueError(f"{where}: [local] must be a table")
        _only(
            local_raw,
            {"max_priority", "may_preempt", "slot_quota", *SHARE_KEYS},
            f"{where} [local]",
        )
        local = LocalPolicy(
            daemon_uid=daemon_uid,
            max_priority=_priority(local_raw.get("max_priority", 0), f"{where} [local]"),
            may_preempt=_bool(local_raw.get("may_preempt", False), f"{where} [local]"),
            slot_quota=_quota(local_raw.get("slot_quota"), f"{where} [local]"),
            max_jobs=_share(local_raw, "max_jobs", f"{where} [local]"),
            max_job_bytes=_share(local_raw, "max_job_bytes", f"{where} [local]"),
        )
        table = cls(local=local)
        entries = data.get("identity", [])
        if not isinstance(entries, list):
            raise ValueError(f"{where}: identities are [[identity]] tables")
        names: set[str] = set()
        for i, raw in enumerate(entries):
            at = f"{where} [[identity]] #{i + 1}"
            if not isinstance(raw, Mapping):
                raise ValueError(f"{at}: must be a table")
            _only(
                raw,
                {
                    "name",
                    "token_sha256",
                    "users",
                    "unix_user",
                    "max_priority",
                    "may_preempt",
                    "slot_quota",
                    *SHARE_KEYS,
                    "admin",
                },
                at,
            )
            name = raw.get("name")
            if not isinstance(name, str) or not NAME_PATTERN.match(name):
                raise ValueError(f"{at}: name must be 1-64 of letters, digits, '.', '_', '@', '-'")
            if name in names or name in ("admin", "cluster"):
                raise ValueError(f"{at}: the name {name!r} is taken")
            names.add(name)
            users = raw.get("users", [])
            if not isinstance(users, list) or not all(isinstance(u, str) and u for u in users):
                raise ValueError(f"{at}: users must be a list of Unix user names")
            principal = Principal(
                name,
                PrincipalKind.TOKEN,
                users=tuple(users),
                max_priority=_priority(raw.get("max_priority", 0), at),
                may_preempt=_bool(raw.get("may_preempt", False), at),
                slot_quota=_quota(raw.get("slot_quota"), at),
                max_jobs=_share(raw, "max_jobs", at),
                max_job_bytes=_share(raw, "max_job_bytes", at),
                admin=_bool(raw.get("admin", False), at),
            )
            digest = raw.get("token_sha256")
            unix_user = raw.get("unix_user")
            if digest is None and unix_user is None:
                raise ValueError(f"{at}: give token_sha256 (a token's identity) or unix_user")
            if digest is not None:
                if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
                    raise ValueError(
                        f"{at}: token_sha256 must be 64 lower-case hex digits "
                        "(`elasticd identity new` prints it)"
                    )
                if digest in table.by_hash:
                    raise ValueError(f"{at}: the same token as {table.by_hash[digest].name!r}")
                table.by_hash[digest] = principal
            if unix_user is not None:
                if not isinstance(unix_user, str) or not unix_user:
                    raise ValueError(f"{at}: unix_user must be a Unix user name")
                table.by_unix_user[unix_user] = principal
        return table

    @classmethod
    def load(cls, path: Path | None, *, daemon_uid: int) -> IdentityTable:
        """The table of the identities file at ``path`` (None: no token identities)."""
        if path is None:
            return cls(local=LocalPolicy(daemon_uid=daemon_uid))
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ValueError(f"identities_file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"identities_file {path}: not valid TOML: {exc}") from None
        return cls.parse(data, daemon_uid=daemon_uid, where=f"identities_file {path}")


def _only(raw: Mapping[str, Any], allowed: Iterable[str], at: str) -> None:
    stray = sorted(set(raw) - set(allowed))
    if stray:
        raise ValueError(f"{at}: unknown key(s) {stray}")


def _priority(value: Any, at: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_PRIORITY:
        raise ValueError(f"{at}: max_priority must be an integer in -1000..1000")
    return value


def _bool(value: Any, at: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{at}: expected true or false, got {value!r}")
    return value


#: The shares an identity (or ``[local]``) may set for itself (:mod:`elasticd.shares`).
SHARE_KEYS = ("max_jobs", "max_job_bytes")


def _share(raw: Mapping[str, Any], key: str, at: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 40:
        raise ValueError(f"{at}: {key} must be a whole number (0..2**40)")
    return value


def _quota(value: Any, at: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10_000_000:
        raise ValueError(f"{at}: slot_quota must be a whole number of slots")
    return value


# -- a job's own token ----------------------------------------------------------------


@dataclass
class JobTokens:
    """The tokens this node made for its jobs' workers, by hash: minted at an agent's start."""

    _by_hash: dict[str, str] = field(default_factory=dict)
    _by_job: dict[str, str] = field(default_factory=dict)

    def mint(self, job_id: str) -> str:
        """The job's token on this node (the same for every attempt while it runs here)."""
        token = new_token()
        old = self._by_job.get(job_id)
        if old is not None:
            self._by_hash.pop(old, None)
        digest = hash_token(token)
        self._by_hash[digest] = job_id
        self._by_job[job_id] = digest
        return token

    def digests(self) -> dict[str, str]:
        """Each job's token hash (the daemon's re-exec hands them over; never the tokens)."""
        return dict(self._by_job)

    def restore(self, job_id: str, digest: str) -> None:
        """Know a job's token again by its hash (after the daemon's re-exec)."""
        self._by_hash[digest] = job_id
        self._by_job[job_id] = digest

    def revoke(self, job_id: str) -> None:
        digest = self._by_job.pop(job_id, None)
        if digest is not None:
            self._by_hash.pop(digest, None)

    def principal(self, token: str) -> Principal | None:
        job_id = self._by_hash.get(hash_token(token))
        if job_id is None:
            return None
        return Principal(f"job:{job_id}", PrincipalKind.JOB, job_id=job_id)


def same_secret(given: str, expected: str | None) -> bool:
    """Constant-time comparison of a presented token with a configured one."""
    return expected is not None and hmac.compare_digest(given.encode(), expected.encode())


@dataclass
class Authenticator:
    """Turns what a request presents (a socket peer's uid, a bearer token) into a principal."""

    admin_token: str
    cluster_token: str | None = None
    table: IdentityTable = field(default_factory=IdentityTable)
    jobs: JobTokens = field(default_factory=JobTokens)
    user_name: Callable[[int], str | None] = field(default=lambda uid: None)

    def from_token(self, token: str) -> Principal | None:
        """The principal a bearer token names; None for an unknown token."""
        token = token.strip()
        if not token:
            return None
        if same_secret(token, self.admin_token):
            return ADMIN
        if self.cluster_token is not None and same_secret(token, self.cluster_token):
            return CLUSTER
        return self.table.for_token(token) or self.jobs.principal(token)

    def from_peer(self, uid: int) -> Principal | None:
        """The principal of a unix-socket peer; None when this daemon does not serve that uid."""
        user = self.user_name(uid)
        overrides = self.table.by_unix_user.get(user) if user is not None else None
        return self.table.local.principal(uid, user, overrides)
