"""``python -m api``: serve the API with uvicorn on 127.0.0.1:${AUK_API_PORT:-8000} (``AUK_API_HOST`` moves it)."""

from __future__ import annotations

import sys

import uvicorn

from auk_worker.errors import ConfigError
from auk_worker.service.connect.logs import configure_logging
from auk_worker.service.connect.settings import Settings

MAX_HEAD_BYTES = 64 * 1024  # request line and headers


def main() -> int:
    try:
        from api.app import create_app
        from api.protocol import with_head_timeout

        settings = Settings.from_env()
        configure_logging(settings.log_format, settings.log_level)
        app = create_app(settings)  # settings are checked here, before the port is bound
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    # Idle keep-alive connections close after AUK_API_KEEP_ALIVE s; a request head must be complete within
    # AUK_API_BODY_TIMEOUT s and at most 64 KiB; a stalled body is cut by the request guard. log_config=None:
    # uvicorn's own lines (access log included) go through the root logger's format.
    uvicorn.run(app, host=settings.api_host, port=settings.api_port, proxy_headers=False,
                timeout_keep_alive=settings.keep_alive_s,
                h11_max_incomplete_event_size=MAX_HEAD_BYTES, http=with_head_timeout(settings.body_timeout_s),
                log_config=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
