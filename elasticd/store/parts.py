"""A listing that no one owner's data can make too large: read a prefix in parts.

A listing over ``store_max_list_bytes`` is refused whole
(:class:`~elasticd.errors.ListingTooLarge`), so before issue 35 a local user
who filled ``job/`` past it failed every scheduler pass, and ``GET /jobs``,
for everyone. :func:`list_in_parts` lists the prefix as before and, only
when that is refused, lists it again split by the next character of the key
(recursively, for a part still too large), so each answer stays under the
bound and the caller gets every entry. It works on every backend through
``Store.list`` and ``Store.get`` alone.

A key whose next character is not in ``alphabet`` is not read in parts: for
``job/`` that is a document no job id could name, which is refused anyway.
The revision is the oldest of the parts: a watch from it sees every change
after the earliest read, and replays in order what the later reads saw.
"""

from __future__ import annotations

import string

from elasticd.errors import ListingTooLarge
from elasticd.store.base import Entry, Listing, Store

#: The characters of a job id (``models.JOB_ID_PATTERN``): what ``job/`` is split by.
JOB_ID_CHARS = string.ascii_letters + string.digits + "._-"


async def list_in_parts(store: Store, prefix: str, alphabet: str = JOB_ID_CHARS) -> Listing:
    """Every entry under ``prefix`` (sorted by key), read in parts where one answer would be
    over the store's list bound."""
    try:
        return await store.list(prefix)
    except ListingTooLarge:
        pass
    entries: list[Entry] = []
    revisions: list[int] = []
    exact = await store.get(prefix)
    if exact is not None:
        entries.append(exact)
    for char in sorted(alphabet):
        part = await list_in_parts(store, prefix + char, alphabet)
        entries.extend(part.entries)
        revisions.append(part.revision)
    entries.sort(key=lambda e: e.key)
    return Listing(entries, min(revisions))
