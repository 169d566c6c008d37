"""``/nodes``: the live members of the cluster (their records are bound to their leases)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.deps import daemon_of
from elasticd.models import QueueView
from elasticd.node.cluster import NodeRecord

router = APIRouter(tags=["nodes"])


@router.get("/nodes", response_model=list[NodeRecord])
async def list_nodes(request: Request) -> list[NodeRecord]:
    """Every live node: address, labels, slots and free slots."""
    return await daemon_of(request).cluster.nodes()


@router.get("/queue", response_model=QueueView, tags=["queue"])
async def fleet_queue(request: Request) -> QueueView:
    """The fleet's queue, in the order jobs will be placed, with why each waits.

    Jobs wait by ``priority`` (higher first), then in submission order. Each
    entry says what the job needs and what the fleet has now (``reason``:
    ``capacity`` or ``unplaceable``), and which job preempted it, if one did.
    ``placements`` shows where every placed job runs (hot spares last).
    """
    return daemon_of(request).jobs.queue()
