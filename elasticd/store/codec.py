"""The ``/store`` wire format, one codec for every side of it.

The store's HTTP API (``api/routes/store.py``, served by every daemon and by
``elasticd store-server``), the daemon's store client
(:mod:`elasticd.store.http`) and the workers' client
(:mod:`elasticd.worker.store`) all encode and decode through these functions,
so the three can never drift apart. Values travel as standard base64 (with
padding); entries and watch events as JSON objects::

    entry:  {"key": str, "value": b64, "version": int, "created": int, "lease": int | null}
    event:  {"kind": "put" | "delete", "key": str, "value": b64 | null, "revision": int}

Which side of the boundary: both. Decoding is strict: what a server (or a
job with store access) sends is parsed field by field into plain data
classes, never unpickled; anything malformed raises :class:`WireFormatError`.
Standard library only (workers import it).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from elasticd.store.base import Entry, WatchEvent

__all__ = [
    "WireFormatError",
    "decode_entry",
    "decode_entry_or_none",
    "decode_event",
    "decode_events",
    "decode_value",
    "encode_entry",
    "encode_event",
    "encode_value",
]


class WireFormatError(ValueError):
    """A ``/store`` message that does not follow the wire format."""


def encode_value(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def decode_value(text: Any) -> bytes:
    """A value off the wire; only standard, padded base64 is accepted."""
    if not isinstance(text, str):
        raise WireFormatError("value must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise WireFormatError(
            "value must be standard base64 (A-Z a-z 0-9 + /, with = padding)"
        ) from None


def encode_entry(entry: Entry) -> dict[str, Any]:
    return {
        "key": entry.key,
        "value": encode_value(entry.value),
        "version": entry.version,
        "created": entry.created,
        "lease": entry.lease,
    }


def _int(data: dict[str, Any], name: str) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireFormatError(f"{name} must be an integer")
    return value


def _str(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise WireFormatError(f"{name} must be a string")
    return value


def _object(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise WireFormatError(f"{what} must be a JSON object")
    return data


def decode_entry(data: Any) -> Entry:
    item = _object(data, "an entry")
    lease = item.get("lease")
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, int)):
        raise WireFormatError("lease must be an integer or null")
    return Entry(
        key=_str(item, "key"),
        value=decode_value(item.get("value")),
        version=_int(item, "version"),
        # Older servers sent no "created": the key's version is the best floor.
        created=_int(item, "created") if "created" in item else _int(item, "version"),
        lease=lease,
    )


def decode_entry_or_none(data: Any) -> Entry | None:
    return None if data is None else decode_entry(data)


def encode_event(event: WatchEvent) -> dict[str, Any]:
    return {
        "kind": event.kind,
        "key": event.key,
        "value": encode_value(event.value) if event.value is not None else None,
        "revision": event.revision,
    }


def decode_event(data: Any) -> WatchEvent:
    item = _object(data, "a watch event")
    kind = item.get("kind")
    if kind not in ("put", "delete"):
        raise WireFormatError(f"unknown event kind {kind!r}")
    raw = item.get("value")
    return WatchEvent(
        kind="put" if kind == "put" else "delete",
        key=_str(item, "key"),
        value=decode_value(raw) if raw is not None else None,
        revision=_int(item, "revision"),
    )


def decode_events(data: Any) -> list[WatchEvent]:
    """The ``events`` of a watch answer, oldest first."""
    events = _object(data, "a watch answer").get("events")
    if not isinstance(events, list):
        raise WireFormatError("events must be a list")
    return [decode_event(item) for item in events]
