"""The keys of one job's rendezvous, all under ``rdzv/<job>/``, and how they are read.

* ``m/state``: the rendezvous document, written only by compare-and-set;
* ``m/node/<name>``: a node's lease-bound *presence* key holding its join info;
* ``signal/done``: the *head*, written by whoever completes or closes a round or
  sets its deadline (what nodes placed inside an open round wait for);
* ``signal/absorber``: the advisory *absorber* role (:mod:`.handler`);
* ``seat/<name>``: a node's seat in the latest complete round it took part
  in (:class:`~.protocol.Seat`: its ranks and the master), and
  ``roster/<round>``: a complete round's participants (jobs of
  ``ABSORBER_FROM`` nodes or more, written by the node that completes it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

from elasticd.errors import RendezvousError
from elasticd.keys import rendezvous_prefix
from elasticd.rendezvous.protocol import NodeInfo, State


class Presence(Mapping[str, NodeInfo]):
    """Announced nodes, decoding a node's join info only when it is looked up."""

    def __init__(self, raw: dict[str, bytes]) -> None:
        self._raw = raw
        self._decoded: dict[str, NodeInfo] = {}

    def __getitem__(self, node: str) -> NodeInfo:
        info = self._decoded.get(node)
        if info is None:
            try:
                info = NodeInfo.from_json(json.loads(self._raw[node]))
            except (ValueError, TypeError) as exc:
                raise RendezvousError(f"node {node!r} announced a malformed join info") from exc
            self._decoded[node] = info
        return info

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, node: object) -> bool:
        return node in self._raw

    def round_of(self, node: str) -> int | None:
        """The round ``node``'s announcement is for; None if it has none or it is malformed."""
        if node not in self._raw:
            return None
        try:
            return self[node].round
        except RendezvousError:
            return None

    def apply(self, node: str, raw: bytes | None) -> None:
        """A presence key written (``raw``) or gone (``None``), from a watch event."""
        self._decoded.pop(node, None)
        if raw is None:
            self._raw.pop(node, None)
        else:
            self._raw[node] = raw


_DECODED: dict[tuple[bytes, int], State] = {}


def roster_bytes(state: State) -> bytes:
    return json.dumps(state.participants, sort_keys=True).encode()


def decode_state(raw: bytes, version: int) -> State:
    """``State.decode`` with a small cache: a process running many agents for one job
    (tests, simulations) decodes each version of the document once."""
    key = (raw, version)  # the whole document: two stores may reuse a version number
    state = _DECODED.get(key)
    if state is None:
        state = State.decode(raw)
        if len(_DECODED) > 64:
            _DECODED.clear()
        _DECODED[key] = state
    return state


def membership_prefix(job_id: str) -> str:
    """The state document and the presence keys: what a running node watches."""
    return rendezvous_prefix(job_id) + "m/"


def state_key(job_id: str) -> str:
    """The rendezvous document of a job."""
    return membership_prefix(job_id) + "state"


def absorber_key(job_id: str) -> str:
    """Held by the node placing announced nodes (see ``signals.AbsorberRole``)."""
    return rendezvous_prefix(job_id) + "signal/absorber"


def presence_prefix(job_id: str) -> str:
    """One lease-bound key per announced node, named after it."""
    return membership_prefix(job_id) + "node/"


def signal_prefix(job_id: str) -> str:
    """The head (``done``) and the absorber role: what joining nodes of a large job watch."""
    return rendezvous_prefix(job_id) + "signal/"


def seat_key(job_id: str, node: str) -> str:
    """A node's seat in the latest complete round it took part in (see ``protocol.Seat``)."""
    return rendezvous_prefix(job_id) + "seat/" + node


def roster_key(job_id: str, round_: int) -> str:
    """The participants of a complete round of a large job (for the agent, not the join)."""
    return rendezvous_prefix(job_id) + f"roster/{round_}"
