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
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _ids, records
from .._authoring.calls import RunHandle
from .._authoring.queues import DEFAULT_QUEUE, QUEUES, check_queue_name
from .._authoring.workflow import Workflow, as_workflow
from .._codec import dump_error
from .._replay.limits import permits, starts
from .._state.history import History
from ..errors import KeyConflictError, RunCancelledError, ValidationError
from ..storage import Storage, validate_key
from ..storage.base import NewRun
from .identity import Identities, identity_of, new_header

if TYPE_CHECKING:
    from .._worker.worker import Worker

ENQUEUE_BATCH = 1000
"""New runs `Engine.enqueue_many` writes in one durable write (`Storage.create_bound`)."""

QUEUE_DOCS = "docs/running.md#the-queue"
FLOW_DOCS = "docs/deploying.md#flow-control"
ON_CONFLICT = ("use_existing", "fail", "cancel_existing")


def _item(run: Any) -> tuple[Any, Any, str | None]:
    """One `enqueue_many` item as (workflow, input, key), checked."""
    if not isinstance(run, tuple) or len(run) not in (2, 3):
        raise ValidationError(f"enqueue_many takes (workflow, input) or (workflow, input, key) items, got {run!r}",
                              hint="engine.enqueue_many([(job, 1), (job, 2, 'nightly-2')])", docs=QUEUE_DOCS)
    key = run[2] if len(run) == 3 else None
    if key is not None:
        validate_key(key)
    return as_workflow(run[0]), run[1], key


def check_enqueue_options(key: str | None, fresh: Any, debounce: Any, on_conflict: Any) -> float | None:
    """Validate `enqueue`'s `fresh=`, `debounce=` (seconds > 0) and `on_conflict=`, which need a `key`."""
    if not isinstance(fresh, bool):
        raise ValidationError(f"fresh= must be True or False, got {fresh!r}",
                              hint="fresh=True starts a new run even when one with this input exists.", docs=FLOW_DOCS)
    if debounce is not None and (isinstance(debounce, bool) or not isinstance(debounce, int | float)
                                 or not 0 < debounce < 1e9):
        raise ValidationError(f"debounce= must be seconds > 0, got {debounce!r}",
                              hint="debounce=5 starts the run once 5 s pass with no newer enqueue of its key.",
                              docs=FLOW_DOCS)
    if on_conflict is not None and on_conflict not in ON_CONFLICT:
        raise ValidationError(f"on_conflict= must be one of {', '.join(ON_CONFLICT)}, got {on_conflict!r}",
                              hint="on_conflict='use_existing' returns the run that has the key already.",
                              docs=FLOW_DOCS)
    if (debounce is not None or on_conflict is not None) and key is None:
        raise ValidationError(f"{'debounce=' if debounce is not None else 'on_conflict='} needs key=: it acts on "
                              "the run that has the same key", hint="enqueue(job, doc, key=f\"index-{doc_id}\", "
                              "debounce=5)", docs=FLOW_DOCS)
    if fresh and (debounce is not None or on_conflict is not None):
        raise ValidationError("fresh=True makes a new run whatever exists; it does not go with debounce= or "
                              "on_conflict=", hint="Use one of them.", docs=FLOW_DOCS)
    return None if debounce is None else float(debounce)


def placement(workflow: Workflow, queue: str | None, partition: str | None) -> dict[str, str]:
    """The header fields that place a new run: its queue (`queue`, else its workflow's; the default queue is
    left out) and partition, checked."""
    name = check_queue_name(queue) if queue is not None else workflow.queue
    fields = {"queue": name} if name is not None and name != DEFAULT_QUEUE else {}
    if partition is not None:
        fields["partition"] = check_queue_name(partition, "partition")
    return fields


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


@dataclass
class QueueInfo:
    """One named queue as `Engine.queues` and `durably queues` show it: its runs by state (`due`: due now and
    not running; `later`: due at a later time; `running`: held by a live process; `parked`: due only when
    woken), how long its oldest due run has waited, its partitions (each the same counts, by name), its limits
    as declared in this process (`limits`, empty when it declares none), and what the store holds against
    them (`in_use`: "runs" started and not ended, "starts" in the rate window)."""

    name: str
    due: int = 0
    later: int = 0
    running: int = 0
    parked: int = 0
    oldest_wait: float | None = None
    partitions: dict[str, dict[str, Any]] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    in_use: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON object of every field (what `durably queues --json` prints)."""
        return asdict(self)


def queue_infos(storage: Storage) -> list[QueueInfo]:
    """Every queue that holds a run, that this process declares, or whose limits a live worker advertises,
    with its counts and limits (by name; this process's declarations win)."""
    now = time.time()
    infos: dict[str, QueueInfo] = {}
    for row in storage.queue_stats(now):
        info = infos.setdefault(row.queue, QueueInfo(row.queue))
        counts = {"due": row.due, "later": row.later, "running": row.running, "parked": row.parked,
                  "oldest_wait": None if row.oldest is None else max(now - row.oldest, 0.0)}
        info.due, info.later = info.due + row.due, info.later + row.later
        info.running, info.parked = info.running + row.running, info.parked + row.parked
        if counts["oldest_wait"] is not None:
            info.oldest_wait = max(info.oldest_wait or 0.0, counts["oldest_wait"])
        if row.partition is not None:
            info.partitions[row.partition] = counts
    for advert in storage.workers():  # the limits the live workers hold the queues to, as they declared them
        served = advert.get("queues")
        for name, limits in (served.items() if isinstance(served, dict) else ()):
            if isinstance(limits, dict):
                infos.setdefault(name, QueueInfo(name)).limits = limits
    for name, declared in QUEUES.items():
        infos.setdefault(name, QueueInfo(name)).limits = declared.limits()
    for key, doc in storage.limits("queue:").items():
        name, _, partition = key[len("queue:"):].partition("/")
        if name in infos and not partition:
            infos[name].in_use = {"runs": len(permits(doc)), "starts": len(starts(doc))}
    return [infos[name] for name in sorted(infos)]


class RunQueue:
    """The durable queue as one engine writes it (`Engine.queue`): enqueueing runs, and the worker this
    engine started (`Engine.start`), poked when new work is due."""

    def __init__(self, storage: Storage, identities: Identities,
                 cancel: Callable[[str], Awaitable[Any]]) -> None:
        self.storage = storage
        self.identities = identities
        self.cancel = cancel  # `Engine.cancel`: on_conflict="cancel_existing" cancels the open run
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
                      budget: dict[str, float] | None, extra: dict[str, str] | None = None, fresh: bool = False,
                      debounce: float | None = None, on_conflict: str | None = None) -> RunHandle:
        """The body of `Engine.enqueue`, whose docstring says what it does (its arguments checked already;
        `extra`: the new run's queue and partition header fields)."""
        extra = extra or {}
        if debounce is None and on_conflict is None:
            run_id = await self.identities.identify(workflow, input, key, fresh, budget, at=time.time() + delay,
                                                    priority=priority, **extra)
        else:
            assert key is not None
            run_id = await self._keyed(workflow, input, key, priority, delay, budget, extra, debounce, on_conflict)
        self.enqueued.add(run_id)
        self.poke()
        return RunHandle(run_id, workflow)

    async def _keyed(self, workflow: Workflow, input: Any, key: str, priority: int, delay: float,
                     budget: dict[str, float] | None, extra: dict[str, str], debounce: float | None,
                     on_conflict: str | None) -> str:
        """Enqueue under `key` when a run with the key may be open: a pending one is superseded by the newcomer
        (`debounce`: the newcomer is due after the quiet period, and the superseded run ends cancelled, naming
        it), else `on_conflict` says what happens (see `Engine.enqueue`)."""
        wire_input, input_digest, identity = identity_of(workflow, input, key)
        storage = self.storage
        at = time.time() + (debounce if debounce is not None else delay)
        while True:
            previous = storage.lookup(identity)
            info = storage.info(previous) if previous is not None else None
            if previous is not None and info is None:  # another process is writing its header now
                return await self.identities.identify(workflow, input, key, False, budget, at=at, priority=priority,
                                                      **extra)
            replaced = None
            if info is not None and not info.ended:
                self.identities.valid(info)
                same = info.input_digest == input_digest
                policy = on_conflict or ("replace" if debounce is not None else "use_existing" if same else "fail")
                if policy == "use_existing":
                    return info.run_id
                if policy == "fail":
                    raise KeyConflictError(
                        f"key {key!r} names run {info.run_id}, which has not ended "
                        f"({'the same' if same else 'another'} input)",
                        hint="on_conflict='use_existing' returns that run, 'cancel_existing' cancels it for the "
                             "newcomer; or enqueue again once it ended.", docs=FLOW_DOCS, run_id=info.run_id,
                        key=key)
                replaced = info.run_id
            run_id = _ids.new_run_id(workflow.name)
            if storage.bind(identity, run_id, expect=previous):
                self.identities.create(run_id, workflow, wire_input, input_digest, key, identity, budget, at=at,
                                       priority=priority, **extra)
                if replaced is not None and not self._supersede(replaced, run_id) \
                        and on_conflict == "cancel_existing":
                    await self.cancel(replaced)
                return run_id

    def _supersede(self, run_id: str, by: str) -> bool:
        """End a pending run that never started as cancelled, naming run `by` that took its place under its key;
        False (nothing changed) when it started (a process claimed it once) or is held now."""

        def choose(recs: list[Any], where: str) -> bytes | None:
            history = History(recs, where)
            if history.claim is not None or history.end is not None:
                return None
            error = RunCancelledError(f"run {run_id} was superseded by run {by} before it started: a newer enqueue "
                                      "of its key took its place", run_id=run_id, superseded_by=by,
                                      hint=f"`durably inspect {by}` shows the run that took its place.",
                                      docs=FLOW_DOCS)
            ended.append(True)
            return records.encode(records.End(status="cancelled", error=dump_error(error), ts=time.time()))

        ended: list[bool] = []
        if not self.storage.amend(run_id, choose, check=records.load) or not ended:
            return False
        self.storage.unschedule(run_id)
        return True

    async def enqueue_many(self, runs: Iterable[tuple[Any, ...]], *, priority: int, delay: float,
                           budget: dict[str, float] | None, queue: str | None = None,
                           partition: str | None = None) -> list[RunHandle]:
        """The body of `Engine.enqueue_many`, whose docstring says what it does (`priority`, `delay` and
        `budget` checked already; each item is checked here before anything is written)."""
        items = [_item(run) for run in runs]
        places = {workflow.name: placement(workflow, queue, partition) for workflow, _, _ in items}
        named = [(workflow, input, key, *identity_of(workflow, input, key)) for workflow, input, key in items]
        at = time.time() + delay if delay else None
        ids: list[str | None] = [None] * len(named)
        for start in range(0, len(named), ENQUEUE_BATCH):
            chunk = range(start, min(start + ENQUEUE_BATCH, len(named)))
            await self._enqueue_chunk(named, chunk, ids, at, priority, budget, places)
        self.enqueued.update(r for r in ids if r is not None)
        self.poke()
        return [RunHandle(run_id, workflow) for run_id, (workflow, *_) in zip(ids, named, strict=True)
                if run_id is not None]

    async def _enqueue_chunk(self, named: list[tuple[Any, ...]], chunk: range, ids: list[str | None],
                             at: float | None, priority: int, budget: dict[str, float] | None,
                             places: dict[str, dict[str, str]]) -> None:
        """Find or create the runs of `chunk` (indexes into `named`), new ones in one `create_bound` (each placed
        as `places` says for its workflow); an item whose identity another process is binding right now, or
        lost to one, goes the way `enqueue` goes."""
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
            header = new_header(run_id, workflow, wire_input, input_digest, key, identity, budget, storage,
                                **places[workflow.name])
            batch.append(NewRun(run_id, header, identity, expect[i], at=at, priority=priority))
        lost = storage.create_bound(batch) if batch else None
        for n, run in enumerate(batch):
            if lost is not None and run.identity == lost:
                slow.extend(fresh[n:])
                break
            ids[fresh[n]] = run.run_id
        for i in sorted(slow):
            workflow, input, key, *_ = named[i]
            ids[i] = await self.identities.identify(workflow, input, key, False, budget, at=at, priority=priority,
                                                    **places[workflow.name])
        for i in chunk:
            if ids[i] is None:
                ids[i] = ids[first[named[i][5]]]
