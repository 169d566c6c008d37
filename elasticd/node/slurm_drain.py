"""A quarantined node drained in Slurm too, where ``slurm_drain = true`` (issue 38, form 2).

Each daemon follows its own node's health record (``health/<node>``,
:mod:`elasticd.node.quarantine`): a quarantine in force, the policy's or an
admin's drain through the API, drains the node in Slurm with its reason
(``scontrol update nodename=N state=drain reason="elasticd: ..."``); its end
(an undrain, a TTL run out) resumes it, only if elasticd drained it: a drain
of Slurm's own or an admin's in Slurm is left alone. :func:`decide` is pure;
:class:`SlurmDrain` watches the record and runs ``scontrol`` as an asyncio
subprocess bounded by :data:`SCONTROL_TIMEOUT`, never blocking the loop; a
failed ``scontrol`` is tried again after :data:`RETRY`.

The node's name in Slurm is its elasticd name (``node_name``, the hostname by
default, as slurmd's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from dataclasses import dataclass
from typing import Literal

from elasticd import keys
from elasticd.clock import Clock
from elasticd.errors import StoreError
from elasticd.node.quarantine import NodeHealth, decode_health, in_force
from elasticd.store import Store

log = logging.getLogger(__name__)

#: Slurm shows a short reason; the whole one is in the node's record (``elasticd node``).
MAX_REASON = 200
#: The bound on one ``scontrol``, and the pause before trying a failed one again.
SCONTROL_TIMEOUT = 20.0
RETRY = 5.0
#: How long one watch of the record waits before looking again (a TTL's end, say).
WATCH = 30.0


@dataclass(frozen=True)
class SlurmAction:
    """One ``scontrol update`` of the node: drain it with ``reason``, or resume it."""

    state: Literal["drain", "resume"]
    reason: str | None = None

    def args(self, node: str) -> list[str]:
        words = ["update", f"nodename={node}", f"state={self.state}"]
        return words + ([f"reason={self.reason}"] if self.reason is not None else [])


def slurm_reason(health: NodeHealth) -> str:
    """The node's drain reason in Slurm for its quarantine (pure)."""
    assert health.quarantine is not None
    text = " ".join(health.quarantine.reason.split()) or "quarantined"
    reason = f"elasticd: {text} (by {health.quarantine.by})"
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."


def decide(health: NodeHealth, applied: str | None, now: float) -> SlurmAction | None:
    """What to tell Slurm (pure): ``applied`` is the reason elasticd drained the node with
    (None: it did not); None when Slurm already shows what the record says."""
    if in_force(health.quarantine, now):
        reason = slurm_reason(health)
        return None if reason == applied else SlurmAction("drain", reason)
    return SlurmAction("resume") if applied is not None else None


class SlurmDrain:
    """Runs for the daemon's life: keeps Slurm's state of this node as its record says."""

    def __init__(self, store: Store, node: str, clock: Clock, scontrol: str | None = None) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self.scontrol = scontrol or shutil.which("scontrol") or "scontrol"
        #: The reason this daemon drained the node with in Slurm (None: not drained by it).
        self.applied: str | None = None

    async def run(self) -> None:
        key = keys.health_key(self.node)
        while True:
            try:
                listing = await self.store.list(key)
                entry = next((e for e in listing.entries if e.key == key), None)
                health = decode_health(self.node, entry.value if entry is not None else None)
                action = decide(health, self.applied, self.clock.time())
                if action is not None and not await self.apply(action):
                    await asyncio.sleep(RETRY)
                    continue
                await self.store.watch(key, listing.revision, WATCH)
            except StoreError as exc:  # StoreCompacted too: read again
                log.debug("slurm drain: %s", exc)
                await asyncio.sleep(RETRY)

    async def apply(self, action: SlurmAction) -> bool:
        """Run the ``scontrol`` of ``action`` (bounded); True when it succeeded."""
        try:
            process = await asyncio.create_subprocess_exec(
                self.scontrol,
                *action.args(self.node),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            log.warning("slurm_drain: cannot run %s: %s", self.scontrol, exc)
            return False
        try:
            async with asyncio.timeout(SCONTROL_TIMEOUT):
                _, err = await process.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            log.warning("slurm_drain: scontrol took over %s s", SCONTROL_TIMEOUT)
            return False
        if process.returncode != 0:
            log.warning("slurm_drain: scontrol %s failed: %s", action.state, err.decode()[-500:])
            return False
        log.info("slurm_drain: node %s %s in Slurm", self.node, action.state)
        self.applied = action.reason if action.state == "drain" else None
        return True
