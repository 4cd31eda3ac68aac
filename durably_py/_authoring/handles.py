"""Handles: what `ctx.step`, `ctx.sleep`, `ctx.wait_for`, `ctx.spawn` and `ctx.join` return.

A handle is an `asyncio.Future` of one durable operation's outcome. Its path in the run was fixed when the
workflow called ctx; the operation starts the first time the workflow awaits the handle or hands it to
asyncio (`asyncio.wait`, `gather`, `as_completed`, `shield`, `create_task`, a `TaskGroup`), so
``h = ctx.step(a); await h`` runs `a` exactly where it ran before handles were futures. From then on it is
a future like any other: it can be awaited any number of times, gathered and then awaited again, passed to
`asyncio.wait`, and cancelled (`h.cancel()`), which is recorded like any outcome.

Awaited directly, the operation runs in the awaiting task itself (no task, no callback: the cost of a
coroutine). Observed any other way, a task of the run drives it. Either way its outcome becomes visible
only in its turn (`durably_py._replay.turns`): that is what makes races replay.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Protocol, TypeVar

from ..errors import NotDurableError

_Future = asyncio.Future
_AWAIT = asyncio.Future.__await__
_ADD = asyncio.Future.add_done_callback
_SET_EXCEPTION = asyncio.Future.set_exception
_CANCEL = asyncio.Future.cancel
set_result = asyncio.Future.set_result
"""`asyncio.Future.set_result`, bypassing nothing: a handle's result as its turn delivers it."""


T = TypeVar("T")


class Operator(Protocol):
    """What a handle asks of the kernel that made it (`kernel.RunKernel` implements it)."""

    def drive(self, handle: Handle[Any], op: Coroutine[Any, Any, Any]) -> None:
        """Run the operation `op` of `handle` in a task of the run."""

    def cancel_handle(self, handle: Handle[Any], msg: Any) -> bool:
        """The workflow cancelled `handle` before it was done: record it and stop its operation."""


class Handle(_Future[T]):
    """The outcome of one durable operation, as an `asyncio.Future` (see the module docstring)."""

    __slots__ = ("operator", "operation", "operands", "path", "label", "observed", "driver", "task_name")
    operator: Operator  # the kernel that made it
    operation: Callable[..., Coroutine[Any, Any, Any]] | None  # the operation, until it starts
    operands: tuple[Any, ...]  # the operation's arguments after the handle
    path: str  # where in the run
    label: str  # the step's name, or "ctx.sleep", "ctx.wait_for", ...
    observed: bool  # a done callback was added (someone other than a direct awaiter looks)
    driver: asyncio.Task[Any] | None  # the task the operation runs in, once it waits
    task_name: str | None  # set_name()'s, when called

    def __await__(self) -> Generator[Any, None, T]:
        op = self.operation
        if op is not None:
            self.operation = None
            return op(self, *self.operands).__await__()
        return _AWAIT(self)

    __iter__ = __await__

    def start(self) -> None:
        """Start the operation in a task of the run, if it has not started."""
        op = self.operation
        if op is not None:
            self.operation = None
            self.operator.drive(self, op(self, *self.operands))

    def add_done_callback(self, fn: Callable[[Any], object], *, context: Any = None) -> None:
        if self.label in DURABLE_WAITS and _timed(sys._getframe(1)):
            raise not_durable(self.label)
        self.start()
        self.observed = True
        _ADD(self, fn, context=context)

    def cancel(self, msg: Any = None) -> bool:
        """Cancel the operation (recorded: a replay finds it cancelled at the same point)."""
        if self.done():
            return False
        return self.operator.cancel_handle(self, msg)

    def get_name(self) -> str:
        return self.task_name or f"durably {self.label} {self.path}"

    def set_name(self, value: object) -> None:
        self.task_name = str(value)

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "done" if self.done() else \
            "pending" if self.operation is not None else "running"
        return f"<durably {self.label!r} at path {self.path} {state}>"


DURABLE_WAITS = frozenset({"ctx.sleep", "ctx.wait_for", "ctx.join", "ctx.join_all", "ctx.awakeable"})
"""Operations that wait on something outside the run (a time, a signal, a child) and may park it."""

_TIMED = frozenset({"_wait", "wait_for", "as_completed"})  # asyncio functions that take a `timeout=`


def _timed(frame: Any) -> bool:
    """Whether the caller is asyncio's `wait`, `wait_for` or `as_completed` with a timeout (plain time)."""
    code = frame.f_code
    return code.co_name in _TIMED and "asyncio" in code.co_filename and frame.f_locals.get("timeout") is not None


def not_durable(label: str) -> NotDurableError:
    """The error for a durable wait inside a plain asyncio deadline (`asyncio.timeout`, `wait_for`)."""
    return NotDurableError(
        f"{label} was awaited inside a plain asyncio deadline (asyncio.timeout, asyncio.wait_for or "
        "asyncio.wait(..., timeout=)); that deadline lives in this process only, so a park or a restart "
        "would forget it and the run would give a different answer",
        hint="Give the wait its own durable deadline: ctx.wait_for(name, timeout=...), or race it with a "
             "durable timer: `which, value = await ctx.first(signal=ctx.wait_for(name), timer=ctx.sleep(60))`.",
        docs="docs/authoring.md#asyncio-idioms")


def handle(kernel: Operator, loop: asyncio.AbstractEventLoop | None, op: Callable[..., Any], args: tuple[Any, ...],
           path: str, label: str) -> Handle[Any]:
    """A new handle for the operation `op(handle, *args)` at `path`."""
    h: Handle[Any] = Handle(loop=loop)
    h.operator = kernel
    h.operation = op
    h.operands = args
    h.path = path
    h.label = label
    h.observed = False
    h.driver = None
    h.task_name = None
    return h


def fail(h: Handle[Any], exc: BaseException, seen: bool = True) -> None:
    """Make `exc` the handle's exception; `seen`: a direct awaiter got it (nothing to log when unobserved)."""
    if h.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        _CANCEL(h)
        return
    _SET_EXCEPTION(h, exc)
    if seen and not h.observed:
        h._log_traceback = False


def cancelled(h: Handle[Any], msg: Any = None) -> None:
    """Mark the handle cancelled (its operation was stopped)."""
    if not h.done():
        _CANCEL(h, msg)


