"""The replay kernel: runs a workflow from the top, answering recorded steps from the log.

Every `ctx.step` gets a hierarchical path when it is *called* (``"3"``, ``"4.1.0"``);
a path with a recorded result returns it without running the function, any
other path runs live and appends its result before returning it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import inspect
import random
import sys
import threading
import time
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import CoroutineType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from .. import records
from .._authoring import graphs
from .._authoring.branches import checked_branches, foreign_strand, outside_workflow, run_branches
from .._authoring.calls import (
    CO_COROUTINE,
    LABELS,
    NOT_RETRYABLE,
    PLAIN,
    Attempt,
    Complete,
    LoopDone,
    RunHandle,
    StepOptions,
    check_budget_kind,
    check_handle,
    check_signal_name,
    check_wake_time,
    current_attempt,
    is_async_callable,
    label_of,
    not_callable,
    spawn_pairs,
    step_options,
)
from .._authoring.handles import Handle, cancelled, fail, handle, not_durable, set_result
from .._authoring.paths import NUMBERS, Scope, current_scope, number
from .._authoring.policies import Retry, check_timeout
from .._authoring.result import Err, Ok
from .._authoring.schema import compile_schema
from .._authoring.workflow import Workflow, as_workflow
from .._clock import Clock
from .._codec import (
    DT_TAG,
    ESC_TAG,
    SCALARS,
    dump_error,
    dump_output,
    dump_value,
    encode_line,
    from_iso,
    load_error,
    load_value,
    to_iso,
)
from .._events import StepEvent
from .._state.advisories import AdvisoryTracker, RetryStormWindow, level_for
from .._state.history import History, path_tuple
from ..errors import (
    BudgetExceededError,
    DependencyFailedError,
    LeaseLostError,
    LoopLimitError,
    PurityError,
    RunCancelledError,
    SerializationError,
    StaleRunError,
    StepInterruptedError,
    StepTimeoutError,
    StorageFullError,
    ValidationError,
    WaitTimeoutError,
)
from .stale import stale_hint
from .turns import Turns, current_turns, deadline_over, discard, guarded, install_factory, raw_timers

if TYPE_CHECKING:
    from .._authoring.graphs import Task
    from .._authoring.resources import Gates
    from .._threads import SyncPlacement
    from ..storage.base import Lease, Storage

_Ok = records.Ok
PLAIN_RESULTS = frozenset({dict, list, tuple, str, int, float, bool, type(None)})  # never awaitable
DEFAULT_SYNC_STEPS = 1000
DEFAULT_SYNC_SECONDS = 1.0
CONTROL_EVERY = 0.5
SPAWN_BATCH = 1024  # a spawn_all creates and records its children this many at a time
CHILDREN_PRUNE = 64  # settled child outcomes are dropped from `RunKernel.children` once it holds this many
JOIN_AHEAD = 1024  # a join_all asks for the outcomes of this many children ahead of the one it records next
PARK_LISTS = 100  # a join's park record names at most this many of the children it waits for (and counts all)
YIELD_EVERY = 0.05  # a run of steps that never suspend still lets the loop in this often (Ctrl-C, cancellation)
LOOP_COMPACT_BYTES = 64 * 1024
PARK_BACKOFF = 5.0
"""A retry backoff at least this long parks a run a worker serves (due at the backoff's end, its process free
meanwhile); a shorter one is waited out in place, as every backoff is in a run with no worker."""


class Crash(BaseException):  # noqa: N818 - it is not an error but a simulated process death
    """Raised by crash injection: the run stops exactly as a killed process would."""




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


def timeout_hint(retry: Any) -> str:
    """What to do about a step timeout, without suggesting `retry=` to a step that already has it."""
    more = "give `retry=` more attempts" if retry is not None else "add `retry=`"
    return f"Raise `timeout=`, {more}, or `attempt().stash()` progress so a retry resumes it."


class Parked(BaseException):  # noqa: N818 - control flow, not an error
    """The run parked (`status` "waiting", "sleeping" or "paused") and its engine was asked not to wait, or
    its worker is stopping ("interrupted"). It is due again at `at` (epoch seconds; None: only when woken), at
    once on a signal named in `names`, or (`children`) when the child runs it waits for in a join ended."""

    def __init__(self, status: str, detail: str, children: tuple[str, ...] = (), *, at: float | None = None,
                 names: tuple[str, ...] = (), path: str | None = None, label: str = "") -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.children = children
        self.at = at
        self.names = names
        self.path = path  # where the first strand that parks waits, and on what
        self.label = label


@dataclass(slots=True)
class Rest:
    """A durable wait a strand of the run is in, and how the run would park on it."""

    status: str  # "sleeping", "waiting", "paused" or "interrupted"
    detail: str
    parkable: bool  # False: the wait goes on only in this process (a child run here, a short backoff)
    at: float | None = None  # due again then (epoch seconds)
    signal: str | None = None  # a signal whose arrival makes it due
    children: tuple[str, ...] = ()  # child runs whose end makes it due
    record: records.Park | None = None  # what parking on it records
    fallback: asyncio.Future[None] | None = None  # set when the run cannot park: the wait goes on here
    task: asyncio.Task[Any] | None = None  # the strand that waits
    path: str | None = None  # the operation waiting, and its label
    label: str = ""


CANCEL_PATH = "$cancel"  # a cancel's place in the order of a run's outcomes (`Turns`)
CANCEL_MSG = "durably: the run was cancelled"  # the message of the CancelledError a cancel request causes
CANCELLED_TYPE = "asyncio.exceptions:CancelledError"  # the recorded error of an operation the workflow cancelled
CUT_OFF = asyncio.CancelledError("cancelled by the workflow")
ABANDONED = asyncio.CancelledError("abandoned: the workflow ended before this step did")
DEFAULT_CLEANUP = 60.0  # seconds a cancelled workflow may spend on clean-up before it is stopped
_INTERNAL = contextvars.Context()  # the context of the kernel's own tasks (none of the workflow's)


class Halted(BaseException):  # noqa: N818 - control flow, not an error
    """The run is stopping; raised by a ctx call made after that."""


HALTED = Halted()
CLEANUP_OVER = Halted("the clean-up window of the cancelled run ended")


def is_run_cancel(exc: BaseException | None) -> bool:
    """Whether `exc` is the `CancelledError` a cancel request of the run put into its workflow."""
    return isinstance(exc, asyncio.CancelledError) and bool(exc.args) and exc.args[0] == CANCEL_MSG


def signal_time(signal: dict[str, Any]) -> float:
    """When a stored signal arrived (epoch seconds on the sender's engine clock), for the order of outcomes
    ready at the same moment."""
    try:
        return from_iso(signal["at"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return time.time()


def make_task(loop: asyncio.AbstractEventLoop, coro: Any, previous: Callable[..., Any] | None,
              **kwargs: Any) -> Any:
    """The task factory workflows' loops get (`turns.install_factory`): `asyncio.create_task(handle)` (and a
    `TaskGroup`'s) starts the handle and returns it; a task the workflow creates is one of its run's."""
    if type(coro) is Handle:
        coro.start()
        return coro
    context = kwargs.get("context")
    turns = context.get(current_turns) if context is not None else current_turns.get()
    if turns is None or turns.closed or type(coro) is not CoroutineType or \
            (context.get(current_attempt, None) if context is not None else current_attempt.get(None)) is not None:
        return previous(loop, coro, **kwargs) if previous is not None else asyncio.Task(coro, loop=loop, **kwargs)
    guard = guarded(coro, turns)
    task = previous(loop, guard, **kwargs) if previous is not None else asyncio.Task(guard, loop=loop, **kwargs)
    turns.adopt(task, coro)
    return task










class EngineServices(Protocol):
    """What the kernel asks of the engine that runs it (`engine.Engine` implements it): child runs, gates."""

    concurrency: int
    gates: Gates
    placement: SyncPlacement

    def create_child(self, parent: str, path: str, workflow: Workflow, input: Any, detached: bool, *,
                     queued: bool = True) -> str: ...

    def create_children(self, parent: str, children: list[tuple[str, Workflow, Any]],
                        detached: bool, *, queued: bool = True) -> list[str]: ...

    def start_child(self, run_id: str, workflow: Workflow | None, *,
                    rerun_failed: bool = False) -> asyncio.Future[Any]: ...

    def start_children(self, handles: list[RunHandle], *, rerun_failed: bool,
                       on_start: Callable[[str, asyncio.Future[Any]], None]) -> Spawned | None: ...

    def parked_in_join(self) -> contextlib.AbstractAsyncContextManager[None]: ...

    def ended_child(self, run_id: str, workflow: Workflow | None) -> asyncio.Future[Any] | None: ...

    def queued_child(self, run_id: str) -> None: ...


class Spawned(Protocol):
    """Spawned children waiting in the engine to start, in spawn order (`EngineServices.start_children`): no
    future each until one starts, when its run id and outcome are handed to the spawning run (`on_start`)."""

    def done(self) -> bool:
        """True once every child started, or the wait was cancelled."""

    def cancel(self) -> None:
        """Start none of those still waiting."""

    def wait(self) -> asyncio.Future[None]:
        """Done once `done()` is."""





Selector = tuple[int, ...] | str | tuple[str, int]


def selects(selector: Selector | None, path: str, label: str, nth: int) -> bool:
    """Whether a step selector (a path tuple, a label, or `(label, nth)` from 1) picks the nth step so labelled."""
    if selector is None:
        return False
    if isinstance(selector, str):
        return selector == label
    if len(selector) == 2 and isinstance(selector[0], str):
        return selector[0] == label and selector[1] == nth
    return tuple(selector) == path_tuple(path)


class Observer(Protocol):
    """What a test harness sees of one live execution (`durably_py.testing`: crash injection, replay checks).

    A kernel has none unless `observing` makes one for it, so each hook point costs one attribute check.
    A hook may set `kernel.dead` and raise `Crash` to stop the run exactly as a killed process would."""

    def unrecorded(self, kernel: RunKernel, path: str, kind: str, label: str) -> None:
        """Work the log has no record of is about to start at `path`: a step (`kind` "step", `label` its label),
        a compensation (`kind` "compensation", `label` its step's label) or a ctx call (`kind` and `label` both
        "ctx.sleep", "ctx.wait_for", "ctx.spawn", "ctx.join", "ctx.graph", "ctx.loop", "ctx.now", "ctx.random"
        or "ctx.uuid")."""

    def step_ran(self, kernel: RunKernel, path: str, label: str, recorded: bool) -> None:
        """A step's function returned: called before its result is written (`recorded` False) and after (True)."""


observing: contextvars.ContextVar[Callable[[RunKernel], Observer | None] | None] = contextvars.ContextVar(
    "durably_observing", default=None)
"""Makes the `Observer` of each kernel created in this context (`durably_py.testing` sets it)."""

_current_tasks: dict[Any, asyncio.Task[Any]] | None = getattr(asyncio.tasks, "_current_tasks", None)
_running_loop = asyncio.events._get_running_loop


def _current_task_311() -> asyncio.Task[Any] | None:
    """`asyncio.current_task()` on 3.11, where it is written in Python: the same table, a third of the cost."""
    return _current_tasks.get(_running_loop())  # type: ignore[union-attr]


current_task: Callable[[], asyncio.Task[Any] | None] = (
    asyncio.current_task if sys.version_info >= (3, 12) or _current_tasks is None else _current_task_311)

running_task: Callable[[asyncio.AbstractEventLoop | None], asyncio.Task[Any] | None] = (
    asyncio.current_task if sys.version_info >= (3, 12) or _current_tasks is None
    else _current_tasks.get)
"""The task running on a given loop: with the loop known, no running-loop lookup (on 3.11 that costs a
`getpid` system call per call)."""
get_ident = threading.get_ident


















async def replayed(h: Handle, turns: Turns, scope: Scope, path: str, wire: Any) -> Any:
    """A recorded `Ok` of a step with no options: the fewest operations between the record and its value.

    In a run of one strand its turn is now (the head of the recorded order is this path): a comparison and a
    counter. Otherwise it waits for its turn (`Turns.recorded`)."""
    try:
        order = turns.order
        head = turns.head
        if turns.solo and head < len(order) and order[head] == path:
            turns.head = head + 1
            if turns.early:
                turns.skip_early()
        elif not turns.now(path):
            h.driver = current_task()
            await turns.recorded(path)
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit):
            fail(h, exc)
        raise
    finally:
        scope.pending -= 1
    t = type(wire)
    if t is dict:  # `load_value` inlined for the common step output, a flat dict of scalars
        for x in wire.values():
            if type(x) not in SCALARS:
                value = load_value(wire)
                break
        else:
            value = load_value(wire) if len(wire) == 1 and (DT_TAG in wire or ESC_TAG in wire) else wire.copy()
    else:
        value = wire if t in SCALARS else load_value(wire)
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








class Watchdog:
    """One timer for the timeouts of every running step of a run (cheaper than a timer per step)."""

    def __init__(self) -> None:
        self.running: dict[int, tuple[float, asyncio.Task[Any], Attempt]] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.armed = float("inf")
        self.ids = iter(range(1 << 62))

    def add(self, timeout: float, task: asyncio.Task[Any] | None, att: Attempt) -> int:
        """Watch the attempt running in `task`; cancel it `timeout` seconds from now unless removed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        watch = next(self.ids)
        if task is not None:
            self.running[watch] = (deadline, task, att)
            if deadline < self.armed:
                self.arm(loop, deadline)
        return watch

    def remove(self, watch: int) -> None:
        self.running.pop(watch, None)

    def arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = loop.call_at(when, self.fire, loop)
        self.armed = when

    def fire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel every attempt past its deadline (marking it timed out) and re-arm for the next one."""
        self.timer, self.armed = None, float("inf")
        now = loop.time()
        upcoming = float("inf")
        for watch, (deadline, task, att) in list(self.running.items()):
            if deadline <= now:
                del self.running[watch]
                att.cancel()
                task.cancel()
            else:
                upcoming = min(upcoming, deadline)
        if upcoming != float("inf"):
            self.arm(loop, upcoming)


class RunKernel:
    """One live execution of one run: owns its lease and appends its records."""

    live = 0  # kernels running in this process (a sync step runs on the loop thread only while it is the only one)

    def __init__(self, *, engine: EngineServices, storage: Storage, lease: Lease, history: History,
                 workflow: Workflow, attempt_cls: Callable[[RunKernel, str, int, Any], Attempt],
                 input: Any, clock: Clock, executor: Executor, checkpoint_every: int | None,
                 on_step: Callable[[StepEvent], Any] | None, advisories: AdvisoryTracker,
                 wait: bool = True, poll: float = 0.2) -> None:
        self.attempt_cls = attempt_cls
        self.engine = engine
        self.wait = wait
        self.poll = poll
        self.storage = storage
        self.lease = lease
        self.history = history
        self.run_id: str = history.header.run_id
        self.workflow = workflow
        self.input = input
        self.clock = clock
        self.executor = executor
        self.on_step = on_step
        self.advisories = advisories
        self.done = history.done
        self.code_changed = history.header.fingerprint != workflow.fingerprint
        self.budget: dict[str, float] | None = history.budget
        self.spent = history.spent()
        self.lock = threading.Lock()
        self.sync_every = checkpoint_every or DEFAULT_SYNC_STEPS
        self.sync_by_time = checkpoint_every is None
        self.unsynced = 0
        self.last_sync = time.monotonic()
        self.syncs = 0
        self.dead = False
        self.executions: dict[str, int] = {}
        self.compensations: dict[str, tuple[Callable[[Any], Any], Any, str]] = {}
        self.annotations: dict[str, int] = {}  # `ctx.annotate` calls made so far in this process, per strand
        self.storm = RetryStormWindow()
        self.ctx: object = None  # the `ctx` handed to the workflow (a `context.WorkflowContext`)
        self.children: list[asyncio.Future[Any] | Spawned] = []  # attached children (`attach`), pruned as they settle
        self.children_limit = CHILDREN_PRUNE
        self.retrying = False
        self.resumed: set[str] = set()  # failed children this retry has resumed already (never twice in one retry)
        self.joining = 0
        self.join_watch: asyncio.Task[None] | None = None
        self.interrupted_by: asyncio.Future[None] | None = None
        self.next_control = 0.0
        self.cancel_error: RunCancelledError | None = None
        self.holding: asyncio.Future[None] | None = None
        self.replay_error: PurityError | StaleRunError | None = None
        self.lost: LeaseLostError | None = None
        self.full: StorageFullError | None = None  # a write refused for space: nothing more is written
        self.watchdog = Watchdog()
        self.placement = engine.placement
        self.event_loop: asyncio.AbstractEventLoop | None = None  # the run's event loop, once a step looked it up
        self.event_thread = 0  # and its thread
        self.running: dict[Attempt, asyncio.Task[Any] | None] = {}
        self.marked: set[Attempt] = set()  # running attempts whose start the heartbeat recorded
        self.began: dict[Attempt, float] = {}  # when each of those started (as near as the heartbeat can tell)
        self.step_running_since: float | None = None
        self.next_yield = 0.0
        self.branches = 0
        self.since_compaction = 0
        self.trimmed: dict[str, None] = {}  # compensable steps whose records a loop compaction dropped, in order
        self.stopping: Callable[[], bool] | None = None  # a worker's graceful stop: no new steps once it says so
        make = observing.get()
        self.observer: Observer | None = make(self) if make is not None else None
        self.parks = False  # served by a worker: children are queued runs; joins and long backoffs park the run
        self.attached: dict[str, None] = {}  # unjoined attached children while `parks` (the end waits for them)
        self.end_sync = True  # False: whoever runs the kernel makes its end durable (a child's, with its siblings')
        self.turns = Turns(history.order(), current_attempt)  # the order outcomes reach the workflow in
        self.rests: dict[object, Rest] = {}  # the durable waits strands are in now
        self.halted: asyncio.Future[tuple[str, Any]] | None = None  # how this execution of the run stops
        self.root: asyncio.Task[Any] | None = None  # the task running the workflow body
        self.driver: asyncio.Task[Any] | None = None  # the task that runs this execution (`run`)
        self.torn_down = False  # ended by a BaseException of the workflow's (KeyboardInterrupt...): as by a kill
        self.canceller: asyncio.Task[Any] | None = None  # delivers a cancel request in its turn
        self.cancel_rec: records.Cancel | None = None  # the cancel delivered, once it is
        self.cancel_pending: records.Cancel | None = None  # a cancel requested in this process, not delivered yet
        self.cleanup = DEFAULT_CLEANUP  # seconds a cancelled workflow may clean up for (the engine's setting)
        self.cleanup_timer: asyncio.TimerHandle | None = None

    # ---- writing -------------------------------------------------------------------------------
    def write(self, rec: records.Record) -> None:
        """Append one record (thread-safe); in a crashed run nothing more is written."""
        if self.dead:
            raise Crash()
        if self.lost is not None:
            raise self.lost
        if self.full is not None:
            raise self.full
        data = records.encode(rec)
        with self.lock:
            try:
                self.storage.append(self.lease, data)
            except LeaseLostError as exc:
                self.lost = exc
                raise
            except StorageFullError as exc:  # a smaller record might still fit: the run stops here all the same
                self.full = exc
                raise
            if type(rec) is records.Ok and rec.signal is None and rec.ts is not None:
                self.history.add_ok(rec)
            else:
                self.history.add(rec)
            self.since_compaction += len(data)

    def write_unkept(self, recs: list[records.Record], batch: str) -> None:
        """Append `recs` in one storage append (one write or transaction for all) without folding them into
        the in-memory history (`History.kept_out`): the spawn and join records of a wide fan-out, which
        nothing in this process reads again."""
        if self.dead:
            raise Crash()
        if self.lost is not None:
            raise self.lost
        if self.full is not None:
            raise self.full
        data = b"".join([records.encode(rec) for rec in recs])
        with self.lock:
            try:
                self.storage.append(self.lease, data)
            except LeaseLostError as exc:
                self.lost = exc
                raise
            except StorageFullError as exc:
                self.full = exc
                raise
            self.history.kept_out(batch, getattr(recs[-1], "ts", None))
            self.since_compaction += len(data)

    def record_long_steps(self) -> None:
        """Record a `start` for every attempt still running since the heartbeat's last look (called from the
        heartbeat thread while a step has run for a while), so a process killed inside a long step leaves
        which step it was in for `inspect`. Quick steps never pay for it; nothing is fsynced; the in-memory
        history is left alone (the records matter to a later process only)."""
        running = list(self.running)
        since = self.step_running_since
        for att in running:
            if att in self.marked:
                continue
            self.marked.add(att)
            # the time it started when it is the only step running (else: now, the latest it can have started)
            ts = time.time() - (time.monotonic() - since) if len(running) == 1 and since is not None else time.time()
            self.began[att] = ts
            recorded = self.history.starts.get(att.path)
            if recorded is not None and recorded.attempt == att.number:  # an unsafe step's start, fsynced
                continue
            data = records.encode(records.Start(path=att.path, label=att.label, attempt=att.number, ts=ts))
            with self.lock:
                if self.dead or self.lost is not None or att not in self.running:
                    continue
                self.storage.append(self.lease, data)
        self.marked.intersection_update(running)
        for att in [att for att in self.began if att not in self.marked]:
            del self.began[att]
        timed = {att for _, _, att in list(self.watchdog.running.values())}
        now = time.time()
        for att, began in list(self.began.items()):  # a slow step with no timeout= is advised while it runs
            if att not in timed and level_for("SLOW_STEP_NO_TIMEOUT", now - began) is not None:
                self.advise("SLOW_STEP_NO_TIMEOUT", now - began,
                            f"step {att.label!r} has run {now - began:.0f}s with no timeout= and still runs")

    def compact_loops(self) -> None:
        """After a loop snapshot: rewrite the log without the records snapshots cover, every
        `LOOP_COMPACT_BYTES` written, so a resumed loop reads a bounded log however many iterations ran.

        The in-memory history drops the same records, so each compaction costs what the log keeps, not
        what the run wrote. Off when the storage does not compact (`compact_above_bytes=None`)."""
        if self.dead or self.since_compaction < LOOP_COMPACT_BYTES \
                or getattr(self.storage, "compact_above_bytes", None) is None:
            return
        with self.lock:
            self.since_compaction = 0
            history = self.history
            covered = [p for p in history.done if history.snapshotted(p)]
            if not covered:
                return
            kept = self.logged().compacted() if history.elided else history.compacted()
            self.storage.rewrite(self.lease, b"".join(records.encode(r) for r in kept))
            for table in (history.fails, history.starts, history.stashes, history.waits, history.wakes):
                for p in [p for p in table if p in history.done]:
                    del table[p]
            for p in covered:
                if p in self.compensations:
                    self.trimmed[p] = None
                del history.done[p]

    def logged(self) -> History:
        """The run's whole history read back from its log (for when the in-memory one forgot records)."""
        log = self.storage.read(self.run_id)
        assert log is not None
        return History(log.records, log.where)

    def step_done(self) -> None:
        """Count a completed step and fsync when the checkpoint policy says so."""
        self.unsynced += 1
        if self.unsynced >= self.sync_every or (
            self.sync_by_time and time.monotonic() - self.last_sync >= DEFAULT_SYNC_SECONDS
        ):
            self.sync()

    def steps_done(self, count: int) -> None:
        """Count `count` steps completed together (one batch of writes): at most one fsync for all of them."""
        self.unsynced += count - 1
        self.step_done()

    def sync(self) -> None:
        """Make everything written so far survive a machine crash."""
        if self.dead:
            return
        with self.lock:
            self.storage.sync(self.lease)
        self.syncs += 1
        self.unsynced = 0
        self.last_sync = time.monotonic()

    # ---- events ---------------------------------------------------------------------------------
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

    def advise(self, code: str, measure: float, msg: str, level: str | None = None, **fmt: Any) -> None:
        """Report an advisory when `measure` crosses one of the code's thresholds (or at `level`); store emissions.
        `fmt` fills the `{names}` of the catalogue's hint."""
        level = level or level_for(code, measure)
        if level is None:
            return
        emitted = self.advisories.report(code, level, msg, **fmt)
        if emitted is not None and not self.dead:
            self.write(records.Advice(advisory=emitted.to_dict()))

    # ---- steps ----------------------------------------------------------------------------------
    def scope(self) -> Scope:
        """The calling strand's scope; paths may only be allocated by the task that owns it."""
        try:
            scope = current_scope.get()
        except LookupError:
            raise outside_workflow() from None
        if scope.owner is not None and scope.owner is not asyncio.current_task():
            raise self.replay_failed(foreign_strand())
        return scope

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
        if options:
            name, opts = step_options(fn, **options)
        else:
            name, opts = None, PLAIN
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
        h: Handle[Any] = Handle(loop=scope.loop)  # `handle()` inlined: this is every step's hot path
        h._kernel = self
        h.path = path
        h.label = label
        h.observed = False
        h.driver = None
        h._name = None
        if rec is None:
            h._op = self.execute
            h._args = (scope, path, label, fn, args, opts)
            return h
        if rec.label != label:
            self.check_label(path, rec, label)
        if opts is PLAIN and type(rec) is _Ok and self.on_step is None:
            h._op = replayed
            h._args = (self.turns, scope, path, rec.value)
        else:
            h._op = self.replay
            h._args = (scope, path, rec, opts)
        return h

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
                self.emit(path, rec.label, "replayed", rec.attempt, rec.ms)
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
            exc = self.cancel_cut(exc, h)
            self.failed(h, exc)
            raise exc from None
        finally:
            scope.pending -= 1
        self.deliver(h, value)
        return value

    # ---- outcomes reaching the workflow -------------------------------------------------------------
    def deliver(self, h: Handle, value: Any) -> None:
        """Make `value` the result of `h` (its turn came); its observers' callbacks run before the next turn."""
        if not h.done():
            set_result(h, value)
            if h.observed:
                self.turns.hop()

    def failed(self, h: Handle, exc: BaseException) -> None:
        """The operation of `h` ended with `exc` (raised to its direct awaiter as well). A stop of the whole
        run (a crash, a lost lease) or a tear-down leaves the handle pending: nothing of the workflow sees it."""
        if h.done() or isinstance(exc, GeneratorExit) or self.stops(exc):
            return
        if not isinstance(exc, Exception | asyncio.CancelledError):
            self.torn_down = True  # KeyboardInterrupt, SystemExit...: the steps it cuts off are cut as by a kill
        fail(h, exc)
        if h.observed:
            self.turns.hop()

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
        h._args = (body, h, *args)
        return h

    def cancel_handle(self, h: Handle, msg: Any) -> bool:
        """The workflow cancelled `h` before its outcome reached it: the cancellation is recorded in the
        workflow's turn (so a replay finds it, and an operation cut off is never run again), the operation is
        stopped, and `h` is cancelled like any future."""
        path = h.path
        if not self.turns.closed and not self.dead:
            if path in self.done:
                self.turns.take(path)  # a replay: the recorded cancel (or an outcome the workflow now refuses)
            elif h._op is None:
                self.write(records.Err(path=path, label=h.label, attempt=1, error=dump_error(CUT_OFF),
                                       ts=time.time()))
        h._op = None
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

    def stops(self, exc: BaseException) -> bool:
        """Whether `exc` stops the whole run rather than failing one operation."""
        return isinstance(exc, Crash | Parked) or exc is self.lost or exc is self.full or exc is HALTED

    def check_budget(self) -> None:
        if self.budget is None:
            return
        for kind, limit in self.budget.items():
            if self.spent[kind] > limit:
                raise BudgetExceededError(
                    f"run {self.run_id} spent {self.spent[kind]:g} {kind}, over its budget of {limit:g}",
                    hint=f"Resume with a larger budget=, e.g. run(..., budget={{{kind!r}: {limit * 2:g}}}); "
                         "the spend so far is kept.",
                    kind=kind, spent=self.spent[kind], limit=limit)

    async def execute(self, h: Handle, scope: Scope, path: str, label: str, fn: Callable[..., Any],
                      args: tuple[Any, ...], opts: StepOptions) -> Any:
        """Run a step live and record its outcome in its turn.

        The common case (no options, nobody observing the run, no earlier attempt or stash at this path) takes
        the short path written out here: the same checks, records and bookkeeping as `_execute` and `_attempts`
        minus what only options, observers and retries need, in one coroutine instead of three."""
        try:
            history = self.history
            if opts is not PLAIN or self.observer is not None or self.on_step is not None \
                    or path in history.fails or path in history.stashes:
                return await self._execute(h, scope, path, label, fn, args, opts)
            if self.stopping is not None and self.stopping():
                await self.interrupted()
            now = time.monotonic()
            if now >= self.next_control:
                await self.boundary()
                now = time.monotonic()
            if self.budget is not None:
                self.check_budget()
            code = getattr(fn, "__code__", None)
            is_async = bool(code.co_flags & CO_COROUTINE) if code is not None else is_async_callable(fn)
            running = self.running
            # `alone(scope)` before this step is registered as running
            inline = not is_async and not running and scope.pending == 1 and not self.branches \
                and RunKernel.live == 1 and self.placement.is_quick(fn, code)
            att = self.attempt_cls(self, path, 1, None)
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
                        self.cut_inline(att)
                    if type(value) not in PLAIN_RESULTS and inspect.isawaitable(value):
                        running[att] = h.driver = current_task()
                        value = await value
                else:
                    value = await self._invoke(fn, args, False)
                wire, value = dump_output(value)
            except asyncio.CancelledError:
                self.step_cut(h, att)
            except (Crash, GeneratorExit):
                raise
            except Exception as exc:
                if exc is self.cancel_error:
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
            self.write(records.Ok(path=path, label=label, value=wire, attempt=1, ms=ms, ts=time.time()))
            now = time.monotonic()
            self.unsynced += 1  # `step_done()` written out, sharing its clock reading with the yield below
            if self.unsynced >= self.sync_every or (self.sync_by_time and now - self.last_sync >= DEFAULT_SYNC_SECONDS):
                self.sync()
            if ms >= 60_000:
                self.advise("SLOW_STEP_NO_TIMEOUT", ms / 1000, f"step {label!r} took {ms / 1000:.0f}s with no timeout=")
            if self.storm.retries:
                self.storm.record(failed=False, retry=False)
            set_result(h, value)
            if h.observed:
                turns.hop()
            if now >= self.next_yield:
                self.next_yield = now + YIELD_EVERY
                await asyncio.sleep(0)
            return value
        except BaseException as exc:
            if self.stops(exc):
                await self.halt(exc)
            exc = self.cancel_cut(exc, h)
            self.failed(h, exc)
            raise exc from None
        finally:
            scope.pending -= 1

    async def _execute(self, h: Handle, scope: Scope, path: str, label: str, fn: Callable[..., Any],
                       args: tuple[Any, ...], opts: StepOptions) -> Any:
        if self.observer is not None:
            self.observer.unrecorded(self, path, "step", label)
        if self.stopping is not None and self.stopping():
            await self.interrupted()
        if time.monotonic() >= self.next_control:
            await self.boundary()
        self.check_budget()
        prior = self.history.fails.get(path)
        number = prior.attempt + 1 if prior else 1
        if prior is not None:
            await self.back_off(path, label, from_iso(prior.next))
        if opts.unsafe:
            started = self.history.starts.get(path)
            if started is not None and (prior is None or started.attempt > prior.attempt):
                error = StepInterruptedError(
                    f"step {label!r} at path {path_tuple(path)} started in an earlier process and never finished",
                    path=list(path_tuple(path)), label=label, operation_id=f"{self.run_id}/{path}")
                await self.live_turn()
                self.write(records.Err(path=path, label=label, attempt=started.attempt, error=dump_error(error),
                                       ts=time.time()))
                self.emit(path, label, "failed", number, error=error)
                raise error
        return await self._attempts(h, scope, path, label, fn, args, opts, number)

    def step_cut(self, h: Handle, att: Any) -> NoReturn:
        """Call while a running step's `CancelledError` is handled: the step was cut off.

        Cut by the run's cancel request: it is recorded as cancelled with the run's error, which its awaiter
        gets (`RunCancelledError`, at the same point on replay). Cut because the workflow cancelled its handle
        or its task (a `TaskGroup` or `gather` giving up, `asyncio.timeout`): recorded as cancelled, so that no
        replay runs it again, and the `CancelledError` goes on."""
        exc = sys.exc_info()[1]
        task = asyncio.current_task()
        path, label, number = att.path, att.label, att.number
        if self.cancel_error is not None and att.cancelled and is_run_cancel(exc):
            if task is not None:
                task.uncancel()
            self.write(records.Err(path=path, label=label, attempt=number, error=dump_error(self.cancel_error),
                                   ts=time.time()))
            raise self.cancel_error from None
        if h.cancelled():  # the workflow's own cancel of the handle: it wrote the record, and takes its cancel back
            if task is not None and task is h.driver:
                task.uncancel()
        elif not self.stopped_from_outside():
            self.write(records.Err(path=path, label=label, attempt=number, error=dump_error(CUT_OFF),
                                   ts=time.time()))
        raise  # the CancelledError the caller is handling

    def stopped_from_outside(self) -> bool:
        """Whether what runs this execution is being cancelled (Ctrl-C, a worker stopping, the event loop
        closing): a step cut off then is cut as by a kill, and recorded as nothing."""
        driver = self.driver
        return self.torn_down or (driver is not None and driver.cancelling() > 0)

    def cut_inline(self, att: Any) -> None:
        """A quick sync step on the loop thread saw a cancel request while it ran (the heartbeat flagged it).
        Nothing else of the run can run meanwhile, so the cancel is delivered here, and the step is cut by it:
        recorded as cancelled, its awaiter gets `RunCancelledError`."""
        self.control(force=True)
        pending = self.cancel_pending
        if pending is not None and self.cancel_rec is None:
            self.deliver_cancel(pending, recorded=False, here=asyncio.current_task())
        if self.cancel_error is not None:
            self.write(records.Err(path=att.path, label=att.label, attempt=att.number,
                                   error=dump_error(self.cancel_error), ts=time.time()))
            raise self.cancel_error

    def alone(self, scope: Scope) -> bool:
        """True when the calling step is the only work of any run in this process that could want the loop now:
        no other step of its strand pending, no parallel branches, no other step running, no other live run."""
        return scope.pending == 1 and not self.branches and len(self.running) == 1 and RunKernel.live == 1

    async def _attempts(self, h: Handle, scope: Scope, path: str, label: str, fn: Callable[..., Any],
                        args: tuple[Any, ...], opts: StepOptions, number: int) -> Any:
        is_async = is_async_callable(fn)
        while True:
            if opts.unsafe:
                self.write(records.Start(path=path, label=label, attempt=number, ts=time.time()))
                self.sync()
            stash = self.history.stashes.get(path)
            att = self.attempt_cls(self, path, number, load_value(stash.value) if stash else None)
            att.label = label
            token = current_attempt.set(att)
            self.executions[path] = self.executions.get(path, 0) + 1
            if self.on_step is not None:
                self.emit(path, label, "running", number)
            gates = self.engine.gates.for_step(opts.concurrency_key, opts.concurrency_limit, opts.uses) \
                if opts.concurrency_key is not None or opts.uses is not None else ()
            passed = 0
            outcome: bool | None = None
            error: Exception | None = None
            self.clock.busy += 1
            if not self.running:
                self.step_running_since = time.monotonic()
            self.running[att] = h.driver = current_task()
            started = time.perf_counter()
            try:
                for gate in gates:
                    await gate.acquire()
                    passed += 1
                if opts.timeout is None and is_async:
                    value = fn(*args)
                    if type(value) is CoroutineType or inspect.isawaitable(value):
                        value = await value
                elif opts.timeout is None:
                    if self.placement.is_quick(fn) and self.alone(scope):
                        value = self.placement.inline(fn, args)
                        if att.cancelled:  # the heartbeat saw a cancel request while the loop was blocked
                            self.cut_inline(att)
                        if type(value) not in PLAIN_RESULTS and inspect.isawaitable(value):
                            value = await value
                    else:
                        value = await self._invoke(fn, args, is_async)
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
                            value = await self._invoke(fn, args, is_async)
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
                if self.observer is not None:
                    self.observer.step_ran(self, path, label, False)
                wire = dump_value(value if opts.schema is None else opts.schema.to_builtins(value), "output")
                value = load_value(wire)
                if opts.schema is not None:
                    value = opts.schema.convert(value, "output")
            except asyncio.CancelledError:
                self.step_cut(h, att)
            except (Crash, GeneratorExit):
                raise
            except Exception as exc:
                if exc is self.cancel_error:
                    raise
                if outcome is None and passed == len(gates):
                    outcome = False
                error = exc
            finally:
                ms = (time.perf_counter() - started) * 1000
                self.clock.busy -= 1
                del self.running[att]
                if not self.running:
                    self.step_running_since = None
                current_attempt.reset(token)
                for gate in gates[:passed]:
                    gate.release(outcome)
            if error is not None:
                if isinstance(error, SerializationError):
                    error.add_note(f"returned by step {label!r} at path {path_tuple(path)}")
                await self._failed(path, label, opts, number, ms, error, att)
                number += 1
                continue
            await self.live_turn()
            self.write(records.Ok(path=path, label=label, value=wire, attempt=number, ms=ms, ts=time.time()))
            self.step_done()
            if opts.compensate is not None:
                self.compensations[path] = (opts.compensate, value, label)
            if self.on_step is not None:
                self.emit(path, label, "ok", number, ms)
            if ms >= 60_000 and opts.timeout is None:
                self.advise("SLOW_STEP_NO_TIMEOUT", ms / 1000, f"step {label!r} took {ms / 1000:.0f}s with no timeout=")
            if self.storm.retries or number > 1:
                self.storm.record(failed=False, retry=number > 1)
            if self.observer is not None:
                self.observer.step_ran(self, path, label, True)
            self.deliver(h, value)
            if time.monotonic() >= self.next_yield:
                # Steps that complete without suspending (quick sync steps on the loop thread, async ones that
                # never await) would otherwise keep the loop from delivering a cancellation such as Ctrl-C.
                self.next_yield = time.monotonic() + YIELD_EVERY
                await asyncio.sleep(0)
            return value

    async def _invoke(self, fn: Callable[..., Any], args: tuple[Any, ...], is_async: bool) -> Any:
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
        retry: Retry | None = opts.retry
        storm = self.storm.record(failed=True, retry=number > 1)
        if storm is not None:
            self.advise("RETRY_STORM", 0, f"{self.storm.retries} retries in this run; "
                        f"{self.storm.failure_ratio:.0%} of recent attempts failed", storm)
        if ms >= 30_000 and not att.did_stash:
            self.advise("STASH_SUGGESTED", ms / 1000,
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
            await self.live_turn()
            self.write(records.Err(path=path, label=label, attempt=number, error=dump_error(exc), ms=ms,
                                   ts=time.time()))
            self.step_done()
            self.emit(path, label, "failed", number, ms, exc)
            raise exc
        self.write(records.Fail(path=path, label=label, attempt=number, error=dump_error(exc), ms=ms,
                                next=to_iso(wake), first=None if first is None else to_iso(first), ts=time.time()))
        self.emit(path, label, "retrying", number, ms, exc)
        await self.back_off(path, label, wake)

    async def back_off(self, path: str, label: str, wake: datetime) -> None:
        """Wait until a retry's `wake` time in place; a backoff of `PARK_BACKOFF` s or more left in a run a
        worker serves may park the run meanwhile (due again at `wake`), when the rest of it rests too."""
        left = (wake - self.clock.now()).total_seconds()
        if left <= 0:
            await self.nap(wake)
            return
        rest = Rest("sleeping", f"retrying step {label!r} at {to_iso(wake)}",
                    parkable=self.parks and left >= PARK_BACKOFF, at=wake.timestamp(),
                    record=records.Park(path=path, until=to_iso(wake), ts=time.time()), path=path, label=label)
        with self.resting(rest):
            await self.nap(wake)

    # ---- control: cancel, pause and resume requests ---------------------------------------------
    def control(self, force: bool = False) -> None:
        """Act on the inbox's control requests (listed at most every 0.5 s unless forced).

        `$cancel` asks for the run's cancellation, delivered in the run's turn (`request_cancel`); `$pause` /
        `$resume` record a pause / resume. While the run is paused the next boundary of every strand comes
        here, and `boundary` holds it."""
        now = time.monotonic()
        if not force and now < self.next_control:
            return
        self.next_control = now + CONTROL_EVERY
        for message in self.storage.inbox(self.run_id):
            name = message.get("name")
            if name in ("$pause", "$resume"):
                self.storage.ack(self.run_id, message["id"])
                if self.history.paused != (name == "$pause"):
                    self.write(records.Pause(ts=time.time()) if name == "$pause" else records.Resume(ts=time.time()))
                    self.sync()
            elif name == "$cancel":
                self.storage.ack(self.run_id, message["id"])
                self.request_cancel(message.get("payload"))
        if self.history.paused:
            self.next_control = float("-inf")

    def flag_attempts(self) -> None:
        """Set the cancelled flag of every running attempt (thread-safe: the heartbeat calls it for a cancel)."""
        for att in list(self.running):
            att.cancel()

    def interrupt(self) -> None:
        """A control request arrived while a step ran (the heartbeat saw it): act on it now. A cancel is
        delivered at the run's next quiet point, which is now when every strand waits (on steps or anything
        else); a pause takes effect at the next step boundary."""
        if self.dead or self.turns.closed:
            return
        try:
            self.control(force=True)
        except Exception:  # noqa: BLE001 - the next step boundary asks the storage again
            pass

    async def boundary(self, force: bool = False) -> None:
        """A durable boundary: act on control requests, and while the run is paused wait here until it resumes."""
        if self.stopping is not None and self.stopping():
            await self.interrupted()
        if not self.history.paused:
            self.control(force)
        canceller = self.canceller
        if canceller is not None and self.cancel_rec is None and not canceller.done():
            await asyncio.shield(canceller)  # a cancel requested goes first: it reaches the workflow here
        if self.history.paused:
            await self.hold()

    async def interrupted(self) -> NoReturn:
        """A worker's graceful stop reached this strand: it starts nothing more, and the run leaves its process
        (due again at once) as soon as the rest of it is quiet and no step runs."""
        with self.resting(Rest("interrupted", "stopped by its worker", parkable=True, at=time.time())):
            await self.forever()
        raise AssertionError("unreachable")

    async def hold(self) -> None:
        """Wait out a pause; every strand shares one pause loop, so the inbox is polled once per `poll` seconds."""
        if self.holding is None or self.holding.done():
            self.holding = self.internal(self._hold())
            self.holding.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(self.holding)

    async def _hold(self) -> None:
        """The pause loop: returns on `$resume`; a run that does not wait parks as paused once it is quiet."""
        with self.resting(Rest("paused", "paused", parkable=not self.wait)):
            while True:
                if self.lost is not None:
                    raise self.lost
                self.control(force=True)
                if not self.history.paused:
                    return
                info = self.storage.info(self.run_id)
                if info is not None and info.last.get("t") != "pause":
                    self.write(records.Pause(ts=time.time()))  # keeps `list`, which reads the last record, exact
                self.turns.wake()
                await asyncio.sleep(self.poll)

    async def nap(self, when: datetime, force: bool = False) -> None:
        """Wait until `when` on the run's clock, acting on control requests every `poll` seconds meanwhile."""
        if force or time.monotonic() >= self.next_control:
            await self.boundary(force)
        if self.clock.now() >= when:
            await self.clock.sleep_until(when)
            return
        sleeper = self.internal(self.clock.sleep_until(when))
        try:
            while not sleeper.done():
                await asyncio.wait((sleeper,), timeout=self.poll)
                if not sleeper.done():
                    self.turns.wake()  # look for a quiet point to park at, whatever changed meanwhile
                    await self.boundary(force=True)
        finally:
            sleeper.cancel()
        sleeper.result()

    def internal(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A task of the kernel's own (a pause loop, a timer): not one of the workflow's tasks."""
        return asyncio.get_running_loop().create_task(coro, context=_INTERNAL.copy())

    @contextlib.contextmanager
    def resting(self, rest: Rest) -> Iterator[None]:
        """While the calling strand waits on something durable (`rest` says how the run would park on it)."""
        rest.task = current_task()
        key = object()
        self.rests[key] = rest
        turns = self.turns
        turns.resting = True
        turns.wake()
        try:
            yield
        finally:
            del self.rests[key]
            turns.resting = bool(self.rests)

    def at_rest(self) -> None:
        """The run is quiet and nothing is due to reach it: park it when every strand rests on something durable
        that lets it park (no step running), else let the waits that can go on in this process do so."""
        halted = self.halted
        if halted is None or halted.done() or not self.rests:
            return
        rests = list(self.rests.values())
        parks = not self.running and all(r.parkable for r in rests)
        if parks and any(r.children for r in rests) and any(
                not r.children and (r.at is not None or r.signal is not None) for r in rests):
            parks = False  # a queue entry waits for children, or for times and signals, not both at once
        if parks and raw_timers(self.turns, {r.task for r in rests}):
            parks = False  # a plain asyncio timer of the workflow's would be lost: wait here for it
        if not parks:
            for r in rests:
                if r.fallback is not None and not r.fallback.done():
                    r.fallback.set_result(None)
            return
        self.stop(("park", rests))

    def stop(self, outcome: tuple[str, Any]) -> None:
        """End this execution of the run with `outcome` (the driver in `run` takes it from there)."""
        halted = self.halted
        if halted is not None and not halted.done():
            halted.set_result(outcome)

    async def halt(self, exc: BaseException) -> NoReturn:
        """The whole run stops here (a crash, a lost lease, a full disk): the calling strand waits until the run
        is torn down, and nothing of the workflow sees `exc`."""
        self.stop(("halt", exc))
        await self.forever()
        raise AssertionError("unreachable")

    @staticmethod
    async def forever() -> None:
        await asyncio.get_running_loop().create_future()

    def cancel_cut(self, exc: BaseException, h: Handle | None = None) -> BaseException:
        """The error an awaiter of `h` gets for `exc`: the run's cancel error when the run's cancel request cut
        the operation. A cancellation this run's kernel caused (a cancel request, the workflow cancelling `h`)
        is taken back from the task, so clean-up code runs in a task that is not cancelling."""
        if not isinstance(exc, asyncio.CancelledError):
            return exc
        task = asyncio.current_task()
        if self.cancel_error is not None and is_run_cancel(exc):
            if task is not None:
                task.uncancel()
            return self.cancel_error
        if h is not None and h.cancelled() and task is not None and task is h.driver:
            task.uncancel()
        return exc

    def finish_cancelled(self, error: BaseException) -> None:
        """Record that the run ended cancelled, sync the log, and stop attached children."""
        self.write(records.End(status="cancelled", error=dump_error(error), ts=time.time()))
        self.sync()
        for outcome in list(self.children):
            outcome.cancel()

    # ---- parking: durable sleeps and waits for signals -----------------------------------------
    def sleep_until(self, when: datetime) -> Handle:
        """Allocate the sleep's path now; its wake time is recorded the first time it runs."""
        check_wake_time(when)
        path, scope, replayed = self.replay_next("ctx.sleep")
        return replayed or self.op(scope, path, "ctx.sleep", self._sleep, path, when)

    async def _sleep(self, h: Handle, path: str, when: datetime) -> None:
        wake = self.history.wakes.get(path)
        if wake is None:
            if self.observer is not None:
                self.observer.unrecorded(self, path, "ctx.sleep", "ctx.sleep")
            self.write(records.Wake(path=path, at=to_iso(when), ts=time.time()))
            self.sync()
        else:
            when = from_iso(wake.at)
        if self.clock.now() < when:
            h.driver = current_task()
            self.check_durable_wait(h)
            with self.resting(Rest("sleeping", f"sleeping until {to_iso(when)}", parkable=not self.wait,
                                   at=when.timestamp(), path=path, label="ctx.sleep")):
                await self.nap(when, force=True)
        await self.live_turn(when.timestamp())
        self.write(records.Ok(attempt=1, path=path, label="ctx.sleep", value=None, ms=0, ts=time.time()))
        self.step_done()

    def wait_for(self, name: str, schema: Any, timeout: float | None) -> Handle:
        """Allocate the wait's path now; it returns the payload of the next signal `name` sent to the run."""
        check_signal_name(name)
        timeout = check_timeout(timeout, "wait_for timeout=")
        compiled = compile_schema(schema, f"schema of wait_for({name!r})")
        path, scope, replayed = self.replay_next("ctx.wait_for", PLAIN if compiled is None else _Schema(compiled),
                                                 f"signal {name!r}")
        return replayed or self.op(scope, path, "ctx.wait_for", self._wait, path, name, compiled, timeout)

    async def _wait(self, h: Handle, path: str, name: str, schema: Any, timeout: float | None) -> Any:
        opened = self.history.waits.get(path)
        if opened is None:
            if self.observer is not None:
                self.observer.unrecorded(self, path, "ctx.wait_for", "ctx.wait_for")
            deadline = self.clock.now() + timedelta(seconds=timeout) if timeout else None
            self.write(records.Wait(path=path, name=name, deadline=to_iso(deadline) if deadline else None,
                                    ts=time.time()))
            self.sync()
            if timeout is None:
                self.advise("WAITFOR_NO_TIMEOUT", 1, f"ctx.wait_for({name!r}) waits without a timeout")
        else:
            deadline = from_iso(opened.deadline) if opened.deadline else None
        expires = self.clock.deadline(deadline) if deadline is not None else None
        h.driver = current_task()
        checked = False
        rest = Rest("waiting", f"waiting for signal {name!r}", parkable=not self.wait,
                    at=deadline.timestamp() if deadline is not None else None, signal=name, path=path,
                    label="ctx.wait_for")
        with self.resting(rest):
            while True:
                await self.boundary(force=True)
                signal = self.next_signal(name)
                if signal is not None and not self.turns.live_now():
                    await self.turns.live(signal_time(signal))
                    signal = self.next_signal(name)  # another wait may have taken it in its turn
                if signal is not None:
                    self.write(records.Ok(attempt=1, path=path, label="ctx.wait_for",
                                          value=signal.get("payload"), ms=0, signal=signal["id"], ts=time.time()))
                    self.step_done()
                    self.storage.ack(self.run_id, signal["id"])
                    value = load_value(signal.get("payload"))
                    if schema is not None:
                        value = schema.convert(value, f"signal {name!r}")
                    break
                if deadline is not None and expires is not None and self.clock.monotonic() >= expires:
                    await self.live_turn(deadline.timestamp())
                    error = WaitTimeoutError(f"no signal {name!r} arrived within {timeout or 0:g}s "
                                             f"(deadline {to_iso(deadline)})", name=name,
                                             path=list(path_tuple(path)))
                    self.write(records.Err(attempt=1, path=path, label="ctx.wait_for", error=dump_error(error),
                                           ts=time.time()))
                    self.step_done()
                    raise error
                if not checked:
                    self.check_durable_wait(h)
                    checked = True
                self.turns.wake()
                pause = self.poll if expires is None else min(self.poll, expires - self.clock.monotonic())
                await self.clock.sleep(pause)
        return value

    def next_signal(self, name: str) -> dict[str, Any] | None:
        """The oldest unread signal `name` in the run's inbox (acknowledging ones already recorded)."""
        for signal in self.storage.inbox(self.run_id):
            if signal["id"] in self.history.signals:
                self.storage.ack(self.run_id, signal["id"])
            elif signal.get("name") == name:
                return signal
        return None

    async def live_turn(self, when: float | None = None) -> None:
        """Wait for the turn of an outcome of this process that happened at `when` (default: now)."""
        turns = self.turns
        if not turns.live_now():
            await turns.live(time.time() if when is None else when)

    def check_durable_wait(self, h: Handle) -> None:
        """A durable wait must not sit inside a plain asyncio deadline, which a park or a crash would lose."""
        task = current_task()
        if task is not None and deadline_over(task):
            raise not_durable(h.label)

    # ---- child runs ---------------------------------------------------------------------------
    def spawn(self, wf: Any, input: Any, detached: bool) -> Handle:
        """Allocate the spawn's path now; the child gets its own durable run, started in this process."""
        workflow = as_workflow(wf)
        scope = self.scope()
        path = scope.alloc()
        return self.op(scope, path, "ctx.spawn", self._spawn, path, workflow, input, detached)

    def spawn_all(self, definitions: list[Any], detached: bool) -> Handle:
        """Spawn one child per `(workflow, input)` pair, under one path."""
        pairs = spawn_pairs(definitions)
        scope = self.scope()
        prefix = scope.alloc()
        if len(pairs) > self.engine.concurrency:
            self.advise("CONCURRENCY_CAPPED", len(pairs) - self.engine.concurrency,
                        f"ctx.spawn_all of {len(pairs)} children; the engine runs {self.engine.concurrency} at once",
                        children=len(pairs), concurrency=self.engine.concurrency)
        return self.op(scope, prefix, "ctx.spawn_all", self._spawn_all, prefix, pairs, detached)

    async def _spawn_all(self, h: Handle, prefix: str, pairs: list[tuple[Workflow, Any]], detached: bool) -> Any:
        """Create the children not recorded yet in batches of `SPAWN_BATCH` (one durable write for each), record
        each batch's spawns as soon as it is created (one append for the batch), and make the records durable
        once: a crash leaves the children created before the records, and a resumed parent finds each one
        created but not recorded through its identity. Nothing per child is kept but its run id (in its
        handle): spawn records are not kept in memory, and only one batch's paths and inputs are in hand at a time.
        The whole spawn reaches the workflow in the turn of its last record."""
        run_ids: list[str] = []
        written = 0
        forget = self.history.forget
        take = self.turns.take
        last = f"{prefix}.{len(pairs) - 1}"
        for first in range(0, len(pairs), SPAWN_BATCH):
            missing: list[tuple[str, Workflow, Any]] = []
            for i in range(first, min(first + SPAWN_BATCH, len(pairs))):
                path = f"{prefix}.{i}"
                if path in self.done:
                    run_ids.append(self.spawned_id(path))
                    forget(path, prefix)
                    if path != last:
                        take(path)
                else:
                    wf, value = pairs[i]
                    missing.append((path, wf, value))
                    run_ids.append("")
            if not missing:
                continue
            if self.observer is not None:
                for path, _, _ in missing:
                    self.observer.unrecorded(self, path, "ctx.spawn", "ctx.spawn")
            created = iter(self.engine.create_children(self.run_id, missing, detached, queued=self.parks))
            spawns: list[records.Record] = []
            ts = time.time()
            for i in range(first, len(run_ids)):
                if not run_ids[i]:
                    run_ids[i] = next(created)
                    spawns.append(records.Ok(attempt=1, path=f"{prefix}.{i}", label="ctx.spawn",
                                             value={"run_id": run_ids[i], "detached": detached}, ms=0, ts=ts))
            if first + SPAWN_BATCH >= len(pairs):
                await self.live_turn()
            self.write_unkept(spawns, prefix)
            written += len(missing)
        if written:
            self.steps_done(written)
        elif pairs:
            await self.recorded_turn(h, last)
        result = self._spawned([RunHandle(run_id, wf) for run_id, (wf, _) in zip(run_ids, pairs, strict=True)],
                               detached)
        return result

    async def _spawn(self, h: Handle, path: str, workflow: Workflow, input: Any, detached: bool) -> RunHandle:
        if path in self.done:
            run_id = self.spawned_id(path)
            await self.recorded_turn(h, path)
        else:
            if self.observer is not None:
                self.observer.unrecorded(self, path, "ctx.spawn", "ctx.spawn")
            run_id = self.engine.create_child(self.run_id, path, workflow, input, detached, queued=self.parks)
            await self.live_turn()
            self.write(records.Ok(attempt=1, path=path, label="ctx.spawn",
                                  value={"run_id": run_id, "detached": detached}, ms=0, ts=time.time()))
            self.step_done()
        return self._spawned([RunHandle(run_id, workflow)], detached)[0]

    async def recorded_turn(self, h: Handle, path: str) -> None:
        """Wait for the turn of the recorded outcome at `path` (of `h`'s operation)."""
        turns = self.turns
        if not turns.now(path):
            h.driver = current_task()
            await turns.recorded(path)

    def spawned_id(self, path: str) -> str:
        """The child run the spawn recorded at `path` names."""
        rec = self.done[path]
        self.check_label(path, rec, "ctx.spawn")
        run_id = rec.value.get("run_id") if isinstance(rec, records.Ok) and isinstance(rec.value, dict) else None
        if not isinstance(run_id, str):
            raise self.replay_failed(PurityError(
                f"the record of ctx.spawn at path {path_tuple(path)} names no child run",
                hint="The log was edited; start over with fresh=True.", run_id=self.run_id))
        return run_id

    def _spawned(self, handles: list[RunHandle], detached: bool) -> list[RunHandle]:
        """Hand spawned children to whoever runs them (a worker when this run parks, else this process, where
        they wait in spawn order with nothing of their own: the attached ones' outcomes come to `attach` as
        they start)."""
        if self.parks:
            for child in handles:
                if not detached:
                    self.attached[child.run_id] = None
                self.engine.queued_child(child.run_id)
        else:
            waiting = self.engine.start_children(list(handles), rerun_failed=self.retrying,
                                                  on_start=functools.partial(self.child_started, detached))
            if waiting is not None and not detached and not waiting.done():
                self.attach(waiting)
        return handles

    def child_started(self, detached: bool, run_id: str, outcome: asyncio.Future[Any]) -> None:
        """A spawned child started: an attached one's outcome is kept (`attach`), and in a retry the child is
        not resumed again by a join that comes after it ended."""
        if self.retrying:
            self.resumed.add(run_id)
        if not detached:
            self.attach(outcome)

    def start_child(self, child: RunHandle) -> asyncio.Future[Any]:
        """The outcome of a child this run waits for (a retry resumes a failed child once, however often
        its joins ask for it)."""
        rerun = self.retrying and child.run_id not in self.resumed
        if rerun:
            self.resumed.add(child.run_id)
        return self.engine.start_child(child.run_id, child.workflow, rerun_failed=rerun)

    def attach(self, outcome: asyncio.Future[Any] | Spawned) -> None:
        """Keep an attached child's outcome, or spawned children waiting to start (cancelled with this run,
        awaited before it ends). Outcomes that settled are dropped whenever the list doubles, not by a callback
        on each. A list, not a set: 8 bytes a child where a set's table took about 100 at 20,000 children; an
        outcome attached twice is cancelled or awaited twice, which does nothing more."""
        if len(self.children) >= self.children_limit:
            self.drop_settled()
        self.children.append(outcome)

    def drop_settled(self) -> None:
        """Forget the outcomes of attached children that ended (and the results they hold)."""
        self.children = [c for c in self.children if not c.done()]
        self.children_limit = max(CHILDREN_PRUNE, 2 * len(self.children))

    def join(self, child: RunHandle) -> Handle:
        """Allocate the join's path now; it returns the child's result (or raises its error) once it ends."""
        check_handle(child)
        path, scope, replayed = self.replay_next("ctx.join")
        if replayed is not None:
            self.attached.pop(child.run_id, None)
            return replayed
        return self.op(scope, path, "ctx.join", self._join, path, child)

    async def _join(self, h: Handle, path: str, child: RunHandle) -> Any:
        if self.observer is not None:
            self.observer.unrecorded(self, path, "ctx.join", "ctx.join")
        h.driver = current_task()
        try:
            value = await self.wait_child(child, path)
            wire = dump_value(value, "child result")
        except (Crash, GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as exc:
            if exc is self.cancel_error or exc is self.lost:
                raise
            await self.live_turn()
            self.write(records.Err(attempt=1, path=path, label="ctx.join", error=dump_error(exc),
                                   ts=time.time()))
            self.step_done()
            raise
        await self.live_turn()
        self.write(records.Ok(attempt=1, path=path, label="ctx.join", value=wire, ms=0, ts=time.time()))
        self.step_done()
        return load_value(wire)

    def park_join(self, path: str, children: list[str]) -> NoReturn:
        """Park the run at its end until `children` end: record on what it waits, and leave its process."""
        self.write(records.Park(path=path, children=children[:PARK_LISTS], count=len(children), ts=time.time()))
        self.sync()
        raise Parked("waiting", f"waiting for {len(children)} child run{'s' if len(children) != 1 else ''}",
                     tuple(children))

    async def rest_on_children(self, path: str, children: list[str]) -> None:
        """A run a worker serves waits for `children` (queued runs any worker may run): it parks on them when
        the rest of it is quiet; this returns only when it cannot park, for the join to go on in this process."""
        count = len(children)
        rest = Rest("waiting", f"waiting for {count} child run{'s' if count != 1 else ''}", parkable=True,
                    children=tuple(children),
                    record=records.Park(path=path, children=children[:PARK_LISTS], count=count, ts=time.time()),
                    path=path, label="ctx.join")
        rest.fallback = asyncio.get_running_loop().create_future()
        with self.resting(rest):
            await rest.fallback

    async def wait_child(self, child: RunHandle, path: str) -> Any:
        """Wait for a child to end, giving back this run's engine slot meanwhile; a cancel or pause request
        for this run is acted on while it waits (one inbox watcher for all of the run's joins). A run a
        worker serves parks instead while the child has not ended (when nothing else of it is busy)."""
        if self.parks:
            ended = self.engine.ended_child(child.run_id, child.workflow)
            if ended is not None:
                self.attached.pop(child.run_id, None)
                return ended.result()
            await self.rest_on_children(path, [child.run_id])
        outcome = self.start_child(child)
        await self.parked_on(outcome)
        return await asyncio.shield(outcome)

    async def parked_on(self, child: asyncio.Future[Any]) -> None:
        """Wait until `child` is done, unless a cancel request (or a lost lease) for this run comes first."""
        self.joining += 1
        if self.join_watch is None or self.join_watch.done():
            self.interrupted_by = asyncio.get_running_loop().create_future()
            self.join_watch = self.internal(self._watch_joins(self.interrupted_by))
        interrupted = self.interrupted_by
        assert interrupted is not None
        try:
            with self.resting(Rest("waiting", "waiting for a child run in this process", parkable=False)):
                async with self.engine.parked_in_join():
                    if not child.done():
                        await asyncio.wait((child, interrupted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.joining -= 1
            if self.joining == 0 and self.join_watch is not None:
                self.join_watch.cancel()
                self.join_watch = None
        if not child.done() and interrupted.done():
            interrupted.result()

    async def _watch_joins(self, interrupted: asyncio.Future[None]) -> None:
        """While any strand waits for a child: act on control requests every `poll` seconds."""
        try:
            while True:
                await asyncio.sleep(self.poll)
                if self.lost is not None:
                    raise self.lost
                self.control(force=True)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting join
            if not interrupted.done():
                interrupted.set_exception(exc)
                interrupted.exception()

    async def wait_attached(self) -> None:
        """Before a served run ends: its attached children still running end first (it parks until they do)."""
        running = [c for c in self.attached if self.engine.ended_child(c, None) is None]
        self.attached = {}
        if running and self.can_park():
            self.park_join("", running)
        for child in running:
            outcome = self.engine.start_child(child, None, rerun_failed=False)
            if not outcome.done():
                self.attach(outcome)

    def can_park(self) -> bool:
        """True when parking the whole run now cuts nothing short (its workflow code ended, no step runs)."""
        return not self.running and not self.branches and not self.joining

    async def attached_ended(self) -> None:
        """Wait until every attached child ended: those still waiting to start start first (their outcomes
        come to `children` as they do)."""
        while waiting := [c.wait() for c in self.children if not isinstance(c, asyncio.Future) and not c.done()]:
            await asyncio.wait(waiting)
        await asyncio.gather(*[c for c in self.children if isinstance(c, asyncio.Future) and not c.done()],
                             return_exceptions=True)

    def join_all(self, handles: list[RunHandle]) -> Handle:
        """Join every child concurrently; one `Ok`/`Err` per handle, in order (join ``i`` at ``<path>.i.0``)."""
        handles = list(handles)
        for child in handles:
            if not isinstance(child, RunHandle):
                raise ValidationError(f"ctx.join_all takes the RunHandles that ctx.spawn_all returned, got {child!r}",
                                      hint="results = await ctx.join_all(await ctx.spawn_all([...]))",
                                      docs="docs/authoring.md#child-runs")
        scope = self.scope()
        prefix = scope.alloc()
        return self.op(scope, prefix, "ctx.join_all", self._joined_all, prefix, handles)

    async def _joined_all(self, h: Handle, prefix: str, handles: list[RunHandle]) -> list[Ok[Any] | Err]:
        """One waiter for all the children (no task, coroutine, context or callback per child): the children's
        joins are recorded in order as they end, and nothing of a child is kept but its result (its join record
        is forgotten once written or replayed). The whole join reaches the workflow in the turn of its last
        record."""
        results: list[Any] = [None] * len(handles)
        unended: list[int] = []
        forget = self.history.forget
        take = self.turns.take
        batch = f"{prefix}.0.0"
        last = f"{prefix}.{len(handles) - 1}.0"
        last_recorded = False
        for i, child in enumerate(handles):
            path = f"{prefix}.{i}.0"
            rec = self.done.get(path)
            if rec is not None:
                self.check_label(path, rec, "ctx.join")
                self.attached.pop(child.run_id, None)
                if self.on_step is not None:
                    self.emit(path, rec.label, "replayed", rec.attempt, rec.ms)
                results[i] = Err(load_error(rec.error)) if isinstance(rec, records.Err) else Ok(load_value(rec.value))
                forget(path, batch)
                if path != last:
                    take(path)
                else:
                    last_recorded = True
                continue
            if self.observer is not None:
                self.observer.unrecorded(self, path, "ctx.join", "ctx.join")
            if self.parks:
                outcome = self.engine.ended_child(child.run_id, child.workflow)
                if outcome is not None:
                    self.attached.pop(child.run_id, None)
                    if path == last:
                        await self.live_turn()
                    results[i] = self._record_join(path, outcome, batch)
                    continue
            unended.append(i)
        if not unended:
            if last_recorded:
                await self.recorded_turn(h, last)
            return results
        if self.parks:
            await self.rest_on_children(prefix, [handles[i].run_id for i in unended])
        ahead: collections.deque[asyncio.Future[Any]] = collections.deque()
        asked = 0

        def ask() -> None:
            """Hold the outcomes of the next `JOIN_AHEAD` children (a child waiting to start gets its future now)."""
            nonlocal asked
            while asked < len(unended) and len(ahead) < JOIN_AHEAD:
                outcome = self.start_child(handles[unended[asked]])
                if not outcome.done():
                    self.attach(outcome)
                ahead.append(outcome)
                asked += 1

        ask()
        all_ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def record_in_order() -> None:
            joins: list[records.Record] = []
            joined = 0

            def flush() -> None:
                if joins:
                    self.write_unkept(joins, batch)
                    self.steps_done(len(joins))
                    joins.clear()

            try:
                for n, i in enumerate(unended):
                    outcome = ahead.popleft()
                    if not outcome.done():
                        flush()
                        await asyncio.wait((outcome,))
                    if outcome.cancelled():
                        flush()
                        return  # the run is being cancelled: the join never ends on its own
                    ask()
                    try:
                        rec, results[i] = self._join_record(f"{prefix}.{i}.0", outcome)
                    except BaseException:
                        flush()
                        raise
                    if n == len(unended) - 1:
                        flush()
                        await self.live_turn()
                    joins.append(rec)
                    if len(joins) >= SPAWN_BATCH:
                        flush()
                    joined += 1
                    if joined >= CHILDREN_PRUNE and 2 * joined >= len(self.children):
                        self.drop_settled()  # the joined children's futures (and results) go as the join goes
                        joined = 0
                flush()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - a crash or lost lease stops the whole join
                if not all_ended.done():
                    all_ended.set_exception(exc)
                return
            if not all_ended.done():
                all_ended.set_result(None)

        recorder = asyncio.ensure_future(record_in_order())
        try:
            await self.parked_on(all_ended)
            all_ended.result()
        finally:
            if not all_ended.done():
                all_ended.cancel()
            recorder.cancel()
        self.drop_settled()
        return results

    def _record_join(self, path: str, outcome: asyncio.Future[Any], batch: str) -> Ok[Any] | Err:
        """Record how a joined child ended (as `ctx.join` at `path` does) and return it as an `Ok` / `Err`;
        the record is not kept in memory (`write_unkept`, `batch` standing for the join_all's)."""
        rec, result = self._join_record(path, outcome)
        self.write_unkept([rec], batch)
        self.step_done()
        return result

    def _join_record(self, path: str, outcome: asyncio.Future[Any]) -> tuple[records.Record, Ok[Any] | Err]:
        """The `ctx.join` record at `path` of how a joined child ended, and the child's `Ok` / `Err`."""
        exc = outcome.exception()
        if exc is not None and not isinstance(exc, Exception):
            raise exc
        if exc is None:
            try:
                wire = dump_value(outcome.result(), "child result")
            except Exception as error:  # noqa: BLE001 - an unserialisable result fails this join only
                exc = error
        if exc is not None:
            return records.Err(attempt=1, path=path, label="ctx.join", error=dump_error(exc), ts=time.time()), Err(exc)
        return (records.Ok(attempt=1, path=path, label="ctx.join", value=wire, ms=0, ts=time.time()),
                Ok(load_value(wire)))

    # ---- task graphs --------------------------------------------------------------------------
    def graph(self, tasks: Mapping[str, Task]) -> Handle:
        """Validate a DAG of child runs now (before any work) and allocate its path; each task runs as
        soon as its prerequisites completed."""
        nodes = graphs.validate(tasks)
        scope = self.scope()
        prefix = scope.alloc()
        return handle(self, scope.loop, self.operation, (self._graph, prefix, nodes), prefix, "ctx.graph")

    async def operation(self, h: Handle, body: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """The operation of `h`: `body(*args)`, whose outcome becomes the handle's (the body records it in its
        turn; a body made of other operations, a graph, a fan-out, a loop, has none of its own). A stop of the
        whole run never reaches the workflow; the run's cancel arrives as `RunCancelledError`."""
        try:
            result = await body(*args)
        except BaseException as exc:
            if self.stops(exc):
                await self.halt(exc)
            exc = self.cancel_cut(exc, h)
            self.failed(h, exc)
            raise exc from None
        self.deliver(h, result)
        return result

    async def _graph(self, prefix: str, nodes: list[graphs.Node]) -> dict[str, Ok[Any] | Err]:
        shape = {n.id: {"workflow": n.workflow.name, "depends_on": list(n.depends_on)} for n in nodes}
        recorded = self.history.graphs.get(prefix)
        if recorded is None:
            if self.observer is not None:
                self.observer.unrecorded(self, prefix, "ctx.graph", "ctx.graph")
            self.write(records.Graph(path=prefix, tasks=shape, ts=time.time()))
        elif recorded.tasks != shape:
            changed = StaleRunError if self.code_changed else PurityError
            raise self.replay_failed(changed(
                f"ctx.graph at path {path_tuple(prefix)} was recorded with tasks {recorded['tasks']!r}, "
                f"now {shape!r}", hint="Keep a started graph's tasks unchanged, or start over with fresh=True.",
                docs=graphs.DOCS, path=path_tuple(prefix)))
        loop = asyncio.get_running_loop()
        outcomes: dict[str, asyncio.Future[Any]] = {n.id: loop.create_future() for n in nodes}

        async def node(n: graphs.Node) -> Any:
            try:
                deps = {}
                for dep in n.depends_on:
                    try:
                        deps[dep] = await asyncio.shield(outcomes[dep])
                    except Exception as exc:
                        raise DependencyFailedError(
                            f"graph task {n.id!r} did not run: its prerequisite {dep!r} failed "
                            f"({type(exc).__name__}: {exc})", task=n.id, dependency=dep) from None
                value = await self.join(await self.spawn(n.workflow, n.make_input(deps), False))
            except BaseException as exc:
                if not outcomes[n.id].done():
                    outcomes[n.id].set_exception(exc)
                raise
            outcomes[n.id].set_result(value)
            return value

        try:
            results = await self._parallel(prefix, [lambda n=n: node(n) for n in nodes], None)
        finally:
            for outcome in outcomes.values():
                if outcome.done() and not outcome.cancelled():
                    outcome.exception()
        return {n.id: result for n, result in zip(nodes, results, strict=True)}

    # ---- recorded values and the rest of the context --------------------------------------------
    def recorded(self, label: str, make: Callable[[], Any]) -> Any:
        """A value recorded once at the next path (ctx.now/random/uuid): live it is made, on replay read."""
        scope = self.scope()
        path = scope.alloc()
        rec = self.done.get(path)
        if rec is not None:
            self.check_label(path, rec, label)
            self.turns.take(path)
            if isinstance(rec, records.Err):
                raise load_error(rec.error)
            return load_value(rec.value)
        if self.observer is not None:
            self.observer.unrecorded(self, path, label, label)
        wire = dump_value(make(), label)
        self.write(records.Ok(attempt=1, path=path, label=label, value=wire, ms=0, ts=time.time()))
        self.step_done()
        return load_value(wire)

    def now(self) -> Any:
        return self.recorded("ctx.now", self.clock.now)

    def random(self) -> float:
        return self.recorded("ctx.random", random.random)

    def uuid(self) -> str:
        return self.recorded("ctx.uuid", lambda: str(uuidlib.uuid4()))

    def patched(self, change: str, deprecated: bool = False) -> bool:
        """`ctx.patched(change)`: True on the new code's branch, False in a run recorded before the change.

        The first answer is recorded and kept for the rest of the run. Without one, the run was recorded
        before the change exactly when it already holds work at or after the point the calling strand
        stands at (its next path, or a later position of an enclosing strand or loop); at its live frontier
        the answer is True. `deprecated` (`ctx.deprecate_patch`): the old branch is gone, so a run that
        answered (or would answer) False cannot go on and is stale."""
        if not isinstance(change, str) or not change or len(change) > 200:
            what = "ctx.deprecate_patch" if deprecated else "ctx.patched"
            raise ValidationError(f"{what} needs a change id of 1-200 characters, got {change!r}",
                                  hint="Name the change, e.g. ctx.patched('send-receipt-by-email').",
                                  docs="docs/versioning.md#ctxpatched")
        scope = self.scope()
        here = f"{scope.prefix}{scope.n}"
        rec = self.history.patches.get(change)
        if rec is None:
            value = not self.history.recorded_from(((scope.prefix, scope.n), *scope.outer))
            rec = records.Patch(change=change, path=here, value=value, ts=time.time())
            self.write(rec)
            self.history.patches.setdefault(change, rec)
        if deprecated and not rec.value:
            where = f"step path {path_tuple(rec.path)}"
            raise self.replay_failed(StaleRunError(
                f"run {self.run_id} is on the old branch of patch {change!r} (recorded before the change, at "
                f"{where}), but the code now calls ctx.deprecate_patch({change!r}): that branch was removed",
                hint=f"Deploy the code with `if ctx.patched({change!r}): ... else: <old branch>` again until "
                     f"`durably list --without-patch {change}` shows no unfinished run, then retry this run "
                     f"(`durably retry {self.run_id}`), or start it over with `durably restart {self.run_id}`.",
                docs="docs/versioning.md#retiring-the-old-branch", run_id=self.run_id, path=path_tuple(rec.path),
                recorded=f"patched({change!r}) = False", called=f"deprecate_patch({change!r})", patch=change))
        return rec.value

    def replaying(self) -> bool:
        """True while the calling strand is before the end of its recorded steps (or a wait or sleep it parked on)."""
        try:
            scope = current_scope.get()
        except LookupError:
            return False
        path = f"{scope.prefix}{scope.n}"
        return path in self.done or path in self.history.waits or path in self.history.wakes

    def charge(self, amounts: dict[str, float]) -> None:
        """Record spend; inside a step it is always new spend, in the workflow body it replays once."""
        for kind, amount in amounts.items():
            check_budget_kind(kind)
            if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount >= 0:
                raise ValidationError(f"charge {kind}={amount!r} must be a non-negative number",
                                      hint="Charge what was spent, e.g. ctx.charge(usd=0.02, tokens=1200).",
                                      docs="docs/policies.md#budgets")
        amounts = {k: float(v) for k, v in amounts.items() if v}
        att = current_attempt.get(None)
        if att is not None and att.kernel is self:
            path = f"{att.path}@{uuidlib.uuid4().hex[:12]}"
        else:
            path = "$" + self.scope().alloc()
            if path in self.history.charges:
                return
        self.write(records.Charge(path=path, amounts=amounts, ts=time.time()))
        for kind, amount in amounts.items():
            self.spent[kind] += amount
            if self.budget and kind in self.budget and self.budget[kind] > 0:
                self.advise("BUDGET_NEAR", self.spent[kind] / self.budget[kind],
                            f"spent {self.spent[kind]:g} of the {self.budget[kind]:g} {kind} budget")

    def annotate(self, values: dict[str, Any]) -> None:
        """Attach JSON values to the run (shown by inspect); the latest value of a name wins.

        A call the run already made (its strand is replaying, or the log has this call of its strand) writes
        nothing, so a resumed run never appends an older value again; a call inside a step is new each time
        the step runs."""
        wire = dump_value(values, "annotations")
        strand = index = None
        att = current_attempt.get(None)
        scope = current_scope.get(None) if att is None or att.kernel is not self else None
        if scope is not None and (scope.owner is None or scope.owner is asyncio.current_task()):
            strand = scope.prefix
            index = self.annotations.get(strand, 0)
            self.annotations[strand] = index + 1
            if index <= self.history.noted.get(strand, -1) or self.replaying():
                return
        if any(self.history.notes.get(k, object()) != v for k, v in wire.items()):
            self.write(records.Note(notes=wire, strand=strand, index=index, ts=time.time()))

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
        return replayed or handle(self, scope.loop, self.operation,
                                  (self._loop, path, initial, reducer, snapshot_every or 1, max_iterations), path,
                                  "ctx.loop")

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
                await self.live_turn()
                self.write(records.Ok(attempt=1, path=path, label="ctx.loop", value=wire, ms=0, ts=time.time()))
                self.step_done()
                return load_value(wire)
            wire = dump_value(out, f"loop state after iteration {i}")
            state = load_value(wire)
            if (i + 1) % every == 0:
                data = encode_line(wire)
                if len(data) >= 256 * 1024:
                    self.advise("SNAPSHOT_HEAVY", len(data),
                                f"ctx.loop at path {path_tuple(path)} snapshots {len(data) // 1024} KiB of state")
                self.write(records.Snap(path=path, iteration=i, state=wire, ts=time.time()))
                self.step_done()
                self.compact_loops()
            i += 1

    def parallel(self, items: list[Any], concurrency: int | None) -> Handle:
        """Allocate a path for the fan-out now; each branch runs under its own prefix."""
        items = checked_branches(items, concurrency)
        scope = self.scope()
        prefix = None if all(type(item) is Handle for item in items) else scope.alloc()
        if len(items) >= 1000:
            self.advise("FANOUT_CEILING", len(items), f"ctx.parallel with {len(items)} branches")
        return handle(self, scope.loop, self.operation, (self._parallel, prefix, items, concurrency),
                      prefix or "", "ctx.parallel")

    async def _parallel(self, prefix: str | None, items: list[Any], concurrency: int | None) -> list[Ok[Any] | Err]:
        """Run the branches; steps already allocated keep their paths, anything else gets ``<prefix>.<i>.``."""
        caller = current_scope.get()
        after = ((caller.prefix, caller.n), *caller.outer)

        def enter(i: int) -> None:
            current_scope.set(Scope(f"{prefix}.{i}.", asyncio.current_task(), after))

        self.branches += 1
        try:
            return await run_branches(items, concurrency, enter if prefix is not None else None)
        finally:
            self.branches -= 1

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
                out = await self._invoke(fn, (value,), is_async_callable(fn))
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
        turns.idle = self.at_rest
        install_factory(loop, make_task)
        halted = self.halted = loop.create_future()
        self.driver = asyncio.current_task()
        RunKernel.live += 1
        try:
            self.root = turns.start(self._body(ctx), contextvars.copy_context())
            if self.history.cancel is not None:
                self.cancel_in_turn(self.history.cancel, recorded=True)
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
            if kind == "raise" and not isinstance(value, Exception):
                self.torn_down = True  # as a process dying: the steps it cuts off are recorded as nothing
            elif kind in ("return", "raise"):
                self.abandon_running()
            discard(turns.close())
            if kind == "park":
                raise self.park(value)
            if kind == "halt":
                if value is not CLEANUP_OVER:
                    raise value
                kind, value = "raise", self.cancel_error
            return await self._end(kind, value)
        finally:
            RunKernel.live -= 1
            if self.cleanup_timer is not None:
                self.cleanup_timer.cancel()

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
                await self.hold()
            result = await self.workflow(ctx, self.input)
        except Complete as done:
            self.stop(("return", done.value))
        except GeneratorExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to `run`, which decides what the run's end is
            self.stop(("halt", exc) if self.stops(exc) else ("raise", exc))
        else:
            self.stop(("return", result))

    def park(self, rests: list[Rest]) -> Parked:
        """Record what the run parks on (a join's children, a retry's wake time) and say when it is due again."""
        for rest in rests:
            if rest.record is not None:
                self.write(rest.record)
        self.sync()
        order = ("interrupted", "paused", "waiting", "sleeping")
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
            if self.attached and self.cancel_error is None:
                await self.wait_attached()
            if self.children and self.cancel_error is None:
                ended = asyncio.ensure_future(self.attached_ended())
                try:
                    await self.parked_on(ended)
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
            if self.dead or isinstance(exc, Crash):
                raise Crash() from exc
            if self.lost is not None:
                raise self.lost from (None if exc is self.lost else exc)
            if self.full is not None:  # never a failed run, never compensated: it resumes once there is space
                if exc is self.full:
                    raise
                raise self.full from exc
            if self.replay_error is not None:
                raise self.replay_error from (None if exc is self.replay_error else exc)
            cancelled = self.cancel_error or (exc if isinstance(exc, RunCancelledError) else None)
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
                self.sync()
            raise
        if self.replay_error is not None:
            raise self.replay_error
        if self.cancel_error is not None:
            await self.end_cancelled(self.cancel_error)
            raise self.cancel_error
        self.write(records.End(status="completed", result=wire, ts=time.time()))
        if self.end_sync:
            self.sync()
        return value

    # ---- cancellation and clean-up ------------------------------------------------------------
    def request_cancel(self, payload: Any) -> None:
        """A cancel request arrived: it reaches the workflow in the run's turn (`deliver_cancel`)."""
        if self.canceller is not None or self.turns.closed:
            return
        options = payload if isinstance(payload, dict) else {}
        compensate = options.get("compensate") is True
        window = options.get("cleanup")
        if isinstance(window, bool) or not isinstance(window, int | float) or not 0 <= window < 1e9:
            window = self.cleanup
        rec = records.Cancel(compensate=compensate, until=to_iso(self.clock.now() + timedelta(seconds=window)))
        self.cancel_pending = rec
        self.cancel_in_turn(rec, recorded=False)

    def cancel_in_turn(self, rec: records.Cancel, recorded: bool) -> None:
        """Deliver the cancel `rec` in its turn: a recorded one where the log has it, a new one when the run is
        next quiet."""

        async def deliver() -> None:
            if recorded:
                await self.turns.recorded(CANCEL_PATH)
            else:
                await self.live_turn()
            if self.cancel_rec is None:
                self.deliver_cancel(rec, recorded)

        self.canceller = self.turns.start(deliver(), contextvars.copy_context())
        self.next_control = float("-inf")  # the next step boundary waits for it

    def deliver_cancel(self, rec: records.Cancel, recorded: bool, here: asyncio.Task[Any] | None = None) -> None:
        """The run is cancelled here: record it (the cancel's place in the log), cut the steps running (each
        recorded as cancelled, its awaiter gets `RunCancelledError`), and cancel the workflow's task, which may
        catch it (`except RunCancelledError:` / `except asyncio.CancelledError:` / `finally:`) and run clean-up
        steps until its clean-up window ends."""
        if self.turns.closed:
            return
        self.cancel_error = RunCancelledError(
            f"run {self.run_id} was cancelled", run_id=self.run_id,
            hint=f"Start it over with `durably restart {self.run_id}` (or run(..., fresh=True)).",
            docs="docs/operations.md#cancel")
        if not recorded:
            rec = records.Cancel(compensate=rec.compensate, until=rec.until, ts=time.time())
            self.write(rec)
            self.sync()
        self.cancel_rec = rec
        targets: dict[asyncio.Task[Any], None] = {}
        for att, task in list(self.running.items()):
            att.cancel()
            if task is not None:
                targets[task] = None
        if self.root is not None and not self.root.done():
            targets[self.root] = None
        if here is not None:
            targets.pop(here, None)  # `here` raises the cancel error itself (`cut_inline`)
        for task in targets:
            task.cancel(CANCEL_MSG)
        for outcome in list(self.children):
            outcome.cancel()
        left = (from_iso(rec.until) - self.clock.now()).total_seconds() if rec.until else self.cleanup
        loop = asyncio.get_running_loop()
        self.cleanup_timer = loop.call_later(max(left, 0.0), self.stop, ("halt", CLEANUP_OVER))

    async def end_cancelled(self, error: BaseException) -> None:
        """The run ends cancelled: compensations of its completed steps first when the cancel asked for them."""
        rec = self.cancel_rec
        if rec is not None and rec.compensate:
            await self.compensate(error)
        self.finish_cancelled(error)

    # ---- what `ctx` asks of its kernel besides the above (`_authoring.context.Kernel`) -------------------
    cancels_losers = True  # `ctx.first` cancels the operations that lost (each cancellation is recorded)

    def sleep(self, seconds: float) -> Handle[None]:
        """`ctx.sleep`: wake `seconds` after the run clock's now."""
        return self.sleep_until(self.clock.now() + timedelta(seconds=seconds))

    def stash(self, path: str, value: Any) -> Any:
        """`attempt().stash`: record the partial progress of the step at `path`; return it as its next attempt
        will find it."""
        wire = dump_value(value, "stash")
        self.write(records.Stash(path=path, value=wire))
        return load_value(wire)
