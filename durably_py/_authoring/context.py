"""The API a workflow sees: `ctx` (`WorkflowContext`) and `attempt()` inside a running step."""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar, cast, overload

from .._codec import from_iso
from ..errors import ValidationError
from .branches import First, first_of
from .calls import Complete, LoopDone, RunHandle, check_budget_kind, current_attempt
from .engine_api import EngineAPI
from .policies import check_timeout
from .result import Err, Ok

if TYPE_CHECKING:
    from .awakeables import Awakeable
    from .graphs import Task
    from .handles import Handle


T = TypeVar("T")


class RunHeader(Protocol):
    """What `ctx` reads of the run's header."""

    @property
    def scheduled_at(self) -> str | None: ...


class RunHistory(Protocol):
    """What `ctx` reads of the run's history: the process attempt and the header."""

    @property
    def attempt(self) -> int: ...

    @property
    def header(self) -> RunHeader: ...


class Kernel(Protocol):
    """What a workflow's `ctx` and `attempt()` forward to: the kernel running the workflow in its mode.

    The local kernel (`_replay.kernel.RunKernel`) and Restate's (`restate.context.RestateKernel`) implement
    it; neither is imported here. A feature a mode does not provide raises its `NotSupportedError` from
    that mode's kernel. The operations return what `ctx` hands the workflow to await."""

    run_id: str

    @property
    def history(self) -> RunHistory: ...
    @property
    def engine(self) -> EngineAPI: ...
    @property
    def budget(self) -> dict[str, float] | None: ...
    @property
    def spent(self) -> dict[str, float]: ...
    @property
    def cancels_losers(self) -> bool: ...

    def step(self, fn: Callable[..., Any], /, *args: Any, **options: Any) -> Handle[Any]: ...
    def transaction(self, fn: Callable[..., Any], /, *args: Any, **options: Any) -> Handle[Any]: ...
    def now(self) -> Any: ...
    def random(self) -> float: ...
    def uuid(self) -> str: ...
    def replaying(self) -> bool: ...
    def patched(self, change: str, deprecated: bool = False) -> bool: ...
    def sleep(self, seconds: float) -> Handle[None]: ...
    def sleep_until(self, when: datetime) -> Handle[None]: ...
    def wait_for(self, name: str, schema: Any, timeout: float | None) -> Handle[Any]: ...
    async def awakeable(self, timeout: float | None, schema: Any, name: str | None) -> Awakeable[Any]: ...
    def parallel(self, items: list[Any], concurrency: int | None) -> Handle[list[Ok[Any] | Err]]: ...
    def loop(self, initial: Any, reducer: Callable[..., Any], snapshot_every: int | None,
             max_iterations: int | None) -> Handle[Any]: ...
    def spawn(self, wf: Any, input: Any, detached: bool) -> Handle[RunHandle]: ...
    def spawn_all(self, definitions: list[Any], detached: bool) -> Handle[list[RunHandle]]: ...
    def join(self, handle: RunHandle) -> Handle[Any]: ...
    def join_all(self, handles: list[RunHandle]) -> Handle[list[Ok[Any] | Err]]: ...
    def graph(self, tasks: Mapping[str, Task]) -> Handle[dict[str, Ok[Any] | Err]]: ...
    def charge(self, amounts: dict[str, float]) -> None: ...
    def annotate(self, values: dict[str, Any]) -> None: ...
    def stash(self, path: str, value: Any) -> Any: ...
    def stream(self, path: str) -> StepStream: ...


class StepStream(Protocol):
    """What `attempt().emit` and `attempt().partials` use of the stream of the step at a path (the local kernel's
    `_replay.streams.StepStream`)."""

    def emit(self, chunk: Any, number: int) -> None: ...
    def partials(self, number: int) -> list[Any]: ...


_EVENT_LOCK = threading.Lock()


class AttemptContext:
    """The running attempt of one step: its number, stash, idempotency key and cancellation flag."""

    __slots__ = ("kernel", "path", "number", "_stashed", "did_stash", "_cancelled", "_event", "label", "_stream")

    label: str  # the step's label, set by the kernel as the attempt starts

    def __init__(self, kernel: Kernel, path: str, number: int, stashed: Any) -> None:
        self.kernel = kernel
        self.path = path
        self.number = number
        self._stashed = stashed
        self.did_stash = False
        self._cancelled = False
        self._event: threading.Event | None = None
        self._stream: StepStream | None = None

    @property
    def stashed(self) -> Any:
        """The value last stashed by an earlier attempt or process (None if nothing was stashed)."""
        return self._stashed

    def stash(self, value: Any) -> None:
        """Record partial progress durably now; the next attempt of this step starts from it."""
        self._stashed = self.kernel.stash(self.path, value)
        self.did_stash = True

    def emit(self, chunk: Any) -> None:
        """Stream `chunk` (a JSON value, usually a str: a model's next tokens) as this step's output so far: kept
        as a partial in the store, readable live (`engine.stream`, `durably logs --follow`, the console), and
        handed to the next attempt as `partials` if this one is cut off. Written in batches, never fsynced."""
        if self._stream is None:
            self._stream = self.kernel.stream(self.path)
        self._stream.emit(chunk, self.number)

    @property
    def partials(self) -> list[Any]:
        """The chunks this step streamed before this attempt started (an attempt that was cut off, in this
        process or a killed one), in order; [] when none. A model call continues after them instead of starting
        over; what this attempt emits or yields is added after them."""
        if self._stream is None:
            self._stream = self.kernel.stream(self.path)
        return self._stream.partials(self.number)

    @property
    def operation_id(self) -> str:
        """Stable across retries and resumes of this step: hand it to an external API as idempotency key."""
        return f"{self.kernel.run_id}/{self.path}"

    @property
    def cancelled(self) -> bool:
        """True once the attempt timed out; sync code should check it and stop."""
        return self._cancelled

    @property
    def cancelled_event(self) -> threading.Event:
        """A `threading.Event` set when the attempt times out, for sync code that waits on something."""
        with _EVENT_LOCK:
            if self._event is None:
                self._event = threading.Event()
                if self._cancelled:
                    self._event.set()
            return self._event

    def cancel(self) -> None:
        """Mark the attempt abandoned (its timeout passed)."""
        with _EVENT_LOCK:
            self._cancelled = True
            if self._event is not None:
                self._event.set()


def attempt() -> AttemptContext:
    """The attempt of the step running in this task or thread."""
    try:
        return cast(AttemptContext, current_attempt.get())
    except LookupError:
        raise ValidationError("attempt() was called outside a running step",
                              hint="Call attempt() inside the function passed to ctx.step().",
                              docs="docs/authoring.md#attempt") from None


class BudgetView:
    """What the run may still spend, per kind (`usd`, `tokens`, `units`)."""

    def __init__(self, kernel: Kernel) -> None:
        self._kernel = kernel

    def spent(self, kind: str) -> float:
        """Total charged so far, across every process that ran this run."""
        return self._kernel.spent[check_budget_kind(kind)]

    def remaining(self, kind: str) -> float:
        """Budget left (infinity when the kind has no budget)."""
        limit = (self._kernel.budget or {}).get(check_budget_kind(kind))
        return float("inf") if limit is None else limit - self._kernel.spent[kind]


class LoopIteration:
    """`it` in a loop reducer: the iteration number, its steps, and `done()`."""

    __slots__ = ("_ctx", "number")

    def __init__(self, ctx: WorkflowContext, number: int) -> None:
        self._ctx = ctx
        self.number = number

    def step(self, fn: Callable[..., Any], /, *args: Any, **options: Any) -> Handle[Any]:
        """A step of this iteration (same options as `ctx.step`)."""
        return self._ctx.step(fn, *args, **options)

    def done(self, value: Any = None) -> LoopDone:
        """End the loop; `ctx.loop` returns `value`."""
        return LoopDone(value)


class WorkflowContext:
    """`ctx`: steps, fan-out, recorded time and randomness, logging, budgets."""

    def __init__(self, kernel: Kernel) -> None:
        self._kernel = kernel
        self.step = kernel.step  # type: ignore[method-assign]  # ctx.step calls the kernel directly: one frame
        self.budget = BudgetView(kernel)

    @property
    def run_id(self) -> str:
        """The id of the durable run."""
        return self._kernel.run_id

    @property
    def attempt(self) -> int:
        """The workflow attempt: 1 for the first process, +1 for every resume (always 1 on Restate, which does
        not tell a workflow)."""
        return self._kernel.history.attempt

    @property
    def engine(self) -> EngineAPI:
        """The engine running this run (under `TestEngine`, its engine over the test's storage), for what a
        workflow asks of its own run or of others from inside a step: ``await ctx.engine.inspect(ctx.run_id)``.
        Answers change as runs move on, so ask inside a step (its result is recorded), not in the workflow body."""
        return self._kernel.engine

    @property
    def scheduled_at(self) -> datetime | None:
        """The tick a run a schedule started serves (timezone-aware UTC, the same in every process and on
        replay), like DBOS's `scheduled_time`; None for a run no schedule started."""
        tick = self._kernel.history.header.scheduled_at
        return from_iso(tick) if tick is not None else None

    @overload
    def step(self, fn: Callable[..., AsyncIterator[Any] | Iterator[Any]], /, *args: Any,
             name: str | None = None, retry: Any = None, timeout: float | None = None,
             compensate: Callable[[Any], Any] | None = None, concurrency_key: str | None = None,
             concurrency_limit: int | None = None, uses: str | None = None, schema: Any = None,
             replay: str = "safe", on_interrupt: str | None = None, keep_partials: bool = False,
             reserve: dict[str, float] | None = None, charge: Any = None) -> Handle[Any]: ...

    @overload
    def step(self, fn: Callable[..., Coroutine[Any, Any, T]], /, *args: Any, name: str | None = None,
             retry: Any = None, timeout: float | None = None, compensate: Callable[[Any], Any] | None = None,
             concurrency_key: str | None = None, concurrency_limit: int | None = None, uses: str | None = None,
             schema: None = None, replay: str = "safe", on_interrupt: str | None = None,
             keep_partials: bool = False, reserve: dict[str, float] | None = None,
             charge: Any = None) -> Handle[T]: ...

    @overload
    def step(self, fn: Callable[..., T], /, *args: Any, name: str | None = None, retry: Any = None,
             timeout: float | None = None, compensate: Callable[[Any], Any] | None = None,
             concurrency_key: str | None = None, concurrency_limit: int | None = None, uses: str | None = None,
             schema: None = None, replay: str = "safe", on_interrupt: str | None = None,
             keep_partials: bool = False, reserve: dict[str, float] | None = None,
             charge: Any = None) -> Handle[T]: ...

    @overload
    def step(self, fn: Callable[..., Any], /, *args: Any, name: str | None = None, retry: Any = None,
             timeout: float | None = None, compensate: Callable[[Any], Any] | None = None,
             concurrency_key: str | None = None, concurrency_limit: int | None = None, uses: str | None = None,
             schema: Any, replay: str = "safe", on_interrupt: str | None = None,
             keep_partials: bool = False, reserve: dict[str, float] | None = None,
             charge: Any = None) -> Handle[Any]: ...

    def step(self, fn: Callable[..., Any], /, *args: Any, **options: Any) -> Handle[Any]:
        """Run `fn(*args)` once, durably; its path is fixed when this is called, its result when it returns.
        The handle is a future: await it (any number of times), or hand it to asyncio (`gather`, `wait`,
        `create_task`, a `TaskGroup`); it runs the first time either happens.

        (Each context binds the kernel's `step` over this method in `__init__`; this body serves a call
        through the class.)"""
        return self._kernel.step(fn, *args, **options)

    @overload
    def transaction(self, fn: Callable[..., Coroutine[Any, Any, T]], /, *args: Any, name: str | None = None,
                    retry: Any = None, compensate: Callable[[Any], Any] | None = None, schema: None = None,
                    concurrency_key: str | None = None, concurrency_limit: int | None = None,
                    uses: str | None = None) -> Handle[T]: ...

    @overload
    def transaction(self, fn: Callable[..., T], /, *args: Any, name: str | None = None, retry: Any = None,
                    compensate: Callable[[Any], Any] | None = None, schema: None = None,
                    concurrency_key: str | None = None, concurrency_limit: int | None = None,
                    uses: str | None = None) -> Handle[T]: ...

    @overload
    def transaction(self, fn: Callable[..., Any], /, *args: Any, name: str | None = None, retry: Any = None,
                    compensate: Callable[[Any], Any] | None = None, schema: Any,
                    concurrency_key: str | None = None, concurrency_limit: int | None = None,
                    uses: str | None = None) -> Handle[Any]: ...

    def transaction(self, fn: Callable[..., Any], /, *args: Any, name: str | None = None, retry: Any = None,
                    compensate: Callable[[Any], Any] | None = None, schema: Any = None,
                    concurrency_key: str | None = None, concurrency_limit: int | None = None,
                    uses: str | None = None, **unknown: Any) -> Handle[Any]:
        """A step whose `fn(conn, *args)` writes through `conn`, a connection to the run's own SQLite or PostgreSQL
        database, inside the transaction that records the step's result: the writes and the record commit
        together or not at all, so a killed process never leaves one without the other. An exception (or a retry
        under `retry=`) rolls the transaction back; a recorded result replays like any step's. Other storage
        raises `NotSupportedError`. See docs/policies.md#transactional-steps."""
        return self._kernel.transaction(fn, *args, name=name, retry=retry, compensate=compensate, schema=schema,
                                        concurrency_key=concurrency_key, concurrency_limit=concurrency_limit,
                                        uses=uses, **unknown)

    def parallel(self, items: Iterable[Any], *, concurrency: int | None = None) -> Handle[list[Ok[Any] | Err]]:
        """Run awaitables or zero-argument callables concurrently; one `Ok`/`Err` per item, in order."""
        return self._kernel.parallel(list(items), concurrency)

    def loop(self, initial: Any, reducer: Callable[..., Any], *, snapshot_every: int | None = None,
             max_iterations: int | None = None) -> Handle[Any]:
        """Iterate `reducer(state, it)` until it returns `it.done(value)`; resumes from the latest snapshot."""
        if not callable(reducer):
            return self._kernel.loop(initial, reducer, snapshot_every, max_iterations)  # the kernel explains

        if inspect.iscoroutinefunction(reducer):  # an async reducer keeps an async wrapper: Restate's kernel asks

            async def turn(state: Any, number: int) -> Any:
                return await reducer(state, LoopIteration(self, number))

            return self._kernel.loop(initial, turn, snapshot_every, max_iterations)

        def iterate(state: Any, number: int) -> Any:
            return reducer(state, LoopIteration(self, number))

        return self._kernel.loop(initial, iterate, snapshot_every, max_iterations)

    def spawn(self, wf: Any, input: Any = None, *, detached: bool = False) -> Handle[RunHandle]:
        """Start a child run of `wf` (its own durable run and retries, spending this run's budget); join it with
        `ctx.join`."""
        return self._kernel.spawn(wf, input, detached)

    def spawn_all(self, definitions: Iterable[Any], *, detached: bool = False) -> Handle[list[RunHandle]]:
        """Start one child run per `(workflow, input)` pair."""
        return self._kernel.spawn_all(list(definitions), detached)

    def join(self, handle: RunHandle) -> Handle[Any]:
        """Wait for a child run to end; return its result or raise its error."""
        return self._kernel.join(handle)

    def join_all(self, handles: Iterable[RunHandle]) -> Handle[list[Ok[Any] | Err]]:
        """Wait for every child run; one `Ok`/`Err` per handle, in order."""
        return self._kernel.join_all(list(handles))

    def graph(self, tasks: Mapping[str, Task]) -> Handle[dict[str, Ok[Any] | Err]]:
        """Run a DAG of child runs (`{id: Task(wf, input, depends_on=[...])}`), validated before any work starts;
        one `Ok`/`Err` per task id. A task whose prerequisite failed gets `Err(DependencyFailedError)`."""
        return self._kernel.graph(tasks)

    def sleep(self, seconds: float) -> Handle[None]:
        """Wait `seconds` durably: the wake time is recorded, so a resumed run waits only what is left."""
        if seconds != 0:
            check_timeout(seconds, "ctx.sleep seconds")
        return self._kernel.sleep(seconds)

    def sleep_until(self, when: datetime) -> Handle[None]:
        """Wait durably until `when` (timezone-aware)."""
        return self._kernel.sleep_until(when)

    def wait_for(self, name: str, schema: Any = None, *, timeout: float | None = None) -> Handle[Any]:
        """Park until signal `name` arrives (from any process) and return its payload; `WaitTimeoutError` after
        `timeout` seconds."""
        return self._kernel.wait_for(name, schema, timeout)

    async def awakeable(self, *, timeout: float | None = None, schema: Any = None,
                        name: str | None = None) -> Awakeable[Any]:
        """Create an awakeable: hand its `id` (or callback `url`) to an outside system, then ``await`` it for the
        value that system resolves it with; the run parks meanwhile, holding no process under a worker. A
        resumed run asking here again gets the same awakeable, with a resolution that arrived meanwhile.
        `timeout`: seconds until it fails with `AwakeableTimeoutError` (the deadline is fixed when it is
        created); `schema`: the value's type, checked when it is resolved and converted as `wait_for` does."""
        return await self._kernel.awakeable(timeout, schema, name)

    async def first(self, *operations: Awaitable[Any], **named: Awaitable[Any]) -> First:
        """Race durable operations: wait for the first to complete, cancel the others (their cancellation is
        recorded), and return which won and with what: ``First(name, value)``, `name` being the keyword (or
        the position of a positional operation). The winner's exception is raised if it failed. Whichever won
        wins again on every replay, even when a resumed run finds several ready at once. (On Restate the
        losers are left pending: Restate cannot take back a journaled step, timer or promise.)

            which, value = await ctx.first(approval=ctx.wait_for("approval"), timeout=ctx.sleep(3600))
        """
        return await first_of(operations, named, cancel_losers=self._kernel.cancels_losers)

    def now(self) -> datetime:
        """The current time, recorded (replay returns the same instant)."""
        return self._kernel.now()

    def random(self) -> float:
        """A random float in [0, 1), recorded."""
        return self._kernel.random()

    def uuid(self) -> str:
        """A random UUID4 string, recorded."""
        return self._kernel.uuid()

    def patched(self, change: str) -> bool:
        """True where the run takes the new code of `change`, False in a run recorded before it: wrap a changed
        part of a deployed workflow in ``if ctx.patched("change"): new else: old``. The first answer is recorded,
        so a run keeps its branch for good; see docs/versioning.md."""
        return self._kernel.patched(change)

    def deprecate_patch(self, change: str) -> None:
        """Mark where ``ctx.patched(change)`` stood once its old branch is deleted: a run still on that branch
        stops as `stale` (`StaleRunError`) instead of silently switching code; see docs/versioning.md."""
        self._kernel.patched(change, deprecated=True)

    def log(self, *values: Any, **print_kwargs: Any) -> None:
        """print() to stderr (stdout stays for results), only when live, never while replaying recorded steps."""
        if not self._kernel.replaying():
            print_kwargs.setdefault("file", sys.stderr)
            print(*values, **print_kwargs)

    def complete(self, value: Any = None) -> NoReturn:
        """End the workflow now with `value` (from anywhere in it, a loop reducer included)."""
        raise Complete(value)

    def charge(self, *, usd: float = 0, tokens: float = 0, units: float = 0) -> None:
        """Record spend against the run's budget; replayed charges are not counted twice."""
        self._kernel.charge({"usd": usd, "tokens": tokens, "units": units})

    def annotate(self, **values: Any) -> None:
        """Attach JSON values to the run, shown by `durably inspect`."""
        self._kernel.annotate(values)
