"""One Restate invocation of a durably workflow: the workflow thread, its durable operations, and the pump.

Restate identifies a journal entry by its position, so every command must be created in the same order on
every replay. durably branches run concurrently, and the SDK serves every await from one input queue, so
neither "each branch awaits the SDK" nor "commands are created whenever a branch gets there" replays safely.

The design here needs no event-loop or SDK internals:

* The workflow's own code (the body and its `ctx.parallel` branches) runs on a private event loop in a
  thread of its own. Its selector tells us when that loop has nothing left to run (`select(None)`: no ready
  callback, no timer): every branch is blocked on a durable operation. That is exact quiescence, observed
  through the selector interface `asyncio.SelectorEventLoop` takes as an argument.
* Workflow code never touches the SDK. `ctx.step`, `ctx.sleep`, ... register an `Op`; at quiescence the
  pump (the handler's coroutine, the only code that awaits the SDK) creates the commands of every newly
  registered op in registration order. The workflow thread is deterministic between deliveries, so that
  order is the same on every replay.
* When one SDK future is outstanding, its completion is the only possible next event. When several are,
  the pump waits for any, journals which ones it resumes in a `durably:sched` run entry, and delivers
  exactly those; a replay reads the recorded choice instead of racing.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import selectors
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from datetime import timedelta
from random import Random
from typing import TYPE_CHECKING, Any

import restate
from restate import RunOptions, TerminalError
from restate.serde import Serde

from .._authoring.calls import NOT_RETRYABLE, current_attempt
from .._authoring.context import AttemptContext, Kernel
from .._codec import decode, dump_error, dump_value, encode, load_error, load_value
from .._threads import DaemonPool
from ..errors import (
    AwakeableRejectedError,
    AwakeableTimeoutError,
    PurityError,
    StepInterruptedError,
    StepTimeoutError,
    WaitTimeoutError,
)

if TYPE_CHECKING:
    from .._authoring.workflow import Workflow

SCHED = "durably:sched"
TOMBSTONE = {"$durably": "timed-out"}
ERROR_KEY = "durably-error"
_POOL = DaemonPool(name="durably-restate-step")


class JsonSerde(Serde[Any]):
    """JSON bytes of durably wire values (the codec's tagged datetimes stay tagged)."""

    def serialize(self, obj: Any) -> bytes:
        return encode(obj)

    def deserialize(self, buf: bytes) -> Any:
        return decode(buf) if buf else None


WIRE = JsonSerde()
_RUN = RunOptions(serde=WIRE)


def failure_of(error: BaseException) -> TerminalError:
    """The terminal failure that carries a durably error out of an invocation, class and all."""
    data = dump_error(error)
    return TerminalError(f"{type(error).__name__}: {data['message']}", 500,
                         metadata={ERROR_KEY: encode(data).decode()})


def error_of(failure: TerminalError) -> BaseException:
    """Rebuild the durably error a child's failure carries (or describe a plain Restate failure)."""
    meta = failure.metadata or {}
    if ERROR_KEY in meta:
        return load_error(decode(meta[ERROR_KEY]))
    if failure.status_code == 409:
        from ..errors import RunCancelledError
        return RunCancelledError(f"the child run was cancelled ({failure.message})")
    return RuntimeError(f"[{failure.status_code}] {failure.message}")


# ---- operations (registered by workflow code, driven by the pump) ----------------------------------------


class Op:
    """One durable operation: created on the workflow thread, given Restate commands by the pump."""

    __slots__ = ("id", "name", "future", "futs", "pump")

    def __init__(self, pump: Pump, name: str) -> None:
        self.pump = pump
        self.name = name
        self.id = pump.register(self)
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.futs: list[Any] = []

    def __await__(self) -> Any:
        return self.future.__await__()

    def start(self) -> None:
        """Create this op's first Restate command(s) (called by the pump, on the handler's loop)."""
        raise NotImplementedError

    async def advance(self, index: int, fut: Any) -> None:
        """React to the completion of `self.futs[index]`: settle, or create the next command."""
        raise NotImplementedError


class StepOp(Op):
    """`ctx.step`: one `run` entry per attempt (the outcome is its value), durable backoff sleeps between."""

    __slots__ = ("kernel", "fn", "args", "label", "path", "retry", "timeout", "schema", "unsafe", "compensate",
                 "number", "marker_live", "is_async", "first")

    def __init__(self, pump: Pump, kernel: Kernel, fn: Callable[..., Any], args: tuple[Any, ...], label: str,
                 path: str, retry: Any, timeout: float | None, schema: Any, unsafe: bool, compensate: Any,
                 is_async: bool) -> None:
        super().__init__(pump, f"{label}@{path}")
        self.kernel = kernel  # whose `attempt()` each attempt is
        self.fn, self.args, self.label, self.path = fn, args, label, path
        self.retry, self.timeout, self.schema, self.unsafe = retry, timeout, schema, unsafe
        self.compensate = compensate
        self.is_async = is_async
        self.number = 1
        self.marker_live = False
        self.first: float | None = None  # when the first attempt started (journaled), for Retry(deadline=)

    def start(self) -> None:
        self._attempt_commands()

    def _attempt_commands(self) -> None:
        rctx = self.pump.rctx
        if self.unsafe:
            self.marker_live = False
            self.futs = [rctx.run_typed(f"{self.name}#start{self.number}", self._mark, _RUN)]
        else:
            self.futs = [rctx.run_typed(self._attempt_name(), self._run_attempt, _RUN)]

    def _attempt_name(self) -> str:
        return self.name if self.number == 1 else f"{self.name}#{self.number}"

    def _mark(self) -> bool:
        self.marker_live = True
        return True

    async def advance(self, index: int, fut: Any) -> None:
        outcome = await fut
        if outcome is None:  # a backoff sleep ended
            self._attempt_commands()
            return
        if isinstance(outcome, bool):  # the replay="unsafe" start marker
            self.futs = [self.pump.rctx.run_typed(self._attempt_name(), self._run_attempt, _RUN)]
            return
        if "ok" in outcome:
            try:
                value = load_value(outcome["ok"])
                if self.schema is not None:
                    value = self.schema.convert(value, "output")
            except Exception as exc:  # noqa: BLE001 - the step's result no longer fits its schema
                self.pump.settle(self, error=exc)
                return
            self.pump.settle(self, value=value)
            return
        error = load_error(outcome["err"])
        retry = self.retry
        if self.first is None:
            self.first = outcome.get("at")
        if retry is None or outcome.get("final") or retry.gives_up(self.number, error) \
                or isinstance(error, NOT_RETRYABLE):
            self.pump.settle(self, error=error)
            return
        delay = retry.delay(self.number, self.pump.jitter if retry.jitter else None)
        if retry.deadline is not None and self.first is not None and "at" in outcome:
            if outcome["at"] + outcome.get("ms", 0) / 1000 + delay > self.first + retry.deadline:
                error.add_note(f"step {self.label!r} gave up after attempt {self.number}: its Retry(deadline="
                               f"{retry.deadline:g}) ends before another attempt could start")
                self.pump.settle(self, error=error)
                return
        self.number += 1
        if delay > 0:
            self.futs = [self.pump.rctx.sleep(timedelta(seconds=delay), name=f"backoff {self.name}#{self.number}")]
        else:
            self._attempt_commands()

    async def _run_attempt(self) -> dict[str, Any]:
        if self.unsafe and not self.marker_live:
            error = StepInterruptedError(
                f"step {self.label!r} at path {self.path} started in an earlier process and never finished",
                path=[int(p) if p.isdigit() else p for p in self.path.split(".")], label=self.label,
                operation_id=f"{self.pump.run_id}/{self.path}")
            return {"err": dump_error(error)}
        att = AttemptContext(self.kernel, self.path, self.number, None)
        att.label = self.label
        token = current_attempt.set(att)
        started = time.perf_counter()
        at = time.time()
        try:
            if self.timeout is None:
                value = await self._invoke()
            else:
                try:
                    async with asyncio.timeout(self.timeout) as cm:
                        value = await self._invoke()
                except TimeoutError:
                    if not cm.expired():
                        raise
                    att.cancel()
                    raise StepTimeoutError(
                        f"step {self.label!r} timed out after {self.timeout:g}s (attempt {self.number})",
                        path=self.path.split("."), label=self.label, timeout=self.timeout) from None
            wire = dump_value(value if self.schema is None else self.schema.to_builtins(value), "output")
            if self.schema is not None:
                self.schema.convert(load_value(wire), "output")
            return {"ok": wire, "ms": (time.perf_counter() - started) * 1000}
        except Exception as exc:  # noqa: BLE001 - a failed attempt is the value of its journal entry
            failed = {"err": dump_error(exc), "ms": (time.perf_counter() - started) * 1000, "at": at}
            if self._final(exc):
                failed["final"] = True
            return failed
        finally:
            current_attempt.reset(token)

    def _final(self, error: Exception) -> bool:
        """True for an error no retry may follow, told by its live class (a recorded one may not rebuild):
        durably's non-retryable errors, the policy's `give_up_on`, and Restate's own `TerminalError`."""
        if isinstance(error, (*NOT_RETRYABLE, TerminalError)):
            return True
        return self.retry is not None and bool(self.retry.give_up_on) and isinstance(error, self.retry.give_up_on)

    async def _invoke(self) -> Any:
        if self.is_async:
            value = self.fn(*self.args)
        else:
            loop = asyncio.get_running_loop()
            value = await loop.run_in_executor(_POOL, contextvars.copy_context().run, self.fn, *self.args)
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        return value


class SleepOp(Op):
    """`ctx.sleep`: a Restate durable timer."""

    __slots__ = ("seconds",)

    def __init__(self, pump: Pump, path: str, seconds: float) -> None:
        super().__init__(pump, f"ctx.sleep@{path}")
        self.seconds = seconds

    def start(self) -> None:
        self.futs = [self.pump.rctx.sleep(timedelta(seconds=max(self.seconds, 0)), name=self.name)]

    async def advance(self, index: int, fut: Any) -> None:
        await fut
        self.pump.settle(self, value=None)


class WaitOp(Op):
    """`ctx.wait_for`: the k-th wait for a name reads the workflow's durable promise `signal:<name>:<k>`.

    `signal` fills the lowest free slot, so signals queue oldest first. A deadline is a durable timer that
    races the promise; if it wins, the wait resolves its own slot with a tombstone, and if a signal filled the
    slot first, that signal is the answer after all."""

    __slots__ = ("signal", "slot", "timeout", "schema", "path", "phase")

    def __init__(self, pump: Pump, path: str, signal: str, slot: int, timeout: float | None, schema: Any) -> None:
        super().__init__(pump, f"ctx.wait_for@{path}")
        self.signal, self.slot, self.timeout, self.schema, self.path = signal, slot, timeout, schema, path
        self.phase = "wait"

    def promise(self) -> Any:
        return self.pump.rctx.promise(f"signal:{self.signal}:{self.slot}", serde=WIRE)

    def start(self) -> None:
        self.futs = [self.promise().value()]
        if self.timeout is not None:
            self.futs.append(self.pump.rctx.sleep(timedelta(seconds=self.timeout), name=f"deadline {self.name}"))

    async def advance(self, index: int, fut: Any) -> None:
        if self.phase == "wait" and index == 0 or self.phase == "reread":
            self._deliver(await fut)
            return
        if self.phase == "wait":  # the deadline won the race: claim the slot
            await fut
            self.phase = "claim"
            self.futs = [self.promise().resolve(TOMBSTONE)]
            return
        try:
            await fut
        except TerminalError:  # a signal filled the slot first
            self.phase = "reread"
            self.futs = [self.promise().value()]
            return
        self.pump.settle(self, error=WaitTimeoutError(
            f"no signal {self.signal!r} arrived within {self.timeout or 0:g}s", name=self.signal,
            path=self.path.split(".")))

    def _deliver(self, box: Any) -> None:
        try:
            value = load_value(box["v"])
            if self.schema is not None:
                value = self.schema.convert(value, f"signal {self.signal!r}")
        except Exception as exc:  # noqa: BLE001 - a payload that does not fit the schema fails the wait
            self.pump.settle(self, error=exc)
            return
        self.pump.settle(self, value=value)


class AwakeOp(Op):
    """`ctx.awakeable`: a Restate awakeable (and, with a timeout, the durable timer of its deadline), created
    in journal order; the op settles at once with Restate's awakeable id, and `AwaitOp` waits for the outcome."""

    __slots__ = ("path", "timeout", "promise", "timer")

    def __init__(self, pump: Pump, path: str, timeout: float | None) -> None:
        super().__init__(pump, f"ctx.awakeable@{path}")
        self.path, self.timeout = path, timeout
        self.promise: Any = None
        self.timer: Any = None

    def start(self) -> None:
        awakeable_id, self.promise = self.pump.rctx.awakeable(serde=WIRE)
        if self.timeout is not None:
            self.timer = self.pump.rctx.sleep(timedelta(seconds=self.timeout), name=f"deadline {self.name}")
        self.pump.settle(self, value=awakeable_id)


class AwaitOp(Op):
    """Awaiting a Restate awakeable (`AwakeOp`): its resolution, its rejection (`AwakeableRejectedError`), or
    its deadline first (`AwakeableTimeoutError`)."""

    __slots__ = ("made", "awakeable", "schema")

    def __init__(self, pump: Pump, made: AwakeOp, awakeable: str, schema: Any) -> None:
        super().__init__(pump, f"await {made.name}")
        self.made, self.awakeable, self.schema = made, awakeable, schema

    def start(self) -> None:
        self.futs = [self.made.promise] + ([self.made.timer] if self.made.timer is not None else [])

    async def advance(self, index: int, fut: Any) -> None:
        if index == 1:
            await fut
            self.pump.settle(self, error=AwakeableTimeoutError(
                f"awakeable {self.awakeable} was not resolved within {self.made.timeout or 0:g}s", name="",
                path=self.made.path.split("."), awakeable=self.awakeable, deadline=None))
            return
        try:
            value = load_value(await fut)
            if self.schema is not None:
                value = self.schema.convert(value, f"awakeable {self.awakeable}")
        except TerminalError as exc:
            self.pump.settle(self, error=AwakeableRejectedError(exc.message, awakeable=self.awakeable))
            return
        except Exception as exc:  # noqa: BLE001 - a value that does not fit the schema fails the await
            self.pump.settle(self, error=exc)
            return
        self.pump.settle(self, value=value)


class SpawnOp(Op):
    """`ctx.spawn`: a call to the child workflow `durably.<name>` keyed `<parent>~<path>`; join awaits it."""

    __slots__ = ("workflow", "input", "key", "detached")

    def __init__(self, pump: Pump, path: str, workflow: Workflow, input: Any, detached: bool) -> None:
        super().__init__(pump, f"ctx.spawn@{path}")
        self.workflow, self.input, self.detached = workflow, dump_value(input, "input"), detached
        self.key = f"{pump.run_id}~{path}"

    def start(self) -> None:
        service, body = f"durably.{self.workflow.name}", encode(self.input)
        if self.detached:
            self.pump.rctx.generic_send(service, "run", body, key=self.key)
        else:
            self.pump.children[self.key] = self.pump.rctx.generic_call(service, "run", body, key=self.key)
        self.pump.settle(self, value=self.key)


class JoinOp(Op):
    """`ctx.join`: the result of the call a spawn made, or its failure with the child's error class."""

    __slots__ = ("key",)

    def __init__(self, pump: Pump, path: str, key: str) -> None:
        super().__init__(pump, f"ctx.join@{path}")
        self.key = key

    def start(self) -> None:
        call = self.pump.children.get(self.key)
        if call is None:
            from .unsupported import unsupported
            self.pump.settle(self, error=unsupported(
                "ctx.join of a detached child", "a detached child is not attached to its parent's invocation",
                "Spawn it without detached=True to join it."))
            return
        self.futs = [call]

    async def advance(self, index: int, fut: Any) -> None:
        try:
            raw = await fut
        except TerminalError as failure:
            self.pump.settle(self, error=error_of(failure))
            return
        self.pump.settle(self, value=load_value(decode(raw) if raw else None))


# ---- the workflow thread ------------------------------------------------------------------------------------


class _IdleSelector(selectors.DefaultSelector):
    """The workflow loop's selector: `select(None)` means no callback is ready and no timer is due."""

    def __init__(self, on_idle: Callable[[], None]) -> None:
        super().__init__()
        self._on_idle = on_idle

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            self._on_idle()
        return super().select(timeout)


class Pump:
    """The only code that awaits the SDK for one invocation: starts ops at quiescence, delivers completions."""

    def __init__(self, rctx: Any, run_id: str) -> None:
        self.rctx = rctx
        self.run_id = run_id
        self.loop = asyncio.get_running_loop()
        rng = rctx.random()
        self.random = Random(rng.getrandbits(64))
        self.jitter = Random(rng.getrandbits(64))
        self.children: dict[str, Any] = {}
        self.compensations: list[tuple[Callable[[Any], Any], Any, str, str]] = []
        self.replaying = not restate.RestateLoggingFilter().filter(logging.makeLogRecord({}))
        self._lock = threading.Lock()
        self._registered: list[Op] = []
        self._active: list[Op] = []
        self._ready: list[tuple[Op, bool, Any]] = []
        self._next_id = 0
        self._sent = 0
        self._seen = 0
        self._idle = False
        self._wake = asyncio.Event()
        self._outcome: tuple[str, Any] | None = None
        self._closing = False
        self.wloop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[Any] | None = None

    # -- called on the workflow thread
    def register(self, op: Op) -> int:
        with self._lock:
            self._next_id += 1
            self._registered.append(op)
            return self._next_id

    def now(self, name: str) -> float:
        """A journaled `time.time()` (blocks the workflow thread; the pump is not awaiting the SDK meanwhile)."""
        future = asyncio.run_coroutine_threadsafe(self._now(name), self.loop)
        while True:
            try:
                return future.result(0.2)
            except TimeoutError:
                if self._closing:
                    raise asyncio.CancelledError() from None

    async def _now(self, name: str) -> float:
        value = await self.rctx.run_typed(name, time.time, _RUN)
        return float(value)

    def _on_idle(self) -> None:
        if not self._closing:
            gen = self._seen
            self.loop.call_soon_threadsafe(self._idle_at, gen)

    def _deliver_batch(self, batch: list[tuple[Op, bool, Any]], replaying: bool) -> None:
        self.replaying = replaying
        for op, ok, value in batch:
            if op.future.done():
                continue
            if ok:
                if isinstance(op, StepOp) and op.compensate is not None:
                    self.compensations.append((op.compensate, value, op.label, op.path))
                op.future.set_result(value)
            else:
                op.future.set_exception(value)
        self._seen += 1

    # -- called on the handler's loop
    def _idle_at(self, gen: int) -> None:
        if gen == self._sent:
            self._idle = True
            self._wake.set()

    def _finished(self, outcome: tuple[str, Any]) -> None:
        self._outcome = outcome
        self._wake.set()

    def settle(self, op: Op, *, value: Any = None, error: BaseException | None = None) -> None:
        """Mark `op` done; the workflow thread sees it with the next delivery."""
        op.futs = []
        self._ready.append((op, error is None, value if error is None else error))

    def _flush(self) -> None:
        batch, self._ready = self._ready, []
        self._active = [op for op in self._active if op.futs]
        self._sent += 1
        self._idle = False
        replaying = not restate.RestateLoggingFilter().filter(logging.makeLogRecord({}))
        assert self.wloop is not None
        self.wloop.call_soon_threadsafe(self._deliver_batch, batch, replaying)

    async def drive(self, body: Callable[[], Any]) -> tuple[str, Any]:
        """Run `body()` (a coroutine function) on the workflow thread until it ends; return its outcome."""
        ready = threading.Event()

        def thread_main() -> None:
            loop = asyncio.SelectorEventLoop(_IdleSelector(self._on_idle))
            self.wloop = loop
            asyncio.set_event_loop(loop)
            try:
                self._main = loop.create_task(body())
                self._main.add_done_callback(self._main_done)
                ready.set()
                try:
                    loop.run_until_complete(self._main)
                except BaseException:  # noqa: BLE001 - the outcome went to the pump; this only tears down
                    pass
            finally:
                self._closing = True
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()

        thread = threading.Thread(target=thread_main, name=f"durably-restate-{self.run_id}", daemon=True)
        thread.start()
        ready.wait()
        try:
            return await self._pump()
        finally:
            self._closing = True
            main, wloop = self._main, self.wloop
            if main is not None and wloop is not None and not main.done():
                wloop.call_soon_threadsafe(main.cancel)
            await asyncio.to_thread(thread.join, 5)

    def _main_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        outcome = ("crash", exc) if exc is not None else task.result()
        self.loop.call_soon_threadsafe(self._finished, outcome)

    async def _pump(self) -> tuple[str, Any]:
        while True:
            if self._outcome is None and not self._idle:
                await self._wake.wait()
                self._wake.clear()
            if self._outcome is not None:
                return self._outcome
            if not self._idle:
                continue
            with self._lock:
                new, self._registered = self._registered, []
            for op in new:
                op.start()
                if op.futs:
                    self._active.append(op)
            self._active = [op for op in self._active if op.futs]
            if self._ready:
                self._flush()
                continue
            pending = [(op, i, fut) for op in self._active for i, fut in enumerate(op.futs)]
            if not pending:
                raise failure_of(PurityError(
                    "every branch of the workflow waits on something that is not durable (an asyncio future or "
                    "task outside ctx), so nothing can wake it on Restate",
                    hint="Await only ctx calls in the workflow body; do I/O and timers inside steps.",
                    docs="docs/restate.md#how-it-works"))
            if len(pending) == 1:
                chosen = pending
                await restate.wait_completed(pending[0][2])
            else:
                done, _ = await restate.wait_completed(*(fut for _, _, fut in pending))
                done_ids = {id(f) for f in done}
                picks, seen = [], set()
                for op, i, fut in pending:
                    if id(fut) in done_ids and op.id not in seen:
                        seen.add(op.id)
                        picks.append([op.id, i])
                picks = await self.rctx.run_typed(SCHED, lambda picks=picks: picks, _RUN)
                index = {(op.id, i): (op, i, fut) for op, i, fut in pending}
                chosen = [index[(a, b)] for a, b in picks]
            for op, i, fut in chosen:
                if i < len(op.futs) and op.futs[i] is fut:
                    await op.advance(i, fut)
            if self._ready:
                self._flush()


def new_uuid(rng: Random) -> str:
    """A version-4 UUID string drawn from the invocation's seeded generator."""
    return str(uuidlib.UUID(int=rng.getrandbits(128), version=4))
