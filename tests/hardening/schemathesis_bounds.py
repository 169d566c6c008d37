"""Bounds on what schemathesis generates for long-polls and streams (shared by the fuzz tests).

Loaded two ways: :func:`bound_query` directly by the in-process fuzz test, and
as a hooks module (``SCHEMATHESIS_HOOKS=tests.hardening.schemathesis_bounds``)
by the test that runs schemathesis' own command, whose stateful phase would
otherwise ask for a long-poll of up to 60 s and read-time out after 10.
"""

from __future__ import annotations

from typing import Any

import schemathesis

#: The longest ``wait``/``timeout`` a generated call asks for, in seconds.
MAX_WAIT_S = 0.2


def bound_query(path: str, query: dict[str, Any] | None) -> dict[str, Any] | None:
    """``query`` with its long-poll bounded and no log follow (in place; also returned)."""
    if query is None:
        return None
    for name in ("wait", "timeout"):
        value = query.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            query[name] = min(value, MAX_WAIT_S)
    if path == "/store/watch" and "timeout" not in query:
        query["timeout"] = MAX_WAIT_S
    query.pop("follow", None)
    return query


@schemathesis.hook
def map_query(context: Any, query: dict[str, Any]) -> dict[str, Any]:
    operation = getattr(context, "operation", None)
    path = getattr(operation, "path", "") if operation is not None else ""
    return bound_query(path, query) or query
