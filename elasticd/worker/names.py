"""Store key names shared by workers and the daemon (standard library only).

The daemon imports this to write the keys workers watch (e.g. in-process
"rank terminated" notices), so it must agree with the workers on two
things: how an arbitrary string becomes a valid store key
(:func:`escape_key`), and how a start of the worker group is named
(:func:`attempt_tag`), so that a restarted group never reads the keys of the
previous one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import quote

from elasticd.keys import worker_prefix

__all__ = ["attempt_tag", "default_namespace", "escape_key", "job_id"]


def escape_key(key: str) -> str:
    """Any string as a valid store key: %-quoted, ``/`` kept, ``.``/``..`` segments quoted."""
    quoted = quote(key, safe="/")
    if "." in quoted:
        quoted = "/".join(
            seg.replace(".", "%2E") if seg in (".", "..") else seg for seg in quoted.split("/")
        )
    return quoted


def attempt_tag(environ: Mapping[str, str] | None = None) -> str:
    """A name for the current start of the worker group, the same on every rank.

    ``ELASTICD_ATTEMPT`` when the daemon sets it (it must then be unique per
    group start across the cluster, e.g. ``<round>.<restart count>``), else
    ``restart<TORCHELASTIC_RESTART_COUNT>``, which is unique per start on a
    single node and whenever every start spends one restart.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("ELASTICD_ATTEMPT")
    if explicit:
        return escape_key(explicit)
    return f"restart{escape_key(env.get('TORCHELASTIC_RESTART_COUNT', '0'))}"


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """The job this worker belongs to, escaped for use in a key."""
    env = os.environ if environ is None else environ
    return escape_key(env.get("ELASTICD_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "local")


def default_namespace(environ: Mapping[str, str] | None = None) -> str:
    """``jobs/<job>/torch/<attempt>/``: where ``elasticd.worker.store()`` keeps its keys."""
    return f"{worker_prefix(job_id(environ))}torch/{attempt_tag(environ)}/"
