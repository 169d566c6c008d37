"""Rendezvous: how the nodes of a job agree on a round, their group ranks and the master.

Every round is one JSON document per job in the store, written only by
compare-and-set, so racing nodes never need a lock: the loser re-reads the
winner's document and decides again. Each round gets a fresh master port,
so no worker of a new round ever dials an address left over from the last
one (torchrun's "connectFullMesh ... Connection refused" after a restart).

This module holds the single-node rendezvous that the agent uses until the
dynamic multi-node protocol (min/max nodes, wait and redundancy lists,
keep-alives) fills the same interface.
"""

from elasticd.rendezvous.handler import Rendezvous, RoundInfo, SoloRendezvous, free_port

__all__ = ["Rendezvous", "RoundInfo", "SoloRendezvous", "free_port"]
