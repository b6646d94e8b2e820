"""``python -m auk_worker.service.delivery.webhooks``: a standalone dispatcher (``dispatch.main``)."""

from auk_worker.service.delivery.webhooks.dispatch import main

raise SystemExit(main())
