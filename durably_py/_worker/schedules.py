"""Schedules: start a workflow on a five-field cron, each tick exactly once across every worker.

A schedule is declared in code (`durably_py.schedule(...)` at module level of a script or module that a
worker imports, or `engine.schedule(...)`); every engine loop that serves it calls `fire_due` once per poll.
Each tick is a run whose key is ``NAME@<tick time ISO>``: the first process to bind that key creates the run,
so workers racing on one tick agree on one run, and a key bound once is never fired again.

Three rules keep firing predictable after restarts and deploys:
- a schedule's registration instant is recorded durably the first time any process declares it (per name
  and cron expression); a tick from before it never fires;
- only the latest tick at or before now fires, so after downtime at most one missed tick is caught up;
- cron expressions are evaluated in UTC, at minute resolution.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from .. import _ids
from .._authoring.workflow import Workflow, as_workflow
from .._clock import Clock
from .._codec import digest, dump_value, load_value, to_iso
from ..errors import ValidationError
from ..storage.base import Storage

__all__ = ["SCHEDULES", "Schedule", "ScheduleState", "fire_due", "next_tick", "schedule", "states"]

DOCS = "docs/authoring.md#schedules"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}\Z")
ORPHAN_AFTER = 5.0
"""Seconds a tick's key may stay bound without a run before another process takes the tick over (the process
that bound it died before writing the run's header)."""


def _cron() -> Any:
    from cronsim import CronSim, CronSimError

    return CronSim, CronSimError


@dataclass(frozen=True)
class Schedule:
    """A workflow started on every tick of a five-field cron expression (UTC), with a fixed input."""

    name: str
    workflow: Workflow
    cron: str
    input: Any = None
    wire_input: Any = field(default=None, repr=False, compare=False)

    def key(self, tick: datetime) -> str:
        """The run key of one tick: ``NAME@2026-01-01T10:05:00Z``."""
        return f"{self.name}@{to_iso(tick)}"

    def next_tick(self, after: datetime) -> datetime:
        """The first tick strictly after `after`."""
        cron_sim, _ = _cron()
        return next(iter(cron_sim(self.cron, after.astimezone(UTC))))

    def last_tick(self, at: datetime) -> datetime:
        """The latest tick at or before `at`."""
        cron_sim, _ = _cron()
        upper = at.astimezone(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
        return next(iter(cron_sim(self.cron, upper, reverse=True)))


@dataclass
class ScheduleState:
    """What `durably schedules` shows: a schedule, since when it is registered, its last and next tick."""

    name: str
    workflow: str
    cron: str
    input: Any
    registered_at: datetime | None
    last_tick: datetime | None
    last_run: str | None
    next_tick: datetime


class ScheduleHost(Protocol):
    """What firing schedules asks of the engine serving them: its storage and clock, its own schedules, and
    writing the header of a tick's run (`Engine.create_run`). `Engine` is one."""

    @property
    def storage(self) -> Storage: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def schedules(self) -> dict[str, Schedule]: ...

    def create_run(self, run_id: str, workflow: Workflow, wire_input: Any, input_digest: str, key: str | None,
                   identity: str, *, scheduled_at: datetime | None = None) -> None: ...


SCHEDULES: dict[str, Schedule] = {}
"""Schedules declared with `durably_py.schedule(...)` in this process, by name."""


def check(wf: Any, cron: Any, input: Any, name: Any) -> Schedule:
    """Validate a schedule's parts; the cron library parses the expression now, so a typo fails at import."""
    workflow = as_workflow(wf)
    name = workflow.name if name is None else name
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValidationError(f"a schedule name is 1-100 letters, digits, '_', '-', '.' or ':', got {name!r}",
                              hint="schedule(report, cron='0 9 * * *', name='morning-report')", docs=DOCS)
    if not isinstance(cron, str) or len(cron.split()) != 5:
        raise ValidationError(f"schedule {name!r}: cron= must be five fields (minute hour day month weekday), "
                              f"got {cron!r}", hint="cron='*/5 * * * *' fires every five minutes (UTC).", docs=DOCS)
    cron_sim, cron_error = _cron()
    try:
        cron_sim(cron, datetime.now(UTC))
    except cron_error as exc:
        raise ValidationError(f"schedule {name!r}: cron expression {cron!r} is invalid: {exc}",
                              hint="Five fields: minute hour day-of-month month day-of-week, e.g. '30 2 * * 1-5'.",
                              docs=DOCS) from None
    schema = workflow.input_schema
    wire = dump_value(schema.to_builtins(input) if schema else input, f"input of schedule {name!r}")
    return Schedule(name, workflow, " ".join(cron.split()), input, wire)


def schedule(wf: Any, cron: str, *, input: Any = None, name: str | None = None) -> Schedule:
    """Declare that `wf(input)` starts on every tick of `cron` (five fields, UTC) in every worker serving it.

    Call it at module level of a script or module that `durably worker --import` loads. Declaring the same
    name again replaces the earlier declaration in this process."""
    declared = check(wf, cron, input, name)
    SCHEDULES[declared.name] = declared
    return declared


def registered_since(storage: Storage, item: Schedule, now: datetime) -> datetime:
    """The instant this schedule (name and cron) was first declared against this storage; recorded once."""
    identity = f"schedule:{item.name}:{item.cron}"
    stamp = storage.lookup(identity)
    if stamp is None:
        mine = f"since-{int(now.timestamp())}"
        if storage.bind(identity, mine, expect=None):
            stamp = mine
        else:
            stamp = storage.lookup(identity) or mine
    return datetime.fromtimestamp(int(stamp.rpartition("-")[2]), UTC)


def _recorded_since(storage: Storage, item: Schedule) -> datetime | None:
    stamp = storage.lookup(f"schedule:{item.name}:{item.cron}")
    return datetime.fromtimestamp(int(stamp.rpartition("-")[2]), UTC) if stamp else None


_orphans: dict[tuple[int, str], float] = {}


def _claim(engine: ScheduleHost, item: Schedule, tick: datetime) -> str | None:
    """Create the run of one tick if no process did; its id, or None when the tick is (being) fired elsewhere."""
    storage = engine.storage
    key = item.key(tick)
    identity = f"key:{key}"
    found = storage.lookup(identity)
    if found is not None:
        if storage.info(found) is not None:
            _orphans.pop((id(storage), identity), None)
            return None
        first = _orphans.setdefault((id(storage), identity), time.monotonic())
        if time.monotonic() - first < ORPHAN_AFTER:
            return None
    run_id = _ids.new_run_id(item.workflow.name)
    if not storage.bind(identity, run_id, expect=found):
        return None
    _orphans.pop((id(storage), identity), None)
    engine.create_run(run_id, item.workflow, item.wire_input, digest(load_value(item.wire_input)), key, identity,
                      scheduled_at=tick)
    return run_id


def all_schedules(engine: ScheduleHost) -> list[Schedule]:
    """The schedules an engine serves: those declared in this process, and its own (which win by name)."""
    return list({**SCHEDULES, **engine.schedules}.values())


async def fire_due(engine: ScheduleHost, now: datetime | None = None) -> list[str]:
    """Queue every schedule's latest due tick that no process queued yet; the ids of the runs queued here.

    The run is recorded `pending` in the storage's queue, due at once, for any worker to claim. The worker
    loop calls this once per poll; any number of processes may call it at once."""
    now = now or engine.clock.now()
    fired = []
    for item in all_schedules(engine):
        since = registered_since(engine.storage, item, now)
        tick = item.last_tick(now)
        if tick < since:
            continue
        run_id = _claim(engine, item, tick)
        if run_id is not None:
            fired.append(run_id)
    return fired


def next_tick(item: Schedule, now: datetime | None = None) -> datetime:
    """The next tick of a schedule after `now`."""
    return item.next_tick(now or datetime.now(UTC))


def states(engine: ScheduleHost, now: datetime | None = None) -> list[ScheduleState]:
    """Every schedule the engine serves, with its registration, latest fired tick and next tick."""
    now = now or engine.clock.now()
    out = []
    for item in sorted(all_schedules(engine), key=lambda s: s.name):
        since = _recorded_since(engine.storage, item)
        last = item.last_tick(now)
        run = engine.storage.lookup(f"key:{item.key(last)}")
        fired = run is not None and engine.storage.info(run) is not None
        out.append(ScheduleState(item.name, item.workflow.name, item.cron, load_value(item.wire_input), since,
                                 last if fired else None, run if fired else None, item.next_tick(now)))
    return out
