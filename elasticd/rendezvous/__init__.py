"""Rendezvous: how the nodes of a job agree on a round, their group ranks and the master.

The protocol (:mod:`.protocol`) is pure: ``decide_*(state, node, settings,
now, alive)`` returns what to do. The executor (:mod:`.handler`) applies
it over the store: the state is one JSON document per job, written only by
compare-and-set, so racing nodes never need a lock for correctness: the
loser re-reads the winner's document and decides again (an advisory
*absorber* role only keeps a crowd of arriving nodes from all doing the same
work). Nodes watch the document (and each other's lease-bound presence keys)
instead of sleeping. Ranks belong here too (:mod:`.ranks`): a completed
round's nodes, in group-rank order, become every worker's global, role and
local ranks, as a pure function.

Each round gets a fresh master port, picked by group rank 0's node when it
joined, so no worker of a new round ever dials an address left over from the
last one (torchrun's "connectFullMesh ... Connection refused" after a restart).
"""

from elasticd.rendezvous.handler import StoreRendezvous
from elasticd.rendezvous.interface import Rendezvous, RoundInfo, free_port
from elasticd.rendezvous.layout import presence_prefix, state_key
from elasticd.rendezvous.protocol import Change, Settings

__all__ = [
    "Change",
    "Rendezvous",
    "RoundInfo",
    "Settings",
    "StoreRendezvous",
    "free_port",
    "presence_prefix",
    "state_key",
]
