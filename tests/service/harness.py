"""Process managers for the service tests: real services on loopback ports.

They live in the package (``auk_dev.local``, also used by ``make run`` and the queue benchmark); this
module re-exports them under the names the tests use.
"""

from __future__ import annotations

from auk_dev.local import (
    REPO,
    VENV_BIN,
    ApiProcess,
    RedisServer,
    S3Server,
    WorkerProcess,
    connection_env,
    free_port,
    port_free,
    stop_process,
    wait_until,
)

_wait = wait_until
_stop = stop_process

__all__ = ["REPO", "VENV_BIN", "ApiProcess", "RedisServer", "S3Server", "WorkerProcess", "connection_env", "free_port",
           "port_free", "stop_process", "wait_until", "_wait", "_stop"]  # fmt: skip
