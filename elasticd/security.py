"""Who may do what on this node: the user jobs run as, and the daemon's own files and socket.

Submitting a job is running a program, so the daemon decides the user it
runs as and never leaves it to the request alone:

Job users
    :func:`resolve_job_users` turns the configuration into a
    :class:`JobUsers` policy once, at start. A daemon that is not root runs
    every job as itself (it could not do otherwise). A root daemon runs jobs
    as ``run_as``; without it, ``elasticd serve`` picks the ``elasticd``
    service user when it exists and otherwise refuses to run jobs as root
    unless ``allow_root = true``. With ``run_as = "dynamic"`` each job that
    names no user gets a uid of its own from ``dynamic_uids``, as systemd's
    ``DynamicUser=`` (:mod:`elasticd.supervise.uids`): two jobs never share
    a uid on a node, so one can neither read another's ``/proc/<pid>/environ``
    nor signal its workers. A job may ask for a ``user`` only from
    ``allowed_users`` (the ``run_as`` user is always allowed), and root only
    with ``allow_root``. An embedded daemon (``elasticd run``,
    ``elasticd.launch``, tests) leaves ``allow_root`` unset and runs jobs as
    the calling user, as torchrun does. An agent decides its job's user
    before anything of the job runs (its health check included); a refused
    user fails the job with the reason.

    The switch itself happens in the worker spawn (:mod:`elasticd.supervise.spawn`):
    ``subprocess`` sets the groups, gid and uid between fork and exec in C
    (no ``preexec_fn``, which is unsafe in a threaded process), and only
    then the parent-death signal is set, because a credential change clears it.

Files
    The daemon's state (its SQLite event log and the embedded store, which
    holds every job spec, ``env`` included) is readable by the daemon's user
    only, from the moment it exists: ``elasticd serve``, ``elasticd run``,
    ``elasticd.launch`` and the store server set the umask to
    :data:`PRIVATE_UMASK` before they create anything
    (:func:`set_private_umask`), the state folder is made with an explicit
    0700 (:func:`make_private_dir`) and each SQLite file is created 0600
    before SQLite opens it (:func:`create_private_file`; SQLite gives its
    ``-wal`` and ``-shm`` files the database file's mode), so no file is
    ever group- or world-readable, not even for an instant a local user
    could use to open it and keep the descriptor. :func:`secure_state_dir`
    then only repairs what an older version left behind.

    When jobs run as other users their logs must be reachable, so the state
    folder and the log root become traverse-only (0711) and
    :func:`prepare_worker_dir` hands each worker its own log folder
    (``<job>/attempt_<n>/<local_rank>``, 0700, the job user's), where its
    log files are 0600 and the job user's. The job and attempt folders
    above it stay the daemon's and traverse-only (0711): the job's user
    (and everyone else) may pass through to a folder whose name it knows,
    never list them, and only the job's user may enter the worker folder,
    so users who share a primary group no longer read each other's output.
    A worker can never redirect the daemon's writes elsewhere with a
    symbolic link (the folders it could swap are not its own), and the
    daemon opens log files with ``O_NOFOLLOW``.

Unix socket
    :func:`bind_unix_socket` creates ``--unix-socket`` itself, so that uvicorn's
    default never applies: a root daemon's 0666 in a 0755 folder (every local
    user is served as itself), 0660 in a 0750 folder of ``unix_socket_group``, a
    user's own daemon's 0600 in 0700.

The token
    Never logged, never put in an event, an API answer or a worker's
    environment: workers get ``ELASTICD_TOKEN_FILE`` (a path) only, and the
    file belongs to the daemon's own user and is 0600, or the daemon refuses
    to start (:func:`elasticd.config.read_token`).
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from elasticd.errors import ConfigError, WorkerSpawnError

if TYPE_CHECKING:
    from elasticd.config import Config
    from elasticd.supervise.uids import DynamicUids

log = logging.getLogger("elasticd.security")

#: The service user a root ``elasticd serve`` runs jobs as when ``run_as`` is not set.
SERVICE_USER = "elasticd"

#: Modes of the daemon's own state: its folder and the files in it.
STATE_DIR_MODE = 0o700
STATE_DIR_MODE_SHARED = 0o711
STATE_FILE_MODE = 0o600
#: The log root when jobs run as other users: they may pass through, not list it.
LOG_ROOT_MODE_SHARED = 0o711
#: A job's and an attempt's log folder (the daemon's): anyone may pass through, nobody
#: but the daemon may list them; a worker's own folder (the job user's) and its log files.
JOB_DIR_MODE = 0o711
WORKER_DIR_MODE = 0o700
LOG_FILE_MODE = 0o600
#: The umask of the daemon and the store server: nothing they create is born readable
#: by anyone else (a mode given explicitly, e.g. 0711, still applies).
PRIVATE_UMASK = 0o077

#: ``run_as = "dynamic"``: each job gets a uid of its own (:mod:`elasticd.supervise.uids`).
DYNAMIC = "dynamic"
#: The ``HOME`` of a job with a dynamic uid: it has no home, as it has no passwd entry;
#: a folder of the job's would outlive the job and go to the uid's next job.
DYNAMIC_HOME = "/nonexistent"

#: The unix socket and the folder it is created in: open to one group, or to every local
#: user (a root daemon: each connection is served as the uid the kernel names), or private.
SOCKET_MODE = 0o660
SOCKET_DIR_MODE = 0o750
SOCKET_MODE_EVERYONE = 0o666
SOCKET_DIR_MODE_EVERYONE = 0o755
SOCKET_MODE_PRIVATE = 0o600
SOCKET_DIR_MODE_PRIVATE = 0o700
#: The longest path a unix socket may have (sun_path is 108 bytes, NUL included).
UNIX_PATH_MAX = 107


@dataclass(frozen=True)
class Identity:
    """A user a worker can run as."""

    user: str
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...] = ()
    """Supplementary groups (``initgroups``), the primary one included."""

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def env(self) -> dict[str, str]:
        """``HOME``, ``USER`` and ``LOGNAME`` as a login of this user would have them."""
        return {"HOME": self.home, "USER": self.user, "LOGNAME": self.user}


def dynamic_identity(uid: int) -> Identity:
    """A job's own uid: no passwd entry, its gid the same number, no supplementary groups."""
    return Identity(f"elasticd-{uid}", uid, uid, DYNAMIC_HOME, ())


def lookup_user(name: str) -> Identity:
    """The identity of a user given by name or numeric uid; ``ConfigError`` if unknown."""
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, ValueError):
        raise ConfigError(f"user {name!r} does not exist on this node") from None
    try:
        groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except OSError:  # pragma: no cover - NSS failure
        groups = (entry.pw_gid,)
    return Identity(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir, groups)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@dataclass(frozen=True)
class JobUsers:
    """The users this daemon runs jobs as: decided once, applied to every worker spawn."""

    default: Identity | None
    """Who jobs run as when they name no user; None: as the daemon itself."""
    allowed: dict[str, Identity] = field(default_factory=dict)
    """Users a job may ask for, by name."""
    refusal: str | None = None
    """Set when jobs that name no user must not run at all, with the reason."""
    daemon_uid: int = field(default_factory=os.geteuid)
    dynamic: DynamicUids | None = None
    """``run_as = "dynamic"``: the uids of jobs that name no user, one per job."""
    embedded: bool = False
    """``elasticd run`` / ``elasticd.launch``: its caller's jobs only, as its caller."""

    @property
    def serves_others(self) -> bool:
        """Whether this daemon runs jobs as users other than its own.

        A root ``elasticd serve`` does (its local callers' jobs run as
        themselves), and so does any daemon with other users configured; an
        embedded daemon runs its caller's job only, even as root.
        """
        return (self.daemon_uid == 0 and not self.embedded) or bool(self.identities)

    def check(self, requested: str | None, *, owner_user: str | None = None) -> None:
        """Whether a job asking for ``requested`` may run here; ``WorkerSpawnError`` if not.

        Decided at submission, before the job is accepted; it claims nothing
        (a dynamic uid is claimed by the job's agent, :meth:`for_job`).
        """
        if requested is None:
            if self.refusal is not None:
                raise WorkerSpawnError(self.refusal)
            return
        self.for_job(requested, owner_user=owner_user)

    def for_job(
        self,
        requested: str | None,
        *,
        owner_user: str | None = None,
        job_id: str | None = None,
    ) -> Identity | None:
        """The identity a job runs as (None: the daemon's own); ``WorkerSpawnError`` if refused.

        ``owner_user``: the Unix user the job runs as by its owner's own right
        (:class:`elasticd.models.JobOwner`): a root daemon runs the job as that
        user when it asks for it, whether or not ``allowed_users`` names it;
        root still needs ``allow_root``.

        ``job_id`` is needed (only) with ``run_as = "dynamic"``: a job that
        names no user gets its own uid, claimed at the first call and the same
        at every later one until :meth:`release`.
        """
        if requested is None:
            if self.refusal is not None:
                raise WorkerSpawnError(self.refusal)
            if self.dynamic is not None:
                if job_id is None:
                    raise WorkerSpawnError("run_as = dynamic: a job's uid needs its id")
                uid = self.dynamic.claim(job_id)
                if uid is None:
                    raise WorkerSpawnError(
                        f"run_as = dynamic: every uid of dynamic_uids ({self.dynamic.uids}) is "
                        "in use on this node (by its jobs or by processes left of them); "
                        "widen the range or wait for a job to end"
                    )
                return dynamic_identity(uid)
            return self.default
        identity = self.allowed.get(requested)
        if identity is None and requested.isdigit():
            identity = next((i for i in self.allowed.values() if str(i.uid) == requested), None)
        if identity is None and requested == owner_user and self.daemon_uid == 0:
            try:
                found = lookup_user(requested)
            except ConfigError as exc:
                raise WorkerSpawnError(str(exc)) from None
            if found.is_root:
                raise WorkerSpawnError(
                    "the job asks to run as root, which this node allows only when started "
                    "with --allow-root (allow_root = true in the config)"
                )
            identity = found
        if identity is None:
            names = ", ".join(sorted(self.allowed)) or "none"
            raise WorkerSpawnError(
                f"the job asks to run as {requested!r}, which this node does not allow "
                f"(--allowed-users, allowed_users in the config: {names})"
            )
        return None if identity.uid == self.daemon_uid else identity

    def release(self, job_id: str) -> None:
        """The job's agent on this node has ended: its dynamic uid (if any) is free again."""
        if self.dynamic is not None:
            self.dynamic.release(job_id)

    @property
    def identities(self) -> list[Identity]:
        """Every identity other than the daemon's own that a worker may get.

        With dynamic uids, one of them stands for all: they are alike to
        every file (no passwd entry, no groups).
        """
        found = {i.uid: i for i in self.allowed.values() if i.uid != self.daemon_uid}
        if self.default is not None and self.default.uid != self.daemon_uid:
            found[self.default.uid] = self.default
        if self.dynamic is not None:
            first = self.dynamic.uids.first
            found[first] = Identity(f"dynamic uids {self.dynamic.uids}", first, first, "/", ())
        return list(found.values())


def resolve_job_users(config: Config, *, euid: int | None = None) -> JobUsers:
    """The job-user policy of ``config`` for a daemon running as ``euid`` (default: this one).

    Raises ``ConfigError`` for a setting that can never work: an unknown
    user, root without ``allow_root``, or other users on a non-root daemon.
    """
    euid = os.geteuid() if euid is None else euid
    run_as: str | None = getattr(config, "run_as", None)
    allow_root: bool | None = getattr(config, "allow_root", None)
    allowed_names: list[str] = list(getattr(config, "allowed_users", []) or [])

    def checked(name: str, setting: str) -> Identity:
        identity = lookup_user(name)
        if identity.is_root and not allow_root:
            raise ConfigError(
                f"{setting}: refusing to run jobs as root ({name!r}); start with --allow-root "
                "(allow_root = true in the config) if that is really intended"
            )
        return identity

    if euid != 0:
        me = pwd.getpwuid(euid).pw_name if _uid_known(euid) else str(euid)
        if run_as == DYNAMIC:
            raise ConfigError(
                "run_as = dynamic: only a daemon running as root can give each job a uid of "
                f"its own; this daemon runs as {me!r}"
            )
        for name, setting in [(run_as, "run_as")] + [(n, "allowed_users") for n in allowed_names]:
            if name is not None and lookup_user(name).uid != euid:
                raise ConfigError(
                    f"{setting}: only a daemon running as root can run jobs as another user "
                    f"({name!r}); this daemon runs as {me!r}"
                )
        allowed = {me: _self_identity(euid)} if _uid_known(euid) else {}
        return JobUsers(default=None, allowed=allowed, daemon_uid=euid)

    allowed = {name: checked(name, "allowed_users") for name in allowed_names}
    if run_as == DYNAMIC:
        from elasticd.supervise.uids import DEFAULT_RANGE, DynamicUids, parse_uid_range

        try:
            uids = parse_uid_range(getattr(config, "dynamic_uids", None) or DEFAULT_RANGE)
        except ValueError as exc:
            raise ConfigError(f"dynamic_uids: {exc}") from None
        return JobUsers(default=None, allowed=allowed, daemon_uid=euid, dynamic=DynamicUids(uids))
    if run_as is not None:
        default: Identity | None = checked(run_as, "run_as")
    elif allow_root is None:
        default = None  # embedded daemon: the calling user's jobs, as torchrun runs them
    elif _user_exists(SERVICE_USER):
        default = lookup_user(SERVICE_USER)
    elif allow_root:
        default = None
    else:
        reason = (
            "refusing to run the job as root: this daemon runs as root and no user to run it "
            f"as is configured (and no {SERVICE_USER!r} user exists). Start the daemon with "
            '--run-as USER (run_as = "USER" in the config), create the '
            f"{SERVICE_USER!r} user (elasticd install-service makes it), or start it with "
            "--allow-root (allow_root = true in the config)"
        )
        return JobUsers(default=None, allowed=allowed, refusal=reason, daemon_uid=euid)
    if default is not None:
        allowed.setdefault(default.user, default)
    elif allow_root:
        allowed.setdefault("root", _self_identity(0))
    return JobUsers(
        default=None if default is not None and default.uid == euid else default,
        allowed=allowed,
        daemon_uid=euid,
        embedded=run_as is None and allow_root is None,
    )


def _uid_known(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _self_identity(uid: int) -> Identity:
    entry = pwd.getpwuid(uid)
    return Identity(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir, (entry.pw_gid,))


# -- the daemon's files --------------------------------------------------------------


def secure_state_dir(state_dir: Path, logs: Path, users: JobUsers | None = None) -> None:
    """Make the daemon's state private: the folder 0700 (0711 when jobs run as others), files 0600.

    When jobs run as other users and their log root lies under the state
    folder, those users must be able to pass through it (never list it):
    the folder and the log root become 0711. Only folders this process owns
    are changed; a file in the state folder that it does not own is left alone.
    """
    # A root daemon runs its local callers' jobs as themselves: they must reach their logs.
    shared = bool(users and users.serves_others)
    state_dir = state_dir.resolve()
    logs = logs.resolve()
    make_state_private(state_dir, STATE_DIR_MODE_SHARED if shared else STATE_DIR_MODE)
    if shared:
        logs.mkdir(parents=True, exist_ok=True)
        st = logs.lstat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode):
            # A job could plant a link named after its job id there, and the daemon
            # would create the job's folders wherever it points.
            raise ConfigError(
                f"log_dir {logs} must be a folder of the daemon's own user, not writable by "
                "group or others, when jobs run as other users (a job could plant links "
                f"there); run: chown {os.geteuid()} {logs} && chmod go-w {logs}"
            )
        _chmod_own(logs, LOG_ROOT_MODE_SHARED)
        for parent in logs.parents:
            if parent == state_dir or state_dir in parent.parents:
                _chmod_own(parent, STATE_DIR_MODE_SHARED)
        for identity in users.identities if users else []:
            blocked = _first_untraversable(logs, identity)
            if blocked is not None:
                log.warning(
                    "user %s cannot reach the worker log folder %s: %s is not searchable "
                    "for it; its jobs will fail to start (give it o+x or set log_dir)",
                    identity.user,
                    logs,
                    blocked,
                )


def ownership_problem(
    path: Path, st: os.stat_result | None, euid: int, *, what: str, owners: str = ""
) -> str | None:
    """Why the daemon must not use ``path`` (its ``lstat`` is ``st``), or None (pure).

    A folder or file of the daemon's state must be the daemon's own and writable by
    nobody else: one that another user made first (in a sticky ``/tmp``, say) can hold
    a store with planted job documents, and its owner keeps the ``-wal`` and ``-shm``
    files SQLite makes beside them. ``what`` names it (``state folder``); ``owners``
    is the owner's name, for the message. A missing path (``st`` None) is fine: the
    daemon makes it itself, private.
    """
    if st is None:
        return None
    who = f"uid {st.st_uid}" + (f" ({owners})" if owners else "")
    if stat.S_ISLNK(st.st_mode):
        return (
            f"{what} {path} is a symbolic link (owned by {who}); the daemon's state is never "
            f"reached through a link: point it at the real path, or remove the link"
        )
    if st.st_uid != euid:
        return (
            f"{what} {path} belongs to {who}, not to this daemon (uid {euid}): another user "
            f"could have planted state there (a store with job documents that run as anyone). "
            f"Use a folder of the daemon's own (e.g. under /var/lib), or, once you have checked "
            f"its content: chown -R {euid} {path} && chmod -R go-w {path}"
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        return (
            f"{what} {path} is writable by its group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}, owner {who}): anyone could plant or swap state "
            f"there. Run: chmod go-w {path}"
        )
    return None


def parent_problem(
    path: Path, st: os.stat_result, euid: int, *, what: str, group_trusted: bool = False
) -> str | None:
    """Why the folder ``path`` above the daemon's state lets another user swap it (pure).

    A parent that another user owns, or may write without the sticky bit, lets that
    user rename the daemon's folder away and put her own in its place. A sticky
    world-writable folder (``/tmp``) is fine for a folder the daemon made itself.
    ``group_trusted``: the parent's group is one no other user belongs to in a way
    that matters (:func:`trusted_group`): its write bit is then no way in (Ubuntu's
    ``/var/log``, ``0775 root:syslog``; a home under a private group and umask 002).
    """
    if st.st_uid not in (0, euid):
        return (
            f"{what}'s parent folder {path} belongs to uid {st.st_uid}: its owner could swap "
            f"the daemon's state for her own. Use a folder under one of root's (e.g. /var/lib)"
        )
    writable = stat.S_IMODE(st.st_mode) & (0o002 if group_trusted else 0o022)
    if writable and not st.st_mode & stat.S_ISVTX:
        return (
            f"{what}'s parent folder {path} is writable by group or others without the sticky "
            f"bit (mode {stat.S_IMODE(st.st_mode):04o}): anyone could swap the daemon's state "
            f"for her own. Run: chmod go-w {path} (or chmod +t {path})"
        )
    return None


def trusted_group(st: os.stat_result) -> bool:
    """Is a root- or daemon-owned folder's group one whose write bit lets no user swap it?

    A system group (gid below 1000, as ``syslog`` on Ubuntu's ``/var/log``) of a
    root-owned folder: its members are system daemons, not users. Or the owner's own
    private group (named as its owner) with no other member (umask 002 on Fedora)."""
    if st.st_uid == 0 and st.st_gid < 1000:
        return True
    try:
        group = grp.getgrgid(st.st_gid)
    except KeyError:
        return False
    owner = _owner_name(st.st_uid)
    return bool(owner) and group.gr_name == owner and set(group.gr_mem) <= {owner}


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:
        return None


def _owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def refuse_foreign_state(state_dir: Path, folders: dict[str, Path] | None = None) -> None:
    """Raise ``ConfigError`` unless the daemon's state is its own and nobody else may write it.

    Checked at start, before anything is opened: the state folder, every file and
    folder directly in it (the store, its ``-wal``/``-shm``, the event log, the lock,
    the token), each folder of ``folders`` (``{"log_dir": path}``) and the parents of
    them all. What is missing is fine (the daemon makes it, private).
    """
    euid = os.geteuid()
    checks: list[tuple[str, Path]] = [("state folder (--state-dir)", Path(state_dir))]
    checks += [(f"{name} folder", Path(p)) for name, p in (folders or {}).items()]
    for what, path in checks:
        path = Path(os.path.abspath(path))
        for parent in path.parents:
            pst = _lstat(parent)
            if pst is None:
                continue
            if stat.S_ISLNK(pst.st_mode) and pst.st_uid in (0, euid):
                pst = parent.stat()  # root's link above (/var/run -> /run): its target counts
            problem = parent_problem(parent, pst, euid, what=what, group_trusted=trusted_group(pst))
            if problem:
                raise ConfigError(problem)
        st = _lstat(path)
        if st is not None and stat.S_ISLNK(st.st_mode) and st.st_uid in (0, euid):
            st = path.stat()  # the operator's own link: its target is what must be private
        problem = ownership_problem(
            path, st, euid, what=what, owners=_owner_name(st.st_uid) if st else ""
        )
        if problem:
            raise ConfigError(problem)
    state = Path(os.path.abspath(state_dir))
    if not state.is_dir():
        return
    for entry in sorted(state.iterdir()):
        st = _lstat(entry)
        if st is not None and stat.S_ISSOCK(st.st_mode):
            continue  # a socket left by a daemon killed before it removed it: replaced at bind
        problem = ownership_problem(
            entry, st, euid, what="state file", owners=_owner_name(st.st_uid) if st else ""
        )
        if problem:
            raise ConfigError(problem)


def make_state_private(state_dir: Path, mode: int = STATE_DIR_MODE) -> None:
    """Set the state folder to ``mode`` and its files to 0600 where this process owns them.

    Born private already (:func:`set_private_umask`, :func:`create_private_file`); this
    repairs a folder an older version, or a hand-made one, left open.
    """
    _chmod_own(state_dir, mode)
    for entry in state_dir.iterdir():
        with contextlib.suppress(OSError):
            st = entry.lstat()
            private = stat.S_IMODE(st.st_mode) & 0o077 == 0
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not private:
                entry.chmod(STATE_FILE_MODE)


def _chmod_own(path: Path, mode: int) -> None:
    with contextlib.suppress(OSError):
        st = path.stat()
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
            path.chmod(mode)


def can_traverse(path: Path, identity: Identity) -> bool:
    """Whether ``identity`` may search the folder ``path`` (root may always)."""
    if identity.is_root:
        return True
    try:
        st = path.stat()
    except OSError:
        return False
    if st.st_uid == identity.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in identity.groups or st.st_gid == identity.gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _first_untraversable(path: Path, identity: Identity) -> Path | None:
    for folder in [*reversed(path.parents), path]:
        if not can_traverse(folder, identity):
            return folder
    return None


def prepare_worker_dir(log_dir: Path, identity: Identity | None) -> None:
    """Create a worker's log folder; when it runs as ``identity``, make it that user's only.

    ``log_dir`` is ``<logs>/<job>/attempt_<n>/<local_rank>``. The job and
    attempt folders stay the daemon's and traverse-only (0711, group: the
    daemon's), so the user cannot swap them for links and nobody can list
    them; the worker's own folder becomes the user's, 0700, for its logs,
    error file and anything else it writes there. The group of the folders
    is never the job user's: that group is often shared (``users``), and a
    group that may read a job's folders reads every job's output.
    """
    attempt_dir = log_dir.parent
    job_dir = attempt_dir.parent
    job_dir.parent.mkdir(parents=True, exist_ok=True)  # the log root: the daemon's to set up
    for folder in (job_dir, attempt_dir, log_dir):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=STATE_DIR_MODE)  # born private, opened below as far as needed
    if identity is None:
        return
    for folder in (job_dir, attempt_dir):
        st = folder.lstat()
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
            raise WorkerSpawnError(
                f"log folder {folder} is not owned by the daemon; refusing to use it"
            )
        if st.st_gid != os.getegid():
            # An older version gave the folders the job user's group.
            os.chown(folder, -1, os.getegid(), follow_symlinks=False)
        if stat.S_IMODE(st.st_mode) != JOB_DIR_MODE:
            folder.chmod(JOB_DIR_MODE)
    st = log_dir.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise WorkerSpawnError(f"log folder {log_dir} is a symbolic link; refusing to use it")
    os.chown(log_dir, identity.uid, identity.gid, follow_symlinks=False)
    os.chmod(log_dir, WORKER_DIR_MODE, follow_symlinks=False)


# -- born private -------------------------------------------------------------------


def set_private_umask() -> int:
    """Set this process's umask to :data:`PRIVATE_UMASK`; returns the one it had.

    Called first thing by the programs that create the daemon's state, before
    any thread exists: the umask is the process's, not a thread's.
    """
    return os.umask(PRIVATE_UMASK)


def current_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``).

    ``os.umask`` can only be read by setting it, which a thread of the same
    process would see for a moment; the kernel's own line has no such window.
    """
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(PRIVATE_UMASK)  # pragma: no cover - a kernel older than 4.7
    os.umask(mask)  # pragma: no cover
    return mask  # pragma: no cover


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) born 0700; an existing folder is left as it is.

    ``Path.mkdir(mode=...)`` gives the mode to the last folder only; the
    parents it creates get the umask's, so each missing one is made here.
    """
    path = Path(path)
    missing = [p for p in [path, *path.parents] if not p.exists()]
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=STATE_DIR_MODE)


def create_private_file(path: Path) -> None:
    """Make sure the file ``path`` exists, created 0600 if it did not (no link followed).

    SQLite creates a missing database 0644 (less the umask), and its ``-wal``
    and ``-shm`` files with the database file's mode: creating the database
    file first, 0600, makes all three private from their first byte.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    os.close(os.open(path, flags, STATE_FILE_MODE))


# -- the unix socket -----------------------------------------------------------------


def bind_unix_socket(
    path: Path, *, group: str | None = None, everyone: bool = False
) -> socket.socket:
    """A listening unix socket at ``path``, in a folder of its own.

    Who may connect: with ``group``, that group's members (0660 in a 0750
    folder of that group); with ``everyone``, every local user (0666 in a
    0755 folder: a root daemon serves each connection as the uid the kernel
    names, :mod:`api.auth`); else this user only (0600 in 0700). The folder
    is created if missing; an existing one must belong to this user. A stale
    socket at ``path`` is replaced; any other file there is an error.
    """
    path = Path(path)
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ConfigError(f"unix socket path {path} is longer than {UNIX_PATH_MAX} bytes")
    if group is not None:
        sock_mode, dir_mode = SOCKET_MODE, SOCKET_DIR_MODE
    elif everyone:
        sock_mode, dir_mode = SOCKET_MODE_EVERYONE, SOCKET_DIR_MODE_EVERYONE
    else:
        sock_mode, dir_mode = SOCKET_MODE_PRIVATE, SOCKET_DIR_MODE_PRIVATE
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True, mode=dir_mode)
    st = folder.stat()
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"unix socket folder {folder} belongs to uid {st.st_uid}, not to this daemon; "
            "use a folder of its own (e.g. /run/elasticd)"
        )
    gid = -1
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(f"unix_socket_group: group {group!r} does not exist") from None
        os.chown(folder, -1, gid)
    folder.chmod(dir_mode)
    try:
        existing = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(existing.st_mode):
            raise ConfigError(f"unix socket path {path} exists and is not a socket")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        # bind() creates the node with the umask applied; set the mode explicitly,
        # as uvicorn would otherwise (it makes its own sockets 0666).
        os.chmod(path, sock_mode)
        if gid != -1:
            os.chown(path, -1, gid)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on unix socket {path}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock
