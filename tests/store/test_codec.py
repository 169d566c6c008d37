"""The one /store wire codec (issue 13 point 6): the server routes, the daemon's client and the
workers' client all go through elasticd.store.codec."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.store.base import Entry, WatchEvent
from elasticd.store.codec import (
    WireFormatError,
    decode_entry,
    decode_events,
    decode_value,
    encode_entry,
    encode_event,
    encode_value,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", [b"", b"\x00\xff binary", "ünïcode".encode(), b"x" * 1000])
def test_values_entries_and_events_round_trip(value: bytes) -> None:
    assert decode_value(encode_value(value)) == value
    entry = Entry("k/1", value, version=7, created=3, lease=2**52 - 1)
    assert decode_entry(encode_entry(entry)) == entry
    events = [WatchEvent("put", "k/1", value, 8), WatchEvent("delete", "k/1", None, 9)]
    assert decode_events({"events": [encode_event(e) for e in events]}) == events


@pytest.mark.parametrize(
    "bad",
    [
        {"key": "k", "value": "not base64!", "version": 1, "created": 1},
        {"key": "k", "value": "YQ", "version": 1, "created": 1},  # no padding
        {"key": "k", "value": "YQ==", "version": "1", "created": 1},
        {"key": "k", "value": "YQ==", "version": True, "created": 1},
        {"key": 5, "value": "YQ==", "version": 1, "created": 1},
        {"key": "k", "value": "YQ==", "version": 1, "created": 1, "lease": "x"},
        ["not", "an", "object"],
    ],
)
def test_a_malformed_entry_is_refused(bad: object) -> None:
    with pytest.raises(WireFormatError):
        decode_entry(bad)


@pytest.mark.parametrize(
    "bad",
    [
        {"events": [{"kind": "boom", "key": "k", "value": None, "revision": 1}]},
        {"events": "nope"},
        {"events": [{"kind": "put", "key": "k", "value": "@@", "revision": 1}]},
    ],
)
def test_a_malformed_watch_answer_is_refused(bad: object) -> None:
    with pytest.raises(WireFormatError):
        decode_events(bad)


def test_no_other_module_encodes_store_values() -> None:
    """base64 for /store values appears in the codec only (etcd.py speaks etcd's own gateway
    format, a different wire)."""
    users = [
        str(p.relative_to(ROOT))
        for package in ("elasticd", "api")
        for p in (ROOT / package).rglob("*.py")
        if p.name not in ("codec.py", "etcd.py") and "b64decode(" in p.read_text()
    ]
    assert users == []
