"""The engine: finds or creates a run, takes its lease and runs the kernel; operations by id live in _operations.py."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import secrets
import socket
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from datetime import datetime
from typing import Any

from .. import records as log_format
from .._authoring.calls import RunHandle, check_budget_kind
from .._authoring.context import AttemptContext, WorkflowContext
from .._authoring.graphs import GraphState
from .._authoring.resources import Gates, Resource
from .._authoring.workflow import Workflow, as_workflow
from .._clock import Clock
from .._codec import dump_error, load_value, to_iso
from .._events import StepEvent
from .._replay.kernel import CONTROL_EVERY, DEFAULT_CLEANUP, Parked, RunKernel, Selector, Spawned
from .._replay.limits import missed_wakeup
from .._state.advisories import Advisory, AdvisoryTracker
from .._state.history import History, RunState, SignalSent
from .._state.timeline import Span
from .._threads import DaemonPool, SyncPlacement
from .._worker.schedules import Schedule, check
from .._worker.worker import Worker, check_concurrency
from ..errors import LeaseLostError, RunParkedError, StaleRunError, ValidationError
from ..storage import FileStorage, Storage, validate_key
from ..storage.url import open_storage, parse_storage_url
from . import budgets, effects, upgrades, versioning
from .awakeables import MISSING as NO_VALUE
from .awakeables import AwakeableResolution, Awakeables, open_awakeables
from .children import ChildRuns, joined
from .code import CodeSource
from .forks import UNSET, Forks
from .heartbeat import Heartbeat
from .hooks import RunHook, add_run_hook, remove_run_hook, run_hooks, set_run_hook
from .identity import Identities
from .operations import BulkResult, Operations
from .queue import (
    QueueInfo,
    RunQueue,
    check_delay,
    check_enqueue_options,
    check_priority,
    placement,
    queue_infos,
)
from .runs import PruneReport, Runs, check_retention
from .streams import StreamReader, interleave

__all__ = ["Engine", "RunHook", "add_run_hook", "create_engine", "durably", "engine_for", "remove_run_hook",
           "run", "run_async", "run_hooks", "set_run_hook"]

JOIN_POLL = 0.05


def check_budget(budget: Any) -> dict[str, float] | None:
    """Validate a `budget=` mapping of kind -> non-negative limit."""
    if budget is None:
        return None
    if not isinstance(budget, dict):
        raise ValidationError(f"budget= must be a dict like {{'usd': 5}}, got {budget!r}",
                              hint="Pass budget={'usd': 5.0, 'tokens': 100000}.", docs="docs/policies.md#budgets")
    for kind, limit in budget.items():
        check_budget_kind(kind)
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit >= 0 or limit == float("inf"):
            raise ValidationError(f"budget {kind}={limit!r} must be a finite number >= 0",
                                  hint="Give each kind a finite limit, e.g. {'usd': 5}.",
                                  docs="docs/policies.md#budgets")
    return {k: float(v) for k, v in budget.items()}


def check_cleanup(value: Any) -> float:
    """Validate `cleanup=`: the seconds a cancelled workflow may spend on its clean-up."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e9:
        raise ValidationError(f"cleanup= must be seconds >= 0, got {value!r}",
                              hint="cleanup=60 gives a cancelled workflow a minute to clean up.",
                              docs="docs/operations.md#cancel")
    return float(value)


def check_checkpoint(value: Any) -> int | None:
    """Validate `checkpoint_every=` (an int >= 1, or None for the default policy)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValidationError(f"checkpoint_every= must be an int >= 1, got {value!r}",
                              hint="checkpoint_every=1 fsyncs after every step.", docs="docs/storage.md#checkpoints")
    return value




class Engine:
    """Runs workflows against one storage; operates its runs by id or key."""

    def __init__(self, storage: Storage | None = None, *, concurrency: int = 4, checkpoint_every: int | None = None,
                 budget: dict[str, float] | None = None,
                 on_run_failed: Callable[[dict[str, Any]], Any] | None = None,
                 lease: float = 30.0, heartbeat: float | None = None, clock: Clock | None = None,
                 resources: list[Resource] | tuple[Resource, ...] = (), sync_steps: str = "auto",
                 retention: float | None = None, cleanup: float = DEFAULT_CLEANUP,
                 callback_url: str | None = None, on_exhausted: str = "park") -> None:
        self.storage: Storage = storage if storage is not None else FileStorage(".durably")
        self.runs = Runs(self.storage)
        self.streams = StreamReader(self.storage, self.runs.resolve, self.runs.read)
        self.retention = check_retention(retention)
        self.cleanup = check_cleanup(cleanup)
        self.concurrency = check_concurrency(concurrency)
        self.checkpoint_every = check_checkpoint(checkpoint_every)
        self.budget = check_budget(budget)
        self.on_exhausted = budgets.check_exhausted(on_exhausted)
        self.on_run_failed = on_run_failed
        self.clock = clock or Clock()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        if sync_steps not in ("auto", "thread"):
            raise ValidationError(f"sync_steps= must be 'auto' or 'thread', got {sync_steps!r}",
                                  hint="'thread' runs every sync step on a worker thread; 'auto' calls quick ones "
                                       "directly on the event loop.", docs="docs/policies.md#where-sync-steps-run")
        self.executor = DaemonPool(max_workers=64)
        self.placement = SyncPlacement(enabled=sync_steps == "auto")
        self.heartbeat = Heartbeat(self.storage, lease, heartbeat, CONTROL_EVERY)
        self.code = CodeSource()
        self.gates = Gates(resources)
        self.schedules: dict[str, Schedule] = {}
        self.retries: set[str] = set()  # runs `retry` runs again now: one failing when it stopped is reopened
        self.identities = Identities(self.storage, self.runs.valid)
        self.queue = RunQueue(self.storage, self.identities, cancel=lambda run_id: self.cancel(run_id))
        self.children = ChildRuns(self.storage, self.executor, concurrency=lambda: self.concurrency, run=self.run,
                                  workflow_for=self.workflow_for, read=self.runs.read, retries=self.retries,
                                  poke=self.queue.poke)
        self.operations = Operations(self.storage, self.runs, self.clock, run=self.run, code_for=self.code_for,
                                     retries=self.retries, concurrency=lambda: self.concurrency,
                                     cleanup=lambda: self.cleanup)
        self.forks = Forks(self.operations)
        self.callback_url = check_callback_url(callback_url or os.environ.get("DURABLY_CALLBACK_URL") or None)
        self.awakeables = Awakeables(self.storage, self.clock)

    @property
    def lease_ttl(self) -> float:
        """Seconds a run this engine claims stays held past its last renewal (`lease=`)."""
        return self.heartbeat.ttl

    @property
    def heartbeat_every(self) -> float:
        """Seconds between renewals of the leases this engine holds (`heartbeat=`)."""
        return self.heartbeat.every

    def configure(self, *, lease: float | None = None, heartbeat: float | None = None,
                  concurrency: int | None = None, retention: float | None = None) -> None:
        """Change settings after construction (the CLI applies its flags, environment and config so), each
        checked as the constructor checks it; None keeps a setting. A new lease without a heartbeat renews
        every third of it. Takes effect for every claim, renewal and child pool from then on."""
        if lease is not None or heartbeat is not None:
            self.heartbeat.configure(self.lease_ttl if lease is None else lease, heartbeat)
        if concurrency is not None:
            self.concurrency = check_concurrency(concurrency)
        if retention is not None:
            self.retention = check_retention(retention)

    # ---- finding and describing runs (runs.py) -----------------------------------------------------
    def _where(self) -> str:
        """Where this engine's runs live, for messages (`Runs.where`; the CLI's spelling)."""
        return self.runs.where()

    def resolve(self, run: str) -> str:
        """A run id from a run id or a run key."""
        return self.runs.resolve(run)

    async def inspect(self, run: str) -> RunState:
        """The state of a run (by id or key): status, steps, advisories, result or error."""
        return await self.runs.inspect(run)

    async def export(self, run: str) -> bytes:
        """The run's whole log (by id or key) as validated JSONL: its header, with the workflow name and input,
        then every record. A self-contained history for `TestEngine.replay` (`durably export`); a child run
        has a log of its own, which the parent's history does not include (its joins record the results)."""
        return await self.runs.export(run)

    async def list(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                   key: str | None = None, key_prefix: str | None = None,
                   since: datetime | None = None, until: datetime | None = None, search: str | None = None,
                   limit: int | None = None, offset: int = 0, parent: str | None = None,
                   without_patch: str | None = None) -> builtins.list[RunState]:
        """Runs newest activity first, filtered by status, workflow name, key, parent run, last activity time
        and a search text.

        `without_patch` keeps only the runs that may still take the old branch of ``ctx.patched(change)``:
        not completed or cancelled, and not recorded as on its new branch (see docs/versioning.md).

        `status` is one status or several (any of them matches); `key` matches exactly, `key_prefix` the
        start of the key; `parent` keeps the child runs of that run; `since`/`until` bound a run's last
        activity; `search` matches a case-insensitive substring of the run id, workflow or key; `offset`
        skips that many matching runs and `limit` keeps at most that many. The page is found in the
        storage's run catalog (an index, not every log) and only its runs are read."""
        return await self.runs.list(status=status, workflow=workflow, key=key, key_prefix=key_prefix, since=since,
                                    until=until, search=search, limit=limit, offset=offset, parent=parent,
                                    without_patch=without_patch)

    async def count(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                    key: str | None = None, key_prefix: str | None = None,
                    since: datetime | None = None, until: datetime | None = None, search: str | None = None,
                    parent: str | None = None, without_patch: str | None = None) -> int:
        """How many runs `list` gives for the same filters."""
        return await self.runs.count(status=status, workflow=workflow, key=key, key_prefix=key_prefix,
                                     since=since, until=until, search=search, parent=parent,
                                     without_patch=without_patch)

    async def timeline(self, run: str) -> builtins.list[Span]:
        """Where the time of a run (by id or key) went: every step attempt, backoff, sleep and wait as a span."""
        return await self.runs.timeline(run)

    async def records(self, run: str) -> builtins.list[dict[str, Any]]:
        """A run's log (by id or key) as plain JSON objects, header first, exactly as recorded."""
        return await self.runs.records(run)

    def follow(self, run: str, *, poll: float = 0.2, chunks: bool = False) -> AsyncIterator[dict[str, Any]]:
        """A run's records (by id or key) as plain JSON objects, then each record appended later by any
        process, until the run ends (completed, failed, cancelled) or parks (waiting, sleeping, paused). With
        `chunks`, the chunks its streamed steps write meanwhile come in between, as
        ``{"t": "chunks", "path": [..], "offset": n, "chunks": [...]}``."""
        if chunks:
            return interleave(self.runs.follow(run, poll=poll), self.streams.chunks(run))
        return self.runs.follow(run, poll=poll)

    def stream(self, run: str, path: Any, *, offset: int = 0, follow: bool = False) -> AsyncGenerator[Any, None]:
        """The chunks the streamed step at `path` (``3``, ``(2, 0)`` or ``"2.0"``) of run `run` (by id or key)
        emitted, from index `offset`, each once and in order; with `follow`, then each new chunk as it is
        written (within ~0.1 s), until the step completes or fails or the run ends. A completed step whose
        partials were folded into its record reads from its result (docs/authoring.md#streamed-steps)."""
        return self.streams.stream(run, path, offset=offset, follow=follow)

    async def graph(self, run: str) -> builtins.list[GraphState]:
        """The task graphs of a run (by id or key): each node's child run, status, and why it waits."""
        return await self.runs.graph(run)

    async def prune(self, *, older_than: float, status: str | Iterable[str] | None = None,
                    workflow: str | None = None, dry_run: bool = False) -> PruneReport:
        """Delete runs that ended (completed, failed or cancelled; `status` narrows) over `older_than` seconds
        ago, with their logs, index entries, queue entries, inboxes and key bindings; `dry_run` only reports.
        Unfinished runs, runs a process holds and children of unfinished parents are never touched."""
        return await self.runs.prune(older_than=older_than, status=status, workflow=workflow, dry_run=dry_run)

    async def signal(self, run: str, name: str, payload: Any = None, *, strict: bool = False) -> SignalSent:
        """Deliver signal `name` to a run (by id or key); its next `ctx.wait_for(name)` returns `payload`.

        The run need not be live: the signal waits in the run's inbox until the run reads it. An ended run is a
        `ValidationError` naming its status; `strict` also refuses a waiting run whose waits are all for other
        names (else `SignalSent.mismatched` tells it). See `Operations.signal`."""
        return await self.operations.signal(run, name, payload, strict=strict)

    # ---- running --------------------------------------------------------------------------------
    async def run(self, wf: Any, input: Any = None, *, key: str | None = None, fresh: bool = False,
                  budget: dict[str, float] | None = None, checkpoint_every: int | None = None,
                  advisories: str | None = None, on_advisory: Callable[[Advisory], Any] | None = None,
                  on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                  run_id: str | None = None,
                  on_run: Callable[[str], Any] | None = None, on_exhausted: str | None = None) -> Any:
        """Run `wf(input)` to its end under the identity and resume rules; return its value or raise its error.

        `on_exhausted` ("park" or "raise"; None: the engine's) says what the run does when its budget runs out
        (docs/policies.md#budgets).

        `on_run` is called with the run id as soon as the run is found or created (before any step runs).
        """
        if on_exhausted is not None:  # for this call (and the child runs it runs here), then as before
            token = budgets.ON_EXHAUSTED.set(budgets.check_exhausted(on_exhausted))
            try:
                return await self.run(wf, input, key=key, fresh=fresh, budget=budget,
                                      checkpoint_every=checkpoint_every, advisories=advisories,
                                      on_advisory=on_advisory, on_step=on_step, wait=wait, run_id=run_id,
                                      on_run=on_run)
            finally:
                budgets.ON_EXHAUSTED.reset(token)
        workflow = as_workflow(wf)
        budget = check_budget(budget) if budget is not None else self.budget
        checkpoint_every = check_checkpoint(checkpoint_every) or self.checkpoint_every
        if advisories not in (None, "silent"):
            raise ValidationError(f"advisories= must be None or 'silent', got {advisories!r}",
                                  hint="advisories='silent' stops printing advisories to stderr.",
                                  docs="docs/advisories.md")
        if key is not None:
            validate_key(key)
        hooks = run_hooks()
        for hook in hooks:
            on_step = hook.chain(on_step)
        def joining(held: str) -> None:  # another process runs it: this one waits (and watchers say so)
            for hook in hooks:
                hook.started(held, workflow.name, joined=True)

        lease, history, wire_input, torn = await self._acquire(workflow, input, key, fresh, budget, run_id, joining)
        if lease is None:
            for hook in hooks:
                hook.started(history.header.run_id, workflow.name, joined=True)
            if on_run is not None:
                on_run(history.header.run_id)
            return joined(workflow, history)
        run_id = lease.run_id
        for hook in hooks:
            hook.started(run_id, workflow.name)
        if on_run is not None:
            on_run(run_id)
        if not self.storage.wake(run_id) and not self.children.in_pool() and self.storage.entry(run_id) is None:
            self.storage.schedule(run_id, time.time())  # due at once should this process die while it runs
        outcome: tuple[str, BaseException | None] = ("interrupted", None)
        try:
            value = await self.drive(workflow, lease, history, wire_input, budget, checkpoint_every,
                                     advisories, on_advisory, on_step, torn, wait)
            outcome = ("completed", None)
            return value
        except Parked as parked:
            outcome = (parked.status, None)
            raise RunParkedError(f"run {run_id} is {parked.detail}", run_id=run_id, status=parked.status,
                                 hint=self._parked_hint(run_id, parked.status, parked.path)) from None
        except Exception as exc:
            outcome = (self.runs.status(run_id), exc)
            raise
        finally:
            for hook in hooks:
                hook.ended(run_id, *outcome)

    async def drive(self, workflow: Workflow, lease: Any, history: History, wire_input: Any,
                    budget: dict[str, float] | None, checkpoint_every: int | None, advisories: str | None,
                    on_advisory: Callable[[Advisory], Any] | None, on_step: Callable[[StepEvent], Any] | None,
                    torn: str | None, wait: bool = True, stopping: Callable[[], bool] | None = None,
                    ends: Callable[[Any], None] | None = None) -> Any:
        """Run a claimed run and keep its queue entry true to how it stopped; the lease is released after.
        A worker passes `stopping`: the run it serves parks in joins and long retry backoffs. A run that ends
        without its own fsync hands its lease over instead: a child run of this engine's pool to the pool's
        group commit (`ChildRuns.hand_over`), which makes it durable, unqueues and releases it before its
        parent learns the outcome; a run a worker serves to `ends`, the worker's group commit of the ends of
        the runs it holds (`Storage.finish_all`)."""
        run_id = lease.run_id
        parked_on: tuple[str, ...] = ()
        grouped = stopping is None and self.children.in_pool()
        try:
            return await self._execute(workflow, lease, history, wire_input, budget, checkpoint_every,
                                       advisories, on_advisory, on_step, torn, wait, stopping,
                                       end_sync=not grouped and ends is None)
        except Parked as parked:
            if parked.children:
                self.storage.join_wait(run_id, parked.children)
                raise
            self.storage.schedule(run_id, parked.at, wait=parked.names)
            missed_wakeup(self.storage, run_id, parked.names)
            parked_on = parked.names  # a signal or resolution sent while it parked wakes it (below)
            raise
        except StaleRunError as exc:
            try:
                self.storage.append(lease, log_format.encode(log_format.Stale(error=dump_error(exc), ts=time.time())))
                self.storage.sync(lease)
                self.storage.schedule(run_id, None)
            except LeaseLostError:
                pass
            raise
        finally:
            if grouped and history.end is not None:  # a child here: made durable with its siblings' ends
                self.children.hand_over(lease)
            elif ends is not None and history.end is not None:  # served: made durable with the worker's others
                ends(lease)
            else:
                if history.end is not None:
                    self.storage.unschedule(run_id)
                self.storage.release(lease)
            if parked_on and any(m.get("name") in parked_on for m in self.storage.inbox(run_id)):
                self.storage.wake(run_id)  # a signal that arrived while it parked

    def _parked_hint(self, run_id: str, status: str, path: str | None = None) -> str:
        """The next move for a parked run, naming the signals it waits for."""
        if status == "paused":
            return f"Resume it with `durably resume {run_id}`, then run it again; nothing is lost meanwhile."
        if status == "needs_attention":
            return (f"Check whether the step's effect happened (`durably inspect {run_id}` shows its operation id, "
                    f"input and start), then `durably resolve {run_id} --path {path or 'PATH'}` with --value JSON (it "
                    "happened: its result), --rerun (run it again) or --fail; nothing runs it meanwhile.")
        if status == "over_budget":
            return budgets.parked_hint(self.storage, run_id)
        if status == "sleeping":
            return "Run it again after its wake time (`durably inspect` shows it); nothing is lost meanwhile."
        try:
            history, _ = self.runs.read(run_id)
            awaiting = open_awakeables(history)
            if awaiting:
                return (f"Resolve it with `durably resolve-awakeable {awaiting[0].id} JSON` (or a POST to its callback "
                        "URL); a worker then continues it, or `durably retry` does; nothing is lost meanwhile.")
            names = [w.name for p, w in history.waits.items() if p not in history.done]
            came = [n for n in names if any(m.get("name") == n for m in self.storage.inbox(run_id))]
        except Exception:  # noqa: BLE001 - the hint falls back to a generic signal name
            names = came = []
        if came:
            return f"Signal {came[0]!r} received; due for the next worker or re-run: `durably retry {run_id}` " \
                   "continues it now."
        sends = " or ".join(f"`durably signal {run_id} {name} PAYLOAD`" for name in names or ["NAME"])
        return f"Send the signal with {sends} (then run it again if no process waits for it); " \
               "nothing is lost meanwhile."

    async def _acquire(self, workflow: Workflow, input: Any, key: str | None, fresh: bool,
                       budget: dict[str, float] | None, run_id: str | None,
                       joining: Callable[[str], None] | None = None) -> tuple[Any, History, Any, str | None]:
        """Find or create the run and claim it; when it is live elsewhere, wait for it and return no lease
        (`joining(run_id)` is told once, when the wait begins)."""
        failed = False
        if run_id is None:
            run_id, failed = await self.identities.identify_run(workflow, input, key, fresh, budget)
        check = _of_workflow(workflow)
        # A run that had failed before this call is run again; one that ends meanwhile is not. A run found failed,
        # or being retried, is claimed reopened at once (its log read once), by a claim that refuses it should it
        # have ended otherwise (completed, cancelled); else a refused claim and a read find out first.
        reopen = tried = failed or run_id in self.retries
        told = False
        while True:
            try:
                lease = self.storage.claim(run_id, self.owner, self.lease_ttl, check=_failed_only(check) if reopen
                                           else check, reopen=reopen)
            except _EndedOtherwise:
                reopen = False
                continue
            if lease is not None:
                history = History(lease.records, lease.where)
                if history.end is not None and history.end.status == "completed":
                    self.storage.release(lease)
                    return None, history, None, lease.torn
                return lease, history, history.header.input, lease.torn
            reopen = False
            if not self.storage.held(run_id):
                history, torn = self.runs.read(run_id)
                if history.end is not None and history.end.status == "failed" and not tried:
                    reopen = tried = True
                    continue
                if history.end is not None:
                    return None, history, None, torn
                continue  # released between the claim and the look
            while self.storage.held(run_id):
                if joining is not None and not told:
                    told = True
                    joining(run_id)
                await asyncio.sleep(JOIN_POLL)
            history, torn = self.runs.read(run_id)
            if history.end is not None:
                return None, history, None, torn

    # ---- the durable queue (queue.py) and this engine's worker (_worker/worker.py) ----------------------
    async def enqueue(self, wf: Any, input: Any = None, *, key: str | None = None, priority: int = 0,
                      delay: float = 0.0, budget: dict[str, float] | None = None,
                      checkpoint_every: int | None = None, queue: str | None = None,
                      partition: str | None = None, fresh: bool = False, debounce: float | None = None,
                      on_conflict: str | None = None) -> RunHandle:
        """Record the run as `pending` in the storage's queue and return its handle; nothing runs yet.

        A worker runs it once due (`delay` seconds from now), highest `priority` first, then oldest: this
        engine after `start()`, or any `durably worker` on the same storage. The identity rules hold: the
        same workflow and input (or `key`) names the same run; `fresh=True` makes a new one all the same.
        `join` waits for it (running it here when this engine has no worker); `drain` works the queue off.

        `queue`: the named queue it waits on (default: its workflow's `@workflow(queue=)`, else "default"),
        whose limits every worker holds it to; `partition`: its partition there (a tenant, say), for fairness
        and per-partition limits. With a `key`: `debounce=SECONDS` makes it due once that long passes with no
        newer enqueue of the key, a newer one superseding it while it has not started (the superseded run
        ends cancelled, naming the run that took its place); `on_conflict` says what happens while a run with
        the key has not ended: "use_existing" (its handle), "fail" (`KeyConflictError`) or "cancel_existing"
        (it is cancelled, or superseded if it never started, and the newcomer takes the key). Without either,
        the same input names that run and another input is a `KeyConflictError`."""
        workflow = as_workflow(wf)
        priority = check_priority(priority)
        delay = check_delay(delay)
        budget = check_budget(budget) if budget is not None else self.budget
        check_checkpoint(checkpoint_every)
        if key is not None:
            validate_key(key)
        debounce = check_enqueue_options(key, fresh, debounce, on_conflict)
        extra = placement(workflow, queue, partition)
        return await self.queue.enqueue(workflow, input, key, priority, delay, budget, extra, fresh, debounce,
                                        on_conflict)

    async def enqueue_many(self, runs: Iterable[tuple[Any, ...]], *, priority: int = 0, delay: float = 0.0,
                           budget: dict[str, float] | None = None, queue: str | None = None,
                           partition: str | None = None) -> builtins.list[RunHandle]:
        """Record many pending runs at once and return their handles, in order: each item is
        `(workflow, input)` or `(workflow, input, key)`. Like `enqueue` of each, under the same identity rules
        (an item naming a run that exists, or an earlier item of the batch, gets that run's handle), but the
        new runs are written `ENQUEUE_BATCH` at a time in one durable write each (one fsync or commit per
        batch, not per run). Every item is checked before anything is written. `queue` and `partition` place
        every new run (default: each workflow's queue)."""
        priority = check_priority(priority)
        delay = check_delay(delay)
        budget = check_budget(budget) if budget is not None else self.budget
        return await self.queue.enqueue_many(runs, priority=priority, delay=delay, budget=budget, queue=queue,
                                             partition=partition)

    async def queues(self) -> builtins.list[QueueInfo]:
        """Every named queue that holds a run or that this process declares: its pending (due now and later),
        running and parked runs, its oldest wait, its partitions, its limits and what is in use of them."""
        return await asyncio.to_thread(queue_infos, self.storage)

    async def start(self, *, poll: float = 0.2, queues: Iterable[str] | None = None) -> None:
        """Run the queue in this process: claim due runs (at most `concurrency` at once, of the named `queues`
        only when given), run them, park and release them, and repeat, until `stop()`. Returns at once;
        idempotent."""
        worker = self.queue.live_worker()
        if worker is None:
            worker = self.queue.worker = Worker(self, concurrency=self.concurrency, poll=poll,
                                                queues=None if queues is None else list(queues))
        worker.start()

    async def join(self, handle: RunHandle) -> Any:
        """Wait for an enqueued run to end; return its value or raise its error. Without a started worker
        in this engine the run is run here and now."""
        worker = self.queue.live_worker()
        if worker is not None:
            return await worker.join(handle)
        return await self.run(handle.workflow or self.workflow_for(handle.run_id), run_id=handle.run_id)

    async def drain(self) -> None:
        """Wait until the queue holds no run that is due now or running here, and every run this engine
        enqueued has ended or parked (their errors stay with their runs and `join`). Starts the worker
        for the duration when it is not running."""
        started = self.queue.live_worker() is None
        await self.start()
        worker = self.queue.worker
        assert worker is not None
        try:
            await worker.drain(self.queue.enqueued)
        finally:
            if started:
                await self.stop()

    async def stop(self) -> builtins.list[str]:
        """Stop this engine's worker gracefully: no new claims and no new steps; steps already running
        finish and are recorded; leases are released, so the runs are due again at once for any worker.
        Returns the ids of the runs it stopped part-way."""
        worker, self.queue.worker = self.queue.worker, None
        return [] if worker is None else await worker.stop()

    def schedule(self, wf: Any, cron: str, *, input: Any = None, name: str | None = None) -> Schedule:
        """Start `wf(input)` on every tick of `cron` (five fields, UTC) wherever this engine's loop serves
        schedules; like `durably_py.schedule`, but for this engine only."""
        item = check(wf, cron, input, name)
        self.schedules[item.name] = item
        return item

    def create_run(self, run_id: str, workflow: Workflow, wire_input: Any, input_digest: str, key: str | None,
                   identity: str, *, scheduled_at: datetime | None = None) -> None:
        """Write the header of a run whose identity this process just bound to `run_id` (`Storage.bind`);
        `scheduled_at` is the tick of the schedule that starts it (`ctx.scheduled_at`)."""
        self.identities.create(run_id, workflow, wire_input, input_digest, key, identity, self.budget,
                               scheduled_at=None if scheduled_at is None else to_iso(scheduled_at))

    # ---- child runs (_children.py): what the kernel asks of `EngineServices` ---------------------------
    def create_child(self, parent: str, path: str, workflow: Workflow, input: Any, detached: bool, *,
                     queued: bool = True) -> str:
        """The child run spawned at `path` of `parent` (created once: a resumed parent finds the same one)."""
        return self.children.create_child(parent, path, workflow, input, detached, queued=queued)

    def create_children(self, parent: str, children: builtins.list[tuple[str, Workflow, Any]],
                        detached: bool, *, queued: bool = True) -> builtins.list[str]:
        """The child runs spawned at each `(path, workflow, input)` of `parent`, in order (`ChildRuns`)."""
        return self.children.create_children(parent, children, detached, queued=queued)

    def start_child(self, run_id: str, workflow: Workflow | None, *, rerun_failed: bool = False) -> asyncio.Future[Any]:
        """The outcome of a child run in this process (at most `concurrency` children run at once)."""
        return self.children.start_child(run_id, workflow, rerun_failed=rerun_failed)

    def start_children(self, handles: builtins.list[RunHandle], *, rerun_failed: bool,
                       on_start: Callable[[str, asyncio.Future[Any]], None]) -> Spawned:
        """Queue spawned children to run in this process in spawn order, with no future each until one starts."""
        return self.children.start_children(handles, rerun_failed=rerun_failed, on_start=on_start)

    async def join_child(self, run_id: str, workflow: Workflow | None, *, rerun_failed: bool = False) -> Any:
        """Wait for a child to end (running it here if no process does) and return its result or raise."""
        return await self.children.join_child(run_id, workflow, rerun_failed=rerun_failed)

    def ended_child(self, run_id: str, workflow: Workflow | None) -> asyncio.Future[Any] | None:
        """How a child run ended, as a settled future (its result or error), or None while it has not ended."""
        return self.children.ended_child(run_id, workflow)

    def queued_child(self, run_id: str) -> None:
        """A child a served run spawned waits in the queue: this engine's worker looks for it at once."""
        self.children.queued_child(run_id)

    def parked_in_join(self) -> contextlib.AbstractAsyncContextManager[None]:
        """While the calling run waits in a join, the slot it runs in (if it is a child) is free for others."""
        return self.children.parked_in_join()

    async def _execute(self, workflow: Workflow, lease: Any, history: History, wire_input: Any,
                       budget: dict[str, float] | None, checkpoint_every: int | None, advisories: str | None,
                       on_advisory: Callable[[Advisory], Any] | None, on_step: Callable[[StepEvent], Any] | None,
                       torn: str | None, wait: bool = True, stopping: Callable[[], bool] | None = None,
                       end_sync: bool = True) -> Any:
        if torn:
            print(f"durably: {torn}; the run resumes from the last complete record", file=sys.stderr)
        threshold = getattr(self.storage, "compact_above_bytes", None)
        most = 0.75 * len(lease.records)  # a compaction that keeps more than this is not worth a rewrite
        if threshold and (lease.size if lease.size >= 0 else self.storage.size(lease.run_id)) > threshold \
                and (history.snaps or len(history.done) < most):  # (each outcome is kept unless a snapshot covers it)
            kept = history.compacted()
            if len(kept) <= most:
                self.storage.rewrite(lease, b"".join(log_format.encode(r) for r in kept))
        tracker = AdvisoryTracker(lease.run_id, now=self.clock.now, on_advisory=on_advisory,
                                  silent=advisories == "silent",
                                  restored=[Advisory.from_dict(a) for a in history.advisories.values()])
        kernel = RunKernel(engine=self, storage=self.storage, lease=lease, history=history, workflow=workflow,
                           attempt_cls=AttemptContext,
                           input=None, clock=self.clock, executor=self.executor, checkpoint_every=checkpoint_every,
                           on_step=on_step, advisories=tracker, wait=wait)
        kernel.stopping = stopping
        kernel.end_sync = end_sync
        kernel.cleanup = self.cleanup
        failed = history.end is not None and history.end.status == "failed"
        retried = lease.run_id in self.retries
        if failed or retried and history.failing:
            kernel.write(log_format.Reopen(ts=time.time()))
        kernel.retrying = failed or retried
        kernel.parks = stopping is not None and not kernel.retrying
        if kernel.code_changed:
            source = workflow.source
            now = source[0] if source is not None else None
            if history.fingerprint != workflow.fingerprint or history.source != now:
                kernel.write(log_format.Code(fingerprint=workflow.fingerprint, source=now))
        if budget is not None and budget != history.budget and budget != history.header.budget:
            kernel.write(log_format.Budget(budget=budget))  # a new budget= (the one it was created with keeps a raise)
            kernel.budget = budget
        kernel.steps.meter.on_exhausted = budgets.ON_EXHAUSTED.get() or self.on_exhausted
        value = load_value(wire_input)
        if workflow.input_schema is not None:
            value = workflow.input_schema.convert(value, "input")
        kernel.input = value
        self.heartbeat.add(kernel, lease)
        try:
            return await kernel.run(WorkflowContext(kernel))
        except Exception as exc:
            ended = kernel.history.end
            if self.on_run_failed is not None and ended is not None and ended.status == "failed":
                try:
                    result = self.on_run_failed({"run_id": lease.run_id, "error": exc})
                    if asyncio.iscoroutine(result):
                        await result
                except Exception:  # noqa: BLE001 - a failing hook never hides the run's own error
                    pass
            raise
        finally:
            self.heartbeat.remove(kernel)

    # ---- operating runs by id ---------------------------------------------------------------------
    def workflow_for(self, run: str) -> Workflow:
        """The workflow code that runs an existing run (by id or key): registered by name, else imported."""
        return self.operations.workflow_for(self.resolve(run))

    def code_for(self, header: log_format.Header) -> Workflow:
        """The workflow code for a run header: registered by name, else the one module or script it recorded,
        where `code` allows it (`CodeSource`)."""
        return self.code.workflow(header)

    async def cancel(self, run: str, *, timeout: float = 30.0, compensate: bool = False,
                     cleanup: float | None = None) -> RunState:
        """Cancel a run (by id or key): its workflow gets `RunCancelledError` where it waits, may clean up (for
        `cleanup` seconds, default the engine's `cleanup=`), and ends cancelled; `compensate=True` also runs the
        compensations of its completed steps. See docs/operations.md#cancel."""
        return await self.operations.cancel(run, timeout=timeout, compensate=compensate, cleanup=cleanup)

    async def pause(self, run: str, *, timeout: float = 30.0) -> RunState:
        """Pause a run (by id or key): at once when no process runs it, else at the running process's next boundary."""
        return await self.operations.pause(run, timeout=timeout)

    async def resume(self, run: str, *, timeout: float = 30.0) -> RunState:
        """Resume a paused run (by id or key): its waiting process continues it, or the next run()/retry does."""
        return await self.operations.resume(run, timeout=timeout)

    async def retry(self, run: str, *, from_step: Selector | None = None,
                    on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                    on_run: Callable[[str], Any] | None = None) -> Any:
        """Resume a failed or interrupted run (by id or key); `from_step=` also runs that step and all later ones again."""
        return await self.operations.retry(run, from_step=from_step, on_step=on_step, wait=wait, on_run=on_run)

    async def restart(self, run: str, *, on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                      on_run: Callable[[str], Any] | None = None) -> Any:
        """Start a run (by id or key) over as a new run with the same workflow, input and key; return its value."""
        return await self.operations.restart(run, on_step=on_step, wait=wait, on_run=on_run)

    async def fork(self, run: str, *, from_step: Selector, set_output: Any = UNSET,
                   on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                   on_run: Callable[[str], Any] | None = None) -> Any:
        """Start a new run from a recorded step of run `run` (by id or key): time-travel for debugging.

        The fork gets the original's workflow, input and budget and a copy of its history up to the record that
        completed `from_step` (a path ``(2,)``, ``(3, 1, 0)`` or ``"3.1.0"``, a label, or ``(label, nth)``, as
        `retry(from_step=)` takes them); with `set_output` that step's recorded output is replaced (a failed
        step then counts as completed with it). It then runs here on the current code, like `retry`: what was
        copied replays, the rest runs live; returns its value or raises its error (`on_run` gets the fork's id
        first; `wait=False`: `RunParkedError` if it parks). The original is only read. The fork is bound to
        the key ``fork:ORIGINAL:N``, never the original's, and `inspect` of each shows the lineage
        (`RunState.forked_from`, `RunState.forks`). Bad input (an unknown run, a step it never completed, an
        output that is not JSON) is a `ValidationError` and writes nothing. See docs/operations.md#forks."""
        return await self.forks.fork(run, from_step=from_step, set_output=set_output, on_step=on_step, wait=wait,
                                     on_run=on_run)

    async def cancel_many(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                          timeout: float = 30.0, dry_run: bool = False) -> BulkResult:
        """Cancel every run `list(status=, workflow=)` selects (by default every run that has not ended);
        returns the runs it cancelled and, for each it could not, why (`dry_run`: only what it selects)."""
        return await self.operations.cancel_many(status=status, workflow=workflow, timeout=timeout, dry_run=dry_run)

    async def resume_many(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                          timeout: float = 30.0, dry_run: bool = False) -> BulkResult:
        """Resume every paused run `list(status=, workflow=)` selects; returns the runs it resumed and why not."""
        return await self.operations.resume_many(status=status, workflow=workflow, timeout=timeout, dry_run=dry_run)

    async def retry_many(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                         dry_run: bool = False) -> BulkResult:
        """Retry every failed or interrupted run `list(status=, workflow=)` selects, in this process; returns
        each run's state afterwards and, for each it could not retry, why."""
        return await self.operations.retry_many(status=status, workflow=workflow, dry_run=dry_run)

    async def diff(self, run: str) -> upgrades.SourceDiff:
        """What changed in the source file of a run (by id or key) since it started: the file kept in the store
        when it started against the file at its script now (`SourceDiff`). A run that recorded no source is a
        `ValidationError`. See docs/versioning.md#upgrades."""
        history = self.operations.history(self.resolve(run))
        return upgrades.source_diff(self.storage, history.header, history.source)

    def use_recorded_source(self, run: str) -> Workflow:
        """Import the source file a run (by id or key) started with, in place of the current code of its workflow
        in this process, so that `retry` runs it on the code it began with (a run held `stale` by an edit); its
        workflow is returned. The file must be self-contained: its own imports load the current modules."""
        history = self.operations.history(self.resolve(run))
        return upgrades.recorded_workflow(self.storage, history.header)

    async def adopt(self, run: str, path: Any = None, *, on_step: Callable[[StepEvent], Any] | None = None,
                    wait: bool = True, on_run: Callable[[str], Any] | None = None) -> Any:
        """Continue a `stale` run (by id or key) asserting that the step the code now calls at `path` (default:
        where its replay stopped; ``(2,)``, ``(3, 1, 0)`` or ``"3.1.0"``) is the recorded one under a new name:
        its recorded result is used, the adoption is recorded, and the run goes on as `retry` would. A run that
        is not stale is a `ValidationError`. See docs/versioning.md#adopt."""
        return await versioning.adopt(self.operations, run, path, on_step=on_step, wait=wait, on_run=on_run)

    async def raise_budget(self, run: str, *, usd: float | None = None, tokens: float | None = None,
                           units: float | None = None, to: bool = False, timeout: float = 30.0) -> RunState:
        """Raise the budget of a run (by id or key) by the amounts given (`to=True`: set each kind to it), and let
        it go on if it parked `over_budget`. A child that spends its parent's budget raises the budget it
        spends (its nearest ancestor created with one). A run no process holds gets a `budget` record and is due
        at once (a worker continues it; without one, run it again or `durably retry` it); a run a process holds
        gets a ``$budget`` request, applied there at its next boundary (waited for up to `timeout` seconds).
        Every over-budget run that spends the same budget is woken. Returns the run's state. See
        docs/policies.md#budgets."""
        return await budgets.raise_budget(self.operations, run, {"usd": usd, "tokens": tokens, "units": units},
                                          to=to, timeout=timeout)

    async def resolve_effect(self, run: str, path: Any, *, value: Any = effects.MISSING, rerun: bool = False,
                             fail: str | bool | None = None, here: bool = True,
                             on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                             on_run: Callable[[str], Any] | None = None) -> Any:
        """Decide about the cut-off unsafe step at `path` (``(2,)``, ``"3.1.0"``) of a run (by id or key) that
        `needs_attention`: `value=` records the effect's verified result (the workflow gets it as the step's
        result), `rerun=True` runs the step again, `fail=` (True or a message) fails it with
        `EffectFailedError`. The decision is recorded (a `resolve` record), then the run continues here as
        `retry` does and its value is returned (or its error raised); `here=False` leaves it due for a worker
        and returns its `RunState`. Anything else (a run that does not need attention, another path, two
        decisions, a value that is not JSON) is refused before anything is written. See
        docs/operations.md#effects-that-need-attention."""
        return await effects.resolve_effect(self.operations, run, path, value=value, rerun=rerun, fail=fail,
                                            here=here, on_step=on_step, wait=wait, on_run=on_run)

    async def resolve_awakeable(self, awakeable: str, value: Any = None, *,
                                token: str | None = None) -> AwakeableResolution:
        """Resolve the awakeable `awakeable` (its id, `a.id`) with `value`: its `await` in the workflow returns it,
        at once when a process waits on it, else when a worker (or a retry) continues the parked run, which it
        makes due. `token`: accept it only with the awakeable's callback token (the callback URL's). Refused
        with nothing changed: an unknown id (`AwakeableNotFoundError`), a wrong token (`AwakeableTokenError`),
        one resolved already, past its deadline or of an ended run (`AwakeableResolvedError`), a value that does
        not match its schema (`ValidationError`). See docs/authoring.md#awakeables-and-callbacks."""
        return await self.awakeables.resolve(awakeable, value, token=token)

    async def reject_awakeable(self, awakeable: str, error: str, *, token: str | None = None) -> AwakeableResolution:
        """Reject the awakeable `awakeable`: its `await` in the workflow raises `AwakeableRejectedError(error)`.
        Refused as `resolve_awakeable` refuses."""
        return await self.awakeables.resolve(awakeable, NO_VALUE, error=error, token=token)


def check_callback_url(url: str | None) -> str | None:
    """Validate `callback_url=` / $DURABLY_CALLBACK_URL: the http(s) base URL `durably ui` is reachable at."""
    if url is None:
        return None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) < 10:
        raise ValidationError(f"callback_url must be an http:// or https:// URL, got {url!r}",
                              hint="The address outside systems reach `durably ui` at, e.g. "
                                   "https://durably.example.com (DURABLY_CALLBACK_URL in the environment).",
                              docs="docs/authoring.md#awakeables-and-callbacks")
    return url.rstrip("/")


def create_engine(storage: Storage | str | os.PathLike[str] | None = None, **options: Any) -> Engine:
    """An engine over `storage`: a Storage, a storage URL (a directory, ``file:PATH``, ``sqlite:PATH``,
    ``postgresql://...``), or None for $DURABLY_STORAGE, else FileStorage at `.durably/`."""
    if storage is None and os.environ.get("DURABLY_STORAGE"):
        storage = os.environ["DURABLY_STORAGE"]
    if isinstance(storage, str | os.PathLike):
        return Engine(open_storage(os.fspath(storage)), **options)
    return Engine(storage, **options)


_engines: dict[str, Engine] = {}


def engine_for(dir: str | os.PathLike[str] | None, storage: str | None = None) -> Engine:
    """The shared engine over storage URL `storage`, else rooted at `dir`, else $DURABLY_STORAGE, else
    $DURABLY_DIR, else `.durably/`."""
    url = storage or (None if dir else os.environ.get("DURABLY_STORAGE")) or None
    if url is not None:
        kind, target = parse_storage_url(url)
        name = f"{kind}:{target if kind == 'postgres' else os.path.abspath(target)}"
        engine = _engines.get(name)
        if engine is None:
            engine = _engines[name] = Engine(open_storage(url))
        return engine
    root = os.path.abspath(dir or os.environ.get("DURABLY_DIR") or ".durably")
    engine = _engines.get(root)
    if engine is None:
        engine = _engines[root] = Engine(FileStorage(root))
    return engine


def _of_workflow(workflow: Workflow) -> Callable[[builtins.list[Any], str], builtins.list[log_format.Record]]:
    """The claim check for running `workflow`: the log validates and its header names this workflow.

    Runs before the claim record is written, so resuming a damaged log, or another workflow's run,
    writes nothing."""
    def check(raw: builtins.list[Any], where: str) -> builtins.list[log_format.Record]:
        typed = log_format.load(raw, where)
        header = typed[0]
        assert isinstance(header, log_format.Header)
        if header.workflow != workflow.name:
            raise ValidationError(
                f"run {header.run_id} belongs to workflow {header.workflow!r}, not {workflow.name!r}",
                hint=f"Resume it with its own workflow (`durably retry {header.run_id}` picks it), or use another "
                     "key or run id for a new run of this one.",
                docs="docs/operations.md#which-code-runs-an-old-run", run_id=header.run_id,
                recorded=header.workflow, called=workflow.name)
        return typed
    return check


class _EndedOtherwise(Exception):
    """Raised by a reopening claim's check (`_failed_only`) for a run whose log ends otherwise than failed: the
    claim writes nothing, and the run is looked at as an ended run."""


def _failed_only(check: Callable[[builtins.list[Any], str], builtins.list[log_format.Record]]
                 ) -> Callable[[builtins.list[Any], str], builtins.list[log_format.Record]]:
    """`check` for a claim that reopens a run found failed: it also refuses (`_EndedOtherwise`) a log that ended
    otherwise since (completed, cancelled), so no claim record is written after such an end."""
    def refusing(raw: builtins.list[Any], where: str) -> builtins.list[log_format.Record]:
        typed = check(raw, where)
        last = typed[-1]
        if type(last) is log_format.End and last.status != "failed":
            raise _EndedOtherwise()
        return typed
    return refusing


class DefaultEngine:
    """`durably`: the engine rooted at `.durably/` (or $DURABLY_DIR), created on first use."""

    def __getattr__(self, name: str) -> Any:
        return getattr(engine_for(None), name)

    def __repr__(self) -> str:
        return "<durably default engine>"


durably = DefaultEngine()


async def run_async(wf: Any, input: Any = None, *, key: str | None = None, fresh: bool = False,
                    budget: dict[str, float] | None = None, dir: str | os.PathLike[str] | None = None,
                    checkpoint_every: int | None = None, advisories: str | None = None,
                    on_advisory: Callable[[Advisory], Any] | None = None,
                    on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                    on_exhausted: str | None = None) -> Any:
    """`run()` for code already inside an event loop."""
    return await engine_for(dir).run(wf, input, key=key, fresh=fresh, budget=budget,
                                     checkpoint_every=checkpoint_every, advisories=advisories,
                                     on_advisory=on_advisory, on_step=on_step, wait=wait, on_exhausted=on_exhausted)


def run(wf: Any, input: Any = None, *, key: str | None = None, fresh: bool = False,
        budget: dict[str, float] | None = None, dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None, advisories: str | None = None,
        on_advisory: Callable[[Advisory], Any] | None = None,
        on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
        on_exhausted: str | None = None) -> Any:
    """Run a workflow durably to its end and return its value: resumes it if an earlier process was cut off.

    A run that parks (`ctx.sleep`, `ctx.wait_for`, a budget run out) keeps this call waiting; with `wait=False`
    it raises `RunParkedError` instead, and a later call resumes it. `on_exhausted="raise"`: a budget run out
    fails the step with `BudgetExceededError` instead of parking the run."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise ValidationError("run() was called inside a running event loop",
                              hint="Use `await run_async(...)` inside async code.", docs="docs/running.md")
    return asyncio.run(run_async(wf, input, key=key, fresh=fresh, budget=budget, dir=dir,
                                 checkpoint_every=checkpoint_every, advisories=advisories,
                                 on_advisory=on_advisory, on_step=on_step, wait=wait, on_exhausted=on_exhausted))
