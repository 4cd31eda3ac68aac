"""Child runs executed in this process: at most `concurrency` at once, a child waiting in a join frees its slot.

A child that waits for a slot costs one small future and a queue entry; only running children have a
Task, and nothing of a child (task, coroutine, context) is kept once it ended: the future that carried its
outcome is dropped as soon as it is settled, so a parent that spawned 100,000 children holds memory for
the children running now, not for those that finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .workflow import Workflow

RunChild = Callable[[str, "Workflow | None", bool], Awaitable[Any]]


class ChildSlot:
    """The slot one running child holds; given back while every strand of it waits in a join."""

    __slots__ = ("pool", "held", "joining")

    def __init__(self, pool: ChildPool) -> None:
        self.pool = pool
        self.held = True
        self.joining = 0

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.pool.free += 1
            self.pool.pump()

    async def take(self) -> None:
        pool = self.pool
        if pool.free > 0 and not pool.waiters:
            pool.free -= 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            pool.waiters.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    pool.free += 1
                    pool.pump()
                raise
        self.held = True

    @contextlib.asynccontextmanager
    async def parked(self) -> AsyncIterator[None]:
        self.joining += 1
        if self.joining == 1:
            self.give_back()
        try:
            yield
        finally:
            self.joining -= 1
            if self.joining == 0 and not self.held:
                await self.take()


CHILD_SLOT: contextvars.ContextVar[ChildSlot | None] = contextvars.ContextVar("durably_child_slot", default=None)


class ChildPool:
    """Runs child runs of one event loop, `size` at a time; running children that want their slot back (after
    a join) go before children not started yet, so a deep fan-out finishes branches before widening."""

    def __init__(self, size: int, run: RunChild) -> None:
        self.size = size
        self.free = size
        self.run = run
        self.outcomes: dict[str, asyncio.Future[Any]] = {}
        self.pending: deque[tuple[str, Workflow | None, bool, asyncio.Future[Any]]] = deque()
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.running: dict[asyncio.Future[Any], asyncio.Task[None]] = {}

    def start(self, run_id: str, workflow: Workflow | None, rerun_failed: bool) -> asyncio.Future[Any]:
        """The future of the child's outcome; the child is queued unless it is queued or running already."""
        outcome = self.outcomes.get(run_id)
        if outcome is not None and not (rerun_failed and outcome.done() and not outcome.cancelled()
                                        and outcome.exception() is not None):
            return outcome
        outcome = asyncio.get_running_loop().create_future()
        self.outcomes[run_id] = outcome
        outcome.add_done_callback(functools.partial(self._settled, run_id))
        self.pending.append((run_id, workflow, rerun_failed, outcome))
        self.pump()
        return outcome

    def _settled(self, run_id: str, outcome: asyncio.Future[Any]) -> None:
        if self.outcomes.get(run_id) is outcome:
            del self.outcomes[run_id]
        if outcome.cancelled():
            task = self.running.pop(outcome, None)
            if task is not None:
                task.cancel()
        else:
            outcome.exception()

    def pump(self) -> None:
        """Hand free slots to running children waiting for theirs, then to queued children."""
        while self.free > 0 and (self.waiters or self.pending):
            if self.waiters:
                turn = self.waiters.popleft()
                if not turn.done():
                    self.free -= 1
                    turn.set_result(None)
                continue
            run_id, workflow, rerun_failed, outcome = self.pending.popleft()
            if outcome.done():
                continue
            self.free -= 1
            task = asyncio.get_running_loop().create_task(self._child(run_id, workflow, rerun_failed, outcome),
                                                          context=contextvars.Context())
            self.running[outcome] = task

    async def _child(self, run_id: str, workflow: Workflow | None, rerun_failed: bool,
                     outcome: asyncio.Future[Any]) -> None:
        slot = ChildSlot(self)
        CHILD_SLOT.set(slot)
        try:
            value = await self.run(run_id, workflow, rerun_failed)
        except asyncio.CancelledError:
            if not outcome.done():
                outcome.cancel()
            raise
        except BaseException as exc:  # noqa: BLE001 - the child's outcome, whatever it is, goes to its joiners
            if not outcome.done():
                outcome.set_exception(exc)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
        else:
            if not outcome.done():
                outcome.set_result(value)
        finally:
            self.running.pop(outcome, None)
            slot.give_back()


def parked_in_join() -> contextlib.AbstractAsyncContextManager[None]:
    """While the calling run waits in a join, the slot it runs in (if it is a child) is free for others."""
    slot = CHILD_SLOT.get()
    return slot.parked() if slot is not None else contextlib.nullcontext()
