"""The ``/store`` wire format, one codec for every side of it.

The store's HTTP API (``api/routes/store.py``, answered by
``api/store_http.py`` in every daemon and in ``elasticd store-server``) and
the one client of it (:mod:`elasticd.store.http`, which the workers reach
through :mod:`elasticd.store.blocking`) encode and decode through these
functions, so the two sides can never drift apart. Values travel as standard base64 (with
padding); entries and watch events as JSON objects::

    entry:  {"key": str, "value": b64, "version": int, "created": int, "lease": int | null}
    event:  {"kind": "put" | "delete", "key": str, "value": b64 | null, "revision": int}

Which side of the boundary: both. Decoding is strict: what a server (or a
job with store access) sends is parsed field by field into plain data
classes, never unpickled; anything malformed raises :class:`WireFormatError`.
Requests are built here too (:class:`StoreCall`: method, path, parameters,
body, and the reader of the answer), so that the client only sends them.
Standard library only (workers import it).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from elasticd.store.base import CasResult, Entry, Listing, WatchEvent

T = TypeVar("T")

__all__ = [
    "StoreCall",
    "WireFormatError",
    "add_call",
    "batch_call",
    "cas_call",
    "decode_entry",
    "decode_entry_or_none",
    "decode_event",
    "decode_events",
    "decode_value",
    "encode_entry",
    "encode_event",
    "encode_value",
    "delete_call",
    "get_call",
    "grant_call",
    "keep_alive_call",
    "list_call",
    "put_call",
    "revoke_call",
    "watch_call",
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


# -- the requests a client sends, and how it reads their answers ----------------------


@dataclass(slots=True)
class StoreCall(Generic[T]):
    """One ``/store`` request (the declaration is ``api/routes/store.py``) and its answer's reader.

    The one client (:mod:`elasticd.store.http`, also under its blocking
    facade) builds its requests here, sends them and reads the answers with
    :meth:`answer`. Not changed once built; not ``frozen`` because a frozen
    dataclass's ``__init__`` costs 2 µs more, once per request, on the
    rendezvous' hot path (issue 24's scale figure).
    """

    what: str  # for messages: "GET", "CAS", "list", ...
    method: str
    path: str
    parse: Callable[[Any], T]
    params: dict[str, Any] | None = None
    body: dict[str, Any] | None = None

    def answer(self, data: Any) -> T:
        """The answer's value; WireFormatError when its shape is not the store's."""
        try:
            return self.parse(data)
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise WireFormatError(
                f"answered {self.what} with an unexpected body ({exc!r})"
            ) from exc


def get_call(key: str) -> StoreCall[Entry | None]:
    return StoreCall("GET", "GET", "/store/kv", _entry_or_none, {"key": key})


def _entry_or_none(data: Any) -> Entry | None:
    return decode_entry_or_none(data["entry"])


def _entry(data: Any) -> Entry:
    return decode_entry(data["entry"])


def put_call(key: str, value: bytes, lease: int | None = None) -> StoreCall[Entry]:
    body = {"key": key, "value": encode_value(value), "lease": lease}
    return StoreCall("PUT", "PUT", "/store/kv", _entry, body=body)


def cas_call(
    key: str, value: bytes, expected_version: int | None, lease: int | None = None
) -> StoreCall[CasResult]:
    body = {
        "key": key,
        "value": encode_value(value),
        "expected_version": expected_version,
        "lease": lease,
    }
    return StoreCall("CAS", "POST", "/store/cas", _cas_result, body=body)


def _cas_result(data: Any) -> CasResult:
    return CasResult(ok=bool(data["ok"]), entry=decode_entry_or_none(data["entry"]))


def batch_call(items: Sequence[tuple[str, bytes]]) -> StoreCall[list[Entry]]:
    body = {"items": [{"key": key, "value": encode_value(value)} for key, value in items]}
    return StoreCall(
        "batch put",
        "POST",
        "/store/batch",
        lambda d: [decode_entry(e) for e in d["entries"]],
        body=body,
    )


def add_call(key: str, delta: int) -> StoreCall[int]:
    body = {"key": key, "delta": delta}
    return StoreCall("add", "POST", "/store/add", _value, body=body)


def _value(data: Any) -> int:
    return int(data["value"])


def delete_call(key: str, expected_version: int | None = None) -> StoreCall[bool]:
    params: dict[str, Any] = {"key": key}
    if expected_version is not None:
        params["expected_version"] = expected_version
    return StoreCall("DELETE", "DELETE", "/store/kv", _deleted, params)


def _deleted(data: Any) -> bool:
    return bool(data["deleted"])


def list_call(prefix: str) -> StoreCall[Listing]:
    return StoreCall("list", "GET", "/store/list", _listing, {"prefix": prefix})


def _listing(data: Any) -> Listing:
    return Listing(
        entries=[decode_entry(e) for e in data["entries"]], revision=int(data["revision"])
    )


def grant_call(ttl: float) -> StoreCall[int]:
    return StoreCall("grant", "POST", "/store/leases", _lease, body={"ttl": ttl})


def _lease(data: Any) -> int:
    return int(data["lease"])


def keep_alive_call(lease: int) -> StoreCall[None]:
    return StoreCall(
        "keepalive", "POST", f"/store/leases/{int(lease)}/keepalive", _nothing, body={}
    )


def revoke_call(lease: int) -> StoreCall[None]:
    return StoreCall("revoke", "DELETE", f"/store/leases/{int(lease)}", _nothing)


def _nothing(_: Any) -> None:
    return None


def watch_call(key: str, after: int, timeout: float, prefix: bool) -> StoreCall[list[WatchEvent]]:
    """One long-poll of at most ``timeout`` seconds."""
    params = {
        "key": key,
        "after": after,
        "timeout": timeout,
        "prefix": "true" if prefix else "false",
    }
    return StoreCall("watch", "GET", "/store/watch", decode_events, params)
