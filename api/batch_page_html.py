"""The batch listening page as HTML: one self-contained document (inline CSS and JS, no build step).

Every line of the batch is a table row: position, ``custom_id``, status, duration, error and an ``<audio>`` player
whose source is the API's own audio route under the page's signature (same origin, so the browser plays it and a
script can fetch it). The "Failed lines first" button (a real ``<button>`` with ``aria-pressed``) reorders the rows
on the page and in the URL (``?failed_first=1``), which the server also honours. Everything is reachable with Tab
in reading order; focus is always visible; players carry labels naming their line.
"""

from __future__ import annotations

from html import escape
from typing import Any

from auk_worker.service.records.jobs import JobRecord, JobStatus

# Rows with these statuses come first, in this order, when failed lines are asked first.
FAILED_ORDER = {JobStatus.FAILED.value: 0, JobStatus.CANCELED.value: 1}

_CSS = """
:root { color-scheme: light dark; --ok: #1a7f37; --bad: #c62828; --muted: #6b7280; }
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 72rem; padding: 1rem 1.5rem 3rem; }
h1 { font-size: 1.35rem; margin: .5rem 0; } code { font-size: .95em; }
.skip { position: absolute; left: -999px; } .skip:focus { left: 1rem; top: .5rem; background: Canvas; padding: .3rem; }
:focus-visible { outline: 3px solid #2563eb; outline-offset: 2px; }
.controls { display: flex; gap: .75rem; align-items: center; margin: .75rem 0; flex-wrap: wrap; }
button { font: inherit; padding: .35rem .8rem; border-radius: .4rem; border: 1px solid #888; cursor: pointer; }
button[aria-pressed="true"] { background: #2563eb; color: white; border-color: #2563eb; }
table { border-collapse: collapse; width: 100%; } caption { text-align: left; color: var(--muted); padding: .3rem 0; }
th, td { text-align: left; padding: .45rem .5rem; border-bottom: 1px solid #8884; vertical-align: middle; }
thead th { font-size: .85rem; text-transform: uppercase; letter-spacing: .03em; color: var(--muted); }
tbody th { font-weight: 600; word-break: break-all; }
.status { font-weight: 600; } .succeeded { color: var(--ok); } .failed, .canceled { color: var(--bad); }
.error { max-width: 28rem; } .num { font-variant-numeric: tabular-nums; white-space: nowrap; }
audio { width: 16rem; max-width: 100%; height: 2.2rem; } .none { color: var(--muted); }
"""

_JS = """
(() => {
  const body = document.querySelector('#lines tbody');
  const button = document.getElementById('failed-first');
  const rank = {failed: 0, canceled: 1};
  function order(failedFirst) {
    const rows = Array.from(body.rows);
    rows.sort((a, b) => {
      const ra = failedFirst ? (rank[a.dataset.status] ?? 2) : 0;
      const rb = failedFirst ? (rank[b.dataset.status] ?? 2) : 0;
      return ra - rb || Number(a.dataset.position) - Number(b.dataset.position);
    });
    rows.forEach((row) => body.appendChild(row));
    button.setAttribute('aria-pressed', String(failedFirst));
    const url = new URL(window.location.href);
    if (failedFirst) url.searchParams.set('failed_first', '1'); else url.searchParams.delete('failed_first');
    history.replaceState(null, '', url);
    document.getElementById('order-note').textContent =
      failedFirst ? 'Failed and canceled lines are listed first.' : 'Lines are in batch order.';
  }
  button.addEventListener('click', () => order(button.getAttribute('aria-pressed') !== 'true'));
  // One player at a time: starting one pauses the others.
  body.addEventListener('play', (event) => {
    for (const audio of body.querySelectorAll('audio')) if (audio !== event.target) audio.pause();
  }, true);
})();
"""


def _duration(record: JobRecord) -> str:
    result = record.result or {}
    seconds = result.get("duration_s")
    if seconds is None:
        seconds = (record.request or {}).get("target_seconds")
        return f"{seconds:.2f} s (asked)" if isinstance(seconds, (int, float)) else "\u2014"
    return f"{seconds:.2f} s"


def _row(position: int, record: JobRecord, audio_src: str | None) -> str:
    status = record.status.value
    name = record.custom_id or record.id
    error = record.error or {}
    error_cell = (f"<code>{escape(error.get('code', ''))}</code> {escape(error.get('message', ''))}"
                  if error else '<span class="none">\u2014</span>')  # fmt: skip
    if audio_src is not None:
        result = record.result or {}
        player = (
            f'<audio controls preload="none" src="{escape(audio_src)}" aria-label="Audio of {escape(name)}, '
            f'{result.get("duration_s", 0):.2f} seconds" data-duration="{result.get("duration_s", 0)}" '
            f'data-samples="{result.get("samples", "")}" data-sample-rate="{result.get("sample_rate", "")}"></audio>'
        )
    else:
        player = '<span class="none">no audio</span>'
    return (f'<tr data-status="{status}" data-position="{position}" data-job-id="{escape(record.id)}">'
            f'<td class="num">{position}</td><th scope="row">{escape(name)}</th>'
            f'<td><span class="status {status}">{status}</span></td><td class="num">{_duration(record)}</td>'
            f'<td class="error">{error_cell}</td><td>{player}</td></tr>')  # fmt: skip


def order_rows(records: list[JobRecord], failed_first: bool) -> list[tuple[int, JobRecord]]:
    """``(position from 1, record)`` in batch order, or failed then canceled lines first (stable)."""
    numbered = list(enumerate(records, start=1))
    if failed_first:
        numbered.sort(key=lambda item: (FAILED_ORDER.get(item[1].status.value, 2), item[0]))
    return numbered


def render_page(batch: dict[str, Any], records: list[JobRecord], audio_src: Any, failed_first: bool,
                expires_at: str) -> str:
    """The page; ``audio_src(record)`` is the player's source for a succeeded line."""
    counts = ", ".join(f"{n} {status}" for status, n in batch["counts"].items() if n) or "no lines"
    state = "canceled" if batch.get("canceled_at") else ("done" if batch["done"] else "in progress")
    rows = "\n".join(_row(position, record, audio_src(record) if record.status == JobStatus.SUCCEEDED else None)
                     for position, record in order_rows(records, failed_first))  # fmt: skip
    note = "Failed and canceled lines are listed first." if failed_first else "Lines are in batch order."
    batch_id = escape(batch["id"])
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>Batch {batch_id}</title>
<style>{_CSS}</style>
</head>
<body>
<a class="skip" href="#lines">Skip to the lines</a>
<header>
<h1>Batch <code>{batch_id}</code></h1>
<p id="summary">{batch["total"]} lines, {state}: {escape(counts)}. Created {escape(batch["created_at"])}.</p>
<div class="controls">
<button type="button" id="failed-first" aria-pressed="{str(failed_first).lower()}"
  aria-describedby="order-note">Failed lines first</button>
<span id="order-note" role="status">{note}</span>
</div>
<p class="none">This link works until {escape(expires_at)}.</p>
</header>
<main>
<table id="lines">
<caption>Every line of the batch with its status, duration, error and audio</caption>
<thead><tr><th scope="col">#</th><th scope="col">custom_id</th><th scope="col">Status</th>
<th scope="col">Duration</th><th scope="col">Error</th><th scope="col">Audio</th></tr></thead>
<tbody>
{rows}
</tbody>
</table>
</main>
<script>{_JS}</script>
</body>
</html>
"""
