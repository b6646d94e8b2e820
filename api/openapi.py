"""What the OpenAPI document says beyond the routes' signatures: the error statuses each route can give, in the
one error shape (``api/errors.py``), the success answers (``documented``), operationIds and links.

Every ``/v1`` route can answer 401 (no or a bad key, from the request guard, before any body is read), 429 (a
per-key quota, with ``Retry-After``), 503 (Redis or storage down, with ``Retry-After``) and, as a last resort, 500;
the routers declare those (``V1_ERRORS``). Routes add what else they can give: 422 where they take parameters,
400/408/413/415 where they read a body, 404 where they name a record, 409 where a record has ended, 416 for a range
past the audio, 504 for a speech render that outlasts its wait.

An operationId is the route function's name (``create_job``), and a created record's answer links to the
operations that take its id (``links``), so that generated clients read well and can follow them.
``install_openapi`` serves the document with ``ErrorBody`` in its components and no operation left with FastAPI's
default 422 (``HTTPValidationError``, a shape this API never sends).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel

from api.responses import ErrorBody
from auk_worker import formats

_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again", "required": True,
                                "schema": {"type": "integer", "minimum": 0}}}  # fmt: skip

# status: (when it is answered, response headers)
ERROR_STATUSES: dict[int, tuple[str, dict[str, Any]]] = {
    400: ("The body is not what the route reads: not JSON, not a JSON object, not UTF-8, an empty body.", {}),
    401: ("No API key, or not a valid one (`Authorization: Bearer <key>`).",
          {"WWW-Authenticate": {"description": "Bearer", "required": True, "schema": {"type": "string"}}}),
    404: ("No such record for this key (another key's record answers the same).", {}),
    408: ("The body arrived too slowly (AUK_API_BODY_TIMEOUT, AUK_API_BODY_MIN_RATE); the connection is closed.", {}),
    409: ("The record has already ended.", {}),
    413: ("The body is over the route's limit; the connection is closed.", {}),
    415: ("The body's Content-Type is not one the route reads.", {}),
    416: ("The Range lies past the end of the audio.",
          {"Content-Range": {"description": "bytes */*", "required": True, "schema": {"type": "string"}}}),
    422: ("The request parses but breaks a rule; `details` names each field (or batch line) and why.", {}),
    429: ("A per-key quota is spent: requests in flight, request rate or queued jobs.", _RETRY_AFTER),
    500: ("An unexpected fault; the request was not completed.", {}),
    503: ("A dependency (Redis, storage, the broker) is down, or no live worker serves the variant.", _RETRY_AFTER),
    504: ("The render did not finish in time (AUK_SPEECH_TIMEOUT); the job goes on.", {}),
}
BODY_ERRORS = (400, 408, 413, 415, 422)

# A stored result as it is streamed back: any of the output formats (``auk_worker/formats.py``).
AUDIO_CONTENT = {spec.mime_type: {"schema": {"type": "string", "format": "binary"}}
                 for spec in formats.FORMATS.values()}


_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for error statuses, each the ``ErrorBody`` shape as JSON (named by reference, not
    ``model``: FastAPI would list a model under the route's own media type, text/html for the batch page)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        description, headers = ERROR_STATUSES[status]
        out[status] = {"description": description, "content": _ERROR_CONTENT}
        if headers:
            out[status]["headers"] = headers
    return out


V1_ERRORS = errors(401, 429, 500, 503)


def documented(model: type[BaseModel] | None, *error_statuses: int, status: int = 200, description: str = "",
               content: dict[str, Any] | None = None, more: dict[int, dict[str, Any]] | None = None,
               follow: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Keyword arguments for a route decorator: ``model`` (or raw ``content``) as the ``status`` answer, plus the
    given error statuses and ``more`` answers. The answer is documented, not re-serialized (``response_model=None``):
    what the route returns goes out as it is. ``follow``: the answer's links (``links``)."""
    success: dict[str, Any] = {"description": description or "OK"}
    if follow:
        success["links"] = follow
    if model is not None:
        success["model"] = model
    if content is not None:
        success["content"] = content
    return {"response_model": None, "responses": {status: success, **(more or {}), **errors(*error_statuses)}}


def _with_error_body(doc: dict[str, Any]) -> dict[str, Any]:
    """The document with ``ErrorBody`` in its components, and any FastAPI default 422 made that body (its
    ``HTTPValidationError`` schemas dropped)."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    error = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error.pop("$defs", {}))
    schemas["ErrorBody"] = error
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            response = operation.get("responses", {}).get("422")
            if response is not None and "HTTPValidationError" in str(response):
                response["description"] = ERROR_STATUSES[422][0]
                response["content"] = _ERROR_CONTENT
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return doc


def operation_id(route: APIRoute) -> str:
    """A route's operationId is its function's name (``create_job``, ``get_batch``): what a generated client's
    methods are called."""
    return route.name


def links(field: str = "id", **targets: tuple[str, str]) -> dict[str, dict[str, Any]]:
    """OpenAPI links from an answer's ``field`` to the operations that take it as a parameter: ``GetJob=("get_job",
    "job_id")``. A client (or a test generator) follows them from the record it just made."""
    return {name: {"operationId": target, "parameters": {param: f"$response.body#/{field}"}}
            for name, (target, param) in targets.items()}


def install_openapi(app: FastAPI) -> None:
    """Serve FastAPI's document as described above (built once, on first request)."""
    build = app.openapi  # FastAPI's own: the routes' document, with the app's title, tags and servers

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _with_error_body(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
