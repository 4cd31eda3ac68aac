"""Advisories: the library's advice to a workflow author, e.g. "this loop of 5,000 steps should be a ctx.loop".

An advisory never changes what a run does. Each of the nine codes in `CODES` has a documented trigger, an
info and (for most) a warn threshold, a default message and hint, and a section in docs/advisories.md.
The kernel measures something (steps with one label, branches, seconds, bytes, a budget fraction) and
calls `level_for(code, measure)` or `AdvisoryTracker.check(code, measure, ...)`; the tracker deduplicates
per run, so a condition that holds for 5,000 steps is announced once per severity, not 5,000 times.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal, TextIO, cast

from .._docs import docs_location
from ..errors import ValidationError

__all__ = [
    "Advisory",
    "AdvisoryCode",
    "AdvisoryTracker",
    "CODES",
    "Level",
    "MAX_ACTIVE_CODES",
    "RetryStormWindow",
    "level_for",
]

Level = Literal["info", "warn"]
_RANK: dict[str, int] = {"info": 1, "warn": 2}
DOCS = "docs/advisories.md"

MAX_ACTIVE_CODES = 10
"""Distinct codes one run keeps; an eleventh distinct code is dropped."""

LOOP_SUGGESTED_INFO = 100
LOOP_SUGGESTED_WARN = 1_000
"""Steps with one label, run one after another in one scope."""

FANOUT_CEILING_INFO = 1_000
FANOUT_CEILING_WARN = 10_000
"""Branches of one ctx.parallel."""

RETRY_STORM_INFO = 10
RETRY_STORM_WARN = 50
"""Retries (attempts after a step's first) in one run."""
RETRY_STORM_FAILURE_RATIO = 0.5
"""Share of the recent attempts that must have failed for retries to count as a storm."""
RETRY_STORM_WINDOW = 20
"""How many recent attempts the failure share is taken over."""

STASH_SUGGESTED_INFO_S = 30.0
STASH_SUGGESTED_WARN_S = 300.0
"""Seconds a failed or timed-out attempt ran without ever stashing."""

BUDGET_NEAR_INFO = 0.80
BUDGET_NEAR_WARN = 0.95
"""Fraction of one budget kind spent."""

WAITFOR_NO_TIMEOUT_INFO = 1
"""wait_for calls without timeout= (one is enough)."""

SNAPSHOT_HEAVY_INFO_BYTES = 256 * 1024
SNAPSHOT_HEAVY_WARN_BYTES = 1024 * 1024
"""Encoded size of one loop snapshot."""

SLOW_STEP_NO_TIMEOUT_INFO_S = 60.0
SLOW_STEP_NO_TIMEOUT_WARN_S = 300.0
"""Seconds a step without timeout= took."""

CONCURRENCY_CAPPED_INFO = 1
"""Children of a fan-out beyond the engine concurrency (N - M); any excess at all."""


@dataclass(frozen=True)
class AdvisoryCode:
    """One catalogue entry: what triggers the code, at which measure it is info or warn, and what to do."""

    code: str
    trigger: str
    measure: str
    info_at: float | None
    warn_at: float | None
    message: str
    hint: str
    docs: str = field(default="")

    def __post_init__(self) -> None:
        if not self.docs:
            object.__setattr__(self, "docs", f"{DOCS}#{self.code.lower()}")


CODES: dict[str, AdvisoryCode] = {
    entry.code: entry
    for entry in (
        AdvisoryCode(
            code="LOOP_SUGGESTED",
            trigger=(
                "Many steps with the same label run one after another in one scope (the workflow body, a "
                "parallel branch or a child run). Each is a separate log entry and a separate replay check; "
                "a ctx.loop records one snapshot every N iterations instead."
            ),
            measure="steps with the same label in one scope",
            info_at=LOOP_SUGGESTED_INFO,
            warn_at=LOOP_SUGGESTED_WARN,
            message="{count} steps labelled {label!r} ran one after another in one scope",
            hint=(
                "Turn the loop into `ctx.loop(...)` with `snapshot_every=` so the run records one snapshot "
                "every N iterations instead of one log entry per step."
            ),
        ),
        AdvisoryCode(
            code="FANOUT_CEILING",
            trigger=(
                "One ctx.parallel is given very many branches. Every branch is tracked in the parent run's "
                "log and memory, so resuming and inspecting it get slow."
            ),
            measure="branches of one ctx.parallel",
            info_at=FANOUT_CEILING_INFO,
            warn_at=FANOUT_CEILING_WARN,
            message="a ctx.parallel has {branches} branches",
            hint=(
                "Batch the work (one branch per chunk of items) or start child runs per batch, so each run's "
                "log stays bounded."
            ),
        ),
        AdvisoryCode(
            code="RETRY_STORM",
            trigger=(
                "Within one run, many attempts are retries (attempts after a step's first) while at least "
                f"{RETRY_STORM_FAILURE_RATIO:.0%} of the last {RETRY_STORM_WINDOW} attempts failed: a dependency "
                "is down and every step keeps hammering it."
            ),
            measure="retries in the run, while the recent failure share is high",
            info_at=RETRY_STORM_INFO,
            warn_at=RETRY_STORM_WARN,
            message="{retries} retries in this run, {failure_pct}% of recent attempts failing",
            hint=(
                "Fix or wait out the failing dependency; put a breaker resource in front of it so steps fail "
                "fast while it is down instead of retrying into it."
            ),
        ),
        AdvisoryCode(
            code="STASH_SUGGESTED",
            trigger=(
                "A step attempt ran for a long time and then failed or timed out without ever calling "
                "attempt().stash(): its retry starts again from zero."
            ),
            measure="seconds the failed attempt ran",
            info_at=STASH_SUGGESTED_INFO_S,
            warn_at=STASH_SUGGESTED_WARN_S,
            message="step {label!r} ran {seconds}s and then failed, with no stashed progress",
            hint=(
                "Call `attempt().stash(progress)` every so often inside the step so a retry resumes from the "
                "last stash instead of starting over."
            ),
        ),
        AdvisoryCode(
            code="BUDGET_NEAR",
            trigger=(
                "The run has spent most of one budget kind (cost, tokens, steps...). At 100% the run parks "
                "over_budget before its next step (or raises BudgetExceededError with on_exhausted='raise')."
            ),
            measure="fraction of the budget kind spent (0.0-1.0)",
            info_at=BUDGET_NEAR_INFO,
            warn_at=BUDGET_NEAR_WARN,
            message="{pct}% of the {kind} budget spent ({spent} of {limit})",
            hint=(
                "Raise it now (`durably budget RUN --raise usd=N`) if the run needs more, or spend less per step; "
                "at 100% the run parks over_budget before its next step until the budget is raised."
            ),
        ),
        AdvisoryCode(
            code="WAITFOR_NO_TIMEOUT",
            trigger=(
                "ctx.wait_for(...) was called without timeout=: if the signal never comes the run stays "
                "parked forever."
            ),
            measure="wait_for calls without a timeout",
            info_at=WAITFOR_NO_TIMEOUT_INFO,
            warn_at=None,
            message="wait_for({signal!r}) has no timeout",
            hint=(
                "Pass `timeout=` to `ctx.wait_for(...)` and handle the timeout (escalate, default, fail) so a "
                "lost signal does not park the run forever."
            ),
        ),
        AdvisoryCode(
            code="SNAPSHOT_HEAVY",
            trigger=(
                "A ctx.loop snapshot is large. Snapshots are written every snapshot_every iterations, so a "
                "large one multiplies disk use and slows every write and resume."
            ),
            measure="encoded bytes of one loop snapshot",
            info_at=SNAPSHOT_HEAVY_INFO_BYTES,
            warn_at=SNAPSHOT_HEAVY_WARN_BYTES,
            message="a snapshot of loop {label!r} is {kib} KiB",
            hint=(
                "Keep loop state small: store ids, counters or file paths instead of whole payloads, or raise "
                "`snapshot_every` so big snapshots are written less often."
            ),
        ),
        AdvisoryCode(
            code="SLOW_STEP_NO_TIMEOUT",
            trigger=(
                "A step with no timeout= took a long time. If it ever hangs, nothing stops it and the run "
                "blocks with it."
            ),
            measure="seconds the step took",
            info_at=SLOW_STEP_NO_TIMEOUT_INFO_S,
            warn_at=SLOW_STEP_NO_TIMEOUT_WARN_S,
            message="step {label!r} took {seconds}s and has no timeout=",
            hint=(
                "Give the step `timeout=` somewhat above its normal duration (plus `retry=`) so a hang fails "
                "and retries instead of blocking the run."
            ),
        ),
        AdvisoryCode(
            code="CONCURRENCY_CAPPED",
            trigger=(
                "A fan-out of N children is wider than the engine concurrency M, so only M run at a time and "
                "the rest queue. Measure: N - M (any positive excess)."
            ),
            measure="children beyond the engine concurrency (N - M)",
            info_at=CONCURRENCY_CAPPED_INFO,
            warn_at=None,
            message="a fan-out of {children} children runs at most {concurrency} at a time",
            hint=(
                "Expected if the limit is deliberate. Otherwise raise the engine concurrency above "
                "{concurrency} (for I/O-bound children), or batch the {children} children into fewer, larger ones."
            ),
        ),
    )
}
"""The catalogue: every advisory code with its trigger, thresholds, default message and hint."""


def level_for(code: str, measure: float) -> Level | None:
    """The level `measure` reaches for `code` by the catalogue thresholds, or None below them."""
    entry = _code(code)
    if entry.warn_at is not None and measure >= entry.warn_at:
        return "warn"
    if entry.info_at is not None and measure >= entry.info_at:
        return "info"
    return None


@dataclass
class Advisory:
    """One advisory of a run: code, current level, the message it was last emitted with, and its report count."""

    code: str
    level: Level
    msg: str
    hint: str
    docs: str
    count: int
    first_at: datetime

    def line(self) -> str:
        """The one readable line printed to stderr."""
        return f"durably advisory [{self.level.upper()}] {self.code}: {self.msg} (hint: {self.hint}; docs: " \
               f"{docs_location(self.docs)})"

    def to_dict(self) -> dict[str, Any]:
        """The advisory as JSON types, for the run log and the CLI."""
        return {
            "code": self.code,
            "level": self.level,
            "msg": self.msg,
            "hint": self.hint,
            "docs": self.docs,
            "count": self.count,
            "first_at": self.first_at.isoformat(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Advisory:
        """Rebuild an advisory from `to_dict` output; codes unknown to this version are kept as they are."""
        try:
            code = str(data["code"])
            level = data["level"]
            first_at = data["first_at"]
            if isinstance(first_at, str):
                first_at = datetime.fromisoformat(first_at)
            if level not in _RANK or not isinstance(first_at, datetime):
                raise ValueError(f"bad level {level!r} or first_at {first_at!r}")
            known = CODES.get(code)
            return cls(
                code=code,
                level=level,
                msg=str(data.get("msg", "")),
                hint=str(data.get("hint") or (known.hint if known else "")),
                docs=str(data.get("docs") or (known.docs if known else DOCS)),
                count=int(data.get("count", 1)),
                first_at=first_at,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValidationError(f"not a recorded advisory: {dict(data)!r} ({exc})") from exc


class RetryStormWindow:
    """Rolling outcomes of a run's last attempts plus its retry total; decides the RETRY_STORM level."""

    def __init__(self, size: int = RETRY_STORM_WINDOW) -> None:
        self._failed: deque[bool] = deque(maxlen=size)
        self.retries = 0

    def record(self, *, failed: bool, retry: bool) -> Level | None:
        """Add one attempt's outcome (`retry`: it was not the step's first attempt); return the level now."""
        self._failed.append(failed)
        if retry:
            self.retries += 1
        return self.level()

    @property
    def failure_ratio(self) -> float:
        """Share of the recent attempts that failed (0.0 with no attempts)."""
        return sum(self._failed) / len(self._failed) if self._failed else 0.0

    def level(self) -> Level | None:
        """RETRY_STORM level by the retry total, or None while most recent attempts succeed."""
        if self.failure_ratio < RETRY_STORM_FAILURE_RATIO:
            return None
        return level_for("RETRY_STORM", self.retries)

    def fmt(self) -> dict[str, Any]:
        """The format fields of the RETRY_STORM message."""
        return {"retries": self.retries, "failure_pct": round(self.failure_ratio * 100)}


class AdvisoryTracker:
    """A run's advisories: deduplicated by code, emitted once per severity crossing, at most ten codes."""

    def __init__(
        self,
        run_id: str,
        *,
        now: Callable[[], datetime],
        on_advisory: Callable[[Advisory], None] | None = None,
        silent: bool = False,
        stream: TextIO | None = None,
        restored: Iterable[Advisory] = (),
    ) -> None:
        self.run_id = run_id
        self._now = now
        self._on_advisory = on_advisory
        self._silent = silent
        self._stream = stream
        self._lock = threading.Lock()
        self._active: dict[str, Advisory] = {}
        self._printed: set[tuple[str, str]] = set()
        for advisory in restored:
            self._active[advisory.code] = replace(advisory)
            self._printed.add((advisory.code, advisory.level))

    def report(self, code: str, level: str, msg: str, **fmt: Any) -> Advisory | None:
        """Count one occurrence; return the advisory (and call back, print) only when its severity rises."""
        entry = _code(code)
        if level not in _RANK:
            raise ValidationError(f"advisory level must be 'info' or 'warn', got {level!r}")
        with self._lock:
            lvl = cast(Level, level)
            current = self._active.get(code)
            if current is None:
                if len(self._active) >= MAX_ACTIVE_CODES:
                    return None
                current = Advisory(code, lvl, _format(msg, fmt), _format(entry.hint, fmt), entry.docs, 1, self._now())
                self._active[code] = current
            else:
                current.count += 1
                if _RANK[level] <= _RANK[current.level]:
                    return None
                current.level = lvl
                current.msg = _format(msg, fmt)
                current.hint = _format(entry.hint, fmt)
            emitted = replace(current)
            if not self._silent and (code, level) not in self._printed:
                self._printed.add((code, level))
                self._print(emitted.line())
        if self._on_advisory is not None:
            try:
                self._on_advisory(emitted)
            except Exception:
                pass
        return emitted

    def check(self, code: str, measure: float, msg: str | None = None, **fmt: Any) -> Advisory | None:
        """Report `code` if `measure` reaches a catalogue threshold, with the catalogue message by default."""
        level = level_for(code, measure)
        if level is None:
            return None
        return self.report(code, level, CODES[code].message if msg is None else msg, **{"measure": measure, **fmt})

    def active(self) -> list[Advisory]:
        """Copies of the run's advisories, in the order they first appeared."""
        with self._lock:
            return [replace(advisory) for advisory in self._active.values()]

    def _print(self, line: str) -> None:
        """Write one line to the stream (stderr at print time by default); a broken stream is ignored."""
        stream = self._stream if self._stream is not None else sys.stderr
        try:
            stream.write(line + "\n")
            stream.flush()
        except Exception:
            pass


class _Keep(dict):
    """Format fields that leave unknown `{names}` in place."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _format(template: str, fmt: Mapping[str, Any]) -> str:
    """`template` filled from `fmt`; never raises, since a bad template must not fail a run."""
    if not fmt:
        return template
    try:
        return template.format_map(_Keep(fmt))
    except Exception:
        return template


def _code(code: str) -> AdvisoryCode:
    """The catalogue entry for `code`, or ValidationError for an unknown code."""
    try:
        return CODES[code]
    except KeyError:
        raise ValidationError(f"unknown advisory code {code!r}; known: {', '.join(CODES)}") from None
