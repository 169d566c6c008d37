"""Daemon configuration: the only place environment variables and the config file are read.

Precedence, highest first: command-line flags, ``ELASTICD_*`` environment
variables, the TOML file named by ``--config`` / ``ELASTICD_CONFIG``,
built-in defaults. Every problem is a ``ConfigError`` naming the setting.

The store's security is checked here, before anything connects
(:func:`check_store`): a store beyond loopback that is both plaintext and
unauthenticated is refused unless ``allow_insecure_store`` is set.
"Authenticated" means that the store can tell this daemon from anyone else
who reaches it: for etcd, an etcd user (``store_username`` with
``store_password_file``) or a TLS client certificate (``etcds://`` with
``store_cert_file``/``store_key_file``, etcd started with
``--client-cert-auth``); for another daemon's store, this daemon's token.
TLS without a client certificate or a user is not authenticated (anyone may
still write), and is refused beyond loopback too. Secrets (the token, the
etcd password, the client key) come from files only this daemon's user owns
and can read, never from a URL.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import pwd
import socket
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from elasticd.errors import ConfigError
from elasticd.models import NODE_NAME_PATTERN
from elasticd.sched.plan import MAX_SELECTOR_ITEMS, MAX_SELECTOR_KEY, MAX_SELECTOR_VALUE
from elasticd.store import redact_url, store_endpoints
from elasticd.tokens import TokenFileError, read_token_file

log = logging.getLogger("elasticd.config")

ENV_PREFIX = "ELASTICD_"
#: The node's own settings for the communication libraries that an operator sets for
#: every job of a node (the network interface, the fabric): ``job_env_passthrough``.
DEFAULT_PASSTHROUGH = ("NCCL_*", "GLOO_*", "UCX_*", "FI_*")
DEFAULT_PORT = 7070


def _default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/elasticd")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "elasticd"


def parse_labels(value: str | Mapping[str, str]) -> dict[str, str]:
    """``"gpu=a100,zone=b"`` or a mapping → dict."""
    if isinstance(value, Mapping):
        return _bounded_labels({str(k): str(v) for k, v in value.items()})
    labels: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"labels: {item!r} is not key=value")
        labels[key.strip()] = val.strip()
    return _bounded_labels(labels)


def _bounded_labels(labels: dict[str, str]) -> dict[str, str]:
    """The labels, or a ConfigError naming the bound they break (the node record's bounds)."""
    if len(labels) > MAX_SELECTOR_ITEMS:
        raise ConfigError(f"labels: at most {MAX_SELECTOR_ITEMS} labels")
    for key, val in labels.items():
        if len(key) > MAX_SELECTOR_KEY or len(val) > MAX_SELECTOR_VALUE:
            raise ConfigError(
                f"labels: {key[:40]!r} is too long (keys at most {MAX_SELECTOR_KEY} characters, "
                f"values at most {MAX_SELECTOR_VALUE})"
            )
    return labels


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Config(BaseModel):
    """The settings of one daemon."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    node_name: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        max_length=253,
        pattern=NODE_NAME_PATTERN,
        description="This node's name: letters, digits, '.', '_', '-' (a host name fits).",
    )
    advertise_addr: str | None = None
    state_dir: Path = Field(default_factory=_default_state_dir)
    log_dir: Path | None = None
    slots: int | None = Field(default=None, ge=1, le=4096)
    labels: dict[str, str] = Field(default_factory=dict)
    token_file: Path | None = None
    store_url: str | None = None
    store_only: bool = False
    # The store's security (check_store; docs/store.md "Running etcd securely").
    store_username: str | None = Field(
        default=None, min_length=1, description="etcd user elasticd authenticates as."
    )
    store_password_file: Path | None = Field(
        default=None,
        description="File holding that user's password (0600, owned by the daemon's user).",
    )
    store_ca_file: Path | None = Field(
        default=None, description="CA that signed etcd's server certificate (etcds://)."
    )
    store_cert_file: Path | None = Field(
        default=None, description="Client certificate for etcd's --client-cert-auth (etcds://)."
    )
    store_key_file: Path | None = Field(
        default=None, description="Its private key (0600, owned by the daemon's user)."
    )
    store_prefix: str = Field(
        default="", description="Key prefix for everything elasticd keeps in etcd, e.g. elasticd/."
    )
    allow_insecure_store: bool = Field(
        default=False,
        description="Accept a plaintext, unauthenticated store on a non-loopback address.",
    )
    shutdown_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds a stopping daemon spends, once its workers are stopped, publishing "
        "queued events, revoking its lease and draining HTTP requests; each step gets what is "
        "left (at least 1 s).",
    )
    health_check: list[str] | None = Field(
        default=None,
        description="A node-wide health check command (argv) run before every group start.",
    )
    health_check_timeout: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="Seconds the operator's checks (health_check above, the GPU check) may take: "
        "theirs, never a job's health_check_timeout (a job that set a tiny one would fail them "
        "and have the node quarantined).",
    )
    nvidia_smi: str | None = Field(
        default=None,
        min_length=1,
        description="nvidia-smi for GPU discovery and the GPU health check: an absolute path, "
        "or unset to look it up on the daemon's own PATH (never a job's).",
    )
    kernel_log: str | None = Field(
        default="/dev/kmsg",
        min_length=1,
        description="The kernel log the GPU check reads NVIDIA Xid errors from (a critical "
        "one fails the check: the node is quarantined); unset: not read. Root only.",
    )
    auto_quarantine: bool = Field(
        default=True,
        description="Quarantine this node when the policy trips: an operator's health check "
        "(the node's, the GPU check; never a job's own) fails, or "
        "quarantine_threshold failures attributed to it within quarantine_window (any jobs; "
        "first failures of rounds count only from two jobs or more, or with a hardware-like "
        "signal among them: one job's own bug is not the node's). "
        "Off: the record still counts them; only an admin's drain takes the node out.",
    )
    quarantine_threshold: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Failures attributed to this node (first failure of a round, or a hardware-"
        "like signal such as SIGBUS) within quarantine_window that quarantine it.",
    )
    quarantine_window: float = Field(
        default=3600.0, gt=0, description="Seconds over which attributed failures are counted."
    )
    quarantine_max_fraction: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="The share of the fleet's nodes automatic quarantine may hold at once (at "
        "least one node); past it failures are counted but quarantine nothing. Bounds what one "
        "job's failures that look like its node's (a SIGBUS it raised itself) can take out; an "
        "admin's drain is not bounded.",
    )
    quarantine_ttl: float | None = Field(
        default=None,
        gt=0,
        description="Seconds an automatic quarantine lasts (unset: until an admin undrains).",
    )
    slurm_drain: bool = Field(
        default=False,
        description="Under Slurm: drain this node in Slurm too while it is quarantined (the "
        "policy's or an admin's drain), with the reason; resume it when released. Needs "
        "scontrol on the daemon's PATH and the right to update nodes (root, SlurmUser).",
    )
    metrics_open_on_loopback: bool = Field(
        default=False, description="Serve /metrics without the token to loopback clients."
    )
    lease_ttl: float = Field(
        default=3.0, gt=0, le=600, description="Seconds of silence after which a node is dead."
    )
    lighthouse_heartbeat_timeout: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="torchft's Lighthouse (jobs of replica_groups): seconds without a "
        "heartbeat after which a replica group is no longer healthy (torchft's "
        "heartbeat_timeout_ms). A killed group stalls the others about this long.",
    )
    lighthouse_join_timeout: float = Field(
        default=60.0,
        ge=0,
        le=3600,
        description="torchft's Lighthouse: seconds a quorum waits for healthy groups that have "
        "not asked yet before it forms without them (torchft's join_timeout_ms).",
    )
    job_retention: float = Field(
        default=7 * 24 * 3600.0,
        ge=0,
        description="Seconds a finished job (its document, events and rendezvous keys) is kept "
        "after it ends; then any daemon deletes it, as DELETE /jobs/{id} does. Worker log files "
        "stay on disk. 0 keeps finished jobs forever.",
    )
    node_failure_grace: float = Field(
        default=60.0,
        ge=0,
        le=86400,
        description="Seconds this node keeps retrying (with backoff, a workers.spawn_retry "
        "event each time) a start it cannot make for its own reason (EMFILE, ENOMEM, EAGAIN, a "
        "missing cgroup) before it gives the job back to the scheduler and declines it for as "
        "long again; never charged to the job. 0: give it back at the first such failure.",
    )
    max_connections: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="Connections the API serves at once (TCP and unix socket together); "
        "unset: half the daemon's descriptor limit (after raising its soft limit to the hard "
        "one), at most 1000 and at least 8, so a flood of idle connections leaves descriptors "
        "for the workers' pipes, the database and the store.",
    )
    event_retention_first: int = Field(
        default=100,
        ge=0,
        le=1_000_000,
        description="Per job and node, the first events always kept (besides every failure "
        "but a crash loop's repeats).",
    )
    event_retention_last: int = Field(
        default=400,
        ge=1,
        le=1_000_000,
        description="Per job and node, the last events always kept (besides every failure "
        "but a crash loop's repeats); routine events between the first and the last, and "
        "failures the same as the one of their kind before them, are dropped, an "
        "events.trimmed marker in their place.",
    )
    event_retention_finished_first: int = Field(
        default=20,
        ge=0,
        le=1_000_000,
        description="Per finished job and node, the first events kept once the job ended "
        "(besides every failure but a crash loop's repeats).",
    )
    event_retention_finished_last: int = Field(
        default=50,
        ge=1,
        le=1_000_000,
        description="Per finished job and node, the last events kept once the job ended "
        "(besides every failure but a crash loop's repeats).",
    )
    event_retention_finished_total: int = Field(
        default=2000,
        ge=0,
        le=10_000_000,
        description="The events of finished jobs this node keeps in all (its database and "
        "the store's copy); past it, the jobs that ended first keep only their last event "
        "and an events.trimmed marker.",
    )
    log_retention_attempts: int = Field(
        default=20,
        ge=1,
        le=1_000_000,
        description="Per job, the newest attempts whose log folders are kept on this node; "
        "older ones are removed at the job's end and every log_retention_interval (never a "
        "running attempt's).",
    )
    log_retention_bytes: int = Field(
        default=1 << 30,
        ge=0,
        description="Per job, the most bytes of log folders kept on this node: the oldest "
        "finished attempts are removed past it (the newest finished one always stays). "
        "0: no byte bound.",
    )
    log_retention_interval: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description="Seconds between two passes of log retention over every job's folder.",
    )
    containment: Literal["auto", "cgroup", "subreaper"] = Field(
        default="auto",
        description="How the processes of a job attempt are contained (elasticd.supervise.cgroup): "
        "cgroup: a cgroup v2 per attempt, killed when it stops (the daemon refuses to start "
        "without one); subreaper: the daemon becomes a child subreaper (partial: an event says "
        "so); auto: cgroup where one can be made, else subreaper.",
    )
    prewarm_move_budget: float = Field(
        default=0.1,
        ge=0,
        le=5,
        description="Seconds a prewarm hand-off may spend moving a standby's cgroup (it and what "
        "its imports started) into the attempt's, holding the daemon's event loop: past them the "
        "move is undone and the rank starts cold (a worker.cold_start event says why). 0 starts "
        "every contained rank cold. Below a third of lease_ttl (the keep-alive's interval): "
        "the loop held longer could let the node's lease lapse.",
    )
    on_corrupt_database: Literal["refuse", "set_aside"] = Field(
        default="refuse",
        description="What the daemon does when its own database (<state_dir>/elasticd.sqlite3: "
        "this node's event log and record of spawned workers) is damaged: refuse: refuse to "
        "start (exit 2) naming the file and the recovery; set_aside: rename it "
        "elasticd.sqlite3.corrupt-<UTC time> (kept, never deleted) and start with an empty one.",
    )
    # Hardening (elasticd.security, api.limits).
    run_as: str | None = Field(
        default=None,
        min_length=1,
        description='User jobs run as; "dynamic": each job a uid of its own from dynamic_uids.',
    )
    dynamic_uids: str = Field(
        default="61184-65519",
        description='The uids of run_as = "dynamic", "first-last" (systemd\'s DynamicUser range).',
    )
    allow_root: bool | None = Field(
        default=None,
        description="Allow jobs as root. Unset: `elasticd serve` refuses; an embedded daemon "
        "(`elasticd run`) runs jobs as its caller.",
    )
    allowed_users: list[str] = Field(
        default_factory=list, description="Users a job may ask to run as (`user` in the spec)."
    )
    unix_socket: Path | None = Field(
        default=None,
        description="The unix socket local callers use (the kernel names them: SO_PEERCRED). "
        "Default: <state_dir>/run/elasticd.sock. A root daemon's socket is open to every local "
        "user (each is served as itself); another daemon's to its own user only.",
    )
    unix_socket_group: str | None = Field(
        default=None, description="Only this group's members may connect to the unix socket."
    )
    job_env_passthrough: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PASSTHROUGH),
        max_length=256,
        description="Names (fnmatch patterns) of the daemon's environment that a served "
        "daemon passes on to every job, besides PATH, HOME, USER, LOGNAME, SHELL, LANG, "
        "LANGUAGE, TZ and LC_*: the node's settings for the communication libraries. Never "
        "name a secret here: every job of the node sees it.",
    )
    identities_file: Path | None = Field(
        default=None,
        description="TOML file of token identities ([[identity]]: name, token_sha256, users, "
        "max_priority, may_preempt, slot_quota, admin) and the rights of local callers "
        "([local]); see docs/hardening.md, 'Who is asking'.",
    )
    cluster_token_file: Path | None = Field(
        default=None,
        description="The credential daemons use with each other and the store (0600). "
        "Default: the token file's token, which is then both the admin's and the cluster's.",
    )
    max_request_bytes: int = Field(
        default=1 << 20, ge=1024, description="Largest request body (413 beyond); not /store."
    )

    # Bounds (api.streams, elasticd.store): what one client or job can make the daemon hold.
    max_streams: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="Live streams (logs?follow=true, SSE events) served at once; 429 beyond.",
    )
    store_max_value_bytes: int = Field(
        default=1 << 20,
        ge=64 * 1024,
        le=64 << 20,
        description="Largest value the store accepts (413 beyond), for the embedded store "
        "and for this daemon's writes to any store.",
    )
    store_history_seconds: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="The embedded store's watch history keeps the changes after any revision "
        "it handed out (a listing's, a watch's) this many seconds ago, plus 1,000 changes "
        "(at most 100,000 changes and 16 MiB); a watch from before gets StoreCompacted and "
        "re-reads.",
    )
    job_store_max_keys: int = Field(
        default=100_000,
        ge=16,
        le=100_000_000,
        description="Keys a job's token may keep under its store prefix (jobs/<id>/), "
        "counted by each daemon its workers use; 429 naming this setting beyond.",
    )
    job_store_max_bytes: int = Field(
        default=32 << 20,
        ge=64 * 1024,
        le=1 << 40,
        description="Bytes of values a job's token may keep under its store prefix; 413 "
        "beyond, so no job fills the store host's disk as root through its token.",
    )
    principal_max_connections: int = Field(
        default=128,
        ge=1,
        le=100_000,
        description="Requests one principal (a local user, an identity, a job's token; not "
        "the admin or the cluster) may have in flight at once; 429 naming this setting beyond.",
    )
    principal_max_long_polls: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Long-polls (store watches, event waits, SSE, log follows) one principal "
        "may hold at once; 429 beyond.",
    )
    admin_reserved_connections: int = Field(
        default=16,
        ge=0,
        le=100_000,
        description="Of the daemon's connections (max_connections), how many only the admin "
        "and the cluster identity may use: their /healthz, /jobs and keep-alives are served "
        "whatever the others hold.",
    )
    owner_max_jobs: int = Field(
        default=1000,
        ge=1,
        le=10_000_000,
        description="Job documents one owner (a local user or token identity; not the admin) "
        "may keep in the store, ended ones included until they are deleted or expire; 429 "
        "naming this setting beyond. An identity's max_jobs overrides it.",
    )
    owner_max_job_bytes: int = Field(
        default=16 << 20,
        ge=64 * 1024,
        le=1 << 40,
        description="Bytes of job documents one owner may keep (413 beyond): below "
        "store_max_list_bytes, so no one owner can fill a listing of job/. An identity's "
        "max_job_bytes overrides it.",
    )
    store_max_list_bytes: int = Field(
        default=64 << 20,
        ge=1 << 20,
        le=4 << 30,
        description="Largest list answer (keys and values) the store gives; a larger one is "
        "an error naming the prefix.",
    )

    @field_validator("nvidia_smi")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isabs(value):
            raise ValueError("must be an absolute path (unset: looked up on the daemon's PATH)")
        return value

    @field_validator("prewarm_move_budget")
    @classmethod
    def _within_the_lease(cls, value: float, info: ValidationInfo) -> float:
        # Checked only where it is set: the default was a constant, whatever the TTL.
        ttl = info.data.get("lease_ttl")
        if ttl is not None and value > 0 and value >= ttl / 3:
            raise ValueError(
                f"{value:g} s holds the event loop, the lease's keep-alive with it, for a "
                f"third of lease_ttl ({ttl:g} s) or more: the node's lease could lapse on "
                f"one hand-off; set it below {ttl / 3:g} s (or lease_ttl above {value * 3:g} s)"
            )
        return value

    @field_validator("dynamic_uids")
    @classmethod
    def _uid_range(cls, value: str) -> str:
        from elasticd.supervise.uids import parse_uid_range

        return str(parse_uid_range(value))

    @field_validator("job_env_passthrough", mode="before")
    @classmethod
    def _patterns(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [u.strip() for u in value.split(",") if u.strip()]
        return value

    @field_validator("allowed_users", mode="before")
    @classmethod
    def _users(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [u.strip() for u in value.split(",") if u.strip()]
        return value

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, value: Any) -> Any:
        return parse_labels(value) if isinstance(value, str | Mapping) else value

    @property
    def socket_path(self) -> Path:
        """Where the unix socket is: ``unix_socket``, else in the state folder."""
        return self.unix_socket or self.state_dir / "run" / "elasticd.sock"

    @property
    def logs(self) -> Path:
        return self.log_dir or self.state_dir / "logs"

    @property
    def advertise(self) -> str:
        """The address peers and workers use to reach this node."""
        if self.advertise_addr:
            return self.advertise_addr
        if self.host in ("0.0.0.0", "::", ""):
            return socket.getfqdn()
        return self.host

    @property
    def url(self) -> str:
        host = self.advertise
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


_ENV_FIELDS = {
    "HOST": "host",
    "PORT": "port",
    "NODE_NAME": "node_name",
    "ADVERTISE_ADDR": "advertise_addr",
    "STATE_DIR": "state_dir",
    "LOG_DIR": "log_dir",
    "SLOTS": "slots",
    "LABELS": "labels",
    "TOKEN_FILE": "token_file",
    "STORE_URL": "store_url",
    "STORE_USERNAME": "store_username",
    "STORE_PASSWORD_FILE": "store_password_file",
    "STORE_CA_FILE": "store_ca_file",
    "STORE_CERT_FILE": "store_cert_file",
    "STORE_KEY_FILE": "store_key_file",
    "STORE_PREFIX": "store_prefix",
    "ALLOW_INSECURE_STORE": "allow_insecure_store",
    "LEASE_TTL": "lease_ttl",
    "AUTO_QUARANTINE": "auto_quarantine",
    "KERNEL_LOG": "kernel_log",
    "HEALTH_CHECK_TIMEOUT": "health_check_timeout",
    "QUARANTINE_THRESHOLD": "quarantine_threshold",
    "QUARANTINE_WINDOW": "quarantine_window",
    "QUARANTINE_TTL": "quarantine_ttl",
    "SLURM_DRAIN": "slurm_drain",
    "QUARANTINE_MAX_FRACTION": "quarantine_max_fraction",
    "SHUTDOWN_TIMEOUT": "shutdown_timeout",
    "JOB_RETENTION": "job_retention",
    "LIGHTHOUSE_HEARTBEAT_TIMEOUT": "lighthouse_heartbeat_timeout",
    "LIGHTHOUSE_JOIN_TIMEOUT": "lighthouse_join_timeout",
    "NODE_FAILURE_GRACE": "node_failure_grace",
    "MAX_CONNECTIONS": "max_connections",
    "CONTAINMENT": "containment",
    "PREWARM_MOVE_BUDGET": "prewarm_move_budget",
    "ON_CORRUPT_DATABASE": "on_corrupt_database",
    "EVENT_RETENTION_FIRST": "event_retention_first",
    "EVENT_RETENTION_LAST": "event_retention_last",
    "EVENT_RETENTION_FINISHED_FIRST": "event_retention_finished_first",
    "EVENT_RETENTION_FINISHED_LAST": "event_retention_finished_last",
    "EVENT_RETENTION_FINISHED_TOTAL": "event_retention_finished_total",
    "LOG_RETENTION_ATTEMPTS": "log_retention_attempts",
    "LOG_RETENTION_BYTES": "log_retention_bytes",
    "LOG_RETENTION_INTERVAL": "log_retention_interval",
    "METRICS_OPEN_ON_LOOPBACK": "metrics_open_on_loopback",
    "NVIDIA_SMI": "nvidia_smi",
    "RUN_AS": "run_as",
    "ALLOW_ROOT": "allow_root",
    "ALLOWED_USERS": "allowed_users",
    "DYNAMIC_UIDS": "dynamic_uids",
    "UNIX_SOCKET": "unix_socket",
    "UNIX_SOCKET_GROUP": "unix_socket_group",
    "IDENTITIES_FILE": "identities_file",
    "JOB_ENV_PASSTHROUGH": "job_env_passthrough",
    "CLUSTER_TOKEN_FILE": "cluster_token_file",
    "MAX_REQUEST_BYTES": "max_request_bytes",
    "MAX_STREAMS": "max_streams",
    "STORE_MAX_VALUE_BYTES": "store_max_value_bytes",
    "STORE_MAX_LIST_BYTES": "store_max_list_bytes",
    "OWNER_MAX_JOBS": "owner_max_jobs",
    "PRINCIPAL_MAX_CONNECTIONS": "principal_max_connections",
    "PRINCIPAL_MAX_LONG_POLLS": "principal_max_long_polls",
    "ADMIN_RESERVED_CONNECTIONS": "admin_reserved_connections",
    "JOB_STORE_MAX_KEYS": "job_store_max_keys",
    "JOB_STORE_MAX_BYTES": "job_store_max_bytes",
    "OWNER_MAX_JOB_BYTES": "owner_max_job_bytes",
    "STORE_HISTORY_SECONDS": "store_history_seconds",
}


def load_config(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Merge flags, environment and the config file into a validated ``Config``."""
    environ = os.environ if environ is None else environ
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    config_file = flags.pop("config", None) or environ.get(ENV_PREFIX + "CONFIG")
    merged: dict[str, Any] = {}
    if config_file:
        merged.update(_read_toml(Path(config_file)))
    for suffix, field in _ENV_FIELDS.items():
        if ENV_PREFIX + suffix in environ:
            merged[field] = environ[ENV_PREFIX + suffix]
    merged.update(flags)
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    section = data.get("elasticd", data)
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [elasticd] must be a table")
    return {k.replace("-", "_"): v for k, v in section.items()}


def read_token(config: Config, environ: Mapping[str, str] | None = None) -> str | None:
    """The bearer token, from ``token_file`` or env.

    The file must belong to the daemon's own user and be readable by nobody
    else: a file owned by another user (a job's user, say) is that user's to
    read or replace, whatever its mode. Checked on the open file, so what is
    read is what was checked.
    """
    environ = os.environ if environ is None else environ
    if config.token_file is None:
        token = environ.get(ENV_PREFIX + "TOKEN")
        return token.strip() or None if token else None
    return read_secret(config.token_file, "token file")


def read_secret(path: Path, setting: str) -> str:
    """A secret file private to this daemon's user (see :mod:`elasticd.tokens`)."""
    try:
        return read_token_file(
            path, what=setting, check=lambda st: _check_private(st, path, setting)
        )
    except TokenFileError as exc:
        raise ConfigError(str(exc)) from None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def own_token(state_dir: Path) -> tuple[str, Path]:
    """The daemon's own token when it was given none: ``<state_dir>/token``, made at first start.

    0600 and this user's (like any token file); the CLI finds it there, as
    Jupyter's clients find its server's token. Made with ``O_EXCL`` in the
    daemon's private state folder, so two daemons starting at once agree on one.
    """
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / "token"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return read_secret(path, "token file"), path
    except OSError as exc:
        raise ConfigError(f"cannot make the daemon's token {path}: {exc.strerror}") from None
    from elasticd.identity import new_token

    token = new_token()
    try:
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    return token, path


def read_cluster_token(config: Config) -> str | None:
    """The cluster credential of ``cluster_token_file``; None: the admin token is it too."""
    if config.cluster_token_file is None:
        return None
    return read_secret(config.cluster_token_file, "cluster_token_file")


def _check_private(st: os.stat_result, path: Path, setting: str) -> None:
    """Refuse a secret file that is not a regular file owned by, and private to, this user."""
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{setting} {path} is not a regular file")
    me = os.geteuid()
    if st.st_uid != me:  # another user may read or replace it
        raise ConfigError(
            f"{setting} {path} belongs to {_user_name(st.st_uid)}, not to the user this "
            f"daemon runs as ({_user_name(me)}), who must own it alone; run: "
            f"chown {_user_name(me)} {path}"
        )
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{setting} {path} is readable by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}"
        )


def _private_file(path: Path, setting: str) -> None:
    """Check a secret file that is read by path later (the TLS key: ``ssl`` opens it)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"{setting} {path} cannot be read: {exc.strerror}") from None
    _check_private(st, path, setting)


def read_store_password(config: Config) -> str | None:
    """etcd's password, from ``store_password_file`` (0600, owned by this daemon's user).

    Checked on the open descriptor, so what is read is what was checked; opened
    non-blocking, so a FIFO put there cannot hang the start-up.
    """
    path = config.store_password_file
    if path is None:
        return None
    return read_secret(path, "store_password_file")


def check_store(config: Config, token: str | None, *, serves_others: bool = False) -> None:
    """Check the ``store_*`` settings, and refuse an insecure store beyond loopback.

    Nothing connects: this runs before the store is opened. See the module's
    docstring for what counts as authenticated. A daemon that runs jobs as
    other users (``serves_others``) refuses an etcd without credentials on
    loopback too: any local user can write to it, and a job document names
    the user its workers run as. (A daemon's HTTP store is probed once it
    answers: :meth:`elasticd.node.daemon.Daemon.refuse_open_store`.)
    """
    target = store_endpoints(config.store_url)
    shown = redact_url(config.store_url or "")
    etcd_settings = {
        "store_username": config.store_username,
        "store_password_file": config.store_password_file,
        "store_ca_file": config.store_ca_file,
        "store_cert_file": config.store_cert_file,
        "store_key_file": config.store_key_file,
        "store_prefix": config.store_prefix or None,
    }
    if target.kind != "etcd":
        stray = [name for name, value in etcd_settings.items() if value is not None]
        if stray:
            raise ConfigError(
                f"{', '.join(stray)} only apply to an etcd store_url (etcd:// or etcds://)"
            )
    if (config.store_username is None) != (config.store_password_file is None):
        raise ConfigError(
            "store_username and store_password_file go together: set both to authenticate "
            "to etcd as that user, or neither"
        )
    if (config.store_cert_file is None) != (config.store_key_file is None):
        raise ConfigError("store_cert_file and store_key_file go together: set both or neither")
    tls_files = [
        name
        for name in ("store_ca_file", "store_cert_file", "store_key_file")
        if etcd_settings[name] is not None
    ]
    if tls_files and not target.tls:
        raise ConfigError(
            f"{', '.join(tls_files)} need TLS, but store_url {shown!r} is plaintext; "
            "use etcds://host:port"
        )
    if config.store_key_file is not None:
        _private_file(config.store_key_file, "store_key_file")
    if config.store_prefix and not config.store_prefix.endswith("/"):
        raise ConfigError(
            f"store_prefix {config.store_prefix!r} must end with '/' (e.g. 'elasticd/'), so "
            "that it is a folder of its own and not also the start of other keys"
        )
    if target.kind == "etcd":
        authenticated = config.store_username is not None or config.store_cert_file is not None
    else:
        authenticated = token is not None
    remote = [h for h in target.hosts if not is_loopback(h)]
    if not remote:
        open_etcd = target.kind == "etcd" and not authenticated
        if open_etcd and serves_others and not config.allow_insecure_store:
            raise ConfigError(
                f"refusing store_url {shown!r}: this daemon runs jobs as other users and the "
                "store is not authenticated, so any local user could write a job into it that "
                "runs as another user (loopback is no boundary). Set an etcd user "
                "(store_username and store_password_file) or a TLS client certificate, and "
                "turn etcd's auth on; allow_insecure_store = true only where every local user "
                'is trusted (see docs/store.md, "Running etcd securely")'
            )
        return
    if authenticated and not target.tls:
        log.warning(
            "store_url %s is plaintext: credentials and data cross the network unencrypted; "
            "use TLS (etcds://, https://)",
            shown,
        )
    if authenticated or config.allow_insecure_store:
        return
    how = (
        "an etcd user (store_username and store_password_file) or a TLS client certificate "
        "(etcds:// with store_cert_file and store_key_file)"
        if target.kind == "etcd"
        else "a token (token_file, the same on every daemon)"
    )
    raise ConfigError(
        f"refusing store_url {shown!r}: {remote[0]} is not a loopback address and the store "
        "is not authenticated, so anyone who can reach it could run programs on every node. "
        f"Set {how}, or set allow_insecure_store = true if the network is trusted "
        '(see docs/store.md, "Running etcd securely").'
    )
