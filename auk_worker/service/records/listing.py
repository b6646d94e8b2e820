"""The owner's job listings: newest first, by status or by batch, paged by an opaque cursor; and the per-status
indexes' one-time backfill for owners whose records predate them (``_ensure_status_index``)."""

from __future__ import annotations

import builtins

from auk_worker.service.records.jobs import JobReader, JobRecord, JobStatus


class JobListing(JobReader):
    """Listing and counting an owner's jobs (the API's ``GET /v1/jobs`` and quotas)."""

    def list(
        self,
        owner: str,
        status: JobStatus | str | None = None,
        batch_id: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[builtins.list[JobRecord], str | None]:
        """The owner's jobs newest first, optionally one status or one batch; ``next_cursor`` is None at the end.

        The cursor is opaque to callers (``"<created ms>-<job id>"``) and stays valid while new jobs arrive.
        """
        want = JobStatus(status) if status is not None else None
        if batch_id:
            index = self.batch_jobs_key(batch_id)
        elif want is not None:
            self._ensure_status_index(owner)
            index = self.status_key(owner, want)  # the filter below then only guards a transition mid-read
        else:
            index = self.owner_key(owner)
        top: float | str = "+inf"
        after: tuple[float, str] | None = None
        if cursor:
            score_s, _, after_id = cursor.partition("-")
            # The score is a creation time in whole milliseconds: digits only (no nan, inf, signs or exponents).
            if not (score_s.isascii() and score_s.isdigit() and len(score_s) <= 16 and after_id):
                raise ValueError(f"bad cursor {cursor!r}")
            after = (float(score_s), after_id)
            top = after[0]
        out: builtins.list[tuple[JobRecord, float]] = []
        # Every id of an owner or status index qualifies: read one page and its look-ahead; a batch filtered by
        # status skips ids, so it reads ahead in larger chunks.
        exact = not (batch_id and want is not None)
        offset, chunk = 0, limit + 1 if exact else max(limit + 1, 64)
        while len(out) <= limit:
            rows = self.redis.zrevrangebyscore(index, top, "-inf", start=offset, num=chunk, withscores=True)
            if not rows:
                break
            offset += len(rows)
            if after is not None:
                # Equal scores come in reverse id order: skip the ids at or above the cursor's.
                rows = [(m, s) for m, s in rows if not (s == after[0] and m >= after[1])]
            records = self.get_many([m for m, _ in rows])
            for (_, score), rec in zip(rows, records):
                if rec is None or rec.owner != owner or (want is not None and rec.status != want):
                    continue
                out.append((rec, score))
                if len(out) > limit:
                    break
        page = out[:limit]
        next_cursor = None
        if len(out) > limit and page:
            last, score = page[-1]
            next_cursor = f"{int(score)}-{last.id}"
        return [rec for rec, _ in page], next_cursor

    def count(self, owner: str, statuses: tuple[JobStatus, ...]) -> int:
        """How many of the owner's jobs are in ``statuses`` (O(1) per status: the status indexes' sizes)."""
        self._ensure_status_index(owner)
        pipe = self.redis.pipeline(transaction=False)
        for status in statuses:
            pipe.zcard(self.status_key(owner, status))
        return sum(pipe.execute())

    def _ensure_status_index(self, owner: str) -> None:
        """Index an owner's records written before the status indexes existed, once (then marked as done).

        Transitions keep the indexes from then on; a record that moves while this runs may leave a stale entry,
        which listings skip (they check each record's status)."""
        marker = self.indexed_key(owner)
        if self.redis.exists(marker):
            return
        offset, chunk = 0, 1000
        while rows := self.redis.zrange(self.owner_key(owner), offset, offset + chunk - 1, withscores=True):
            offset += len(rows)
            records = self.get_many([job_id for job_id, _ in rows])
            pipe = self.redis.pipeline(transaction=False)
            for (job_id, score), record in zip(rows, records):
                if record is not None:
                    pipe.zadd(self.status_key(owner, record.status), {job_id: score})
            pipe.execute()
        self.redis.set(marker, "1")
