"""The replay kernel: runs a workflow from the top, answering recorded steps from the log.

Every `ctx.step` gets a hierarchical path when it is *called* (``"3"``, ``"4.1.0"``);
a path with a recorded result returns it without running the function, any
other path runs live and appends its result before returning it.

`RunKernel` is one execution of one run, made of parts that never see it: its log and the fence on it
(`log.RunLog`), its control requests, rests and stops (`control.Control`), its live steps (`steps.Steps`),
its child runs (`children.Children`) and the values it records once (`values.Values`). The kernel allocates paths, replays recorded outcomes, and runs
the workflow from its start to its end.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from concurrent.futures import Executor
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from .. import records
from .._authoring.branches import checked_branches, run_branches, strand_scope
from .._authoring.calls import (
    LABELS,
    PLAIN,
    Attempt,
    Complete,
    LoopDone,
    StepOptions,
    check_signal_name,
    check_wake_time,
    current_attempt,
    is_async_callable,
    label_of,
    not_callable,
    step_options,
)
from .._authoring.handles import Handle, cancelled, fail, handle, set_result
from .._authoring.paths import NUMBERS, Scope, current_scope, number
from .._authoring.policies import check_timeout
from .._authoring.result import Err, Ok
from .._authoring.schema import compile_schema
from .._authoring.workflow import Workflow
from .._clock import Clock
from .._codec import DT_TAG, ESC_TAG, SCALARS, dump_error, dump_value, encode_line, load_error, load_value
from .._events import StepEvent
from .._state.advisories import AdvisoryTracker
from .._state.history import History, path_tuple
from ..errors import LeaseLostError, LoopLimitError, PurityError, RunCancelledError, StaleRunError, ValidationError
from .awakeables import Awakeables
from .budgets import owner_of
from .children import Children
from .control import CONTROL_EVERY, DEFAULT_CLEANUP, Control
from .log import RunLog
from .ports import EngineServices, Hooks, Observer, Selector, Spawned, observing, selects
from .stale import stale_hint
from .steps import Steps
from .stops import ABANDONED, CANCEL_MSG, CANCELLED_TYPE, CLEANUP_OVER, CUT_OFF, Crash, Parked, Rest
from .streams import StepStream, Streams
from .tasks import current_task, get_ident, make_task, running_task
from .transactions import TransactionSteps
from .turns import Turns, current_turns, discard, install_factory
from .upgrade import UpgradeGuard, code_changed
from .values import Values

__all__ = ["CONTROL_EVERY", "DEFAULT_CLEANUP", "Crash", "EngineServices", "Observer", "Parked", "RunKernel",
           "Selector", "Spawned", "observing", "selects"]

if TYPE_CHECKING:
    from ..storage.base import Lease, Storage

_Ok = records.Ok


def loaded(wire: Any) -> Any:
    """A recorded step output as the workflow gets it: a copy of a flat dict of scalars (the common output, with
    `load_value` inlined), the scalar itself, or what `load_value` makes of the rest."""
    t = type(wire)
    if t is dict:
        for x in wire.values():
            if type(x) not in SCALARS:
                return load_value(wire)
        return load_value(wire) if len(wire) == 1 and (DT_TAG in wire or ESC_TAG in wire) else wire.copy()
    return wire if t in SCALARS else load_value(wire)


class Replayed(Handle[Any]):
    """The handle of a recorded `Ok` of a step with no options (operands: turns, scope, path, recorded value).

    Awaited directly in its turn (in a run of one strand, the head of the recorded order is its path: a comparison
    and a counter), it delivers the value in `__await__` itself, with no coroutine; else `replayed` waits for the
    turn. Observed any other way (`start`), it is a handle like any other."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, Any]:
        if self.operation is not None:
            turns, scope, path, wire = self.operands
            order = turns.order
            head = turns.head
            if turns.solo and head < len(order) and order[head] == path:
                self.operation = None
                turns.head = head + 1
                if turns.early:
                    turns.skip_early()
                scope.pending -= 1
                set_result(self, loaded(wire))
        return Handle.__await__(self)


async def replayed(h: Handle, turns: Turns, scope: Scope, path: str, wire: Any) -> Any:
    """A recorded `Ok` of a step with no options (`Replayed`), delivered in its turn."""
    try:
        if not turns.now(path):
            h.driver = current_task()
            await turns.recorded(path)
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit):
            fail(h, exc)
        raise
    finally:
        scope.pending -= 1
    value = loaded(wire)
    set_result(h, value)
    if h.observed:
        turns.hop()
    return value


class _Schema:
    """Step options carrying only a schema (a replayed wait_for converts its payload like a live one)."""

    __slots__ = ("schema", "compensate")

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self.compensate = None




class RunKernel:
    """One live execution of one run: owns its lease and appends its records."""

    child_runs: Children

    def __init__(self, *, engine: EngineServices, storage: Storage, lease: Lease, history: History,
                 workflow: Workflow, attempt_cls: Callable[[RunKernel, str, int, Any], Attempt],
                 input: Any, clock: Clock, executor: Executor, checkpoint_every: int | None,
                 on_step: Callable[[StepEvent], Any] | None, advisories: AdvisoryTracker,
                 wait: bool = True, poll: float = 0.2) -> None:
        self.engine = engine
        self.storage = storage
        self.history = history
        self.run_id: str = history.header.run_id
        self.workflow = workflow
        self.input = input
        self.clock = clock
        self.on_step = on_step
        self.done = history.done
        self.code_changed = code_changed(history.header, workflow)
        self.spent = history.spent()
        self.compensations: dict[str, tuple[Callable[[Any], Any], Any, str]] = {}
        self.trimmed: dict[str, None] = {}  # compensable steps whose records a loop compaction dropped, in order
        self.ctx: object = None  # the `ctx` handed to the workflow (a `context.WorkflowContext`)
        self.replay_error: PurityError | StaleRunError | None = None
        self.root: asyncio.Task[Any] | None = None  # the task running the workflow body
        self.end_sync = True  # False: whoever runs the kernel makes its end durable (a child's, with its siblings')
        self.turns = Turns(history.order(), current_attempt)  # the order outcomes reach the workflow in
        self.guard = UpgradeGuard(self.turns, self.code_changed and bool(self.turns.order),
                                  lambda: self.replay_error)
        self.running: dict[Attempt, asyncio.Task[Any] | None] = {}  # the attempts in flight (shared by the parts)
        self.log = RunLog(storage, lease, history, advisories, checkpoint_every)
        self.control = Control(storage=storage, log=self.log, turns=self.turns, clock=clock, running=self.running,
                               wait=wait, poll=poll)
        self.control.cut = self.cut
        steps = self.steps = Steps(log=self.log, control=self.control, turns=self.turns, clock=clock,
                                   placement=engine.placement, gates=engine.gates, executor=executor,
                                   new_attempt=functools.partial(attempt_cls, self), on_step=on_step,
                                   compensations=self.compensations, spent=self.spent, budget=history.budget,
                                   parks=lambda: children.parks, running=self.running)
        self.log.flight = self.steps
        self.streams = steps.streams = Streams(storage, self.run_id)
        if history.budget is None and history.header.parent is not None:
            steps.meter.owner = owner_of(storage, history.header.parent)  # a child spends its owner's budget
        self.emit = self.steps.emit
        self.awakeables = Awakeables(storage=storage, log=self.log, control=self.control, turns=self.turns,
                                     clock=clock, replay_next=self.replay_next, op=self.op,
                                     base_url=lambda: engine.callback_url)
        self.awakeable = self.awakeables.create
        self.values = Values(log=self.log, turns=self.turns, clock=clock, owner=self, scope=self.scope,
                             check_label=self.check_label, replay_failed=self.replay_failed,
                             record=steps.meter.record)
        children = self.child_runs = Children(engine=engine, log=self.log, control=self.control, turns=self.turns,
                                              busy=steps, calls=self, code_changed=self.code_changed,
                                              guard=self.guard,
                                              emits=on_step is not None)
        # what the engine, the heartbeat and `ctx` call, served by the parts themselves
        self.write = self.log.write
        self.advise = self.log.advise
        self.execute = self.steps.execute
        # what runs a step not in the log: held by the upgrade guard while it is on, else the live step itself (the
        # guard's state read once, not per step)
        self.live_step = self.execute_after_replay if self.guard.active else self.execute
        self.guard.released = self.unguarded
        self.flag_attempts = self.control.flag_attempts
        self.interrupt = self.control.interrupt
        self.spawn = self.child_runs.spawn
        self.spawn_all = self.child_runs.spawn_all
        self.join = self.child_runs.join
        self.join_all = self.child_runs.join_all
        self.graph = self.child_runs.graph
        self.now = self.values.now
        self.random = self.values.random
        self.uuid = self.values.uuid
        self.patched = self.values.patched
        self.replaying = self.values.replaying
        self.annotate = self.values.annotate
        self.charge = self.values.charge
        self.transaction = TransactionSteps(self.log, self, self.replay_next, self.execute).call
        self._observer: Observer | None = None
        make = observing.get()
        self.observer = make(self) if make is not None else None

    # ---- what others set and read of the run, kept by its parts ------------------------------------
    @property
    def observer(self) -> Observer | None:
        """The test harness watching this execution (`Observer`), if any."""
        return self._observer

    @observer.setter
    def observer(self, observer: Observer | None) -> None:
        self._observer = observer
        hooks = Hooks(observer, self) if observer is not None else None
        self.steps.hooks = self.control.hooks = self.child_runs.hooks = self.values.hooks = hooks

    @property
    def dead(self) -> bool:
        """The process is as good as killed (crash injection): nothing more is written."""
        return self.log.dead

    @dead.setter
    def dead(self, value: bool) -> None:
        self.log.dead = value

    @property
    def lost(self) -> LeaseLostError | None:
        """The lease went to another process (the heartbeat says so): nothing more is written."""
        return self.log.lost

    @lost.setter
    def lost(self, error: LeaseLostError | None) -> None:
        self.log.lost = error

    @property
    def budget(self) -> dict[str, float] | None:
        """The run's own budget (None: none, or the budget of the ancestor it spends from: `meter.owner`)."""
        return self.steps.budget

    @budget.setter
    def budget(self, budget: dict[str, float] | None) -> None:
        self.steps.budget = budget

    @property
    def retrying(self) -> bool:
        """This execution retries a failed run: each failed child it joins is resumed once."""
        return self.child_runs.retrying

    @retrying.setter
    def retrying(self, value: bool) -> None:
        self.child_runs.retrying = value

    @property
    def parks(self) -> bool:
        """Served by a worker: children are queued runs; joins and long backoffs park the run."""
        return self.child_runs.parks

    @parks.setter
    def parks(self, value: bool) -> None:
        self.child_runs.parks = value

    @property
    def children(self) -> list[Any]:
        """The attached children's outcomes kept (`Children.attach`)."""
        return self.child_runs.children

    @property
    def stopping(self) -> Callable[[], bool] | None:
        """A worker's graceful stop: no new steps once it says so."""
        return self.control.stopping

    @stopping.setter
    def stopping(self, stopping: Callable[[], bool] | None) -> None:
        self.control.stopping = stopping

    @property
    def cleanup(self) -> float:
        """Seconds a cancelled workflow may clean up for (the engine's setting)."""
        return self.control.cleanup

    @cleanup.setter
    def cleanup(self, seconds: float) -> None:
        self.control.cleanup = seconds

    @property
    def step_running_since(self) -> float | None:
        """Since when (monotonic) steps have been running without a pause (None: none runs)."""
        return self.steps.step_running_since

    @property
    def next_control(self) -> float:
        """When (monotonic) the control inbox is looked at next."""
        return self.control.next_control

    # ---- steps ----------------------------------------------------------------------------------
    def scope(self) -> Scope:
        """The calling strand's scope; paths may only be allocated by the task that owns it."""
        return strand_scope(self.replay_failed)

    def check_label(self, path: str, rec: records.Ok | records.Err, label: str) -> None:
        recorded = rec.label
        if recorded == label or self.history.accepts(path, label):
            return
        where = f"step path {path_tuple(path)}: recorded as {recorded!r}, now called {label!r}"
        if self.code_changed:
            raise self.replay_failed(StaleRunError(
                f"run {self.run_id} was recorded by other code of workflow {self.workflow.name!r}; at {where}",
                hint=stale_hint(self.workflow.fn, self.run_id, recorded, label),
                docs="docs/versioning.md#adopt", run_id=self.run_id, path=path_tuple(path), recorded=recorded,
                called=label))
        raise self.replay_failed(PurityError(
            f"the workflow took another branch on replay; at {where}",
            hint="Keep workflow code between steps deterministic: read time, randomness and I/O through "
                 "ctx.now()/ctx.random()/ctx.step(), or start over with fresh=True.",
            run_id=self.run_id, path=path_tuple(path), recorded=recorded, called=label))

    def replay_failed(self, error: PurityError | StaleRunError) -> PurityError | StaleRunError:
        """Remember that replay cannot go on: the run then ends unrecorded (resumable with the right code)."""
        if self.replay_error is None:
            self.replay_error = error
        return error

    def step(self, fn: Callable[..., Any], /, *args: Any, **options: Any) -> Handle[Any]:
        """`ctx.step` itself (the context binds it as its own `step`, so a call is one Python frame): allocate
        the step's path now; return an awaitable that replays or runs it."""
        opts = PLAIN
        name = None
        if options:
            name, opts = step_options(fn, **options)
        if name:
            if not callable(fn):
                raise not_callable(fn)
            label = name
        else:
            try:
                label = LABELS[fn]  # holds callables only
            except (KeyError, TypeError):
                if not callable(fn):
                    raise not_callable(fn) from None
                label = label_of(fn)
        scope = current_scope.get(None)
        if scope is None or (scope.owner is not None and (
                scope.thread != get_ident() or scope.owner is not running_task(scope.loop))):
            scope = self.scope()
        n = scope.n
        scope.n = n + 1
        try:
            path = scope.prefix + NUMBERS[n]
        except IndexError:
            path = scope.prefix + number(n)
        pending = scope.pending
        if not pending:
            labels = scope.labels
            count = labels[label] = labels.get(label, 0) + 1
            if count == 100 or count == 1000:
                self.advise("LOOP_SUGGESTED", count, f"{count} steps labelled {label!r} ran one after another")
        rec = self.done.get(path)
        scope.pending = pending + 1
        ok = rec if type(rec) is _Ok and opts is PLAIN and self.on_step is None else None  # replayed plainly
        # `handle()` inlined: this is every step's hot path
        h: Handle[Any] = (Handle if ok is None else Replayed)(loop=scope.loop)
        h.operator = self
        h.path = path
        h.label = label
        h.observed = False
        h.driver = None
        h.task_name = None
        if rec is None:
            h.operation = self.live_step
            h.operands = (scope, path, label, fn, args, opts)
            return h
        if rec.label != label:
            self.check_label(path, rec, label)
        if ok is not None:
            h.operation = replayed
            h.operands = (self.turns, scope, path, ok.value)
        else:
            h.operation = self.replay
            h.operands = (scope, path, rec, opts)
        return h

    def unguarded(self) -> None:
        """The upgrade guard went off: steps called from now on run live at once."""
        self.live_step = self.execute

    async def execute_after_replay(self, h: Handle, *operands: Any) -> Any:
        """A live step of a run resumed on changed code: run once the replay is over (`upgrade.UpgradeGuard`)."""
        await self.guard.hold()
        return await self.execute(h, *operands)

    def replay_next(self, label: str, opts: StepOptions | _Schema = PLAIN,
                    where: str = "output") -> tuple[str, Scope, Handle | None]:
        """Allocate the calling strand's next path for `label` (a sleep, wait, join or loop), and the handle
        replaying the record at it when there is one (its label checked), else None: the caller then runs it
        live."""
        scope = self.scope()
        path = scope.alloc()
        rec = self.done.get(path)
        if rec is None:
            return path, scope, None
        self.check_label(path, rec, label)
        scope.pending += 1
        return path, scope, handle(self, scope.loop, self.replay, (scope, path, rec, opts, where), path, label)

    async def replay(self, h: Handle, scope: Scope, path: str, rec: records.Ok | records.Err,
                     opts: StepOptions | _Schema, where: str = "output") -> Any:
        """A recorded outcome, in its turn."""
        try:
            turns = self.turns
            if not turns.now(path):
                h.driver = current_task()
                await turns.recorded(path)
            if self.on_step is not None:
                self.steps.emit(path, rec.label, "replayed", rec.attempt, rec.ms)
            if isinstance(rec, records.Err):
                if rec.error.get("type") == CANCELLED_TYPE:
                    raise asyncio.CancelledError()
                raise load_error(rec.error)
            value = load_value(rec.value)
            if opts.schema is not None:
                value = opts.schema.convert(value, where)
            if opts.compensate is not None:
                self.compensations[path] = (opts.compensate, value, rec.label)
        except BaseException as exc:
            exc = self.control.cancel_cut(exc, h)
            self.control.failed(h, exc)
            raise exc from None
        finally:
            scope.pending -= 1
        self.control.deliver(h, value)
        return value

    def drive(self, h: Handle, op: Coroutine[Any, Any, Any]) -> None:
        """Run the operation of a handle the workflow hands to asyncio (rather than awaiting it) in a task of
        the run."""
        if self.turns.closed:
            op.close()
            return
        h.driver = self.turns.start(op, contextvars.copy_context())

    def op(self, scope: Scope, path: str, label: str, body: Callable[..., Awaitable[Any]], *args: Any) -> Handle:
        """A handle at `path` whose operation is `body(handle, *args)` (`operation`)."""
        h = handle(self, scope.loop, self.operation, (), path, label)
        h.operands = (body, h, *args)
        return h

    def composite(self, scope: Scope, path: str, label: str, body: Callable[..., Awaitable[Any]],
                  *args: Any) -> Handle:
        """A handle at `path` whose operation is `body(*args)`, made of other operations (a graph, a fan-out, a
        loop): it records nothing of its own."""
        return handle(self, scope.loop, self.operation, (body, *args), path, label)

    async def operation(self, h: Handle, body: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """The operation of `h`: `body(*args)`, whose outcome becomes the handle's (the body records it in its
        turn; a body made of other operations, a graph, a fan-out, a loop, has none of its own). A stop of the
        whole run never reaches the workflow; the run's cancel arrives as `RunCancelledError`."""
        try:
            result = await body(*args)
        except BaseException as exc:
            if self.log.stops(exc):
                await self.control.halt(exc)
            exc = self.control.cancel_cut(exc, h)
            self.control.failed(h, exc)
            raise exc from None
        self.control.deliver(h, result)
        return result

    def cancel_handle(self, h: Handle, msg: Any) -> bool:
        """The workflow cancelled `h` before its outcome reached it: the cancellation is recorded in the
        workflow's turn (so a replay finds it, and an operation cut off is never run again), the operation is
        stopped, and `h` is cancelled like any future."""
        path = h.path
        if not self.turns.closed and not self.log.dead:
            if path in self.done:
                self.turns.take(path)  # a replay: the recorded cancel (or an outcome the workflow now refuses)
            elif h.operation is None:
                self.write(records.Err(path=path, label=h.label, attempt=1, error=dump_error(CUT_OFF),
                                       ts=time.time()))
        h.operation = None
        for att in list(self.running):
            if att.path == path:
                att.cancel()
        driver = h.driver
        cancelled(h, msg)
        if h.observed:
            self.turns.hop()
        if driver is not None and not driver.done() and driver is not asyncio.current_task():
            driver.cancel(msg)
        return True

    # ---- durable sleeps and waits for signals (`Control`) ----------------------------------------
    def sleep_until(self, when: datetime) -> Handle:
        """Allocate the sleep's path now; its wake time is recorded the first time it runs."""
        check_wake_time(when)
        path, scope, replayed = self.replay_next("ctx.sleep")
        return replayed or self.op(scope, path, "ctx.sleep", self.control.sleep, path, when)

    def wait_for(self, name: str, schema: Any, timeout: float | None) -> Handle:
        """Allocate the wait's path now; it returns the payload of the next signal `name` sent to the run."""
        check_signal_name(name)
        timeout = check_timeout(timeout, "wait_for timeout=")
        compiled = compile_schema(schema, f"schema of wait_for({name!r})")
        path, scope, replayed = self.replay_next("ctx.wait_for", PLAIN if compiled is None else _Schema(compiled),
                                                 f"signal {name!r}")
        return replayed or self.op(scope, path, "ctx.wait_for", self.control.wait_for, path, name, compiled, timeout)

    def loop(self, initial: Any, reducer: Callable[..., Any], snapshot_every: int | None,
             max_iterations: int | None) -> Handle[Any]:
        """Allocate the loop's path now; each iteration's steps live under ``<path>.<iteration>.``."""
        if not callable(reducer):
            raise ValidationError(f"ctx.loop needs a reducer function, got {reducer!r}",
                                  hint="Pass `async def reducer(state, it)` returning the next state or it.done(value).",
                                  docs="docs/authoring.md#loops")
        for name, value in (("snapshot_every", snapshot_every), ("max_iterations", max_iterations)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValidationError(f"ctx.loop {name}= must be an int >= 1, got {value!r}",
                                      hint=f"Omit {name}= for the default.", docs="docs/authoring.md#loops")
        path, scope, replayed = self.replay_next("ctx.loop")
        return replayed or self.composite(scope, path, "ctx.loop", self._loop, path, initial, reducer,
                                          snapshot_every or 1, max_iterations)

    async def _loop(self, path: str, initial: Any, reducer: Callable[..., Any], every: int,
                    max_iterations: int | None) -> Any:
        caller = current_scope.get()
        after = ((caller.prefix, caller.n), *caller.outer)
        snap = self.history.snaps.get(path)
        if snap is not None:
            state, start = load_value(snap.state), snap.iteration + 1
        else:
            state, start = load_value(dump_value(initial, "loop state")), 0
        i = start
        while True:
            if max_iterations is not None and i >= max_iterations:
                raise LoopLimitError(
                    f"ctx.loop at path {path_tuple(path)} reached max_iterations={max_iterations} without it.done()",
                    hint="Return it.done(value) from the reducer when the work is finished, or raise max_iterations=.",
                    path=list(path_tuple(path)), iterations=i)
            token = current_scope.set(Scope(f"{path}.{i}.", asyncio.current_task(), ((f"{path}.", i + 1), *after)))
            try:
                out = reducer(state, i)
                if inspect.isawaitable(out):
                    out = await out
            finally:
                current_scope.reset(token)
            if isinstance(out, LoopDone):
                wire = dump_value(out.value, "loop result")
                if self.observer is not None and path not in self.done:
                    self.observer.unrecorded(self, path, "ctx.loop", "ctx.loop")
                await self.control.live_turn()
                self.write(records.Ok(attempt=1, path=path, label="ctx.loop", value=wire, ms=0, ts=time.time()))
                self.log.step_done()
                return load_value(wire)
            wire = dump_value(out, f"loop state after iteration {i}")
            state = load_value(wire)
            if (i + 1) % every == 0:
                data = encode_line(wire)
                if len(data) >= 256 * 1024:
                    self.advise("SNAPSHOT_HEAVY", len(data),
                                f"ctx.loop at path {path_tuple(path)} snapshots {len(data) // 1024} KiB of state")
                self.write(records.Snap(path=path, iteration=i, state=wire, ts=time.time()))
                self.log.step_done()
                for p in self.log.compact_loops():
                    if p in self.compensations:
                        self.trimmed[p] = None
            i += 1

    def parallel(self, items: list[Any], concurrency: int | None) -> Handle:
        """Allocate a path for the fan-out now; each branch runs under its own prefix."""
        items = checked_branches(items, concurrency)
        scope = self.scope()
        prefix = None if all(isinstance(item, Handle) for item in items) else scope.alloc()
        if len(items) >= 1000:
            self.advise("FANOUT_CEILING", len(items), f"ctx.parallel with {len(items)} branches")
        return self.composite(scope, prefix or "", "ctx.parallel", self.branch_out, prefix, items, concurrency)

    async def branch_out(self, prefix: str | None, items: list[Any], concurrency: int | None) -> list[Ok[Any] | Err]:
        """Run the branches; steps already allocated keep their paths, anything else gets ``<prefix>.<i>.``."""
        caller = current_scope.get()
        after = ((caller.prefix, caller.n), *caller.outer)

        def enter(i: int) -> None:
            current_scope.set(Scope(f"{prefix}.{i}.", asyncio.current_task(), after))

        self.steps.branches += 1
        try:
            return await run_branches(items, concurrency, enter if prefix is not None else None)
        finally:
            self.steps.branches -= 1


    # ---- the whole run ------------------------------------------------------------------------
    async def compensate(self, error: BaseException) -> None:
        """Run the compensations of completed steps in reverse completion order, each once, durably."""
        order = {p: i - len(self.trimmed) for i, p in enumerate(self.trimmed)}
        order.update((p, i) for i, p in enumerate(self.done))
        failures = []
        for path in sorted(self.compensations, key=lambda p: order.get(p, -1), reverse=True):
            if path in self.history.comps or path not in order:
                continue
            fn, value, label = self.compensations[path]
            if self.observer is not None:
                self.observer.unrecorded(self, path, "compensation", label)
            try:
                out = await self.steps.invoke(fn, (value,), is_async_callable(fn))
                del out
            except (Crash, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - recorded and reported, the others still run
                self.write(records.Comp(path=path, ok=False, error=dump_error(exc), ts=time.time()))
                failures.append(f"compensation of step {label!r} at {path_tuple(path)} failed: "
                                f"{type(exc).__name__}: {exc}")
                continue
            self.write(records.Comp(path=path, ok=True, ts=time.time()))
        for line in failures:
            error.add_note(line)
            print(f"durably: {line}", file=sys.stderr)

    def completed_undone(self) -> PurityError:
        """The failure of a failing run (killed after compensations ran, before its end) whose replay returned
        instead of failing again: its result would rest on steps the compensations undid."""
        undone = [f"{path_tuple(p)} {self.done[p].label!r}" for p, comp in self.history.comps.items()
                  if comp.ok and p in self.done]
        return PurityError(
            f"run {self.run_id} failed and its compensations undid step(s) {', '.join(undone) or '(compacted)'} "
            "before it was interrupted; resumed, its workflow returned instead of failing again, so its result "
            "would use the results of undone steps",
            hint=f"Retry it (`durably retry {self.run_id}`): the undone steps run again. The workflow took another "
                 "path than before (changed code, or a decision outside ctx.step).",
            docs="docs/policies.md#compensation", run_id=self.run_id)

    async def run(self, ctx: object) -> Any:
        """Execute the workflow and record how it ended.

        The workflow body runs in a task of its own. This coroutine waits for the run to stop: the body ended
        (its end is then recorded here), the run parked (it is quiet and rests on durable waits only), or it
        stopped (a crash, a lost lease, a full disk). Whatever of the workflow is still pending then is torn
        down (`turns.discard`): no internal exception ever completes a task or future of the workflow's."""
        self.ctx = ctx
        loop = asyncio.get_running_loop()
        turns = self.turns
        turns.loop = loop
        turns.idle = self.control.at_rest
        install_factory(loop, make_task)
        halted = self.control.halted = loop.create_future()
        self.control.driver = asyncio.current_task()
        Steps.live += 1
        try:
            self.root = turns.start(self._body(ctx), contextvars.copy_context())
            if self.history.cancel is not None:
                self.control.cancel_in_turn(self.history.cancel, recorded=True)
            try:
                kind, value = await asyncio.shield(halted)
            except asyncio.CancelledError:
                tasks = turns.close()
                try:
                    await self.let_steps_clean_up()
                finally:
                    discard(tasks)
                raise
            except BaseException:
                discard(turns.close())
                raise
            if kind == "raise" and not isinstance(value, Exception) or kind == "halt" and isinstance(value, Parked):
                self.control.torn_down = True  # as a process dying: the steps it cuts off are recorded as nothing
            elif kind in ("return", "raise"):
                self.abandon_running()
            discard(turns.close())
            if kind == "park":
                raise self.park(value)
            if kind == "halt":
                if value is not CLEANUP_OVER:
                    raise value
                kind, value = "raise", self.control.cancel_error
            return await self._end(kind, value)
        finally:
            Steps.live -= 1
            if self.control.cleanup_timer is not None:
                self.control.cleanup_timer.cancel()

    async def let_steps_clean_up(self) -> None:
        """Stopped from outside (Ctrl-C, a worker stopping): each step still running is cancelled and waited for,
        so its own `except CancelledError:` or `finally:` runs to its end (nothing more of the workflow does:
        its turns are closed); a second stop cuts the wait short."""
        tasks = {task for task in self.running.values() if task is not None and not task.done()}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def abandon_running(self) -> None:
        """The workflow ended while steps it started still ran (nobody waited for them): each is recorded as
        cancelled, as a replay will find it, before the tear-down stops it."""
        for att in list(self.running):
            if att.path not in self.done:
                self.write(records.Err(path=att.path, label=att.label, attempt=att.number,
                                       error=dump_error(ABANDONED), ts=time.time()))

    async def _body(self, ctx: object) -> None:
        """The workflow itself, as the run's first task: how it ends goes to `run` (`stop`)."""
        current_scope.set(Scope("", asyncio.current_task()))
        current_turns.set(self.turns)
        try:
            if self.history.paused:
                await self.control.hold()
            result = await self.workflow(ctx, self.input)
        except Complete as done:
            self.control.stop(("return", done.value))
        except GeneratorExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to `run`, which decides what the run's end is
            self.control.stop(("halt", exc) if self.log.stops(exc) else ("raise", exc))
        else:
            self.control.stop(("return", result))

    def park(self, rests: list[Rest]) -> Parked:
        """Record what the run parks on (a join's children, a retry's wake time) and say when it is due again."""
        for rest in sorted(rests, key=lambda r: r.status == "over_budget"):  # its park last: the run's status
            if rest.record is not None:
                self.write(rest.record)
        self.log.sync()
        order = ("interrupted", "paused", "over_budget", "waiting", "sleeping")
        first = min(rests, key=lambda r: order.index(r.status))
        times = [r.at for r in rests if r.at is not None]
        names = tuple(dict.fromkeys(r.signal for r in rests if r.signal is not None))
        children = tuple(dict.fromkeys(c for r in rests for c in r.children))
        if first.status in ("paused", "interrupted"):
            times, names, children = ([time.time()] if first.status == "interrupted" else []), (), ()
        return Parked(first.status, first.detail, children, at=min(times) if times else None, names=names,
                      path=first.path, label=first.label)

    async def _end(self, kind: str, value: Any) -> Any:
        """Record how the workflow ended: `kind` "return" with its value or "raise" with its exception."""
        try:
            if kind == "raise":
                raise value
            result = value
            if self.child_runs.attached and self.control.cancel_error is None:
                await self.child_runs.wait_attached()
            if self.child_runs.children and self.control.cancel_error is None:
                ended = asyncio.ensure_future(self.child_runs.attached_ended())
                try:
                    await self.child_runs.parked_on(ended)
                finally:
                    ended.cancel()
            if any(comp.ok for comp in self.history.comps.values()):
                raise self.completed_undone()
            schema = self.workflow.output_schema
            wire = dump_value(schema.to_builtins(result) if schema else result, "result")
            value = load_value(wire)
            if schema is not None:
                value = schema.convert(value, "result")
        except Parked:
            raise
        except BaseException as exc:
            if self.log.dead or isinstance(exc, Crash):
                raise Crash() from exc
            if self.log.lost is not None:
                raise self.log.lost from (None if exc is self.log.lost else exc)
            if self.log.full is not None:  # never a failed run, never compensated: it resumes once there is space
                if exc is self.log.full:
                    raise
                raise self.log.full from exc
            if self.replay_error is not None:
                raise self.replay_error from (None if exc is self.replay_error else exc)
            cancelled = self.control.cancel_error or (exc if isinstance(exc, RunCancelledError) else None)
            if cancelled is not None:
                await self.end_cancelled(cancelled)
                if cancelled is exc:
                    raise
                raise cancelled from (None if isinstance(exc, asyncio.CancelledError) else exc)
            if not isinstance(exc, Exception):
                raise
            await self.compensate(exc)
            self.write(records.End(status="failed", error=dump_error(exc), ts=time.time()))
            if self.end_sync:
                self.log.sync()
            raise
        if self.replay_error is not None:
            raise self.replay_error
        if self.control.cancel_error is not None:
            await self.end_cancelled(self.control.cancel_error)
            raise self.control.cancel_error
        self.write(records.End(status="completed", result=wire, ts=time.time()))
        if self.end_sync:
            self.log.sync()
        return value


    # ---- cancellation and clean-up ------------------------------------------------------------
    def cut(self, here: asyncio.Task[Any] | None) -> None:
        """The run's cancel is delivered (`Control.deliver_cancel`): cut the steps running, cancel the workflow's
        task and every attached child. `here` raises the cancel error itself (`Control.cut_inline`)."""
        targets: dict[asyncio.Task[Any], None] = {}
        for att, task in list(self.running.items()):
            att.cancel()
            if task is not None:
                targets[task] = None
        if self.root is not None and not self.root.done():
            targets[self.root] = None
        if here is not None:
            targets.pop(here, None)
        for task in targets:
            task.cancel(CANCEL_MSG)
        self.child_runs.cancel_all()

    def finish_cancelled(self, error: BaseException) -> None:
        """Record that the run ended cancelled, sync the log, and stop attached children."""
        self.write(records.End(status="cancelled", error=dump_error(error), ts=time.time()))
        self.log.sync()
        self.child_runs.cancel_all()

    async def end_cancelled(self, error: BaseException) -> None:
        """The run ends cancelled: compensations of its completed steps first when the cancel asked for them."""
        rec = self.control.cancel_rec
        if rec is not None and rec.compensate:
            await self.compensate(error)
        self.finish_cancelled(error)

    # ---- what `ctx` asks of its kernel besides the above (`_authoring.context.Kernel`) -------------------
    cancels_losers = True  # `ctx.first` cancels the operations that lost (each cancellation is recorded)

    def sleep(self, seconds: float) -> Handle[None]:
        """`ctx.sleep`: wake `seconds` after the run clock's now."""
        return self.sleep_until(self.clock.now() + timedelta(seconds=seconds))

    def stream(self, path: str) -> StepStream:
        """`attempt().emit` and `.partials`: the stream of the step at `path` (`streams.Streams`)."""
        streams = self.streams
        if streams.loop is None and self.root is not None:
            streams.loop = self.root.get_loop()
        return streams.stream(path)

    def stash(self, path: str, value: Any) -> Any:
        """`attempt().stash`: record the partial progress of the step at `path`; return it as its next attempt
        will find it."""
        wire = dump_value(value, "stash")
        self.write(records.Stash(path=path, value=wire))
        return load_value(wire)
