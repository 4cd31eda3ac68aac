"""`ctx` for a workflow running on Restate: the same API as on files, backed by the invocation's journal."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, NoReturn

from .._authoring.branches import First, checked_branches, first_of, foreign_strand, outside_workflow, run_branches
from .._authoring.calls import (
    Complete,
    RunHandle,
    StepOptions,
    check_handle,
    check_signal_name,
    check_wake_time,
    is_async_callable,
    label_of,
    not_callable,
    spawn_pairs,
)
from .._authoring.policies import check_timeout
from .._authoring.result import Err, Ok
from .._authoring.schema import compile_schema
from .._authoring.workflow import as_workflow
from ..errors import LoopLimitError, ValidationError
from .runtime import JoinOp, Pump, SleepOp, SpawnOp, StepOp, WaitOp, new_uuid
from .unsupported import unsupported

PATCH_HINT = ("Register the changed code as a new Restate deployment: invocations already running stay on the "
              "deployment that started them, new ones take the new code (docs/restate.md#what-does-not-map).")


class _Scope:
    """Allocates the paths of one sequential strand (the body, a parallel branch, a loop turn)."""

    __slots__ = ("prefix", "n", "owner")

    def __init__(self, prefix: str, owner: asyncio.Task[Any] | None) -> None:
        self.prefix = prefix
        self.n = 0
        self.owner = owner

    def alloc(self) -> str:
        path = f"{self.prefix}{self.n}"
        self.n += 1
        return path


_scope: contextvars.ContextVar[_Scope] = contextvars.ContextVar("durably_restate_scope")


class _NoBudget:
    """`ctx.budget` on Restate: budgets are not mapped, so any use says so."""

    def spent(self, kind: str) -> float:
        raise unsupported("ctx.budget", "budgets are not journaled on Restate")

    def remaining(self, kind: str) -> float:
        raise unsupported("ctx.budget", "budgets are not journaled on Restate")


class RestateWorkflowContext:
    """What a workflow sees on Restate; every durable call registers an op the pump journals."""

    def __init__(self, pump: Pump, run_id: str) -> None:
        self._pump = pump
        self._run_id = run_id
        self._slots: dict[str, int] = {}
        self.budget = _NoBudget()

    @property
    def run_id(self) -> str:
        """The id of the durable run (the Restate workflow key)."""
        return self._run_id

    @property
    def engine(self) -> NoReturn:
        """Not available on Restate: operate its runs with `durably_py.restate.RestateClient`."""
        raise unsupported("ctx.engine", "a run on Restate has no durably engine",
                          "Use durably_py.restate.RestateClient(ingress, admin) inside a step to inspect runs.")

    @property
    def scheduled_at(self) -> datetime | None:
        """None: schedules start runs on durably's own storage, not on Restate."""
        return None

    @property
    def attempt(self) -> int:
        """The workflow attempt; Restate does not expose it to the workflow, so always 1."""
        return 1

    def _scope(self) -> _Scope:
        try:
            scope = _scope.get()
        except LookupError:
            raise outside_workflow() from None
        if scope.owner is not None and scope.owner is not asyncio.current_task():
            raise foreign_strand()
        return scope

    # ---- steps ------------------------------------------------------------------------------------------
    def step(self, fn: Callable[..., Any], /, *args: Any, name: str | None = None, retry: Any = None,
             timeout: float | None = None, compensate: Callable[[Any], Any] | None = None,
             concurrency_key: str | None = None, concurrency_limit: int | None = None, uses: str | None = None,
             schema: Any = None, replay: str = "safe") -> Awaitable[Any]:
        """Run `fn(*args)` once, durably, as a Restate `run` entry named `label@path`."""
        if not callable(fn):
            raise not_callable(fn)
        label = name or label_of(fn)
        opts = StepOptions(label, retry, timeout, compensate, concurrency_key, concurrency_limit, uses, schema, replay)
        if concurrency_key is not None:
            raise unsupported("concurrency_key=", "Restate has no step concurrency limits shared across runs")
        if uses is not None:
            raise unsupported("uses= (resources and rate limits)",
                              "Restate has no shared rate limits or circuit breakers across runs")
        path = self._scope().alloc()
        return StepOp(self._pump, fn, args, label, path, opts.retry, opts.timeout, opts.schema, opts.unsafe,
                      compensate, is_async_callable(fn))

    def parallel(self, items: Iterable[Any], *, concurrency: int | None = None) -> Awaitable[list[Ok[Any] | Err]]:
        """Run awaitables or zero-argument callables concurrently; one `Ok`/`Err` per item, in order."""
        items = checked_branches(items, concurrency)
        scope = self._scope()
        prefix = None if all(isinstance(item, StepOp) for item in items) else scope.alloc()

        def enter(i: int) -> None:
            _scope.set(_Scope(f"{prefix}.{i}.", asyncio.current_task()))

        return run_branches(items, concurrency, enter if prefix is not None else None)

    def loop(self, initial: Any, reducer: Callable[..., Any], *, snapshot_every: int | None = None,
             max_iterations: int | None = None) -> Awaitable[Any]:
        """Iterate `reducer(state, it)` until `it.done(value)`; on Restate every iteration stays in the journal."""
        if snapshot_every is not None:
            raise unsupported("ctx.loop(snapshot_every=)", "a Restate journal replays whole; it cannot resume "
                              "from a snapshot", "Drop snapshot_every=; the loop then replays every iteration.")
        if not inspect.iscoroutinefunction(reducer):
            raise ValidationError("ctx.loop needs an async reducer",
                                  hint="Pass `async def reducer(state, it)` returning the next state or "
                                       "it.done(value).", docs="docs/authoring.md#loops")
        path = self._scope().alloc()
        return self._loop(path, initial, reducer, max_iterations)

    async def _loop(self, path: str, state: Any, reducer: Callable[..., Any], limit: int | None) -> Any:
        from .._authoring.context import LoopDone, LoopIteration

        i = 0
        while True:
            if limit is not None and i >= limit:
                raise LoopLimitError(f"ctx.loop ran {limit} iterations without it.done()", max_iterations=limit)
            token = _scope.set(_Scope(f"{path}.{i}.", asyncio.current_task()))
            try:
                state = await reducer(state, LoopIteration(self, i))  # type: ignore[arg-type]
            finally:
                _scope.reset(token)
            if isinstance(state, LoopDone):
                return state.value
            i += 1

    # ---- children ---------------------------------------------------------------------------------------
    def spawn(self, wf: Any, input: Any = None, *, detached: bool = False) -> Awaitable[RunHandle]:
        """Start a child run of `wf` as the Restate workflow `durably.<name>`, keyed `<run id>~<path>`."""
        workflow = as_workflow(wf)
        op = SpawnOp(self._pump, self._scope().alloc(), workflow, input, detached)
        return self._handle(op, workflow)

    async def _handle(self, op: SpawnOp, workflow: Any) -> RunHandle:
        return RunHandle(await op, workflow)

    def spawn_all(self, definitions: Iterable[Any], *, detached: bool = False) -> Awaitable[list[RunHandle]]:
        """Start one child run per `(workflow, input)` pair."""
        pairs = spawn_pairs(definitions)
        prefix = self._scope().alloc()
        ops = [(SpawnOp(self._pump, f"{prefix}.{i}", wf, value, detached), wf) for i, (wf, value) in enumerate(pairs)]
        return self._handles(ops)

    async def _handles(self, ops: list[tuple[SpawnOp, Any]]) -> list[RunHandle]:
        return [RunHandle(await op, wf) for op, wf in ops]

    def join(self, handle: RunHandle) -> Awaitable[Any]:
        """Wait for a child run to end; return its result or raise its error."""
        check_handle(handle)
        return JoinOp(self._pump, self._scope().alloc(), handle.run_id)

    def join_all(self, handles: Iterable[RunHandle]) -> Awaitable[list[Ok[Any] | Err]]:
        """Wait for every child run; one `Ok`/`Err` per handle, in order."""
        return self.parallel([lambda h=h: self.join(h) for h in handles])

    def graph(self, tasks: Mapping[str, Any]) -> Awaitable[dict[str, Ok[Any] | Err]]:
        """Not available on Restate."""
        raise unsupported("ctx.graph", "task graphs are not mapped to Restate yet",
                          "Spawn the tasks with ctx.spawn and join them in dependency order.")

    # ---- parking ----------------------------------------------------------------------------------------
    def sleep(self, seconds: float) -> Awaitable[None]:
        """Wait `seconds` on a Restate durable timer (no process is held meanwhile)."""
        if seconds != 0:
            check_timeout(seconds, "ctx.sleep seconds")
        return SleepOp(self._pump, self._scope().alloc(), float(seconds))

    def sleep_until(self, when: datetime) -> Awaitable[None]:
        """Wait durably until `when` (timezone-aware), measured from the journaled `ctx.now()`."""
        check_wake_time(when)
        seconds = (when - self.now()).total_seconds()
        return SleepOp(self._pump, self._scope().alloc(), max(seconds, 0.0))

    def wait_for(self, name: str, schema: Any = None, *, timeout: float | None = None) -> Awaitable[Any]:
        """Park until signal `name` arrives and return its payload; `WaitTimeoutError` after `timeout` seconds."""
        check_signal_name(name)
        timeout = check_timeout(timeout, "wait_for timeout=")
        compiled = compile_schema(schema, f"schema of wait_for({name!r})")
        path = self._scope().alloc()
        slot = self._slots[name] = self._slots.get(name, -1) + 1
        return WaitOp(self._pump, path, name, slot, timeout, compiled)

    # ---- recorded values --------------------------------------------------------------------------------
    async def first(self, *operations: Awaitable[Any], **named: Awaitable[Any]) -> First:
        """Race durable operations; the first to complete wins (Restate journals which). The losers are left
        pending rather than cancelled: Restate cannot take back a journaled step, timer or promise."""
        return await first_of(operations, named, cancel_losers=False)

    def now(self) -> datetime:
        """The current time, journaled as a `run` entry (replay returns the same instant)."""
        path = self._scope().alloc()
        return datetime.fromtimestamp(self._pump.now(f"ctx.now@{path}"), UTC)

    def random(self) -> float:
        """A random float in [0, 1) from the invocation's seeded generator (stable across replays)."""
        return self._pump.random.random()

    def uuid(self) -> str:
        """A random UUID4 string from the invocation's seeded generator."""
        return new_uuid(self._pump.random)

    def patched(self, change: str) -> bool:
        """Not available on Restate: version a Restate service by registering a new deployment."""
        raise unsupported(f"ctx.patched({change!r})", "an invocation recorded before the change replays its whole "
                          "journal, which has no entry for the answer", hint=PATCH_HINT)

    def deprecate_patch(self, change: str) -> None:
        """Not available on Restate (see `patched`)."""
        raise unsupported(f"ctx.deprecate_patch({change!r})", "Restate journals have no patch answers",
                          hint=PATCH_HINT)

    def log(self, *values: Any, **print_kwargs: Any) -> None:
        """print() to stderr (stdout stays for results), only when live, never while it replays its journal."""
        if not self._pump.replaying:
            print_kwargs.setdefault("file", sys.stderr)
            print(*values, **print_kwargs)

    def complete(self, value: Any = None) -> NoReturn:
        """End the workflow now with `value`."""
        raise Complete(value)

    def charge(self, *, usd: float = 0, tokens: float = 0, units: float = 0) -> None:
        """Not available on Restate."""
        raise unsupported("ctx.charge (budgets)", "budgets are not journaled on Restate")

    def annotate(self, **values: Any) -> None:
        """Not available on Restate."""
        raise unsupported("ctx.annotate", "run annotations are not stored on Restate")


def enter_root(pump: Pump) -> None:
    """Give the workflow body its root path scope (called inside the body's task)."""
    _scope.set(_Scope("", asyncio.current_task()))


async def run_body(pump: Pump, ctx: RestateWorkflowContext, workflow: Any, input: Any) -> tuple[str, Any]:
    """The workflow body on its thread: its result wire, or its error after the compensations ran."""
    from .._codec import dump_error, dump_value

    enter_root(pump)
    try:
        try:
            result = await workflow(ctx, input)
        except Complete as done:
            result = done.value
        schema = workflow.output_schema
        wire = dump_value(schema.to_builtins(result) if schema else result, "result")
        if schema is not None:
            from .._codec import load_value
            schema.convert(load_value(wire), "result")
        return "ok", wire
    except Exception as exc:  # noqa: BLE001 - the run's failure is its outcome
        await _compensate(ctx, exc)
        return "err", (exc, dump_error(exc))


async def _compensate(ctx: RestateWorkflowContext, error: BaseException) -> None:
    """Each completed step's compensation, newest first, as a journaled step of its own."""
    for i, (fn, value, label, path) in enumerate(reversed(ctx._pump.compensations)):
        _scope.set(_Scope(f"comp.{i}.", asyncio.current_task()))
        try:
            await ctx.step(fn, value, name=f"compensate {label}")
        except Exception as exc:  # noqa: BLE001 - reported; the others still run
            error.add_note(f"compensation of step {label!r} at {path} failed: {type(exc).__name__}: {exc}")
