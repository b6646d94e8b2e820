"""A small process supervisor for the local service (``make run``): a child that exits is started again.

Each child is one of ``local.py``'s process managers (``RedisServer``, ``S3Server``, ``WorkerProcess``,
``ApiProcess``): anything with a ``proc`` (the ``Popen`` of its current run) and a ``start()`` that runs it again
on the same ports and data. ``check()`` restarts the children that have exited, in the order they were added
(Redis and storage before the worker and the API that need them), counts the restarts and writes them to a status
file. A child that dies again within ``QUICK_EXIT_S`` of its start waits longer each time (1, 2, 4 ... 30 s), so a
child that cannot start does not spin.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

QUICK_EXIT_S = 10.0
MAX_BACKOFF_S = 30.0


@dataclass
class Child:
    name: str
    process: Any  # a local.py process manager
    restarts: int = 0
    quick_exits: int = 0  # exits in a row within QUICK_EXIT_S of a start
    last_exit: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    next_try: float = 0.0

    @property
    def pid(self) -> int | None:
        proc = self.process.proc
        return proc.pid if proc is not None else None

    def running(self) -> bool:
        proc = self.process.proc
        return proc is not None and proc.poll() is None


class Supervisor:
    """Restarts exited children and keeps ``status_path`` (JSON) up to date."""

    def __init__(self, status_path: Path) -> None:
        self.status_path = Path(status_path)
        self.children: dict[str, Child] = {}

    def add(self, name: str, process: Any) -> None:
        self.children[name] = Child(name, process)
        self.write_status()

    def check(self) -> list[str]:
        """Restart every child that has exited and whose wait is over; returns a line per event."""
        events = []
        now = time.monotonic()
        for child in self.children.values():
            if child.running() or now < child.next_try:
                continue
            proc = child.process.proc
            if proc is not None and child.next_try == 0.0:  # a fresh exit: note it once
                child.last_exit = proc.returncode
                quick = now - child.started_at < QUICK_EXIT_S
                child.quick_exits = child.quick_exits + 1 if quick else 0
                events.append(f"{child.name} exited with status {proc.returncode}")
                if child.quick_exits > 1:
                    child.next_try = now + min(MAX_BACKOFF_S, 2.0 ** (child.quick_exits - 2))
                    events.append(f"{child.name} exits soon after each start: next try in "
                                  f"{child.next_try - now:.0f} s")  # fmt: skip
                    continue
            events.append(self._restart(child))
        if events:
            self.write_status()
        return events

    def _restart(self, child: Child) -> str:
        child.restarts += 1
        child.started_at = time.monotonic()
        child.next_try = 0.0
        try:
            child.process.start()
        except (RuntimeError, OSError) as exc:
            child.next_try = time.monotonic() + min(MAX_BACKOFF_S, 2.0 ** child.quick_exits)
            child.quick_exits += 1
            return f"{child.name} did not start again (restart {child.restarts}): {str(exc).splitlines()[0]}"
        return f"{child.name} restarted (pid {child.pid}, {child.restarts} restart{'s' * (child.restarts != 1)} so far)"

    def status(self) -> dict[str, dict[str, Any]]:
        return {c.name: {"pid": c.pid, "running": c.running(), "restarts": c.restarts, "last_exit": c.last_exit}
                for c in self.children.values()}  # fmt: skip

    def summary(self) -> str:
        """One line: each child's state and restart count."""
        return ", ".join(f"{name} {'up' if s['running'] else 'down'} (restarts {s['restarts']})"
                         for name, s in self.status().items())  # fmt: skip

    def write_status(self) -> None:
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "children": self.status()}, indent=2) + "\n")
        tmp.replace(self.status_path)
