"""Bulk grouping: which queued jobs a worker renders together in one DiT pass, decided when a batch is enqueued.

A batch's jobs are sorted by their schedule (``rules.resolve_knobs``: unset knobs read as the deploy config's
defaults, so an unset knob and its explicit default land together; Flash jobs all follow its one recipe) and then by
target length, and cut into groups of at most ``max_num_seqs`` jobs (the deploy config's stage 1 limit) that share
variant and schedule. Each group goes to the bulk queue as one ``auk.render_group`` task; the pipeline's
``render_batch`` pads and masks the group within its position budget. With ``max_num_seqs: 1`` there is nothing to
group and every job stays an ``auk.render`` task.

No torch import: the API (which never imports torch) and the throughput benchmark call this.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from auk_worker import rules
from auk_worker.deploy import DiTSampling, load_deploy_config
from auk_worker.errors import ConfigError
from auk_worker.service.records.jobs import JobRecord

log = logging.getLogger(__name__)

RENDER_GROUP_TASK = "auk.render_group"  # args: [job ids], all bulk jobs of one variant
KNOB_FIELDS = ("num_inference_steps", "guidance_scale", "sway", "seed")  # the request fields resolve_knobs takes


@functools.lru_cache(maxsize=8)
def _limits(deploy_config: str) -> tuple[int, DiTSampling]:
    deploy = load_deploy_config(Path(deploy_config))
    return deploy.dit.max_num_seqs, deploy.defaults


def group_limits(deploy_config: str | Path) -> tuple[int, DiTSampling | None]:
    """``(max_num_seqs, sampling defaults)`` of the deploy config's stage 1, read once per path.

    A config that does not load (the API host lacks it, or it is malformed) gives ``(1, None)``: every job is then
    sent on its own, which is always correct, only slower, and needs no defaults; the reason is logged.
    """
    try:
        return _limits(str(deploy_config))
    except (ConfigError, OSError) as exc:
        message = exc.message if isinstance(exc, ConfigError) else str(exc)
        log.warning("deploy config %s unreadable (%s); bulk jobs are sent one at a time", deploy_config, message)
        return 1, None


def schedule_key(request: dict[str, Any], defaults: DiTSampling) -> tuple:
    """The variant and the resolved schedule of a record's request: equal keys can share a DiT pass."""
    variant = request.get("variant", "base")
    knobs = rules.resolve_knobs(variant, defaults, **{name: request.get(name) for name in KNOB_FIELDS})
    return (variant, *knobs.key)


def target_seconds(request: dict[str, Any]) -> float:
    """The job's target length (the API stores it resolved; a clip-only request falls back to the clip)."""
    if request.get("target_seconds") is not None:
        return float(request["target_seconds"])
    if request.get("gen_seconds") is not None:
        return float(request["gen_seconds"])
    clip = request.get("clip") or {}
    return float(clip.get("duration_s") or 0.0)


def plan_groups(records: Sequence[JobRecord], max_jobs: int, defaults: DiTSampling) -> list[list[JobRecord]]:
    """Records sorted by (schedule, target length), cut into runs of one schedule of at most ``max_jobs``."""
    if max_jobs < 1:
        raise ValueError(f"max_jobs must be at least 1, got {max_jobs}")
    keyed = sorted(
        ((schedule_key(r.request, defaults), target_seconds(r.request), position, r) for position, r in
         enumerate(records)),
        key=lambda item: item[:3],
    )  # fmt: skip
    groups: list[list[JobRecord]] = []
    current_key: tuple | None = None
    for key, _, _, record in keyed:
        if not groups or key != current_key or len(groups[-1]) >= max_jobs:
            groups.append([])
            current_key = key
        groups[-1].append(record)
    return groups


def in_line_order(groups: list[list[JobRecord]], records: Sequence[JobRecord]) -> list[list[JobRecord]]:
    """``groups`` ordered by their earliest member's place in ``records`` (the batch's lines). Staged in this order, a
    batch is released, and so rendered, from its first lines towards its last, and its oldest queued jobs are in the
    first staged tasks, where the queue audit looks for them (``ops/audit.py``)."""
    place = {record.id: i for i, record in enumerate(records)}
    return sorted(groups, key=lambda group: min(place[record.id] for record in group))
