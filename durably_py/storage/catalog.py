"""The run catalog every adapter keeps: which runs exist and what a listing filters and orders them by.

An adapter answers `list_runs` and `count_runs` from an index, never by reading every log. Each run's entry
holds what its header says (workflow, key, parent) and two things the adapter learns without interpreting
the log beyond its last record:

- `state`: ``"open"`` while the run has not ended, else the status of its end record (``"completed"``,
  ``"failed"``, ``"cancelled"``). The engine derives the finer statuses (running, sleeping, waiting, paused,
  stale, interrupted, ...) from an open run's log, as `inspect` does.
- `updated`: when the run was last active (epoch seconds), the listing's order (newest first).

`RunFilter` is the one description of a listing's filters; the SQL adapters turn it into a WHERE clause
over indexed columns, the memory adapter matches it in Python, the file adapter queries its index database.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import ValidationError
from ..records import is_end_line, is_open_line, kind_of, may_change_state
from .base import DEFAULT_QUEUE

OPEN = "open"
ENDED = ("completed", "failed", "cancelled")
STATES = (OPEN, *ENDED)

_OPENERS = ("reopen", "reset")
_LINE = msgspec.json.Decoder(dict[str, Any])


def state_of(records: Any) -> str:
    """A run's catalog state from its records (typed or dicts), oldest first: the status of its last end
    record, unless a later reopen or reset record opened it again; "open" for a log without a run header
    (so the engine reads it, and lists it as damaged, instead of trusting an end)."""
    state = OPEN
    for number, record in enumerate(records):
        kind = kind_of(record)
        if number == 0 and kind != "run":
            return OPEN
        if kind == "end":
            status = record.get("status")
            state = status if status in ENDED else OPEN
        elif kind in _OPENERS:
            state = OPEN
    return state


def state_after(state: str, data: bytes | bytearray) -> str:
    """The catalog state of a run in `state` once the complete record lines `data` are appended: unchanged
    (three substring checks) unless `data` holds an end, reopen or reset record."""
    if not may_change_state(data):
        return state
    for line in bytes(data).split(b"\n"):
        if is_end_line(line):
            try:
                status = _LINE.decode(line).get("status")
            except msgspec.DecodeError:
                continue
            state = status if status in ENDED else OPEN
        elif is_open_line(line):
            state = OPEN
    return state


def header_fields(header: Any) -> tuple[str | None, str | None, str | None]:
    """(workflow, key, parent) of a decoded header, each None unless a string."""
    if not isinstance(header, dict) and not hasattr(header, "get"):
        return None, None, None
    found = [header.get(name) for name in ("workflow", "key", "parent")]
    return tuple(value if isinstance(value, str) else None for value in found)  # type: ignore[return-value]


def queue_fields(header: Any) -> tuple[str, str | None]:
    """(queue, partition) a decoded header places its run in: its "queue" ("default" unless a non-empty string)
    and its "partition" (None unless a non-empty string), as `QueueEntry` keeps them."""
    if not isinstance(header, dict) and not hasattr(header, "get"):
        return DEFAULT_QUEUE, None
    queue, partition = header.get("queue"), header.get("partition")
    return (queue if isinstance(queue, str) and queue else DEFAULT_QUEUE,
            partition if isinstance(partition, str) and partition else None)


def _text(name: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValidationError(f"{name}= must be a string, got {value!r}")
    return value


def _time(name: str, value: object) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValidationError(f"{name}= must be epoch seconds, got {value!r}")
    return None if value is None else float(value)


@dataclass(frozen=True)
class RunFilter:
    """Which runs a listing keeps: every given field must match (None: any)."""

    state: tuple[str, ...] | None = None  # catalog states (any of them)
    workflow: str | None = None
    key: str | None = None  # exact key
    key_prefix: str | None = None  # the start of the key (runs without a key never match)
    search: str | None = None  # a case-insensitive substring of the run id, workflow or key
    parent: str | None = None  # the parent run's id (child runs of it)
    since: float | None = None  # last active at or after (epoch seconds)
    until: float | None = None  # last active at or before (epoch seconds)

    @classmethod
    def of(cls, *, state: str | Iterable[str] | None = None, workflow: str | None = None, key: str | None = None,
           key_prefix: str | None = None, search: str | None = None, parent: str | None = None,
           since: float | None = None, until: float | None = None) -> RunFilter:
        """A validated filter from `list_runs`'s keyword arguments."""
        states: tuple[str, ...] | None = None
        if state is not None:
            states = (state,) if isinstance(state, str) else tuple(state)
            bad = [s for s in states if s not in STATES]
            if bad:
                raise ValidationError(f"unknown catalog state {bad[0]!r}",
                                      hint=f"A storage adapter lists by {', '.join(STATES)}.")
        return cls(states, _text("workflow", workflow), _text("key", key), _text("key_prefix", key_prefix),
                   _text("search", search) or None, _text("parent", parent), _time("since", since),
                   _time("until", until))

    def matches(self, run_id: str, state: str, workflow: str | None, key: str | None, parent: str | None,
                updated: float) -> bool:
        """Whether one entry passes (for adapters that filter in Python)."""
        if self.state is not None and state not in self.state:
            return False
        if self.workflow is not None and workflow != self.workflow:
            return False
        if self.key is not None and key != self.key:
            return False
        if self.key_prefix is not None and (key is None or not key.startswith(self.key_prefix)):
            return False
        if self.parent is not None and parent != self.parent:
            return False
        if self.since is not None and updated < self.since:
            return False
        if self.until is not None and updated > self.until:
            return False
        if self.search is not None:
            needle = self.search.lower()
            if not any(needle in (text or "").lower() for text in (run_id, workflow, key)):
                return False
        return True

    def where(self, mark: str = "?", seconds: str = "{}") -> tuple[str, list[Any]]:
        """A SQL condition over columns run_id, state, workflow, key, parent, updated (`mark`: the driver's
        placeholder; `seconds`: how a time in epoch seconds becomes comparable with ``updated``) and its
        parameters; "" when nothing is filtered."""
        parts: list[str] = []
        params: list[Any] = []
        if self.state is not None:
            parts.append(f"state IN ({', '.join([mark] * len(self.state))})" if self.state else "1 = 0")
            params.extend(self.state)
        for column, value in (("workflow", self.workflow), ("key", self.key), ("parent", self.parent)):
            if value is not None:
                parts.append(f"{column} = {mark}")
                params.append(value)
        if self.key_prefix is not None:
            parts.append(f"substr(key, 1, {len(self.key_prefix)}) = {mark}")  # LIKE ignores case in SQLite
            params.append(self.key_prefix)
        if self.since is not None:
            parts.append(f"updated >= {seconds.format(mark)}")
            params.append(self.since)
        if self.until is not None:
            parts.append(f"updated <= {seconds.format(mark)}")
            params.append(self.until)
        if self.search is not None:
            needle = "%" + _like(self.search.lower()) + "%"
            parts.append(" OR ".join(f"lower(coalesce({c}, '')) LIKE {mark} ESCAPE '\\'"
                                     for c in ("run_id", "workflow", "key")).join("()"))
            params.extend([needle] * 3)
        return " AND ".join(parts), params


def _like(text: str) -> str:
    """`text` with LIKE's wildcards escaped."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def validate_page(limit: object, offset: object) -> tuple[int | None, int]:
    """`limit` (None or an int >= 0) and `offset` (an int >= 0) of a listing."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValidationError(f"limit= must be None or an int >= 0, got {limit!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValidationError(f"offset= must be an int >= 0, got {offset!r}")
    return limit, offset
