"""Errors as RFC 9457 problem details (``application/problem+json``).

One table maps elasticd's exception tree to HTTP status codes; routes never
format errors themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from api.schemas import Problem
from elasticd import errors

PROBLEM_JSON = "application/problem+json"

#: Every route with a JSON body answers 400 when the body cannot be decoded at all (not
#: UTF-8 JSON); one that decodes but does not fit the schema gets 422. The OpenAPI
#: generator (``api.app``) documents it on each such operation.
UNPARSEABLE_BODY = "The body cannot be parsed: it is not UTF-8 JSON"


def problem_response(description: str) -> dict[str, Any]:
    """A route's ``responses=`` entry for a problem+json answer."""
    return {"description": description, "model": Problem, "content": {PROBLEM_JSON: {}}}


#: The 404 of a store call that names a lease which expired or was revoked.
LEASE_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: problem_response("No such lease: it expired or was revoked")
}

#: Most specific class first; the first match wins.
STATUS_BY_ERROR: list[tuple[type[errors.ElasticdError], int, str]] = [
    (errors.JobNotFound, 404, "Job not found"),
    (errors.LogNotFound, 404, "Log not found"),
    (errors.JobConflict, 409, "Conflict"),
    (errors.JobForbidden, 403, "Forbidden"),
    (errors.LeaseNotFound, 404, "Lease not found"),
    (errors.ListingTooLarge, 413, "Listing too large"),
    (errors.ValueTooLarge, 413, "Value too large"),
    (errors.InvalidKey, 422, "Invalid store key"),
    (errors.KeyForbidden, 403, "Forbidden"),
    (errors.StoreCompacted, 410, "Store history compacted"),
    (errors.StoreUnavailable, 503, "Store unavailable"),
    (errors.ShuttingDown, 503, "Daemon shutting down"),
    (errors.StorageFull, 507, "Insufficient storage"),
    (errors.TooManyStreams, 429, "Too many streams"),
    (errors.OverShareBytes, 413, "Over its share"),
    (errors.OverShare, 429, "Over its share"),
    (errors.ConfigError, 400, "Bad configuration"),
    (errors.ElasticdError, 500, "Internal error"),
]


def problem(
    status: int,
    title: str,
    detail: str,
    *,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """A problem+json response with a message a person can act on."""
    body: dict[str, Any] = {"type": "about:blank", "title": title, "status": status}
    body["detail"] = detail
    body.update(extra)
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def status_for(exc: errors.ElasticdError) -> tuple[int, str]:
    for cls, status, title in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status, title
    return 500, "Internal error"  # pragma: no cover - ElasticdError is the last row


def error_problem(exc: errors.ElasticdError) -> JSONResponse:
    """The problem an elasticd error is answered with (the one table above)."""
    status, title = status_for(exc)
    extra: dict[str, Any] = {}
    if isinstance(exc, errors.StoreCompacted):
        extra["revision"] = exc.revision
    return problem(status, title, str(exc) or title, **extra)


def _field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def validation_problem(errors: Iterable[dict[str, Any]]) -> JSONResponse:
    """The 422 of invalid parameters or body: each field (by its ``loc``) and its message."""
    invalid = [
        {"field": _field_path(err.get("loc", ())), "message": err.get("msg", "")} for err in errors
    ]
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in invalid)
    return problem(422, "Invalid request", detail, errors=invalid)


def install_error_handlers(app: FastAPI) -> None:
    """Register the one error-handler table on ``app``."""

    async def on_elasticd_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, errors.ElasticdError)
        return error_problem(exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_problem(exc.errors())

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers) if exc.headers else None
        title = {
            400: "Bad request",
            401: "Unauthorized",
            403: "Forbidden",
            404: "Not found",
            405: "Method not allowed",
            413: "Request too large",
        }.get(exc.status_code, "HTTP error")
        return problem(exc.status_code, title, str(exc.detail), headers=headers)

    app.add_exception_handler(errors.ElasticdError, on_elasticd_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
