"""Running a step live (`Steps`): its attempts, timeouts, retries and backoffs, where a `def` step runs, and the
one recorded tail every successful attempt goes through (its record, the checkpoint, advisories, its delivery).

`execute` is every live step's entry: one guard sends a step with options, an observer, an `on_step`
listener or an earlier attempt to the general path (`_attempts`); the rest take the short path written out
in `execute` itself. Both end in `_recorded`."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor
from datetime import UTC, datetime, timedelta
from types import CoroutineType
from typing import TYPE_CHECKING, Any, NoReturn

from .. import records
from .._authoring.calls import (
    CO_COROUTINE,
    NOT_RETRYABLE,
    PLAIN,
    Attempt,
    StepOptions,
    current_attempt,
    is_async_callable,
)
from .._authoring.handles import Handle, set_result
from .._authoring.paths import Scope
from .._authoring.policies import Retry
from .._authoring.usage import EXTRACTORS
from .._clock import Clock
from .._codec import dump_error, dump_output, dump_value, from_iso, load_value, to_iso
from .._events import StepEvent
from .._state.advisories import RetryStormWindow
from .._state.history import path_tuple
from ..errors import (
    CircuitOpenError,
    SerializationError,
    StepInterruptedError,
    StepTimeoutError,
)
from . import transactions
from .budgets import Meter
from .control import Control
from .limits import Limiter
from .log import DEFAULT_SYNC_SECONDS, RunLog
from .stops import CUT_OFF, Crash, Parked, Rest, is_run_cancel
from .streams import Streams, streamed, streaming
from .tasks import current_task, get_ident, running_task
from .turns import Turns
from .watchdog import Watchdog

if TYPE_CHECKING:
    from .._authoring.resources import Gates
    from .._threads import SyncPlacement
    from .ports import Hooks

GENERATORS = inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR  # a generator step streams (`streams`)
PLAIN_RESULTS = frozenset({dict, list, tuple, str, int, float, bool, type(None)})  # never awaitable
YIELD_EVERY = 0.05  # a run of steps that never suspend still lets the loop in this often (Ctrl-C, cancellation)
PARK_BACKOFF = 5.0
"""A retry backoff at least this long parks a run a worker serves (due at the backoff's end, its process free
meanwhile); a shorter one is waited out in place, as every backoff is in a run with no worker."""


def retry_started(prior: records.Fail | None, now: datetime, ms: float) -> datetime:
    """When a step's first attempt started, on the run's clock: as its earlier failed attempts recorded it, else
    (this is the first) this attempt's start. A log written before the field existed gives the start of its
    last failed attempt, by that record's timestamp."""
    if prior is None:
        return now - timedelta(milliseconds=ms)
    if prior.first is not None:
        return from_iso(prior.first)
    if prior.ts is not None:
        return datetime.fromtimestamp(prior.ts - (prior.ms or 0) / 1000, UTC)
    return now - timedelta(milliseconds=ms)


def effect_input(args: tuple[Any, ...]) -> Any:
    """A step's arguments as an unsafe step's `start` record keeps them for an operator to read: a JSON list,
    each argument in its wire form, or its `repr` (at most 500 characters) when it is not JSON."""
    try:
        return dump_value(list(args), "input")
    except (SerializationError, TypeError, ValueError):
        out: list[Any] = []
        for arg in args:
            try:
                out.append(dump_value(arg, "input"))
            except (SerializationError, TypeError, ValueError):
                out.append(repr(arg)[:500])
        return out


def timeout_hint(retry: Any) -> str:
    """What to do about a step timeout, without suggesting `retry=` to a step that already has it."""
    more = "give `retry=` more attempts" if retry is not None else "add `retry=`"
    return f"Raise `timeout=`, {more}, or `attempt().stash()` progress so a retry resumes it."


class Steps:
    """The live steps of one execution of a run: what runs now, and how each attempt's outcome is recorded."""

    live = 0  # kernels running in this process (a sync step runs on the loop thread only while it is the only one)
    streams: Streams  # the run's streamed steps, set by the kernel

    def __init__(self, *, log: RunLog, control: Control, turns: Turns, clock: Clock, placement: SyncPlacement,
                 gates: Gates, executor: Executor, new_attempt: Callable[[str, int, Any], Attempt],
                 on_step: Callable[[StepEvent], Any] | None, compensations: dict[str, Any],
                 spent: dict[str, float], budget: dict[str, float] | None, parks: Callable[[], bool],
                 running: dict[Attempt, asyncio.Task[Any] | None]) -> None:
        self.log = log
        self.history = log.history
        self.run_id = log.run_id
        self.control = control
        self.turns = turns
        self.clock = clock
        self.placement = placement
        self.gates = gates
        self.executor = executor
        self.new_attempt = new_attempt
        self.on_step = on_step
        self.compensations = compensations  # path -> (compensation, value, label) of the steps that completed
        self.spent = spent
        self.meter = Meter(log=log, control=control, storage=log.storage, spent=spent, budget=budget)
        self.parks = parks  # whether a worker serves the run (a long backoff may park it)
        self.hooks: Hooks | None = None
        self.executions: dict[str, int] = {}
        self.storm = RetryStormWindow()
        self.watchdog = Watchdog()
        self.running = running  # the attempts in flight, with the task each runs in (None: on the loop thread)
        self.step_running_since: float | None = None
        self.event_loop: asyncio.AbstractEventLoop | None = None  # the run's event loop, once a step looked it up
        self.event_thread = 0  # and its thread
        self.next_yield = 0.0
        self.branches = 0  # `ctx.parallel` fan-outs running
        self.limiter = Limiter(log.storage, log.run_id, log.lease.epoch, control)

    def emit(self, path: str, label: str, status: str, attempt: int, ms: float | None = None,
             error: BaseException | None = None) -> None:
        """Tell the `on_step` listener; a listener that raises never fails the run."""
        if self.on_step is None:
            return
        try:
            self.on_step(StepEvent(self.run_id, path_tuple(path), label, status, attempt,  # type: ignore[arg-type]
                                   self.executions.get(path, 0), ms, error))
        except Exception:  # noqa: BLE001 - listeners must never fail the run
            pass

    @property
    def budget(self) -> dict[str, float] | None:
        """The run's own budget (`Meter.budget`)."""
        return self.meter.budget

    @budget.setter
    def budget(self, budget: dict[str, float] | None) -> None:
        self.meter.budget = budget

    def alone(self, scope: Scope) -> bool:
        """True when the calling step is the only work of any run in this process that could want the loop now:
        no other step of its strand pending, no parallel branches, no other step running, no other live run."""
        return scope.pending == 1 and not self.branches and len(self.running) == 1 and Steps.live == 1

    async def execute(self, h: Handle, scope: Scope, path: str, label: str, fn: Callable[..., Any],
                      args: tuple[Any, ...], opts: StepOptions) -> Any:
        """Run a step live and record its outcome in its turn.

        The common case (no options, nobody observing the run, no earlier attempt or stash at this path) takes
        the short path written out here: the same checks and bookkeeping as `_execute` and `_attempts` minus
        what only options, observers and retries need, in one coroutine instead of three."""
        control = self.control
        try:
            history = self.history
            code = getattr(fn, "__code__", None)
            flags = code.co_flags if code is not None else 0
            if opts is not PLAIN or self.hooks is not None or self.on_step is not None \
                    or path in history.fails or path in history.stashes or flags & GENERATORS:
                return await self._execute(h, scope, path, label, fn, args, opts)
            if control.stopping is not None and control.stopping():
                await control.interrupted()
            now = time.monotonic()
            if now >= control.next_control:
                await control.boundary()
                now = time.monotonic()
            meter = self.meter
            if meter.checks:
                await meter.admit(path, label, None)
            is_async = bool(flags & CO_COROUTINE) if code is not None else is_async_callable(fn)
            running = self.running
            # `alone(scope)` before this step is registered as running
            inline = not is_async and not running and scope.pending == 1 and not self.branches \
                and Steps.live == 1 and self.placement.is_quick(fn, code)
            att = self.new_attempt(path, 1, None)
            att.label = label
            token = current_attempt.set(att)
            clock = self.clock
            error: Exception | None = None
            clock.busy += 1
            if not running:
                self.step_running_since = now
            if running:
                loop = None
                running[att] = h.driver = current_task()
            else:
                # No step of this run in flight: this is the run's own loop on its own thread (another loop on
                # it could only run inside a step), so it is looked up once (a `getpid` per lookup on 3.11).
                loop = self.event_loop
                if loop is None or self.event_thread != get_ident():
                    loop = self.event_loop = asyncio.get_running_loop()
                    self.event_thread = get_ident()
                # a step on the loop thread needs no task to cancel: no callback can run until it returns
                running[att] = h.driver = None if inline else running_task(loop)
            started = time.perf_counter()
            try:
                if is_async:
                    value = fn(*args)
                    if type(value) is CoroutineType or inspect.isawaitable(value):
                        value = await value
                elif inline:
                    value = self.placement.inline(fn, args, started, loop)
                    if att.cancelled:  # the heartbeat saw a cancel request while the loop was blocked
                        control.cut_inline(att)
                    if type(value) not in PLAIN_RESULTS and inspect.isawaitable(value):
                        running[att] = h.driver = current_task()
                        value = await value
                else:
                    value = await self.invoke(fn, args, False)
                wire, value = dump_output(value)
            except asyncio.CancelledError:
                self.step_cut(h, att)
            except (Crash, GeneratorExit):
                raise
            except Exception as exc:
                if exc is control.cancel_error:
                    raise
                error = exc
            finally:
                ms = (time.perf_counter() - started) * 1000
                clock.busy -= 1
                del running[att]
                if not running:
                    self.step_running_since = None
                current_attempt.reset(token)
            if error is not None:
                if isinstance(error, SerializationError):
                    error.add_note(f"returned by step {label!r} at path {path_tuple(path)}")
                await self._failed(path, label, opts, 1, ms, error, att)
                return await self._attempts(h, scope, path, label, fn, args, opts, 2)
            turns = self.turns
            if not (turns.solo and turns.head >= len(turns.order) and not turns.ready) and not turns.live_now():
                await turns.live(time.time())
            if type(value) is dict and "usage" in value or EXTRACTORS:
                meter.charge_result(path, label, value)
            if self._recorded(h, path, label, wire, value, 1, ms, opts):
                await self.settled(h, value)
            return value
        except BaseException as exc:
            if self.log.stops(exc):
                await control.halt(exc)
            exc = control.cancel_cut(exc, h)
            control.failed(h, exc)
            raise exc from None
        finally:
            scope.pending -= 1

    def _recorded(self, h: Handle, path: str, label: str, wire: Any, value: Any, number: int, ms: float,
                  opts: StepOptions, committed: bool = False) -> bool:
        """A step's attempt `number` returned `value` (`wire` its recorded form), and its turn came: record it
        (unless its transaction `committed` the record already), fsync when the checkpoint policy says so, keep its
        compensation, tell listeners and advisories, and deliver it. True when the loop is due a look-in (steps
        that never suspend would otherwise keep it from delivering a cancellation such as Ctrl-C): the caller
        then yields once."""
        log = self.log
        if not committed:
            log.write(records.Ok(path=path, label=label, value=wire, attempt=number, ms=ms, ts=time.time()))
        if self.streams.open:
            self.streams.finished(path, opts.keep_partials)
        now = time.monotonic()
        log.unsynced += 1  # `log.step_done()` written out, sharing its clock reading with the yield below
        if log.unsynced >= log.sync_every or (log.sync_by_time and now - log.last_sync >= DEFAULT_SYNC_SECONDS):
            log.sync()
        if opts.compensate is not None:
            self.compensations[path] = (opts.compensate, value, label)
        if self.on_step is not None:
            self.emit(path, label, "ok", number, ms)
        if ms >= 60_000 and opts.timeout is None:
            log.advise("SLOW_STEP_NO_TIMEOUT", ms / 1000, f"step {label!r} took {ms / 1000:.0f}s with no timeout=")
        if self.storm.retries or number > 1:
            self.storm.record(failed=False, retry=number > 1)
        if self.hooks is not None:
            self.hooks.step_ran(path, label, True)
        if log.pending is not None:  # appends committed in groups: delivered once its record is durable
            return True
        if not h.done():
            set_result(h, value)
            if h.observed:
                self.turns.hop()
        if now >= self.next_yield:
            self.next_yield = now + YIELD_EVERY
            return True
        return False

    async def settled(self, h: Handle, value: Any) -> None:
        """After `_recorded` asked for it: yield to the loop once, or, when the storage commits appends in groups,
        wait until the step's record is durable and only then deliver `value` to `h`."""
        if self.log.pending is None:
            await asyncio.sleep(0)
            return
        await self.log.settled()
        if not h.done():
            set_result(h, value)
            if h.observed:
                self.turns.hop()

    async def _execute(self, h: Handle, scope: Scope, path: str, label: str, fn: Callable[..., Any],
                       args: tuple[Any, ...], opts: StepOptions) -> Any:
        control = self.control
        if self.hooks is not None:
            self.hooks.unrecorded(path, "step", label)
        if control.stopping is not None and control.stopping():
            await control.interrupted()
        if time.monotonic() >= control.next_control:
            await control.boundary()
        prior = self.history.fails.get(path)
        number = prior.attempt + 1 if prior else 1
        if prior is not None:
            await self.back_off(path, label, from_iso(prior.next))
        if opts.unsafe:
            started = self.history.starts.get(path)
            if started is not None and (prior is None or started.attempt > prior.attempt):
                if opts.on_interrupt != "raise" and control.cancel_error is None:
                    await self.needs_attention(path, label, started, args)
                error = StepInterruptedError(
                    f"step {label!r} at path {path_tuple(path)} started in an earlier process and never finished",
                    path=list(path_tuple(path)), label=label, operation_id=f"{self.run_id}/{path}")
                await control.live_turn()
                self.log.write(records.Err(path=path, label=label, attempt=started.attempt, error=dump_error(error),
                                           ts=time.time()))
                self.emit(path, label, "failed", number, error=error)
                raise error
        return await self._attempts(h, scope, path, label, fn, args, opts, number)

    async def needs_attention(self, path: str, label: str, started: records.Start, args: tuple[Any, ...]) -> NoReturn:
        """A "manual" unsafe step was cut off in an earlier process: nothing runs at it, and the whole run stops
        here as `needs_attention` until an operator resolves the step (`Engine.resolve_effect`). A start recorded
        without the manual policy (by older code, or under on_interrupt="raise") is recorded again with it, so
        the log alone says the run needs attention."""
        if started.effect != "manual":
            self.log.write(records.Start(path=path, label=label, attempt=started.attempt, effect="manual",
                                         input=started.input if started.input is not None else effect_input(args),
                                         ts=started.ts))
            self.log.sync()
        await self.control.halt(Parked(
            "needs_attention", f"needs attention: step {label!r} at path {path_tuple(path)} started in an earlier "
            "process and never finished", path=path, label=label))

    def step_cut(self, h: Handle, att: Any) -> NoReturn:
        """Call while a running step's `CancelledError` is handled: the step was cut off.

        Cut by the run's cancel request: it is recorded as cancelled with the run's error, which its awaiter
        gets (`RunCancelledError`, at the same point on replay). Cut because the workflow cancelled its handle
        or its task (a `TaskGroup` or `gather` giving up, `asyncio.timeout`): recorded as cancelled, so that no
        replay runs it again, and the `CancelledError` goes on."""
        exc = sys.exc_info()[1]
        task = asyncio.current_task()
        path, label, number = att.path, att.label, att.number
        control = self.control
        if control.cancel_error is not None and att.cancelled and is_run_cancel(exc):
            if task is not None:
                task.uncancel()
            self.log.write(records.Err(path=path, label=label, attempt=number,
                                       error=dump_error(control.cancel_error), ts=time.time()))
            raise control.cancel_error from None
        if h.cancelled():  # the workflow's own cancel of the handle: it wrote the record, and takes its cancel back
            if task is not None and task is h.driver:
                task.uncancel()
        elif not control.stopped_from_outside():
            self.log.write(records.Err(path=path, label=label, attempt=number, error=dump_error(CUT_OFF),
                                       ts=time.time()))
        raise  # the CancelledError the caller is handling

    async def _attempts(self, h: Handle, scope: Scope, path: str, label: str, fn: Callable[..., Any],
                        args: tuple[Any, ...], opts: StepOptions, number: int) -> Any:
        if streaming(fn):
            fn = streamed(fn)
        is_async = is_async_callable(fn)
        control = self.control
        meter = self.meter
        while True:
            if meter.checks or opts.reserve is not None:
                await meter.admit(path, label, opts.reserve)
            stash = self.history.stashes.get(path)
            att = self.new_attempt(path, number, load_value(stash.value) if stash else None)
            att.label = label
            limits = self.gates.for_step(opts.concurrency_key, opts.concurrency_limit, opts.uses) \
                if opts.concurrency_key is not None or opts.uses is not None else ()
            if limits:
                h.driver = current_task()
                try:
                    await self.limiter.enter(limits, path, label)  # the attempt starts once every limit lets it
                except CircuitOpenError as exc:
                    await self._failed(path, label, opts, number, 0.0, exc, att)
                    number += 1
                    continue
            if opts.unsafe:
                self.log.write(records.Start(path=path, label=label, attempt=number,
                                             effect="raise" if opts.on_interrupt == "raise" else "manual",
                                             input=effect_input(args), ts=time.time()))
                self.log.sync()
            token = current_attempt.set(att)
            self.executions[path] = self.executions.get(path, 0) + 1
            if self.on_step is not None:
                self.emit(path, label, "running", number)
            outcome: bool | None = None
            error: Exception | None = None
            self.clock.busy += 1
            if not self.running:
                self.step_running_since = time.monotonic()
            self.running[att] = h.driver = current_task()
            started = time.perf_counter()
            try:
                if opts.transactional:  # committed with its record at its turn (`transactions`)
                    value = await transactions.attempt(self.log, control.live_turn, self.executor, path, label, fn,
                                                       args, opts, number, started)
                elif opts.timeout is None and is_async:
                    value = fn(*args)
                    if type(value) is CoroutineType or inspect.isawaitable(value):
                        value = await value
                elif opts.timeout is None:
                    if self.placement.is_quick(fn) and self.alone(scope):
                        value = self.placement.inline(fn, args)
                        if att.cancelled:  # the heartbeat saw a cancel request while the loop was blocked
                            control.cut_inline(att)
                        if type(value) not in PLAIN_RESULTS and inspect.isawaitable(value):
                            value = await value
                    else:
                        value = await self.invoke(fn, args, is_async)
                else:
                    task = asyncio.current_task()
                    pending = task.cancelling() if task is not None else 0
                    watch = self.watchdog.add(opts.timeout, task, att)
                    try:
                        if is_async:
                            value = fn(*args)
                            if type(value) is CoroutineType or inspect.isawaitable(value):
                                value = await value
                        else:
                            value = await self.invoke(fn, args, is_async)
                    except asyncio.CancelledError as exc:
                        if not att.cancelled or is_run_cancel(exc) or h.cancelled() or task is None \
                                or task.uncancel() > pending:
                            raise
                        raise StepTimeoutError(
                            f"step {label!r} timed out after {opts.timeout:g}s (attempt {number})",
                            path=list(path_tuple(path)), label=label, timeout=opts.timeout,
                            hint=timeout_hint(opts.retry)) from None
                    finally:
                        self.watchdog.remove(watch)
                outcome = True
                if self.hooks is not None:
                    self.hooks.step_ran(path, label, False)
                raw = value
                wire = None
                if not opts.transactional:
                    wire = dump_value(value if opts.schema is None else opts.schema.to_builtins(value), "output")
                    value = load_value(wire)
                    if opts.schema is not None:
                        value = opts.schema.convert(value, "output")
            except asyncio.CancelledError:
                self.step_cut(h, att)
            except (Crash, GeneratorExit):
                raise
            except Exception as exc:
                if exc is control.cancel_error:
                    raise
                if outcome is None:
                    outcome = False
                error = exc
            finally:
                ms = (time.perf_counter() - started) * 1000
                self.clock.busy -= 1
                del self.running[att]
                if not self.running:
                    self.step_running_since = None
                current_attempt.reset(token)
                meter.release(opts.reserve)
                if limits:
                    self.limiter.leave(limits, path, outcome)
            if error is not None:
                if isinstance(error, SerializationError):
                    error.add_note(f"returned by step {label!r} at path {path_tuple(path)}")
                await self._failed(path, label, opts, number, ms, error, att)
                number += 1
                continue
            if not opts.transactional:
                await control.live_turn()
            if opts.charge is not False and (opts.charge is not None or EXTRACTORS or (
                    type(raw) is dict and "usage" in raw) or type(raw) not in PLAIN_RESULTS and hasattr(raw, "usage")):
                meter.charge_result(path, label, raw, opts.charge)
            if self._recorded(h, path, label, wire, value, number, ms, opts, opts.transactional):
                await self.settled(h, value)
            return value

    async def invoke(self, fn: Callable[..., Any], args: tuple[Any, ...], is_async: bool) -> Any:
        """Call `fn(*args)`: an `async def` one here, a `def` one on the run's executor; await what it returns."""
        if is_async:
            value = fn(*args)
        else:
            loop = asyncio.get_running_loop()
            value = await loop.run_in_executor(self.executor, contextvars.copy_context().run, self.placement.timed,
                                               fn, *args)
        if inspect.isawaitable(value):
            value = await value
        return value

    async def _failed(self, path: str, label: str, opts: StepOptions, number: int, ms: float,
                      exc: Exception, att: Attempt) -> None:
        """Record a failed attempt; wait out the backoff and return to retry, or raise (in its turn) to fail
        the step."""
        log = self.log
        if self.streams.open:
            self.streams.flush(path)
        retry: Retry | None = opts.retry
        storm = self.storm.record(failed=True, retry=number > 1)
        if storm is not None:
            log.advise("RETRY_STORM", 0, f"{self.storm.retries} retries in this run; "
                       f"{self.storm.failure_ratio:.0%} of recent attempts failed", storm)
        if ms >= 30_000 and not att.did_stash:
            log.advise("STASH_SUGGESTED", ms / 1000,
                       f"step {label!r} ran {ms / 1000:.0f}s and failed without stashing progress")
        wake = first = None
        if retry is not None and not retry.gives_up(number, exc) and not isinstance(exc, NOT_RETRYABLE):
            now = self.clock.now()
            wake = now + timedelta(seconds=retry.delay(number))
            if retry.deadline is not None:
                first = retry_started(self.history.fails.get(path), now, ms)
                if wake > first + timedelta(seconds=retry.deadline):
                    exc.add_note(f"step {label!r} gave up after attempt {number}: its Retry(deadline="
                                 f"{retry.deadline:g}) ends before another attempt could start")
                    wake = None
        if wake is None:
            await self.control.live_turn()
            log.write(records.Err(path=path, label=label, attempt=number, error=dump_error(exc), ms=ms,
                                  ts=time.time()))
            log.step_done()
            self.emit(path, label, "failed", number, ms, exc)
            raise exc
        log.write(records.Fail(path=path, label=label, attempt=number, error=dump_error(exc), ms=ms,
                               next=to_iso(wake), first=None if first is None else to_iso(first), ts=time.time()))
        self.emit(path, label, "retrying", number, ms, exc)
        await self.back_off(path, label, wake)

    async def back_off(self, path: str, label: str, wake: datetime) -> None:
        """Wait until a retry's `wake` time in place; a backoff of `PARK_BACKOFF` s or more left in a run a
        worker serves may park the run meanwhile (due again at `wake`), when the rest of it rests too."""
        left = (wake - self.clock.now()).total_seconds()
        if left <= 0:
            await self.control.nap(wake)
            return
        rest = Rest("sleeping", f"retrying step {label!r} at {to_iso(wake)}",
                    parkable=self.parks() and left >= PARK_BACKOFF, at=wake.timestamp(),
                    record=records.Park(path=path, until=to_iso(wake), ts=time.time()), path=path, label=label)
        with self.control.resting(rest):
            await self.control.nap(wake)
