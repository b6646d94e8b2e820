"""Whether some live worker serves a job's variant, asked before anything is written.

``require_worker_for`` asks the workers' heartbeats whether some live worker serves the job's variant, so that a
job no worker would ever take is refused at once (503 ``no_worker_for_variant``, naming the variants that are
served) rather than queued forever. ``AUK_VARIANT_CHECK`` says when:

- ``live`` (default): refuse when at least one worker is live and none serves (or is loading) the variant. With no
  live worker at all the job is queued: an operator may start the API before the workers, and the first worker to
  come up takes the queue.
- ``strict``: refuse also when no worker is live.
- ``off``: never refuse (workers are started on demand, say by an autoscaler reading the queue length).

A worker is live while its heartbeat key exists (it expires 10 s after the last write) and does not say
``failed``; one still loading counts (its heartbeat names its variant from ``AUK_VARIANT``, or ``?``, which counts
for any variant).
"""

from __future__ import annotations

import time

from api.deps import Services
from auk_worker.errors import NoWorker
from auk_worker.service.records.workers import live_variants, read_heartbeats

VARIANT_VIEW_S = 1.0  # a passed variant check holds this long per API process: reading every heartbeat per job
# costs one command per worker (a hundred a job on a hundred workers); a refusal always reads them afresh
_variant_view: dict[int, tuple[float, dict[str, list[str]], int]] = {}  # id(redis client) -> (monotonic, served, live)


def _variant_missing(policy: str, variants: set[str], served: dict[str, list[str]], live: int) -> list[str]:
    if "?" in served or (live == 0 and policy == "live"):
        return []
    return sorted(variants - set(served))


def require_worker_for(svc: Services, variants: set[str]) -> None:
    """Refuse (``NoWorker``) when ``AUK_VARIANT_CHECK`` says a job of one of ``variants`` would wait forever."""
    policy = svc.settings.variant_check
    if policy == "off":
        return
    cached = _variant_view.get(id(svc.redis))
    if cached is not None and time.monotonic() - cached[0] < VARIANT_VIEW_S \
            and not _variant_missing(policy, variants, cached[1], cached[2]):  # fmt: skip
        return
    served, live = live_variants(read_heartbeats(svc.redis))
    _variant_view[id(svc.redis)] = (time.monotonic(), served, live)
    missing = _variant_missing(policy, variants, served, live)
    if not missing:
        return
    serving = ", ".join(f"{v} ({len(ids)} worker{'s' if len(ids) > 1 else ''})" for v, ids in sorted(served.items()))
    message = (f"no live worker serves variant {', '.join(missing)}; live workers serve: {serving or 'nothing'}; "
               "send the job with a served variant, or start a worker for it")  # fmt: skip
    raise NoWorker(message, details={"variant": missing, "live_variants": sorted(served)})
