"""Turns: the order in which durable outcomes reach a run's workflow code, the same live and on replay.

A workflow replays: after a crash, a park or a retry it runs again from the top and must take the same
path. A strand that awaits its own steps one after another sees the same values in the same order
whatever happens. A workflow that races things does not: `asyncio.wait(..., FIRST_COMPLETED)`,
`as_completed`, the first error of a `gather` or a `TaskGroup`, a task that checks another's `done()`
all see whatever completed first, and by the time a run resumes everything it raced may be ready at once.

So outcomes reach workflow code in turns:

- An outcome becomes visible (an `await` returns, a done callback runs, `done()` turns True) only while the
  rest of the run's workflow code is *quiet*: every other task of the run is blocked on something and no
  done callback of the run is still on its way. One outcome is delivered per quiet point, so whatever reacts
  to it has run (and blocked again) before the next one arrives.
- Outcomes recorded by an earlier process are delivered in the order of their records in the log; an
  outcome that happens in this process is recorded when it is delivered, after every recorded one. The log
  therefore holds the order in which the workflow saw its outcomes, written before it saw each, and a
  replay shows it the same outcomes in the same order at the same points of its code.
- A workflow that runs one strand (no task of its own, no racing) is quiet whenever it awaits, so each
  outcome is delivered at once: the cost there is a counter and a comparison per step.

A recorded outcome nobody asks for by the time the run is quiet (code that no longer reaches it) gives
up its turn; one asked for after that is delivered late, never blocking the run.

`Turns` also knows the run's tasks (the workflow body, `ctx.parallel` branches, tasks the workflow
creates, and the tasks that drive raced operations), which is what `quiet` looks at, and what a run that
parks or stops tears down (`close`) so that no internal exception ever completes a task of the user's.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

current_turns: contextvars.ContextVar[Turns | None] = contextvars.ContextVar("durably_turns", default=None)
"""The turns of the run whose workflow code is running (inherited by the tasks it creates)."""

_WAITER = "_fut_waiter"  # the future a blocked task waits on (CPython's Task, C and Python alike)
_CAN_SEE_BLOCKED = hasattr(asyncio.Task, _WAITER)


class Turns:
    """The delivery order and the tasks of one live run."""

    __slots__ = ("order", "head", "early", "passed", "tasks", "inflight", "solo", "asked", "ready", "count",
                 "scheduled", "loop", "idle", "resting", "closed", "attempt")

    tasks: dict[asyncio.Task[Any], Coroutine[Any, Any, Any]]

    def __init__(self, order: list[str], attempt: contextvars.ContextVar[Any]) -> None:
        self.order = order  # the paths of the outcomes recorded by earlier processes, in log order
        self.head = 0  # the next of them to deliver
        self.early: set[str] = set()  # recorded outcomes taken ahead of their turn (values read synchronously)
        self.passed: set[str] = set()  # recorded outcomes whose turn passed with nobody asking
        self.tasks = {}  # the run's tasks, each with the coroutine it guards (`guarded`)
        self.inflight = 0  # done callbacks of the run's tasks and deliveries not run yet
        self.solo = True  # at most one task and nothing in flight: every outcome is delivered at once
        self.asked: dict[str, asyncio.Future[None]] = {}  # recorded outcomes awaited before their turn
        self.ready: list[tuple[float, int, asyncio.Future[None]]] = []  # this process's outcomes waiting for quiet
        self.count = itertools.count()
        self.scheduled = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.idle: Callable[[], None] | None = None  # called when quiet with nothing to deliver
        self.resting = False  # a strand waits on something durable: `idle` is worth a look
        self.closed = False
        self.attempt = attempt  # `current_attempt`: tasks created inside a step are the step's, not the run's

    # ---- the run's tasks ------------------------------------------------------------------------------
    def start(self, coro: Coroutine[Any, Any, Any], context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        """A task of the run running `coro` (guarded: a tear-down ends it quietly)."""
        assert self.loop is not None
        task = self.loop.create_task(guarded(coro, self), context=context)
        self.adopt(task, coro)
        return task

    def adopt(self, task: asyncio.Task[Any], coro: Coroutine[Any, Any, Any]) -> None:
        """Count `task`, running `guarded(coro)`, as one of the run's (its end is a delivery like any other:
        see `quiet`)."""
        if self.closed or task in self.tasks:
            return
        self.tasks[task] = coro
        self.solo = len(self.tasks) <= 1 and not self.inflight
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        # The first of the task's done callbacks: the others were scheduled with it and run before `_settled`.
        self.tasks.pop(task, None)
        if not task.cancelled():
            task.exception()  # an internal stop never logs "exception was never retrieved"
        self.hop()

    def hop(self) -> None:
        """Something just scheduled callbacks of the run: it is not quiet until they ran."""
        self.inflight += 1
        self.solo = False
        assert self.loop is not None
        self.loop.call_soon(self._settled)

    def _settled(self) -> None:
        self.inflight -= 1
        if not self.inflight and len(self.tasks) <= 1:
            self.solo = True
        self.wake()

    def quiet(self, me: asyncio.Task[Any] | None = None) -> bool:
        """True when no workflow code of the run but `me` can run before something is delivered to it."""
        if self.inflight:
            return False
        if not _CAN_SEE_BLOCKED:
            return True
        for task in self.tasks:
            if task is me:
                continue
            if task.done():
                return False  # its done callbacks have not all run (`_ended` removes it first)
            waiter = getattr(task, _WAITER)
            if waiter is None or waiter.done():
                return False
        return True

    # ---- delivering -----------------------------------------------------------------------------------
    def take(self, path: str) -> None:
        """A recorded outcome at `path` was read synchronously (a recorded value, a batch of a join): its place
        in the order is taken whether or not it was its turn."""
        order, head = self.order, self.head
        if head < len(order) and order[head] == path:
            self.head = head + 1
            if self.early:
                self.skip_early()
        elif head < len(order):
            self.early.add(path)

    def skip_early(self) -> None:
        order, early = self.order, self.early
        head = self.head
        while head < len(order) and order[head] in early:
            early.discard(order[head])
            head += 1
        self.head = head

    def now(self, path: str) -> bool:
        """Whether the recorded outcome at `path` may reach the calling task now; if so its turn is taken."""
        order, head = self.order, self.head
        if head < len(order) and order[head] == path:
            if self.solo or self.quiet(asyncio.current_task()):
                self.head = head + 1
                if self.early:
                    self.skip_early()
                return True
            return False
        if path in self.passed:
            if self.solo or self.quiet(asyncio.current_task()):
                self.passed.discard(path)
                return True
        return False

    async def recorded(self, path: str) -> None:
        """Wait until the recorded outcome at `path` may reach the workflow (see the module docstring)."""
        if self.now(path):
            return
        turn = self.asked.get(path)
        if turn is None:
            assert self.loop is not None
            turn = self.asked[path] = self.loop.create_future()
        self.wake()
        await turn

    def live_now(self) -> bool:
        """Whether an outcome of this process may reach the calling task now (every recorded one did)."""
        return self.head >= len(self.order) and not self.ready and (
            self.solo or self.quiet(asyncio.current_task()))

    async def live(self, when: float) -> None:
        """Wait until an outcome of this process that happened at `when` (epoch seconds) may reach the workflow;
        of outcomes ready at the same quiet point, the earliest goes first."""
        if self.live_now():
            return
        assert self.loop is not None
        turn = self.loop.create_future()
        heapq.heappush(self.ready, (when, next(self.count), turn))
        self.wake()
        try:
            await turn
        except BaseException:
            if not turn.done():
                turn.cancel()
            raise

    def wake(self) -> None:
        """Look for a quiet point soon (deliveries, or the run's `idle` hook)."""
        if not self.scheduled and not self.closed and self.loop is not None:
            self.scheduled = True
            self.loop.call_soon(self._check)

    def _check(self) -> None:
        self.scheduled = False
        if self.closed:
            return
        if not self.quiet():
            if self.asked or self.ready or self.resting:
                self.wake()
            return
        order = self.order
        while self.head < len(order):
            path = order[self.head]
            turn = self.asked.pop(path, None)
            self.head += 1
            if self.early:
                self.skip_early()
            if turn is not None:
                if not turn.done():
                    turn.set_result(None)
                    self.hop()
                    return
                continue
            self.passed.add(path)  # nobody asked for it and nobody can before a delivery: its turn passes
        for path, turn in list(self.asked.items()):  # asked for after their turn passed
            del self.asked[path]
            self.passed.discard(path)
            if not turn.done():
                turn.set_result(None)
                self.hop()
                return
        while self.ready:
            _, _, turn = heapq.heappop(self.ready)
            if not turn.done():
                turn.set_result(None)
                self.hop()
                return
        if self.idle is not None and self.resting:
            self.idle()

    def close(self) -> list[tuple[asyncio.Task[Any], Coroutine[Any, Any, Any]]]:
        """The run stops here: nothing more is delivered; its tasks are returned for `discard`."""
        self.closed = True
        for turn in self.asked.values():
            turn.cancel()
        for _, _, turn in self.ready:
            turn.cancel()
        self.asked.clear()
        self.ready.clear()
        return list(self.tasks.items())


async def guarded(coro: Coroutine[Any, Any, Any], turns: Turns) -> Any:
    """A task of the run: `coro`, ended quietly (no result, no exception) once the run is torn down."""
    try:
        return await coro
    except BaseException:
        if turns.closed:
            return None
        raise


def discard(tasks: list[tuple[asyncio.Task[Any], Coroutine[Any, Any, Any]]]) -> None:
    """Stop tasks of a run that parked or stopped, running none of their code as if it went on: each coroutine
    is closed (`GeneratorExit` through its frames: `finally:` blocks run, nothing is awaited), then its task is
    cancelled, which its guard (`guarded`) turns into a quiet end. No internal exception completes them."""
    for task, coro in tasks:
        if task.done():
            if not task.cancelled():
                task.exception()
            continue
        try:
            coro.close()
        except BaseException:  # noqa: BLE001 - a `finally:` that awaited or raised: the run is gone all the same
            pass
        task.cancel()


def install_factory(loop: asyncio.AbstractEventLoop, make_task: Callable[..., Any]) -> None:
    """Make `loop` count the tasks a workflow creates as its run's (and accept `asyncio.create_task(handle)`),
    on top of any task factory already set; `make_task(loop, coro, previous, **kwargs)` builds each task."""
    previous = loop.get_task_factory()
    if getattr(previous, "durably", False):
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        return make_task(loop, coro, previous, **kwargs)

    factory.durably = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


# ---- plain asyncio timers of the workflow's ----------------------------------------------------------------
# A park or a crash loses what lives only in this process. The loop's scheduled timers say which of the run's
# tasks a plain asyncio timer would wake (`asyncio.sleep`, `asyncio.timeout`, `asyncio.wait_for`,
# `asyncio.wait(timeout=)`). CPython's event loops keep them in `_scheduled`; a loop that does not (uvloop)
# shows none, and a run there parks as if it had none.

def _timers(loop: asyncio.AbstractEventLoop) -> list[Any]:
    return [t for t in getattr(loop, "_scheduled", ()) if not t.cancelled()]


def _target(timer: Any) -> tuple[Any, Any]:
    """What a timer wakes: ("task", task) for `asyncio.timeout`, ("future", future) for the others we know."""
    callback = getattr(timer, "_callback", None)
    owner = getattr(callback, "__self__", None)
    if owner is not None and type(owner).__name__ == "Timeout" and hasattr(owner, "_task"):
        return "task", owner._task
    args = getattr(timer, "_args", ()) or ()
    name = getattr(callback, "__name__", "")
    if args and name in ("_set_result_unless_cancelled", "_release_waiter"):
        return "future", args[0]
    return None, None


def deadline_over(task: asyncio.Task[Any]) -> bool:
    """Whether a plain asyncio deadline (`asyncio.timeout`, `asyncio.wait_for`) would cancel `task`."""
    loop = task.get_loop()
    waiters = {id(getattr(t, _WAITER, None)) for t in asyncio.all_tasks(loop) if t is not task}
    for timer in _timers(loop):
        kind, target = _target(timer)
        if kind == "task" and (target is task or getattr(target, _WAITER, None) is task):
            return True
        if kind == "future" and timer._callback.__name__ == "_release_waiter" \
                and id(target) in waiters and _awaits(task, target):
            return True
    return False


def _awaits(task: asyncio.Task[Any], waiter: Any) -> bool:
    """Whether `task` runs inside the `asyncio.wait_for` / `asyncio.wait` whose timer releases `waiter`: the
    task's coroutine is awaited by the one waiting on `waiter` (3.11's `wait_for` wraps it in a task)."""
    for other in asyncio.all_tasks(task.get_loop()):
        if getattr(other, _WAITER, None) is waiter:
            frame: Any = other.get_coro()
            while frame is not None:
                code = getattr(frame, "cr_code", None) or getattr(frame, "gi_code", None)
                local = getattr(frame, "cr_frame", None) or getattr(frame, "gi_frame", None)
                if code is not None and code.co_name == "wait_for" and local is not None:
                    inner = local.f_locals.get("fut")
                    if inner is task:
                        return True
                frame = getattr(frame, "cr_await", None) or getattr(frame, "gi_yieldfrom", None)
    return False


def raw_timers(turns: Turns, resting: set[Any]) -> bool:
    """Whether a plain asyncio timer will wake one of the run's tasks that is not resting on a durable wait
    (`asyncio.sleep` or a deadline in workflow code): parking now would lose it."""
    waiting = {id(getattr(t, _WAITER, None)): t for t in list(turns.tasks) if t not in resting}
    for timer in _timers(turns.loop) if turns.loop is not None else ():
        kind, target = _target(timer)
        if kind == "task" and target in turns.tasks and target not in resting:
            return True
        if kind == "future" and id(target) in waiting:
            return True
    return False
