"""Answers encoded in one pass by pydantic's own serializer (issue 40).

FastAPI answers a route that returns a model by dumping it to Python objects,
validating those against the ``response_model`` again, serializing them to
JSON-ready objects and then ``json.dumps``: four passes, about 4 ms for a page
of 100 events on a loaded core. The read routes a dashboard or a follower polls
return :func:`json_of` instead: the bytes ``TypeAdapter.dump_json`` makes, the
very JSON FastAPI would answer (by alias, every field). Their decorators keep
``response_model``, so ``openapi.json`` is unchanged.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from fastapi import Response
from pydantic import TypeAdapter


@cache
def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def json_of(kind: Any, value: Any) -> Response:
    """``value`` (of type ``kind``, the route's ``response_model``) as a JSON answer."""
    body = _adapter(kind).dump_json(value, by_alias=True)
    return Response(body, media_type="application/json")
