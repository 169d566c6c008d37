"""A quarantined node drained in Slurm too, where ``slurm_drain = true`` (issue 38, form 2).

Each daemon follows its own node's health record (``health/<node>``,
:mod:`elasticd.node.quarantine`): a quarantine in force, the policy's or an
admin's drain through the API, drains the node in Slurm with its reason
(``scontrol update nodename=N state=drain reason="elasticd: ..."``); its end
(an undrain, a TTL run out) resumes it, only if elasticd drained it: a drain
of Slurm's own or an admin's in Slurm is left alone, never overwritten.

Whose drain it is, Slurm says, not this process's memory: ``scontrol -o show
node N`` gives the node's State and Reason, and a drain whose Reason starts
with :data:`OURS` (``elasticd:``) is elasticd's, so a daemon restarted (or
re-executed) while its node is drained still resumes it when the quarantine
ends. (The prolog's own drain reads ``elasticd prolog: ...``: not this
one's to resume.) :func:`decide` is pure over the record and Slurm's state and
reason; :class:`SlurmDrain` watches the record and runs ``scontrol`` (show,
then update when needed) as asyncio subprocesses each bounded by
:data:`SCONTROL_TIMEOUT`, never blocking the loop; a failed ``scontrol`` is
tried again after :data:`RETRY`.

The node's name in Slurm is its elasticd name (``node_name``, the hostname by
default, as slurmd's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
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
#: How a drain reason elasticd wrote begins (:func:`slurm_reason`).
OURS = "elasticd:"


@dataclass(frozen=True)
class SlurmNode:
    """What ``scontrol show node`` says of the node: its State and its Reason ("" if none)."""

    state: str
    reason: str = ""

    @property
    def drained(self) -> bool:
        """Draining or drained (``IDLE+DRAIN``, ``DRAINED``, ``MIXED+DRAIN``, ...)."""
        return "DRAIN" in self.state.upper()

    @property
    def drained_by_us(self) -> bool:
        return self.drained and self.reason.startswith(OURS)


def parse_show_node(text: str) -> SlurmNode | None:
    """``scontrol -o show node N``'s one line as a :class:`SlurmNode` (None: no State in it).

    Reason is the last field Slurm prints that matters here; its value runs to
    `` [user@time]`` (the stamp Slurm adds) or to the next ``Key=`` field.
    """
    state = re.search(r"(?:^|\s)State=(\S+)", text)
    if state is None:
        return None
    reason = ""
    match = re.search(r"(?:^|\s)Reason=(.*)$", text.strip())
    if match is not None:
        value = re.split(r"\s\[[^\]]*@[^\]]*\]|\s[A-Z][A-Za-z]*=", match.group(1), maxsplit=1)[0]
        reason = value.strip()
    return SlurmNode(state.group(1), "" if reason == "(null)" else reason)


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


def decide(health: NodeHealth, slurm: SlurmNode, now: float) -> SlurmAction | None:
    """What to tell Slurm (pure), from the record and what Slurm shows of the node; None
    when Slurm already shows what the record says, or the drain there is not elasticd's."""
    if in_force(health.quarantine, now):
        reason = slurm_reason(health)
        if slurm.drained and not slurm.drained_by_us:
            return None  # Slurm's or an admin's drain: theirs to keep, with their reason
        return None if slurm.drained and slurm.reason == reason else SlurmAction("drain", reason)
    return SlurmAction("resume") if slurm.drained_by_us else None


class SlurmDrain:
    """Runs for the daemon's life: keeps Slurm's state of this node as its record says."""

    def __init__(self, store: Store, node: str, clock: Clock, scontrol: str | None = None) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self.scontrol = scontrol or shutil.which("scontrol") or "scontrol"

    async def run(self) -> None:
        key = keys.health_key(self.node)
        while True:
            try:
                listing = await self.store.list(key)
                entry = next((e for e in listing.entries if e.key == key), None)
                health = decode_health(self.node, entry.value if entry is not None else None)
                slurm = await self.show()
                action = None if slurm is None else decide(health, slurm, self.clock.time())
                if slurm is None or (action is not None and not await self.apply(action)):
                    await asyncio.sleep(RETRY)
                    continue
                await self.store.watch(key, listing.revision, WATCH)
            except StoreError as exc:  # StoreCompacted too: read again
                log.debug("slurm drain: %s", exc)
                await asyncio.sleep(RETRY)

    async def show(self) -> SlurmNode | None:
        """What Slurm shows of the node (bounded ``scontrol -o show node``); None if unknown."""
        out = await self.scontrol_run(["-o", "show", "node", self.node], "show")
        if out is None:
            return None
        shown = parse_show_node(out)
        if shown is None:
            log.warning("slurm_drain: no State for %s in: %s", self.node, out[:200])
        return shown

    async def apply(self, action: SlurmAction) -> bool:
        """Run the ``scontrol`` of ``action`` (bounded); True when it succeeded."""
        if await self.scontrol_run(action.args(self.node), action.state) is None:
            return False
        log.info("slurm_drain: node %s %s in Slurm", self.node, action.state)
        return True

    async def scontrol_run(self, args: list[str], what: str) -> str | None:
        """``scontrol ARGS`` within :data:`SCONTROL_TIMEOUT`: its output, None if it failed."""
        try:
            process = await asyncio.create_subprocess_exec(
                self.scontrol,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            log.warning("slurm_drain: cannot run %s: %s", self.scontrol, exc)
            return None
        try:
            async with asyncio.timeout(SCONTROL_TIMEOUT):
                out, err = await process.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            log.warning("slurm_drain: scontrol %s took over %s s", what, SCONTROL_TIMEOUT)
            return None
        if process.returncode != 0:
            log.warning("slurm_drain: scontrol %s failed: %s", what, err.decode()[-500:])
            return None
        return out.decode(errors="replace")
