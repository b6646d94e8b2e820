"""Log lines for people and for machines: plain text on a terminal, one JSON object a line otherwise.

``AUK_LOG_FORMAT=json|text`` chooses; unset, a process whose stderr is a terminal writes text and any other (a
container, a service manager, a log file) writes JSON. Every JSON line has ``ts`` (ISO-8601 UTC), ``level``,
``logger`` and ``message``, plus what the line is about:

- ``worker``: the worker's identity, on every line of a worker process (``set_identity``);
- ``job_id`` and ``batch_id`` on every line written while a job runs (``job_context``), or given per line with
  ``extra={"job_id": ...}``;
- any other ``extra`` field, such as a finished job's ``stages`` (seconds per stage) and ``duration_s``;
- ``exc`` with the traceback when there is one.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_job: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("auk_log_job", default={})
_identity: dict[str, str] = {}
# Attributes every LogRecord has: what is left on a record besides these came from ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName",
                                                                                  "color_message"}  # uvicorn


def set_identity(**fields: str) -> None:
    """Fields on every line of this process (a worker's ``worker`` id)."""
    _identity.update({k: v for k, v in fields.items() if v})


@contextmanager
def job_context(job_id: str | None = None, batch_id: str | None = None) -> Iterator[None]:
    """Every line written inside the block (this thread or task) carries these ids."""
    fields = {k: v for k, v in (("job_id", job_id), ("batch_id", batch_id)) if v}
    token = _job.set({**_job.get(), **fields})
    try:
        yield
    finally:
        _job.reset(token)


class ContextFilter(logging.Filter):
    """Puts the process identity and the current job's ids on each record (``extra`` given per line wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in {**_identity, **_job.get()}.items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
        out: dict[str, Any] = {
            "ts": stamp.replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_"):
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["exc"] = record.stack_info
        return json.dumps(out, default=str, ensure_ascii=False)


def resolve_format(log_format: str | None) -> str:
    """``json`` or ``text``: as set, else text on a terminal and JSON otherwise."""
    if log_format in ("json", "text"):
        return log_format
    return "text" if sys.stderr.isatty() else "json"


def configure_logging(log_format: str | None, level: str | int = "INFO") -> str:
    """Route the root logger to stderr in the chosen format (replacing its handlers); returns the format used."""
    chosen = resolve_format(log_format)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if chosen == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
    logging.captureWarnings(True)  # Python warnings (Celery's among them) become log lines in the same format
    return chosen
