"""Where a run's time went: every step attempt, backoff, sleep and wait as a span in wall-clock time.

`History` keeps only what replay needs (a step's final record); a timeline keeps every attempt, so
retries and the backoff between them stay visible. Built from the records a storage returns, in log
order, with no code of the workflow imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..records import kind_of
from .history import path_tuple

INTERNAL = ("ctx.sleep", "ctx.wait_for")


@dataclass
class Span:
    """One stretch of a run's time.

    `kind` is "attempt" (a step attempt ran), "backoff" (waiting to retry: status "retrying", `end` the
    retry time), "sleep" (`ctx.sleep`), "wait" (`ctx.wait_for`) or "snapshot" (a `ctx.loop`'s latest snapshot,
    an instant: its loop's row, its iteration in `detail`). An attempt is "ok" or "failed"; a
    sleep, a wait or a begun `replay="unsafe"` step is "sleeping", "waiting" or "running" while it is
    open (`end` is None). Times are seconds since the epoch."""

    path: tuple[int, ...]
    label: str
    kind: str
    status: str
    attempt: int
    start: float
    end: float | None
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form."""
        return {"path": list(self.path), "label": self.label, "kind": self.kind, "status": self.status,
                "attempt": self.attempt, "start": self.start, "end": self.end, "detail": self.detail}


def epoch(iso: Any) -> float | None:
    """A recorded ISO 8601 time as epoch seconds (None when it is not one)."""
    try:
        return datetime.fromisoformat(iso).timestamp() if isinstance(iso, str) else None
    except ValueError:
        return None


def _error(rec: dict[str, Any]) -> str | None:
    error = rec.get("e")
    if not isinstance(error, dict):
        return None
    return f"{str(error.get('type', '')).rpartition(':')[2]}: {error.get('message', '')}"


def spans(records: list[dict[str, Any]]) -> list[Span]:
    """The spans of a run's log (header first), ordered by start time then path."""
    out: list[Span] = []
    open_: dict[str, Span] = {}  # sleeps, waits and begun unsafe steps still without their result
    snapshots: dict[str, Span] = {}  # each loop's latest snapshot (one span per loop, however many iterations)

    def finish(path: str, ts: float, status: str) -> bool:
        span = open_.pop(path, None)
        if span is None:
            return False
        span.end, span.status = max(ts, span.start), status
        return True

    for rec in records[1:]:
        t = kind_of(rec)
        path = rec.get("p")
        ts = rec.get("ts")
        if not isinstance(path, str) or not isinstance(ts, int | float):
            continue
        try:
            where = path_tuple(path)
        except ValueError:
            continue
        if t == "snap":
            snapshots[path] = Span(where, "ctx.loop", "snapshot", "ok", 1, ts, ts,
                                   f"iteration {rec.get('i')} done (snapshot)")
        elif t == "wake":
            span = Span(where, "ctx.sleep", "sleep", "sleeping", 1, ts, None, f"until {rec.get('at')}")
            open_[path] = span
            out.append(span)
        elif t == "wait":
            span = Span(where, "ctx.wait_for", "wait", "waiting", 1, ts, None, f"signal {rec.get('name')!r}")
            open_[path] = span
            out.append(span)
        elif t == "start":
            span = Span(where, str(rec.get("l", "")), "attempt", "running", int(rec.get("a", 1)), ts, None)
            open_[path] = span
            out.append(span)
        elif t in ("ok", "err", "fail"):
            status = "ok" if t == "ok" else "failed"
            label = str(rec.get("l", ""))
            if label in INTERNAL and finish(path, ts, status):
                continue
            ms = rec["ms"] if isinstance(rec.get("ms"), int | float) else 0.0
            opened = open_.pop(path, None)
            start = ts - ms / 1000 if opened is None else min(opened.start, ts - ms / 1000) if ms else opened.start
            if opened is not None:
                out.remove(opened)
            detail = _error(rec)
            if t == "ok" and label == "ctx.spawn" and isinstance(rec.get("v"), dict):
                detail = f"child {rec['v'].get('run_id')}"
            out.append(Span(where, label, "attempt", status, int(rec.get("a", 1)), start, ts, detail))
            if t == "fail":
                until = epoch(rec.get("next"))
                if until is not None:
                    out.append(Span(where, label, "backoff", "retrying", int(rec.get("a", 1)), ts, max(until, ts),
                                    f"retry {int(rec.get('a', 1)) + 1} at {rec.get('next')}"))
    out.extend(snapshots.values())
    out.sort(key=lambda s: (s.start, s.path))
    return out
