"""The cluster store: the only state daemons share.

See :mod:`elasticd.store.base` for the interface and its semantics.
"""

from elasticd.store.base import (
    DEFAULT_MAX_VALUE_BYTES,
    CasResult,
    Entry,
    Listing,
    Store,
    WatchEvent,
)

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "CasResult",
    "Entry",
    "Listing",
    "Store",
    "WatchEvent",
]
