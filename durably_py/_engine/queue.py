"""The durable queue as the engine sees it: what makes a run due, and where a parked run goes back in.

Every run has a queue entry in its storage from creation until the engine records its end (see
`durably_py.storage.base`). The engine moves the entry at the moments that change when a run is next due:

- created (`run`, `enqueue`, a child): due at once, or after `delay`, with its `priority`; an attached child
  its parent runs in the parent's process has no entry (the parent's stands for it, see `ChildRuns`);
- parked on `ctx.sleep`: due at the wake time; on `ctx.wait_for`: due at the deadline (or only when woken),
  and woken at once by a signal with a name it waits for (`Storage.send` wakes it);
- parked in a join (a run a worker serves waits in `ctx.join` / `ctx.join_all`, or at its end for attached
  children): due only when the last child it waits for ends (`Storage.join_wait`; the child's
  `Storage.unschedule` makes it due, atomically with leaving the queue itself);
- parked in a retry backoff of at least `PARK_BACKOFF` seconds (a run a worker serves; `_replay.kernel`): due when it ends;
- paused: due only when resumed; stopped by a worker's graceful stop, or claimed by a process that runs
  it in place: due at once (so it is taken over at once should that process die);
- stale (its replay stopped with `StaleRunError`): due only when someone retries it;
- ended: out of the queue.

A run whose entry is due and that no live owner holds is due, which is also how an orphan (its process
killed, its lease lapsed) comes back: its entry stayed due while it ran.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import _ids
from .._authoring.calls import RunHandle
from .._authoring.workflow import Workflow, as_workflow
from ..errors import ValidationError
from ..storage import Storage, validate_key
from ..storage.base import NewRun
from .identity import Identities, identity_of, new_header

if TYPE_CHECKING:
    from .._worker.worker import Worker

ENQUEUE_BATCH = 1000
"""New runs `Engine.enqueue_many` writes in one durable write (`Storage.create_bound`)."""

QUEUE_DOCS = "docs/running.md#the-queue"


def _item(run: Any) -> tuple[Any, Any, str | None]:
    """One `enqueue_many` item as (workflow, input, key), checked."""
    if not isinstance(run, tuple) or len(run) not in (2, 3):
        raise ValidationError(f"enqueue_many takes (workflow, input) or (workflow, input, key) items, got {run!r}",
                              hint="engine.enqueue_many([(job, 1), (job, 2, 'nightly-2')])", docs=QUEUE_DOCS)
    key = run[2] if len(run) == 3 else None
    if key is not None:
        validate_key(key)
    return as_workflow(run[0]), run[1], key


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


class RunQueue:
    """The durable queue as one engine writes it (`Engine.queue`): enqueueing runs, and the worker this
    engine started (`Engine.start`), poked when new work is due."""

    def __init__(self, storage: Storage, identities: Identities) -> None:
        self.storage = storage
        self.identities = identities
        self.worker: Worker | None = None
        self.enqueued: set[str] = set()

    def poke(self) -> None:
        """New due work may be in the queue: this engine's worker (if started) looks for it at once."""
        if self.worker is not None:
            self.worker.poke()

    def live_worker(self) -> Worker | None:
        """This engine's worker while it runs (None: not started, or stopped)."""
        return None if self.worker is None or self.worker.finished else self.worker

    async def enqueue(self, workflow: Workflow, input: Any, key: str | None, priority: int, delay: float,
                      budget: dict[str, float] | None) -> RunHandle:
        """The body of `Engine.enqueue`, whose docstring says what it does (its arguments checked already)."""
        run_id = await self.identities.identify(workflow, input, key, False, budget, at=time.time() + delay,
                                                priority=priority)
        self.enqueued.add(run_id)
        self.poke()
        return RunHandle(run_id, workflow)

    async def enqueue_many(self, runs: Iterable[tuple[Any, ...]], *, priority: int, delay: float,
                           budget: dict[str, float] | None) -> list[RunHandle]:
        """The body of `Engine.enqueue_many`, whose docstring says what it does (`priority`, `delay` and
        `budget` checked already; each item is checked here before anything is written)."""
        items = [_item(run) for run in runs]
        named = [(workflow, input, key, *identity_of(workflow, input, key)) for workflow, input, key in items]
        at = time.time() + delay if delay else None
        ids: list[str | None] = [None] * len(named)
        for start in range(0, len(named), ENQUEUE_BATCH):
            chunk = range(start, min(start + ENQUEUE_BATCH, len(named)))
            await self._enqueue_chunk(named, chunk, ids, at, priority, budget)
        self.enqueued.update(r for r in ids if r is not None)
        self.poke()
        return [RunHandle(run_id, workflow) for run_id, (workflow, *_) in zip(ids, named, strict=True)
                if run_id is not None]

    async def _enqueue_chunk(self, named: list[tuple[Any, ...]], chunk: range, ids: list[str | None],
                             at: float | None, priority: int, budget: dict[str, float] | None) -> None:
        """Find or create the runs of `chunk` (indexes into `named`), new ones in one `create_bound`; an item
        whose identity another process is binding right now, or lost to one, goes the way `enqueue` goes."""
        storage = self.storage
        first: dict[str, int] = {}  # identity -> the first item of the chunk naming it
        for i in chunk:
            first.setdefault(named[i][5], i)
        unique = list(first.values())
        fresh: list[int] = []
        slow: list[int] = []
        bound = storage.lookup_many([named[i][5] for i in unique])
        expect: dict[int, str | None] = {}
        for i, previous in zip(unique, bound, strict=True):
            workflow, input, key, wire_input, input_digest, identity = named[i]
            if previous is None:
                fresh.append(i)
                expect[i] = None
                continue
            info = storage.info(previous)
            if info is None:
                slow.append(i)  # bound by another process that is writing its header now
                continue
            self.identities.valid(info)
            if key is not None and info.input_digest != input_digest:
                slow.append(i)  # `enqueue` raises the key conflict, naming the bound run
                continue
            if info.end_status in ("completed", "cancelled"):
                fresh.append(i)
                expect[i] = previous
                continue
            ids[i] = previous
        batch = []
        for i in fresh:
            workflow, input, key, wire_input, input_digest, identity = named[i]
            run_id = _ids.new_run_id(workflow.name)
            header = new_header(run_id, workflow, wire_input, input_digest, key, identity, budget)
            batch.append(NewRun(run_id, header, identity, expect[i], at=at, priority=priority))
        lost = storage.create_bound(batch) if batch else None
        for n, run in enumerate(batch):
            if lost is not None and run.identity == lost:
                slow.extend(fresh[n:])
                break
            ids[fresh[n]] = run.run_id
        for i in sorted(slow):
            workflow, input, key, *_ = named[i]
            ids[i] = await self.identities.identify(workflow, input, key, False, budget, at=at, priority=priority)
        for i in chunk:
            if ids[i] is None:
                ids[i] = ids[first[named[i][5]]]
