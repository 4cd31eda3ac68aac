"""`ctx` for a workflow running on Restate: the shared `WorkflowContext` over `RestateKernel`, the `Kernel` that
backs every durable call with an op the invocation's pump journals."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

from .._authoring.awakeables import Awakeable, check_name
from .._authoring.branches import checked_branches, run_branches, strand_scope
from .._authoring.calls import (
    Complete,
    LoopDone,
    RunHandle,
    check_handle,
    check_signal_name,
    check_wake_time,
    is_async_callable,
    label_of,
    not_callable,
    spawn_pairs,
    step_options,
)
from .._authoring.context import Kernel, WorkflowContext
from .._authoring.paths import Scope, current_scope
from .._authoring.policies import check_timeout
from .._authoring.schema import compile_schema
from .._authoring.transactions import ALTERNATIVE
from .._authoring.workflow import as_workflow
from .._codec import dump_error, dump_value, load_value
from ..errors import LoopLimitError, ValidationError
from .runtime import AwaitOp, AwakeOp, JoinOp, Pump, SleepOp, SpawnOp, StepOp, WaitOp, new_uuid
from .unsupported import unsupported

PATCH_HINT = ("Register the changed code as a new Restate deployment: invocations already running stay on the "
              "deployment that started them, new ones take the new code (docs/restate.md#what-does-not-map).")
NO_BUDGETS = "budgets are not journaled on Restate"
NO_PARTIALS = ("Restate journals a step's result only, with nowhere to keep the chunks it streams while it runs "
               "(stream partials)")


class _Header:
    scheduled_at: str | None = None  # schedules start runs on durably's own storage, not on Restate


class _History:
    """What `ctx` reads of a run's history on Restate."""

    attempt = 1  # Restate does not tell a workflow its attempt
    header = _Header()


class _Outcome:
    """The outcome of a Restate awakeable: its `AwaitOp`, registered the first time it is awaited."""

    def __init__(self, pump: Pump, made: AwakeOp, awakeable: str, schema: Any) -> None:
        self.pump, self.made, self.awakeable, self.schema = pump, made, awakeable, schema
        self.op: AwaitOp | None = None

    def __await__(self) -> Any:
        if self.op is None:
            self.op = AwaitOp(self.pump, self.made, self.awakeable, self.schema)
        return self.op.__await__()


class RestateKernel:
    """The `Kernel` of one Restate invocation: each durable call registers an op the pump journals; the
    features Restate does not map raise their `NotSupportedError` here."""

    cancels_losers = False  # Restate cannot take back a journaled step, timer or promise: losers stay pending
    history = _History()

    def __init__(self, pump: Pump, run_id: str) -> None:
        self._pump = pump
        self.run_id = run_id
        self._slots: dict[str, int] = {}

    @property
    def engine(self) -> NoReturn:
        raise unsupported("ctx.engine", "a run on Restate has no durably engine",
                          "Use durably_py.restate.RestateClient(ingress, admin) inside a step to inspect runs.")

    @property
    def budget(self) -> NoReturn:
        raise unsupported("ctx.budget", NO_BUDGETS)

    @property
    def spent(self) -> NoReturn:
        raise unsupported("ctx.budget", NO_BUDGETS)

    def scope(self) -> Scope:
        """The calling strand's scope; paths may only be allocated by the task that owns it."""
        return strand_scope()

    # ---- steps ------------------------------------------------------------------------------------------
    def step(self, fn: Callable[..., Any], /, *args: Any, **options: Any) -> Any:
        """`ctx.step`: one Restate `run` entry per attempt, named `label@path` (a `StepOp` to await)."""
        if not callable(fn):
            raise not_callable(fn)
        name, opts = step_options(fn, **options)
        if opts.keep_partials or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            raise unsupported("streamed steps (a generator step, keep_partials=)", NO_PARTIALS)
        if opts.reserve is not None or opts.charge not in (None, False):
            raise unsupported("reserve= and charge= (budgets)", NO_BUDGETS,
                              "Leave them out on Restate: a step's result is not metered there.")
        if opts.concurrency_key is not None:
            raise unsupported("concurrency_key=", "Restate has no step concurrency limits shared across runs")
        if opts.uses is not None:
            raise unsupported("uses= (resources and rate limits)",
                              "Restate has no shared rate limits or circuit breakers across runs")
        if opts.on_interrupt == "attention":
            raise unsupported("on_interrupt='attention' (a run that needs an operator's attention)",
                              "Restate keeps no operator decisions about a cut-off step: there a cut-off "
                              "replay='manual' step raises StepInterruptedError, as on_interrupt='raise' does")
        label = name or label_of(fn)
        return StepOp(self._pump, self, fn, args, label, self.scope().alloc(), opts.retry, opts.timeout, opts.schema,
                      opts.unsafe, opts.compensate, is_async_callable(fn))

    def parallel(self, items: list[Any], concurrency: int | None) -> Any:
        """`ctx.parallel`: the branches run under ``<path>.<i>.`` (steps already allocated keep their paths)."""
        items = checked_branches(items, concurrency)
        scope = self.scope()
        prefix = None if all(isinstance(item, StepOp) for item in items) else scope.alloc()

        def enter(i: int) -> None:
            current_scope.set(Scope(f"{prefix}.{i}.", asyncio.current_task()))

        return run_branches(items, concurrency, enter if prefix is not None else None)

    def loop(self, initial: Any, reducer: Callable[..., Any], snapshot_every: int | None,
             max_iterations: int | None) -> Any:
        """`ctx.loop`: every iteration stays in the journal (a Restate journal replays whole)."""
        if snapshot_every is not None:
            raise unsupported("ctx.loop(snapshot_every=)", "a Restate journal replays whole; it cannot resume "
                              "from a snapshot", "Drop snapshot_every=; the loop then replays every iteration.")
        if not inspect.iscoroutinefunction(reducer):
            raise ValidationError("ctx.loop needs an async reducer",
                                  hint="Pass `async def reducer(state, it)` returning the next state or "
                                       "it.done(value).", docs="docs/authoring.md#loops")
        return self._loop(self.scope().alloc(), initial, reducer, max_iterations)

    async def _loop(self, path: str, state: Any, reducer: Callable[..., Any], limit: int | None) -> Any:
        i = 0
        while True:
            if limit is not None and i >= limit:
                raise LoopLimitError(f"ctx.loop ran {limit} iterations without it.done()", max_iterations=limit)
            token = current_scope.set(Scope(f"{path}.{i}.", asyncio.current_task()))
            try:
                state = await reducer(state, i)
            finally:
                current_scope.reset(token)
            if isinstance(state, LoopDone):
                return state.value
            i += 1

    # ---- children ---------------------------------------------------------------------------------------
    def spawn(self, wf: Any, input: Any, detached: bool) -> Any:
        """`ctx.spawn`: the Restate workflow `durably.<name>`, keyed `<run id>~<path>`."""
        workflow = as_workflow(wf)
        return self._handle(SpawnOp(self._pump, self.scope().alloc(), workflow, input, detached), workflow)

    async def _handle(self, op: SpawnOp, workflow: Any) -> RunHandle:
        return RunHandle(await op, workflow)

    def spawn_all(self, definitions: list[Any], detached: bool) -> Any:
        """`ctx.spawn_all`: one child per pair, at ``<path>.<i>``."""
        pairs = spawn_pairs(definitions)
        prefix = self.scope().alloc()
        return self._handles([(SpawnOp(self._pump, f"{prefix}.{i}", wf, value, detached), wf)
                              for i, (wf, value) in enumerate(pairs)])

    async def _handles(self, ops: list[tuple[SpawnOp, Any]]) -> list[RunHandle]:
        return [RunHandle(await op, wf) for op, wf in ops]

    def join(self, handle: RunHandle) -> Any:
        """`ctx.join`: the outcome of the call the spawn made."""
        check_handle(handle)
        return JoinOp(self._pump, self.scope().alloc(), handle.run_id)

    def join_all(self, handles: list[RunHandle]) -> Any:
        """`ctx.join_all`: a join per handle, as branches of one `ctx.parallel`."""
        return self.parallel([lambda h=h: self.join(h) for h in handles], None)

    def graph(self, tasks: Mapping[str, Any]) -> NoReturn:
        raise unsupported("ctx.graph", "task graphs are not mapped to Restate yet",
                          "Spawn the tasks with ctx.spawn and join them in dependency order.")

    # ---- parking ----------------------------------------------------------------------------------------
    def sleep(self, seconds: float) -> Any:
        """`ctx.sleep`: a Restate durable timer (no process is held meanwhile)."""
        return SleepOp(self._pump, self.scope().alloc(), float(seconds))

    def sleep_until(self, when: datetime) -> Any:
        """`ctx.sleep_until`: a durable timer measured from the journaled `ctx.now()`."""
        check_wake_time(when)
        seconds = (when - self.now()).total_seconds()
        return SleepOp(self._pump, self.scope().alloc(), max(seconds, 0.0))

    def wait_for(self, name: str, schema: Any, timeout: float | None) -> Any:
        """`ctx.wait_for`: the next free slot of the workflow's durable promises for `name`."""
        check_signal_name(name)
        timeout = check_timeout(timeout, "wait_for timeout=")
        compiled = compile_schema(schema, f"schema of wait_for({name!r})")
        path = self.scope().alloc()
        slot = self._slots[name] = self._slots.get(name, -1) + 1
        return WaitOp(self._pump, path, name, slot, timeout, compiled)

    async def awakeable(self, timeout: float | None, schema: Any, name: str | None) -> Awakeable[Any]:
        """`ctx.awakeable`: a Restate awakeable. Its id is Restate's: resolve it with `RestateClient.resolve_awakeable`
        (`durably resolve-awakeable ID JSON --restate URL`) or Restate's own `POST
        /restate/awakeables/{id}/resolve`; `url` is None (Restate's ingress is the callback)."""
        timeout = check_timeout(timeout, "ctx.awakeable timeout=")
        name = check_name(name)
        compiled = compile_schema(schema, "schema of ctx.awakeable")
        path = self.scope().alloc()
        deadline = None
        if timeout is not None:
            deadline = datetime.fromtimestamp(self._pump.now(f"ctx.awakeable@{path}:now"), UTC) + \
                timedelta(seconds=timeout)
        made = AwakeOp(self._pump, path, timeout)
        awakeable_id = await made
        return Awakeable(awakeable_id, None, deadline, name, _Outcome(self._pump, made, awakeable_id, compiled))

    # ---- recorded values --------------------------------------------------------------------------------
    def now(self) -> datetime:
        """The current time, journaled as a `run` entry."""
        return datetime.fromtimestamp(self._pump.now(f"ctx.now@{self.scope().alloc()}"), UTC)

    def random(self) -> float:
        """From the invocation's seeded generator (stable across replays)."""
        return self._pump.random.random()

    def uuid(self) -> str:
        return new_uuid(self._pump.random)

    def patched(self, change: str, deprecated: bool = False) -> NoReturn:
        if deprecated:
            raise unsupported(f"ctx.deprecate_patch({change!r})", "Restate journals have no patch answers",
                              hint=PATCH_HINT)
        raise unsupported(f"ctx.patched({change!r})", "an invocation recorded before the change replays its whole "
                          "journal, which has no entry for the answer", hint=PATCH_HINT)

    def replaying(self) -> bool:
        """True while the invocation replays its journal."""
        return self._pump.replaying

    def charge(self, amounts: dict[str, float]) -> NoReturn:
        raise unsupported("ctx.charge (budgets)", NO_BUDGETS)

    def annotate(self, values: dict[str, Any]) -> NoReturn:
        raise unsupported("ctx.annotate", "run annotations are not stored on Restate")

    def stream(self, path: str) -> NoReturn:
        raise unsupported("attempt().emit() and attempt().partials (streamed steps)", NO_PARTIALS)

    def transaction(self, fn: Callable[..., Any], /, *args: Any, **options: Any) -> NoReturn:
        raise unsupported("ctx.transaction", "a Restate journal is not in the application's database, so a write "
                          "and the step's record cannot commit together", hint=ALTERNATIVE)

    def stash(self, path: str, value: Any) -> NoReturn:
        raise unsupported("attempt().stash()", "a step cannot journal progress inside itself on Restate",
                          "Split the work into smaller steps, or keep progress in your own store keyed by "
                          "attempt().operation_id.")


class RestateWorkflowContext(WorkflowContext):
    """`ctx` on Restate: the shared `WorkflowContext` over the invocation's `RestateKernel`."""

    # the features Restate does not map need no invocation: a context made without one still refuses them
    _kernel: Kernel = RestateKernel.__new__(RestateKernel)

    def __init__(self, pump: Pump, run_id: str) -> None:
        super().__init__(RestateKernel(pump, run_id))


async def run_body(pump: Pump, ctx: WorkflowContext, workflow: Any, input: Any) -> tuple[str, Any]:
    """The workflow body on its thread: its result wire, or its error after the compensations ran."""
    current_scope.set(Scope("", asyncio.current_task()))
    try:
        try:
            result = await workflow(ctx, input)
        except Complete as done:
            result = done.value
        schema = workflow.output_schema
        wire = dump_value(schema.to_builtins(result) if schema else result, "result")
        if schema is not None:
            schema.convert(load_value(wire), "result")
        return "ok", wire
    except Exception as exc:  # noqa: BLE001 - the run's failure is its outcome
        await _compensate(pump, ctx, exc)
        return "err", (exc, dump_error(exc))


async def _compensate(pump: Pump, ctx: WorkflowContext, error: BaseException) -> None:
    """Each completed step's compensation, newest first, as a journaled step of its own."""
    for i, (fn, value, label, path) in enumerate(reversed(pump.compensations)):
        current_scope.set(Scope(f"comp.{i}.", asyncio.current_task()))
        try:
            await ctx.step(fn, value, name=f"compensate {label}")
        except Exception as exc:  # noqa: BLE001 - reported; the others still run
            error.add_note(f"compensation of step {label!r} at {path} failed: {type(exc).__name__}: {exc}")
