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

from .._authoring.workflow import as_workflow
from .._engine.children import joined
from .._state.history import History
from ..errors import ValidationError
from ..storage import validate_key
from ..storage.base import NewRun

if TYPE_CHECKING:
    from .._authoring.calls import RunHandle
    from .._engine.engine import Engine
    from .worker import Worker

JOIN_POLL = 0.05
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
    """The durable queue as one engine works it (`Engine.queue`): enqueueing runs, this process's worker, and
    waiting for enqueued runs to end or for the queue to drain.

    What `RunQueue` needs from above it (the engine's checks, `RunHandle`, `Worker`) it imports when called."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.worker: Worker | None = None
        self.enqueued: set[str] = set()

    def poke(self) -> None:
        """New due work may be in the queue: this engine's worker (if started) looks for it at once."""
        if self.worker is not None:
            self.worker.poke()

    async def enqueue(self, wf: Any, input: Any = None, *, key: str | None = None, priority: int = 0,
                      delay: float = 0.0, budget: dict[str, float] | None = None,
                      checkpoint_every: int | None = None) -> RunHandle:
        """The body of `Engine.enqueue`, whose docstring says what it does."""
        from .._authoring.calls import RunHandle
        from .._engine.engine import check_budget, check_checkpoint

        workflow = as_workflow(wf)
        priority = check_priority(priority)
        delay = check_delay(delay)
        budget = check_budget(budget) if budget is not None else self.engine.budget
        check_checkpoint(checkpoint_every)
        if key is not None:
            validate_key(key)
        run_id = await self.engine._identify(workflow, input, key, False, budget, at=time.time() + delay,
                                             priority=priority)
        self.enqueued.add(run_id)
        self.poke()
        return RunHandle(run_id, workflow)

    async def enqueue_many(self, runs: Iterable[tuple[Any, ...]], *, priority: int = 0, delay: float = 0.0,
                           budget: dict[str, float] | None = None) -> list[RunHandle]:
        """The body of `Engine.enqueue_many`, whose docstring says what it does."""
        from .._authoring.calls import RunHandle
        from .._engine.engine import check_budget, new_run_id

        priority = check_priority(priority)
        delay = check_delay(delay)
        budget = check_budget(budget) if budget is not None else self.engine.budget
        items = [_item(run) for run in runs]
        engine = self.engine
        named = [(workflow, input, key, *engine._identity_of(workflow, input, key)) for workflow, input, key in items]
        at = time.time() + delay if delay else None
        ids: list[str | None] = [None] * len(named)
        for start in range(0, len(named), ENQUEUE_BATCH):
            chunk = range(start, min(start + ENQUEUE_BATCH, len(named)))
            await self._enqueue_chunk(named, chunk, ids, at, priority, budget, new_run_id)
        self.enqueued.update(r for r in ids if r is not None)
        self.poke()
        return [RunHandle(run_id, workflow) for run_id, (workflow, *_) in zip(ids, named, strict=True)
                if run_id is not None]

    async def _enqueue_chunk(self, named: list[tuple[Any, ...]], chunk: range, ids: list[str | None],
                             at: float | None, priority: int, budget: dict[str, float] | None,
                             new_run_id: Any) -> None:
        """Find or create the runs of `chunk` (indexes into `named`), new ones in one `create_bound`; an item
        whose identity another process is binding right now, or lost to one, goes the way `enqueue` goes."""
        engine = self.engine
        storage = engine.storage
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
            engine._valid(info)
            if key is not None and info.header.get("input_digest") != input_digest:
                slow.append(i)  # `enqueue` raises the key conflict, naming the bound run
                continue
            if info.last.get("t") == "end" and info.last.get("status") in ("completed", "cancelled"):
                fresh.append(i)
                expect[i] = previous
                continue
            ids[i] = previous
        batch = []
        for i in fresh:
            workflow, input, key, wire_input, input_digest, identity = named[i]
            run_id = new_run_id(workflow.name)
            header = engine._header(run_id, workflow, wire_input, input_digest, key, identity, budget)
            batch.append(NewRun(run_id, header, identity, expect[i], at=at, priority=priority))
        lost = storage.create_bound(batch) if batch else None
        for n, run in enumerate(batch):
            if lost is not None and run.identity == lost:
                slow.extend(fresh[n:])
                break
            ids[fresh[n]] = run.run_id
        for i in sorted(slow):
            workflow, input, key, *_ = named[i]
            ids[i] = await engine._identify(workflow, input, key, False, budget, at=at, priority=priority)
        for i in chunk:
            if ids[i] is None:
                ids[i] = ids[first[named[i][5]]]

    async def start(self, *, poll: float = 0.2) -> None:
        """The body of `Engine.start`, whose docstring says what it does."""
        from .worker import Worker

        if self.worker is None or self.worker.finished:
            self.worker = Worker(self.engine, concurrency=self.engine.concurrency, poll=poll)
        self.worker.start()

    async def join(self, handle: RunHandle) -> Any:
        """The body of `Engine.join`, whose docstring says what it does."""
        if self.worker is None or self.worker.finished:
            workflow = handle.workflow or self.engine.workflow_for(handle.run_id)
            return await self.engine.run(workflow, run_id=handle.run_id)
        while True:
            info = self.engine.storage.info(handle.run_id)
            if info is not None and info.last.get("t") == "end":
                return joined(handle.workflow, History([info.header, info.last]))
            await self.worker.settled(JOIN_POLL * 4)

    async def drain(self) -> None:
        """The body of `Engine.drain`, whose docstring says what it does."""
        started = self.worker is None or self.worker.finished
        if started:
            await self.start()
        worker = self.worker
        assert worker is not None
        waiting = list(self.enqueued)
        try:
            while True:
                while waiting and self._settled(waiting[-1]):  # each run is looked at until it settles, once
                    waiting.pop()
                if not waiting and not worker.active and not worker.ending \
                        and not self.engine.storage.due(1, skip=worker.skipped()):
                    waiting = [r for r in self.enqueued if not self._settled(r)]  # one that was queued again
                    if not waiting:
                        return
                await worker.settled(JOIN_POLL * 4)
        finally:
            if started:
                await self.stop()

    def _settled(self, run_id: str) -> bool:
        """True when an enqueued run ended, parked for later, or left the queue."""
        info = self.engine.storage.info(run_id)
        if info is None or info.last.get("t") == "end":
            return True
        entry = self.engine.storage.entry(run_id)
        return entry is None or (info.last.get("t") != "run" and (entry.at is None or entry.at > time.time()))

    async def stop(self) -> list[str]:
        """The body of `Engine.stop`, whose docstring says what it does."""
        worker, self.worker = self.worker, None
        if worker is None:
            return []
        return await worker.stop()
