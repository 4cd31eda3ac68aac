"""The durable queue as the engine sees it: what makes a run due, and where a parked run goes back in.

Every run has a queue entry in its storage from creation until the engine records its end (see
`durably_py.storage.base`). The engine moves the entry at the moments that change when a run is next due:

- created (`run`, `enqueue`, a child): due at once, or after `delay`, with its `priority`;
- parked on `ctx.sleep`: due at the wake time; on `ctx.wait_for`: due at the deadline (or only when woken),
  and woken at once by a signal with a name it waits for (`Storage.send` wakes it);
- parked in a join (a run a worker serves waits in `ctx.join` / `ctx.join_all`, or at its end for attached
  children): due only when the last child it waits for ends (`Storage.join_wait`; the child's
  `Storage.unschedule` makes it due, atomically with leaving the queue itself);
- parked in a retry backoff of at least `PARK_BACKOFF` seconds (a run a worker serves): due when it ends;
- paused: due only when resumed; stopped by a worker's graceful stop, or claimed by a process that runs
  it in place: due at once (so it is taken over at once should that process die);
- stale (its replay stopped with `StaleRunError`): due only when someone retries it;
- ended: out of the queue.

A run whose entry is due and that no live owner holds is due, which is also how an orphan (its process
killed, its lease lapsed) comes back: its entry stayed due while it ran.
"""

from __future__ import annotations

import time
from typing import Any

from .codec import from_iso
from .errors import ValidationError
from .history import History

QUEUE_DOCS = "docs/running.md#the-queue"
PARK_BACKOFF = 5.0
"""A retry backoff at least this long parks a run a worker serves (due at the backoff's end, its process free
meanwhile); a shorter one is waited out in place, as every backoff is in a run with no worker."""


def check_priority(priority: Any) -> int:
    """Validate `priority=` (an int; higher runs first)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 2**62:
        raise ValidationError(f"priority= must be an int, got {priority!r}", hint="Higher runs first: priority=10.",
                              docs=QUEUE_DOCS)
    return priority


def check_delay(delay: Any) -> float:
    """Validate `delay=` (seconds >= 0 before the run is due)."""
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay < 1e10:
        raise ValidationError(f"delay= must be seconds >= 0, got {delay!r}",
                              hint="delay=60 makes the run due a minute from now.", docs=QUEUE_DOCS)
    return float(delay)


def park_entry(history: History, status: str) -> tuple[float | None, tuple[str, ...]]:
    """When a run parked with `status` is next due, and which signal names wake it earlier.

    Sleeps wake at their earliest open wake time, a parked retry backoff at its end; waits at their earliest
    deadline (None: only a signal);
    a paused or stale run only when an operation moves it; a run stopped by its worker at once."""
    if status in ("paused", "stale"):
        return None, ()
    if status not in ("sleeping", "waiting"):
        return time.time(), ()
    times: list[float] = []
    names: list[str] = []
    if history.park is not None and history.park.until is not None:
        times.append(from_iso(history.park.until).timestamp())
    for path, wake in history.wakes.items():
        if path not in history.done:
            times.append(from_iso(wake["at"]).timestamp())
    for path, wait in history.waits.items():
        if path not in history.done:
            names.append(wait["name"])
            if wait.get("deadline"):
                times.append(from_iso(wait["deadline"]).timestamp())
    if not times and not names:
        return time.time(), ()
    return (min(times) if times else None), tuple(dict.fromkeys(names))
