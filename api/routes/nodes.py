"""``/nodes``: the live members of the cluster (their records are bound to their leases)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.deps import daemon_of
from elasticd.node.cluster import NodeRecord

router = APIRouter(tags=["nodes"])


@router.get("/nodes", response_model=list[NodeRecord])
async def list_nodes(request: Request) -> list[NodeRecord]:
    """Every live node: address, labels, slots and free slots."""
    return await daemon_of(request).cluster.nodes()
