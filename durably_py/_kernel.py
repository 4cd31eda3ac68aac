"""The replay kernel: runs a workflow from the top, answering recorded steps from the log.

Every `ctx.step` gets a hierarchical path when it is *called* (``"3"``, ``"4.1.0"``);
a path with a recorded result returns it without running the function, any
other path runs live and appends its result before returning it.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import inspect
import random
import sys
import threading
import time
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import CoroutineType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from . import _graphs as graphs
from . import _queue as queue
from . import records
from ._advisories import AdvisoryTracker, RetryStormWindow, level_for
from ._branches import checked_branches, foreign_strand, outside_workflow, run_branches
from ._clock import Clock
from ._codec import (
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
from ._events import StepEvent
from ._history import BUDGET_KINDS, History, path_tuple
from ._policies import Retry, check_timeout
from ._result import Err, Ok
from ._schema import compile_schema
from ._versioning import stale_hint
from ._workflow import Workflow, as_workflow
from .errors import (
    ArgumentError,
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

if TYPE_CHECKING:
    import contextlib

    from ._graphs import Task
    from ._resources import Gates
    from ._threads import SyncPlacement
    from .storage.base import Lease, Storage

CO_COROUTINE = inspect.CO_COROUTINE
_Ok = records.Ok
PLAIN_RESULTS = frozenset({dict, list, tuple, str, int, float, bool, type(None)})  # never awaitable
NOT_RETRYABLE = (ValidationError, SerializationError, PurityError, BudgetExceededError, StepInterruptedError)
DEFAULT_SYNC_STEPS = 1000
DEFAULT_SYNC_SECONDS = 1.0
CONTROL_EVERY = 0.5
SPAWN_BATCH = 1024  # a spawn_all creates and records its children this many at a time
CHILDREN_PRUNE = 64  # settled child outcomes are dropped from `RunKernel.children` once it holds this many
JOIN_AHEAD = 1024  # a join_all asks for the outcomes of this many children ahead of the one it records next
PARK_LISTS = 100  # a join's park record names at most this many of the children it waits for (and counts all)
YIELD_EVERY = 0.05  # a run of steps that never suspend still lets the loop in this often (Ctrl-C, cancellation)
LOOP_COMPACT_BYTES = 64 * 1024


class Crash(BaseException):  # noqa: N818 - it is not an error but a simulated process death
    """Raised by crash injection: the run stops exactly as a killed process would."""


class Complete(BaseException):  # noqa: N818 - control flow, not an error
    """`ctx.complete(value)`: unwinds to the top of the workflow with its result."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


def timeout_hint(retry: Any) -> str:
    """What to do about a step timeout, without suggesting `retry=` to a step that already has it."""
    more = "give `retry=` more attempts" if retry is not None else "add `retry=`"
    return f"Raise `timeout=`, {more}, or `attempt().stash()` progress so a retry resumes it."


class Parked(BaseException):  # noqa: N818 - control flow, not an error
    """The run parked (`status` "waiting", "sleeping" or "paused") and its engine was asked not to wait, or
    its worker is stopping ("interrupted"); `children`: the child runs it waits for in a join."""

    def __init__(self, status: str, detail: str, children: tuple[str, ...] = ()) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.children = children


class Scope:
    """Allocates the child paths of one sequential strand (the workflow body, a branch, a loop turn)."""

    __slots__ = ("prefix", "n", "owner", "loop", "thread", "labels", "pending", "outer")

    def __init__(self, prefix: str, owner: asyncio.Task[Any] | None,
                 outer: tuple[tuple[str, int], ...] = ()) -> None:
        self.prefix = prefix
        self.n = 0
        self.owner = owner
        # where the owner runs: the caller is the owner when `running_task(loop)` is it on `thread`
        self.loop = owner.get_loop() if owner is not None else None
        self.thread = threading.get_ident()
        self.labels: dict[str, int] = {}
        self.pending = 0
        self.outer = outer  # (prefix, first index) of the positions that come after this strand in its enclosing ones

    def alloc(self) -> str:
        n = self.n
        self.n = n + 1
        return self.prefix + number(n)


_NUMBERS: list[str] = []
_NUMBERS_KEPT = 1 << 15


def number(n: int) -> str:
    """`str(n)` for a path index, from a table of the first `_NUMBERS_KEPT` (a path is built per step)."""
    global _NUMBERS
    try:
        return _NUMBERS[n]
    except IndexError:
        if n >= _NUMBERS_KEPT:
            return str(n)
        # a new table, swapped in whole: a thread reading the old one meanwhile still reads true entries
        _NUMBERS = list(map(str, range(min(max(n + 1, 2 * len(_NUMBERS), 64), _NUMBERS_KEPT))))
        return _NUMBERS[n]


current_scope: contextvars.ContextVar[Scope] = contextvars.ContextVar("durably_scope")
class Attempt(Protocol):
    """What the kernel needs of the object `attempt()` returns inside a step (`context.AttemptContext`)."""

    kernel: Any
    path: str
    did_stash: bool
    number: int
    label: str  # set by the kernel as the attempt starts

    @property
    def cancelled(self) -> bool: ...

    def cancel(self) -> None: ...


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


class LoopDone:
    """What a loop reducer returns to end the loop with `value` (`it.done(value)`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


current_attempt: contextvars.ContextVar[Attempt] = contextvars.ContextVar("durably_attempt")

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


_LABELS: dict[Any, str] = {}


def label_of(fn: Callable[..., Any]) -> str:
    """The default step label: the callable's qualified name, without the enclosing function's."""
    try:
        return _LABELS[fn]
    except (KeyError, TypeError):
        pass
    target = getattr(fn, "func", fn)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    label: str = name.rpartition("<locals>.")[2]
    if callable(fn):  # `RunKernel.step` takes a label found here as proof that `fn` is callable
        try:
            if len(_LABELS) >= 4096:
                _LABELS.clear()
            _LABELS[fn] = label
        except TypeError:  # an unhashable callable: computed every time
            pass
    return label


def not_callable(fn: Any) -> ValidationError:
    """`ctx.step` of something that is not a function."""
    return ValidationError(f"ctx.step needs a callable, got {fn!r}",
                           hint="Pass the function itself: ctx.step(fetch, url), not ctx.step(fetch(url)).",
                           docs="docs/authoring.md#steps")


def check_wake_time(when: Any) -> None:
    """`ctx.sleep_until`'s argument: a timezone-aware datetime."""
    if not isinstance(when, datetime) or when.tzinfo is None:
        raise ValidationError(f"ctx.sleep_until needs a timezone-aware datetime, got {when!r}",
                              hint="Use ctx.now() + timedelta(...) or datetime(..., tzinfo=UTC).",
                              docs="docs/authoring.md#parking")


def check_signal_name(name: Any) -> None:
    """`ctx.wait_for`'s signal name: 1-200 characters, not starting with '$'."""
    if not isinstance(name, str) or not name or len(name) > 200 or name.startswith("$"):
        raise ValidationError(f"a signal name is 1-200 characters not starting with '$', got {name!r}",
                              hint="Name what you wait for, e.g. ctx.wait_for('approval').",
                              docs="docs/authoring.md#parking")


def check_handle(handle: Any) -> None:
    """`ctx.join`'s argument: the `RunHandle` that `ctx.spawn` returned."""
    if not isinstance(handle, RunHandle):
        raise ValidationError(f"ctx.join takes the RunHandle that ctx.spawn returned, got {handle!r}",
                              hint="handle = await ctx.spawn(child, input); value = await ctx.join(handle)",
                              docs="docs/authoring.md#child-runs")


def spawn_pairs(definitions: Iterable[Any]) -> list[tuple[Workflow, Any]]:
    """`ctx.spawn_all`'s argument as `(workflow, input)` pairs."""
    pairs = []
    for i, item in enumerate(definitions):
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ValidationError(f"ctx.spawn_all item {i} is {item!r}, not a (workflow, input) pair",
                                  hint="ctx.spawn_all([(summarize, url) for url in urls])",
                                  docs="docs/authoring.md#child-runs")
        pairs.append((as_workflow(item[0]), item[1]))
    return pairs


def _is_async(fn: Callable[..., Any]) -> bool:
    code = getattr(fn, "__code__", None)
    if code is not None:
        return bool(code.co_flags & CO_COROUTINE)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def replayed(scope: Scope, wire: Any) -> Any:
    """A recorded `Ok` of a step with no options: the fewest operations between the record and its value.

    (A coroutine that never suspends costs less to create and await on CPython than a done Future or
    a hand-made ready awaitable, measured: 0.1 us against 0.2 and 0.5 us.)"""
    scope.pending -= 1
    t = type(wire)
    if t is dict:  # `load_value` inlined for the common step output, a flat dict of scalars
        for x in wire.values():
            if type(x) not in SCALARS:
                return load_value(wire)
        if len(wire) == 1 and (DT_TAG in wire or ESC_TAG in wire):
            return load_value(wire)
        return wire.copy()
    return wire if t in SCALARS else load_value(wire)


@dataclass(frozen=True, slots=True)
class RunHandle:
    """A child run: its id, and the workflow that runs it (so a resumed parent can restart it)."""

    run_id: str
    workflow: Workflow | None = field(default=None, compare=False, repr=False)


class _Schema:
    """Step options carrying only a schema (a replayed wait_for converts its payload like a live one)."""

    __slots__ = ("schema", "compensate")

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self.compensate = None


class StepOptions:
    """Validated options of one `ctx.step` call."""

    __slots__ = ("retry", "timeout", "compensate", "concurrency_key", "concurrency_limit", "uses", "schema", "unsafe")

    def __init__(self, label: str, retry: Any, timeout: Any, compensate: Any, concurrency_key: Any,
                 concurrency_limit: Any, uses: Any, schema: Any, replay: Any) -> None:
        if retry is not None and not isinstance(retry, Retry):
            raise ValidationError(f"retry= of step {label!r} must be a Retry(...), got {retry!r}",
                                  hint="Use retry=Retry(3, backoff='exponential').", docs="docs/policies.md#retry")
        if compensate is not None and not callable(compensate):
            raise ValidationError(f"compensate= of step {label!r} must be callable, got {compensate!r}",
                                  hint="Pass a function that takes the step's output and undoes it.",
                                  docs="docs/policies.md#compensation")
        if replay not in ("safe", "unsafe"):
            raise ValidationError(f"replay= of step {label!r} must be 'safe' or 'unsafe', got {replay!r}",
                                  hint="replay='unsafe' stops a resumed run from re-running an interrupted step.",
                                  docs="docs/policies.md#replay")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValidationError(f"concurrency_limit= of step {label!r} must be an int >= 1",
                                  hint="concurrency_limit caps the steps sharing a concurrency_key.",
                                  docs="docs/policies.md#concurrency-keys")
        if concurrency_limit is not None and concurrency_key is None:
            raise ValidationError(f"step {label!r} sets concurrency_limit= without concurrency_key=",
                                  hint="Name the shared key, e.g. concurrency_key=host, concurrency_limit=5.",
                                  docs="docs/policies.md#concurrency-keys")
        self.retry = retry
        self.timeout = check_timeout(timeout, f"timeout= of step {label!r}")
        self.compensate = compensate
        self.concurrency_key = concurrency_key
        self.concurrency_limit = concurrency_limit
        self.uses = uses
        self.schema = compile_schema(schema, f"schema of step {label!r}")
        self.unsafe = replay == "unsafe"


PLAIN = StepOptions("", None, None, None, None, None, None, None, "safe")
_OPTIONS: dict[tuple[Any, ...], StepOptions] = {}  # validated options by call shape: repeated steps skip validation


def step_options(fn: Callable[..., Any], /, name: str | None = None, retry: Any = None, timeout: float | None = None,
                 compensate: Callable[[Any], Any] | None = None, concurrency_key: str | None = None,
                 concurrency_limit: int | None = None, uses: str | None = None, schema: Any = None,
                 replay: str = "safe", **unknown: Any) -> tuple[str | None, StepOptions]:
    """The step name and validated options of a `ctx.step` call with keywords (validated once per call shape)."""
    if unknown:
        raise ArgumentError(
            f"ctx.step() got unknown keyword argument(s) {', '.join(map(repr, unknown))}",
            hint="Arguments for the step function are positional: ctx.step(fn, a, b); to pass keywords, "
                 "wrap it: ctx.step(functools.partial(fn, x=1)) or a lambda.", docs="docs/errors.md#argumenterror")
    if (retry is None and timeout is None and compensate is None and concurrency_key is None
            and concurrency_limit is None and uses is None and schema is None and replay == "safe"):
        return name, PLAIN
    label = name or label_of(fn)
    key = (label, retry, timeout, compensate, concurrency_key, concurrency_limit, uses, schema, replay)
    try:
        opts = _OPTIONS.get(key)
    except TypeError:
        key, opts = None, None  # type: ignore[assignment]
    if opts is None:
        opts = StepOptions(label, retry, timeout, compensate, concurrency_key, concurrency_limit, uses, schema,
                           replay)
        if key is not None and compensate is None:
            if len(_OPTIONS) >= 4096:
                _OPTIONS.clear()
            _OPTIONS[key] = opts
    return name, opts


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
        self.storm = RetryStormWindow()
        self.ctx: object = None  # the `ctx` handed to the workflow (a `context.WorkflowContext`)
        self.children: list[asyncio.Future[Any] | Spawned] = []  # attached children (`attach`), pruned as they settle
        self.children_limit = CHILDREN_PRUNE
        self.retrying = False
        self.resumed: set[str] = set()  # failed children this retry has resumed already (never twice in one retry)
        self.joining = 0
        self.join_watch: asyncio.Task[None] | None = None
        self.interrupted: asyncio.Future[None] | None = None
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

    def step(self, fn: Callable[..., Any], /, *args: Any, **options: Any) -> Awaitable[Any]:
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
                label = _LABELS[fn]  # holds callables only
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
            path = scope.prefix + _NUMBERS[n]
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
        if rec is None:
            return self.execute(scope, path, label, fn, args, opts)
        if rec.label != label:
            self.check_label(path, rec, label)
        if opts is PLAIN and type(rec) is _Ok and self.on_step is None:
            return replayed(scope, rec.value)
        return self.replay(scope, path, rec, opts)

    def replay_next(self, label: str, opts: StepOptions | _Schema = PLAIN,
                    where: str = "output") -> tuple[str, Awaitable[Any] | None]:
        """Allocate the calling strand's next path for `label` (a sleep, wait, join or loop), and the replay of
        the record at it when there is one (its label checked), else None: the caller then runs it live."""
        scope = self.scope()
        path = scope.alloc()
        rec = self.done.get(path)
        if rec is None:
            return path, None
        self.check_label(path, rec, label)
        scope.pending += 1
        return path, self.replay(scope, path, rec, opts, where)

    async def replay(self, scope: Scope, path: str, rec: records.Ok | records.Err, opts: StepOptions | _Schema,
                     where: str = "output") -> Any:
        try:
            if self.on_step is not None:
                self.emit(path, rec.label, "replayed", rec.attempt, rec.ms)
            if isinstance(rec, records.Err):
                raise load_error(rec.error)
            value = load_value(rec.value)
            if opts.schema is not None:
                value = opts.schema.convert(value, where)
            if opts.compensate is not None:
                self.compensations[path] = (opts.compensate, value, rec.label)
            return value
        finally:
            scope.pending -= 1

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

    async def execute(self, scope: Scope, path: str, label: str, fn: Callable[..., Any], args: tuple[Any, ...],
                      opts: StepOptions) -> Any:
        """Run a step live and record its outcome.

        The common case (no options, nobody observing the run, no earlier attempt or stash at this path) takes
        the short path written out here: the same checks, records and bookkeeping as `_execute` and `_attempts`
        minus what only options, observers and retries need, in one coroutine instead of three."""
        try:
            history = self.history
            if opts is not PLAIN or self.observer is not None or self.on_step is not None \
                    or path in history.fails or path in history.stashes:
                return await self._execute(scope, path, label, fn, args, opts)
            if self.stopping is not None and self.stopping():
                raise Parked("interrupted", "stopped by its worker before its next step")
            now = time.monotonic()
            if now >= self.next_control:
                await self.boundary()
                now = time.monotonic()
            if self.budget is not None:
                self.check_budget()
            code = getattr(fn, "__code__", None)
            is_async = bool(code.co_flags & CO_COROUTINE) if code is not None else _is_async(fn)
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
                running[att] = current_task()
            else:
                # No step of this run in flight: this is the run's own loop on its own thread (another loop on
                # it could only run inside a step), so it is looked up once (a `getpid` per lookup on 3.11).
                loop = self.event_loop
                if loop is None or self.event_thread != get_ident():
                    loop = self.event_loop = asyncio.get_running_loop()
                    self.event_thread = get_ident()
                # a step on the loop thread needs no task to cancel: no callback can run until it returns
                running[att] = None if inline else running_task(loop)
            started = time.perf_counter()
            try:
                if is_async:
                    value = fn(*args)
                    if type(value) is CoroutineType or inspect.isawaitable(value):
                        value = await value
                elif inline:
                    value = self.placement.inline(fn, args, started, loop)
                    if att.cancelled:  # the heartbeat saw a cancel request while the loop was blocked
                        self.control(force=True)
                    if type(value) not in PLAIN_RESULTS and inspect.isawaitable(value):
                        running[att] = current_task()
                        value = await value
                else:
                    value = await self._invoke(fn, args, False)
                wire, value = dump_output(value)
            except asyncio.CancelledError:
                self.step_cancelled(att)
            except Crash:
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
                return await self._attempts(scope, path, label, fn, args, opts, 2)
            self.write(records.Ok(path=path, label=label, value=wire, attempt=1, ms=ms, ts=time.time()))
            now = time.monotonic()
            self.unsynced += 1  # `step_done()` written out, sharing its clock reading with the yield below
            if self.unsynced >= self.sync_every or (self.sync_by_time and now - self.last_sync >= DEFAULT_SYNC_SECONDS):
                self.sync()
            if ms >= 60_000:
                self.advise("SLOW_STEP_NO_TIMEOUT", ms / 1000, f"step {label!r} took {ms / 1000:.0f}s with no timeout=")
            if self.storm.retries:
                self.storm.record(failed=False, retry=False)
            if now >= self.next_yield:
                self.next_yield = now + YIELD_EVERY
                await asyncio.sleep(0)
            return value
        finally:
            scope.pending -= 1

    async def _execute(self, scope: Scope, path: str, label: str, fn: Callable[..., Any], args: tuple[Any, ...],
                       opts: StepOptions) -> Any:
        if self.observer is not None:
            self.observer.unrecorded(self, path, "step", label)
        if self.stopping is not None and self.stopping():
            raise Parked("interrupted", "stopped by its worker before its next step")
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
                self.write(records.Err(path=path, label=label, attempt=started.attempt, error=dump_error(error),
                                       ts=time.time()))
                self.emit(path, label, "failed", number, error=error)
                raise error
        return await self._attempts(scope, path, label, fn, args, opts, number)

    def step_cancelled(self, att: Any) -> NoReturn:
        """Call while a running step's `CancelledError` is handled: the run's cancel error when a cancel request
        for this run cut the step off (and nothing else cancelled its task), else the `CancelledError` itself."""
        task = asyncio.current_task()
        if self.cancel_error is None or not att.cancelled or task is None or task.uncancel() > 0:
            raise  # the CancelledError the caller is handling
        raise self.cancel_error from None

    def alone(self, scope: Scope) -> bool:
        """True when the calling step is the only work of any run in this process that could want the loop now:
        no other step of its strand pending, no parallel branches, no other step running, no other live run."""
        return scope.pending == 1 and not self.branches and len(self.running) == 1 and RunKernel.live == 1

    async def _attempts(self, scope: Scope, path: str, label: str, fn: Callable[..., Any], args: tuple[Any, ...],
                        opts: StepOptions, number: int) -> Any:
        is_async = _is_async(fn)
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
            self.running[att] = current_task()
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
                            self.control(force=True)
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
                    except asyncio.CancelledError:
                        if not att.cancelled or self.cancel_error is not None or task is None \
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
                self.step_cancelled(att)
            except Crash:
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
        """Record a failed attempt; wait out the backoff and return to retry, or raise to fail the step."""
        retry: Retry | None = opts.retry
        storm = self.storm.record(failed=True, retry=number > 1)
        if storm is not None:
            self.advise("RETRY_STORM", 0, f"{self.storm.retries} retries in this run; "
                        f"{self.storm.failure_ratio:.0%} of recent attempts failed", storm)
        if ms >= 30_000 and not att.did_stash:
            self.advise("STASH_SUGGESTED", ms / 1000,
                        f"step {label!r} ran {ms / 1000:.0f}s and failed without stashing progress")
        if retry is None or number >= retry.attempts or isinstance(exc, NOT_RETRYABLE):
            self.write(records.Err(path=path, label=label, attempt=number, error=dump_error(exc), ms=ms,
                                   ts=time.time()))
            self.step_done()
            self.emit(path, label, "failed", number, ms, exc)
            raise exc
        delay = retry.delay(number)
        wake = self.clock.now() + timedelta(seconds=delay)
        self.write(records.Fail(path=path, label=label, attempt=number, error=dump_error(exc), ms=ms,
                                next=to_iso(wake), ts=time.time()))
        self.emit(path, label, "retrying", number, ms, exc)
        await self.back_off(path, label, wake)

    async def back_off(self, path: str, label: str, wake: datetime) -> None:
        """Wait until a retry's `wake` time: in place, or (a backoff of `queue.PARK_BACKOFF` s or more left in a
        run a worker serves, nothing else of it busy) by parking the run, due again at `wake`."""
        if self.parks and (wake - self.clock.now()).total_seconds() >= queue.PARK_BACKOFF and self.can_park():
            self.write(records.Park(path=path, until=to_iso(wake), ts=time.time()))
            self.sync()
            raise Parked("sleeping", f"retrying step {label!r} at {to_iso(wake)}")
        await self.nap(wake)

    # ---- control: cancel, pause and resume requests ---------------------------------------------
    def control(self, force: bool = False) -> None:
        """Act on the inbox's control requests (listed at most every 0.5 s unless forced).

        `$cancel` raises `RunCancelledError`; `$pause` / `$resume` record a pause / resume. While the run is
        paused the next boundary of every strand comes here, and `boundary` holds it."""
        if self.cancel_error is not None:
            raise self.cancel_error
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
                self.cancel_error = RunCancelledError(
                    f"run {self.run_id} was cancelled", run_id=self.run_id,
                    hint=f"Start it over with `durably restart {self.run_id}` (or run(..., fresh=True)).",
                    docs="docs/operations.md#cancel")
                self.next_control = float("-inf")
                raise self.cancel_error
        if self.history.paused:
            self.next_control = float("-inf")

    def flag_attempts(self) -> None:
        """Set the cancelled flag of every running attempt (thread-safe: the heartbeat calls it for a cancel)."""
        for att in list(self.running):
            att.cancel()

    def interrupt(self) -> None:
        """A control request arrived while a step ran (the heartbeat saw it): act on it now.

        A cancel stops the steps in flight: async ones are cancelled, sync ones on worker threads are
        abandoned with `attempt().cancelled` set, and the run ends cancelled. A pause takes effect at the
        next step boundary."""
        if self.dead or self.cancel_error is not None:
            return
        try:
            self.control(force=True)
        except RunCancelledError:
            for att, task in list(self.running.items()):
                att.cancel()
                if task is not None:
                    task.cancel()
        except Exception:  # noqa: BLE001 - the next step boundary asks the storage again
            pass

    async def boundary(self, force: bool = False) -> None:
        """A durable boundary: act on control requests, and while the run is paused wait here until it resumes."""
        if self.stopping is not None and self.stopping():
            raise Parked("interrupted", "stopped by its worker")
        if not self.history.paused:
            self.control(force)
        if self.history.paused:
            await self.hold()

    async def hold(self) -> None:
        """Wait out a pause; every strand shares one pause loop, so the inbox is polled once per `poll` seconds."""
        if self.holding is None or self.holding.done():
            self.holding = asyncio.ensure_future(self._hold())
            self.holding.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(self.holding)

    async def _hold(self) -> None:
        """The pause loop: returns on `$resume`, raises on `$cancel`, or raises `Parked` when not waiting."""
        while True:
            if self.lost is not None:
                raise self.lost
            self.control(force=True)
            if not self.history.paused:
                return
            info = self.storage.info(self.run_id)
            if info is not None and info.last.get("t") != "pause":
                self.write(records.Pause(ts=time.time()))  # keeps `list`, which reads the last record, exact
            if not self.wait:
                raise Parked("paused", "paused")
            await asyncio.sleep(self.poll)

    async def nap(self, when: datetime, force: bool = False) -> None:
        """Wait until `when` on the run's clock, acting on control requests every `poll` seconds meanwhile."""
        if force or time.monotonic() >= self.next_control:
            await self.boundary(force)
        if self.clock.now() >= when:
            await self.clock.sleep_until(when)
            return
        sleeper = asyncio.ensure_future(self.clock.sleep_until(when))
        try:
            while not sleeper.done():
                await asyncio.wait((sleeper,), timeout=self.poll)
                if not sleeper.done():
                    await self.boundary(force=True)
        finally:
            sleeper.cancel()
        sleeper.result()

    def finish_cancelled(self, error: BaseException) -> None:
        """Record that the run ended cancelled (no compensation runs), sync the log, and stop attached children."""
        self.write(records.End(status="cancelled", error=dump_error(error), ts=time.time()))
        self.sync()
        for outcome in list(self.children):
            outcome.cancel()

    # ---- parking: durable sleeps and waits for signals -----------------------------------------
    def sleep_until(self, when: datetime) -> Awaitable[None]:
        """Allocate the sleep's path now; its wake time is recorded the first time it runs."""
        check_wake_time(when)
        path, replayed = self.replay_next("ctx.sleep")
        return replayed or self._sleep(path, when)

    async def _sleep(self, path: str, when: datetime) -> None:
        if self.observer is not None:
            self.observer.unrecorded(self, path, "ctx.sleep", "ctx.sleep")
        wake = self.history.wakes.get(path)
        if wake is None:
            self.write(records.Wake(path=path, at=to_iso(when), ts=time.time()))
            self.sync()
        else:
            when = from_iso(wake.at)
        if self.clock.now() < when:
            if not self.wait:
                raise Parked("sleeping", f"sleeping until {to_iso(when)}")
            await self.nap(when, force=True)
        self.write(records.Ok(attempt=1, path=path, label="ctx.sleep", value=None, ms=0, ts=time.time()))
        self.step_done()

    def wait_for(self, name: str, schema: Any, timeout: float | None) -> Awaitable[Any]:
        """Allocate the wait's path now; it returns the payload of the next signal `name` sent to the run."""
        check_signal_name(name)
        timeout = check_timeout(timeout, "wait_for timeout=")
        compiled = compile_schema(schema, f"schema of wait_for({name!r})")
        path, replayed = self.replay_next("ctx.wait_for", PLAIN if compiled is None else _Schema(compiled),
                                          f"signal {name!r}")
        return replayed or self._wait(path, name, compiled, timeout)

    async def _wait(self, path: str, name: str, schema: Any, timeout: float | None) -> Any:
        if self.observer is not None:
            self.observer.unrecorded(self, path, "ctx.wait_for", "ctx.wait_for")
        opened = self.history.waits.get(path)
        if opened is None:
            deadline = self.clock.now() + timedelta(seconds=timeout) if timeout else None
            self.write(records.Wait(path=path, name=name, deadline=to_iso(deadline) if deadline else None,
                                    ts=time.time()))
            self.sync()
            if timeout is None:
                self.advise("WAITFOR_NO_TIMEOUT", 1, f"ctx.wait_for({name!r}) waits without a timeout")
        else:
            deadline = from_iso(opened.deadline) if opened.deadline else None
        expires = self.clock.deadline(deadline) if deadline is not None else None
        while True:
            await self.boundary(force=True)
            signal = self.next_signal(name)
            if signal is not None:
                self.write(records.Ok(attempt=1, path=path, label="ctx.wait_for", value=signal.get("payload"), ms=0,
                                      signal=signal["id"], ts=time.time()))
                self.step_done()
                self.storage.ack(self.run_id, signal["id"])
                value = load_value(signal.get("payload"))
                return schema.convert(value, f"signal {name!r}") if schema is not None else value
            if deadline is not None and expires is not None and self.clock.monotonic() >= expires:
                error = WaitTimeoutError(f"no signal {name!r} arrived within {timeout or 0:g}s "
                                         f"(deadline {to_iso(deadline)})", name=name, path=list(path_tuple(path)))
                self.write(records.Err(attempt=1, path=path, label="ctx.wait_for", error=dump_error(error), ts=time.time()))
                self.step_done()
                raise error
            if not self.wait:
                raise Parked("waiting", f"waiting for signal {name!r}")
            pause = self.poll if expires is None else min(self.poll, expires - self.clock.monotonic())
            await self.clock.sleep(pause)

    def next_signal(self, name: str) -> dict[str, Any] | None:
        """The oldest unread signal `name` in the run's inbox (acknowledging ones already recorded)."""
        for signal in self.storage.inbox(self.run_id):
            if signal["id"] in self.history.signals:
                self.storage.ack(self.run_id, signal["id"])
            elif signal.get("name") == name:
                return signal
        return None

    # ---- child runs ---------------------------------------------------------------------------
    def spawn(self, wf: Any, input: Any, detached: bool) -> Awaitable[RunHandle]:
        """Allocate the spawn's path now; the child gets its own durable run, started in this process."""
        workflow = as_workflow(wf)
        path = self.scope().alloc()
        return self._spawn(path, workflow, input, detached)

    def spawn_all(self, definitions: list[Any], detached: bool) -> Awaitable[list[RunHandle]]:
        """Spawn one child per `(workflow, input)` pair, under one path."""
        pairs = spawn_pairs(definitions)
        prefix = self.scope().alloc()
        if len(pairs) > self.engine.concurrency:
            self.advise("CONCURRENCY_CAPPED", len(pairs) - self.engine.concurrency,
                        f"ctx.spawn_all of {len(pairs)} children; the engine runs {self.engine.concurrency} at once",
                        children=len(pairs), concurrency=self.engine.concurrency)
        return self._spawn_all(prefix, pairs, detached)

    async def _spawn_all(self, prefix: str, pairs: list[tuple[Workflow, Any]], detached: bool) -> list[RunHandle]:
        """Create the children not recorded yet in batches of `SPAWN_BATCH` (one durable write for each), record
        each batch's spawns as soon as it is created (one append for the batch), and make the records durable
        once: a crash leaves the children created before the records, and a resumed parent finds each one
        created but not recorded through its identity. Nothing per child is kept but its run id (in its
        handle): spawn records are not kept in memory, and only one batch's paths and inputs are in hand at a time."""
        run_ids: list[str] = []
        written = 0
        forget = self.history.forget
        for first in range(0, len(pairs), SPAWN_BATCH):
            missing: list[tuple[str, Workflow, Any]] = []
            for i in range(first, min(first + SPAWN_BATCH, len(pairs))):
                path = f"{prefix}.{i}"
                if path in self.done:
                    run_ids.append(self.spawned_id(path))
                    forget(path, prefix)
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
            self.write_unkept(spawns, prefix)
            written += len(missing)
        if written:
            self.steps_done(written)
        return self._spawned([RunHandle(run_id, wf) for run_id, (wf, _) in zip(run_ids, pairs, strict=True)], detached)

    async def _spawn(self, path: str, workflow: Workflow, input: Any, detached: bool) -> RunHandle:
        if path in self.done:
            run_id = self.spawned_id(path)
        else:
            if self.observer is not None:
                self.observer.unrecorded(self, path, "ctx.spawn", "ctx.spawn")
            run_id = self.engine.create_child(self.run_id, path, workflow, input, detached, queued=self.parks)
            self.write(records.Ok(attempt=1, path=path, label="ctx.spawn", value={"run_id": run_id, "detached": detached},
                                  ms=0, ts=time.time()))
            self.step_done()
        return self._spawned([RunHandle(run_id, workflow)], detached)[0]

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
            for handle in handles:
                if not detached:
                    self.attached[handle.run_id] = None
                self.engine.queued_child(handle.run_id)
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

    def start_child(self, handle: RunHandle) -> asyncio.Future[Any]:
        """The outcome of a child this run waits for (a retry resumes a failed child once, however often
        its joins ask for it)."""
        rerun = self.retrying and handle.run_id not in self.resumed
        if rerun:
            self.resumed.add(handle.run_id)
        return self.engine.start_child(handle.run_id, handle.workflow, rerun_failed=rerun)

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

    def join(self, handle: RunHandle) -> Awaitable[Any]:
        """Allocate the join's path now; it returns the child's result (or raises its error) once it ends."""
        check_handle(handle)
        path, replayed = self.replay_next("ctx.join")
        if replayed is not None:
            self.attached.pop(handle.run_id, None)
            return replayed
        return self._join(path, handle)

    async def _join(self, path: str, handle: RunHandle) -> Any:
        if self.observer is not None:
            self.observer.unrecorded(self, path, "ctx.join", "ctx.join")
        try:
            value = await self.wait_child(handle, path)
            wire = dump_value(value, "child result")
        except (Crash, asyncio.CancelledError):
            raise
        except Exception as exc:
            if exc is self.cancel_error or exc is self.lost:
                raise
            self.write(records.Err(attempt=1, path=path, label="ctx.join", error=dump_error(exc), ts=time.time()))
            self.step_done()
            raise
        self.write(records.Ok(attempt=1, path=path, label="ctx.join", value=wire, ms=0, ts=time.time()))
        self.step_done()
        return load_value(wire)

    def can_park(self) -> bool:
        """True when parking the whole run now cuts nothing short: no step runs and no other strand is busy."""
        return not self.running and not self.branches and not self.joining

    def park_join(self, path: str, children: list[str]) -> NoReturn:
        """Park the run until `children` end: record on what it waits, and leave its process (`Parked`)."""
        self.write(records.Park(path=path, children=children[:PARK_LISTS], count=len(children), ts=time.time()))
        self.sync()
        raise Parked("waiting", f"waiting for {len(children)} child run{'s' if len(children) != 1 else ''}",
                     tuple(children))

    async def wait_child(self, handle: RunHandle, path: str) -> Any:
        """Wait for a child to end, giving back this run's engine slot meanwhile; a cancel or pause request
        for this run is acted on while it waits (one inbox watcher for all of the run's joins). A run a
        worker serves parks instead while the child has not ended (when nothing else of it is busy)."""
        if self.parks:
            ended = self.engine.ended_child(handle.run_id, handle.workflow)
            if ended is not None:
                self.attached.pop(handle.run_id, None)
                return ended.result()
            if self.can_park():
                self.park_join(path, [handle.run_id])
        child = self.start_child(handle)
        await self.parked_on(child)
        return await asyncio.shield(child)

    async def parked_on(self, child: asyncio.Future[Any]) -> None:
        """Wait until `child` is done, unless a cancel request (or a lost lease) for this run comes first."""
        self.joining += 1
        if self.join_watch is None or self.join_watch.done():
            self.interrupted = asyncio.get_running_loop().create_future()
            self.join_watch = asyncio.ensure_future(self._watch_joins(self.interrupted))
        interrupted = self.interrupted
        assert interrupted is not None
        try:
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

    async def attached_ended(self) -> None:
        """Wait until every attached child ended: those still waiting to start start first (their outcomes
        come to `children` as they do)."""
        while waiting := [c.wait() for c in self.children if not isinstance(c, asyncio.Future) and not c.done()]:
            await asyncio.wait(waiting)
        await asyncio.gather(*[c for c in self.children if isinstance(c, asyncio.Future) and not c.done()],
                             return_exceptions=True)

    def join_all(self, handles: list[RunHandle]) -> Awaitable[list[Ok[Any] | Err]]:
        """Join every child concurrently; one `Ok`/`Err` per handle, in order (join ``i`` at ``<path>.i.0``)."""
        handles = list(handles)
        for handle in handles:
            if not isinstance(handle, RunHandle):
                raise ValidationError(f"ctx.join_all takes the RunHandles that ctx.spawn_all returned, got {handle!r}",
                                      hint="results = await ctx.join_all(await ctx.spawn_all([...]))",
                                      docs="docs/authoring.md#child-runs")
        return self._join_all(self.scope().alloc(), handles)

    async def _join_all(self, prefix: str, handles: list[RunHandle]) -> list[Ok[Any] | Err]:
        """One waiter for all the children (no task, coroutine, context or callback per child): the children's
        joins are recorded in order as they end, and nothing of a child is kept but its result (its join record
        is forgotten once written or replayed)."""
        results: list[Any] = [None] * len(handles)
        unended: list[int] = []
        forget = self.history.forget
        batch = f"{prefix}.0.0"
        for i, handle in enumerate(handles):
            path = f"{prefix}.{i}.0"
            rec = self.done.get(path)
            if rec is not None:
                self.check_label(path, rec, "ctx.join")
                self.attached.pop(handle.run_id, None)
                if self.on_step is not None:
                    self.emit(path, rec.label, "replayed", rec.attempt, rec.ms)
                results[i] = Err(load_error(rec.error)) if isinstance(rec, records.Err) else Ok(load_value(rec.value))
                forget(path, batch)
                continue
            if self.observer is not None:
                self.observer.unrecorded(self, path, "ctx.join", "ctx.join")
            if self.parks:
                outcome = self.engine.ended_child(handle.run_id, handle.workflow)
                if outcome is not None:
                    self.attached.pop(handle.run_id, None)
                    results[i] = self._record_join(path, outcome, batch)
                    continue
            unended.append(i)
        if self.parks and unended and self.can_park():
            self.park_join(prefix, [handles[i].run_id for i in unended])
        if not unended:
            return results
        ahead: collections.deque[asyncio.Future[Any]] = collections.deque()
        asked = 0

        def ask() -> None:
            """Hold the outcomes of the next `JOIN_AHEAD` children (a child waiting to start gets its future now)."""
            nonlocal asked
            while asked < len(unended) and len(ahead) < JOIN_AHEAD:
                handle = handles[unended[asked]]
                outcome = self.start_child(handle)
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
                for i in unended:
                    outcome = ahead.popleft()
                    if not outcome.done():
                        flush()
                        await asyncio.wait((outcome,))
                    if outcome.cancelled() or self.cancel_error is not None:
                        flush()
                        return  # the run is being cancelled: the join never ends on its own
                    ask()
                    try:
                        rec, results[i] = self._join_record(f"{prefix}.{i}.0", outcome)
                    except BaseException:
                        flush()
                        raise
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
    def graph(self, tasks: Mapping[str, Task]) -> Awaitable[dict[str, Ok[Any] | Err]]:
        """Validate a DAG of child runs now (before any work) and allocate its path; each task runs as
        soon as its prerequisites completed."""
        nodes = graphs.validate(tasks)
        prefix = self.scope().alloc()
        return self._graph(prefix, nodes)

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
            if kind not in BUDGET_KINDS:
                raise ValidationError(f"unknown budget kind {kind!r}", hint=f"Use one of {', '.join(BUDGET_KINDS)}.",
                                      docs="docs/policies.md#budgets")
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
        """Attach JSON values to the run (shown by inspect); the latest value of a name wins."""
        wire = dump_value(values, "annotations")
        if any(self.history.notes.get(k, object()) != v for k, v in wire.items()):
            self.write(records.Note(notes=wire))

    def loop(self, initial: Any, reducer: Callable[..., Any], snapshot_every: int | None,
             max_iterations: int | None) -> Awaitable[Any]:
        """Allocate the loop's path now; each iteration's steps live under ``<path>.<iteration>.``."""
        if not callable(reducer):
            raise ValidationError(f"ctx.loop needs a reducer function, got {reducer!r}",
                                  hint="Pass `async def reducer(state, it)` returning the next state or it.done(value).",
                                  docs="docs/authoring.md#loops")
        for name, value in (("snapshot_every", snapshot_every), ("max_iterations", max_iterations)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValidationError(f"ctx.loop {name}= must be an int >= 1, got {value!r}",
                                      hint=f"Omit {name}= for the default.", docs="docs/authoring.md#loops")
        path, replayed = self.replay_next("ctx.loop")
        return replayed or self._loop(path, initial, reducer, snapshot_every or 1, max_iterations)

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

    def parallel(self, items: list[Any], concurrency: int | None) -> Awaitable[list[Ok[Any] | Err]]:
        """Allocate a path for the fan-out now; each branch runs under its own prefix."""
        items = checked_branches(items, concurrency)
        scope = self.scope()
        prefix = None if all(type(item) is CoroutineType and item.cr_code in STEP_CODES for item in items) \
            else scope.alloc()
        if len(items) >= 1000:
            self.advise("FANOUT_CEILING", len(items), f"ctx.parallel with {len(items)} branches")
        return self._parallel(prefix, items, concurrency)

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
                out = await self._invoke(fn, (value,), _is_async(fn))
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

    async def run(self, ctx: object) -> Any:
        """Execute the workflow body and record how it ended."""
        self.ctx = ctx
        current_scope.set(Scope("", asyncio.current_task()))
        RunKernel.live += 1
        try:
            return await self._run(ctx)
        finally:
            RunKernel.live -= 1

    async def _run(self, ctx: object) -> Any:
        try:
            try:
                if self.history.paused:
                    await self.hold()
                result = await self.workflow(ctx, self.input)
            except Complete as done:
                result = done.value
            if self.attached and self.cancel_error is None:
                await self.wait_attached()
            if self.children and self.cancel_error is None:
                ended = asyncio.ensure_future(self.attached_ended())
                try:
                    await self.parked_on(ended)
                finally:
                    ended.cancel()
            schema = self.workflow.output_schema
            wire = dump_value(schema.to_builtins(result) if schema else result, "result")
            value = load_value(wire)
            if schema is not None:
                value = schema.convert(value, "result")
        except (Crash, asyncio.CancelledError):
            raise
        except Exception as exc:
            if self.dead:
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
                self.finish_cancelled(cancelled)
                if cancelled is exc:
                    raise
                raise cancelled from exc
            await self.compensate(exc)
            self.write(records.End(status="failed", error=dump_error(exc), ts=time.time()))
            if self.end_sync:
                self.sync()
            raise
        if self.replay_error is not None:
            raise self.replay_error
        if self.cancel_error is not None:
            self.finish_cancelled(self.cancel_error)
            raise self.cancel_error
        self.write(records.End(status="completed", result=wire, ts=time.time()))
        if self.end_sync:
            self.sync()
        return value


STEP_CODES = frozenset({RunKernel.execute.__code__, RunKernel.replay.__code__, replayed.__code__})
