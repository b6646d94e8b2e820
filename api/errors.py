"""Errors as the API answers them: the one place that maps error kinds and job states to HTTP.

Every caller fault is an ``InputError`` (``auk_worker/errors.py``) raised wherever it is found; ``STATUS`` maps its
class to the HTTP status, and each error leaves the API as JSON ``{"error": {"code", "message", "details"?}}``.
A malformed body is 400, a missing or bad key 401, an unknown or foreign job 404, a body that stops arriving 408,
cancelling a finished job 409, an oversized body 413, an unreadable content type 415, a body that parses but breaks
a rule 422 (naming the field), and a spent per-key quota 429 (with ``Retry-After``). Only a dependency being down is a 5xx (503, retry later); anything unexpected is a logged 500, the last
resort.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from auk_worker.errors import (
    AuKError,
    Conflict,
    InfraError,
    InputError,
    MalformedBody,
    NotFound,
    RequestTimeout,
    TooLarge,
    TooManyRequests,
    Unauthorized,
    UnsupportedMediaType,
)
from auk_worker.service.records.batches import batch_state  # noqa: F401 - a batch's status, kept with its store
from auk_worker.service.records.jobs import TERMINAL, JobStatus

log = logging.getLogger(__name__)

RETRY_AFTER_S = "5"  # what a 503 (a dependency down) tells the client to wait before trying again

# The service's error classes as HTTP statuses: the nearest class in an error's ancestry decides; others are 500.
STATUS: dict[type[AuKError], int] = {
    MalformedBody: 400,
    Unauthorized: 401,
    NotFound: 404,
    RequestTimeout: 408,
    Conflict: 409,
    TooLarge: 413,
    UnsupportedMediaType: 415,
    TooManyRequests: 429,
    InputError: 422,
    InfraError: 503,
}
HEADERS: dict[type[AuKError], dict[str, str]] = {
    Unauthorized: {"WWW-Authenticate": "Bearer"},
    InfraError: {"Retry-After": RETRY_AFTER_S},
}


def status_for_error(exc: AuKError) -> int:
    """HTTP status for the service's own error family."""
    return next((STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS), 500)


def headers_for_error(exc: AuKError) -> dict[str, str] | None:
    """The response headers of an error: ``WWW-Authenticate`` for a 401, ``Retry-After`` for a 429 (the quota's
    own wait) or a 503."""
    if isinstance(exc, TooManyRequests):
        return {"Retry-After": str(exc.retry_after)}
    return next((HEADERS[cls] for cls in type(exc).__mro__ if cls in HEADERS), None)


class BodyRefused(StarletteHTTPException):
    """A request body cut while it was read (over its limit, or stalled): raised from the guarded ``receive`` so that
    it passes through FastAPI's body parsing, answered as ``error`` with ``Connection: close`` (the rest of the body
    is never read)."""

    def __init__(self, error: AuKError) -> None:
        super().__init__(status_code=status_for_error(error), detail=error.message)
        self.error = error


def too_large(what: str, limit: int) -> TooLarge:
    return TooLarge(f"{what} is larger than the limit of {limit} bytes")


def require_cancelable(status: JobStatus, job_id: str) -> None:
    """A finished job keeps its final state: cancelling it is a conflict, not a silent no-op."""
    if status in TERMINAL:
        raise Conflict(f"job {job_id!r} is already {status.value} and cannot be canceled", code="already_finished")


def describe_validation_errors(errors: Iterable[Mapping[str, Any]], *, skip: Sequence[str] = ("body",)) -> list[dict]:
    """Pydantic errors as ``{"field", "message"}`` pairs, the field written as a dotted path (``audio.key``)."""
    described = []
    for err in errors:
        loc = [str(part) for part in err.get("loc", ()) if str(part) not in skip]
        field = ".".join(loc)
        kind = err.get("type", "")
        message = str(err.get("msg", "invalid value"))
        if kind == "extra_forbidden":
            message = "unknown field"
        elif kind == "missing":
            message = "field required"
        elif message.startswith("Value error, "):
            message = message[len("Value error, "):]
        if message.startswith("Expected UploadFile"):  # a multipart part without a filename arrives as text
            message = "must be a file: a multipart part with a filename"
        described.append({"field": field, "message": message})
    return described


MAX_REPORTED_ERRORS = 20  # field errors named in one response; a body with 50,000 unknown keys gets a short answer


def summarize(described: Sequence[Mapping[str, str]]) -> str:
    """One sentence out of several field errors: ``instruction: field required; foo: unknown field``."""
    shown = "; ".join(f"{d['field']}: {d['message']}" if d["field"] else d["message"]
                      for d in described[:MAX_REPORTED_ERRORS])
    hidden = len(described) - MAX_REPORTED_ERRORS
    return f"{shown}; and {hidden} more" if hidden > 0 else shown


def json_failure(exc: BaseException | None) -> str | None:
    """Why ``json.loads`` failed past its own JSONDecodeError, in the caller's terms; None for other errors."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte {exc.start})"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, ValueError) and "integer string conversion" in str(exc):
        return "a number has too many digits"
    return None


def _body(code: str, message: str, details: Any = None) -> dict:
    error: dict[str, Any] = {"code": code, "message": message}
    if details is not None:
        error["details"] = details
    return {"error": error}


def _invalid(described: Sequence[Mapping[str, str]]) -> JSONResponse:
    return JSONResponse(_body("invalid_request", summarize(described), list(described[:MAX_REPORTED_ERRORS])),
                        status_code=422)


def error_response(exc: AuKError) -> JSONResponse:
    """The answer to one of the service's own errors: its mapped status, code, message and details."""
    details = getattr(exc, "details", None)
    return JSONResponse(_body(exc.code, exc.message, details), status_code=status_for_error(exc),
                        headers=headers_for_error(exc))  # fmt: skip


_NOT_OBJECT = {"model_attributes_type", "dict_type", "model_type"}


def _malformed_json(message: str) -> JSONResponse:
    return error_response(MalformedBody(message, code="malformed_json"))


async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    bad_json = [e for e in errors if e.get("type") == "json_invalid"]
    if bad_json:
        ctx = bad_json[0].get("ctx") or {}
        reason = ctx.get("error") or bad_json[0].get("msg", "")
        return _malformed_json(f"the request body is not valid JSON: {reason}")
    whole_body = [e.get("type") for e in errors if tuple(e.get("loc", ())) == ("body",)]
    if "missing" in whole_body:
        return _malformed_json("the request body is empty: send a JSON object with Content-Type: application/json")
    if _NOT_OBJECT & set(whole_body):
        return _malformed_json("the request body must be a JSON object sent with Content-Type: application/json")
    return _invalid(describe_validation_errors(errors, skip=("body", "query", "path", "header")))


async def _pydantic_validation(_: Request, exc: ValidationError) -> JSONResponse:
    return _invalid(describe_validation_errors(exc.errors()))


async def _auk_error(request: Request, exc: AuKError) -> JSONResponse:
    if status_for_error(exc) >= 500:
        log.warning("%s %s: %s (%s)", request.method, request.url.path, exc.message, exc.code)
    return error_response(exc)


async def _redis_error(request: Request, exc: redis.RedisError) -> JSONResponse:
    if isinstance(exc, redis.ResponseError):  # Redis answered and refused a command: a fault here, not an outage
        return await _unexpected(request, exc)
    log.warning("%s %s: redis: %s", request.method, request.url.path, exc)
    return error_response(InfraError(f"the job store (Redis) is unreachable: {exc}"))


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    if isinstance(exc, BodyRefused):
        response = error_response(exc.error)
        response.headers["Connection"] = "close"
        return response
    # Every status a route or Starlette raises, with a code the error table lists: a 4xx without its own code is a
    # refused request (``invalid_request``), a 5xx an ``internal`` fault.
    codes = {400: "malformed_body", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
             408: "body_timeout", 413: "too_large", 415: "unsupported_media_type"}  # fmt: skip
    message = exc.detail if isinstance(exc.detail, str) else "request refused"
    # FastAPI's own body parsing fails past json.loads' JSONDecodeError with a bare "error parsing the body";
    # the cause it chains says what was wrong.
    reason = json_failure(exc.__cause__)
    if reason is not None:
        return _malformed_json(f"the request body is not valid JSON: {reason}")
    if exc.status_code == 404 and message == "Not Found":
        message = "no such endpoint"
    fallback = "invalid_request" if exc.status_code < 500 else "internal"
    return JSONResponse(_body(codes.get(exc.status_code, fallback), message), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("%s %s: unexpected error", request.method, request.url.path)
    return JSONResponse(_body("internal", "internal error; the request was not completed"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(ValidationError, _pydantic_validation)
    app.add_exception_handler(AuKError, _auk_error)
    app.add_exception_handler(redis.RedisError, _redis_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
