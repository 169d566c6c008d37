"""A lock handed over in a hand-over the new image cannot read (issue 34)."""

from __future__ import annotations

import os
from pathlib import Path

from elasticd.node.statelock import StateLock


def test_an_image_that_cannot_read_the_hand_over_still_locks_its_folder(tmp_path: Path) -> None:
    """take_manifest() gives None for an unreadable hand-over; the lock descriptor the old
    image made inheritable is still open here. Before the fix the new image refused itself
    ("in use by another elasticd (pid <its own>)", exit 2: systemd does not restart it)."""
    old = StateLock(tmp_path).acquire()
    handed = os.dup(old.fileno())
    os.set_inheritable(handed, True)
    os.close(old.fileno())  # close-on-exec: gone at the exec
    lock = StateLock(tmp_path).acquire()
    try:
        assert lock.fileno() == handed
        assert not os.get_inheritable(handed)  # no worker inherits it
        assert (tmp_path / lock.path.name).read_text().strip() == str(os.getpid())
    finally:
        lock.release()
