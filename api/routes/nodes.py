"""``/nodes``: the live members of the cluster (their records are bound to their leases)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request
from pydantic import BaseModel, ConfigDict, Field

from api.auth import principal_of
from api.deps import daemon_of
from elasticd.identity import Action, Deny, authorize
from elasticd.models import NODE_NAME_PATTERN, QueueView
from elasticd.node.cluster import NodeRecord
from elasticd.node.quarantine import NodeView

router = APIRouter(tags=["nodes"])


@router.get("/nodes", response_model=list[NodeRecord])
async def list_nodes(request: Request) -> list[NodeRecord]:
    """Every live node: address, labels, slots and free slots, and its ``state`` in the
    fleet (``ready``, ``quarantined`` by its policy, ``drained`` by an admin) with why."""
    daemon = daemon_of(request)
    records = await daemon.cluster.nodes()
    views = {v.name: v for v in await daemon.health.views([r.name for r in records])}
    return [r.model_copy(update=_shown(views[r.name])) for r in records]


def _shown(view: NodeView) -> dict[str, object]:
    fields = ("state", "reason", "since", "until", "by", "attributed_failures")
    return {f: getattr(view, f) for f in fields}


class DrainRequest(BaseModel):
    """Why an admin drains or undrains a node (kept in its health record, said in events)."""

    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=1024)


NodeName = Annotated[str, Path(max_length=253, pattern=NODE_NAME_PATTERN)]


@router.post(
    "/nodes/{name}/drain",
    response_model=NodeView,
    responses={403: {"description": "Not an admin"}},
)
async def drain_node(name: NodeName, body: DrainRequest, request: Request) -> NodeView:
    """Quarantine a node (admins only): the fleet places nothing on it, its jobs re-form
    without it (onto spares where there are any), uncharged, until an undrain."""
    principal = principal_of(request)
    decision = authorize(principal, Action.DRAIN)
    if isinstance(decision, Deny):
        raise HTTPException(403, decision.reason)
    return await daemon_of(request).health.drain(name, body.reason, principal.name)


@router.post(
    "/nodes/{name}/undrain",
    response_model=NodeView,
    responses={403: {"description": "Not an admin"}},
)
async def undrain_node(name: NodeName, body: DrainRequest, request: Request) -> NodeView:
    """Release a node from quarantine or a drain (admins only); its counted failures are
    forgiven."""
    principal = principal_of(request)
    decision = authorize(principal, Action.DRAIN)
    if isinstance(decision, Deny):
        raise HTTPException(403, decision.reason)
    return await daemon_of(request).health.undrain(name, body.reason, principal.name)


@router.get("/queue", response_model=QueueView, tags=["queue"])
async def fleet_queue(request: Request) -> QueueView:
    """The fleet's queue, in the order jobs will be placed, with why each waits.

    Jobs wait by ``priority`` (higher first), then in submission order. Each
    entry says what the job needs and what the fleet has now (``reason``:
    ``capacity`` or ``unplaceable``), and which job preempted it, if one did.
    ``placements`` shows where every placed job runs (hot spares last).
    """
    return daemon_of(request).jobs.queue()
