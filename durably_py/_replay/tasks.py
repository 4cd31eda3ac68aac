"""The tasks of a run: which task is running (cheaply, on the hot path), and the task factory a run's loop
gets so that the tasks a workflow creates are its run's."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
from collections.abc import Callable
from types import CoroutineType
from typing import Any

from .._authoring.calls import current_attempt
from .._authoring.handles import Handle
from .turns import current_turns, guarded

INTERNAL = contextvars.Context()  # the context of the kernel's own tasks (none of the workflow's)


def make_task(loop: asyncio.AbstractEventLoop, coro: Any, previous: Callable[..., Any] | None,
              **kwargs: Any) -> Any:
    """The task factory workflows' loops get (`turns.install_factory`): `asyncio.create_task(handle)` (and a
    `TaskGroup`'s) starts the handle and returns it; a task the workflow creates is one of its run's."""
    if isinstance(coro, Handle):
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


def internal(coro: Any) -> asyncio.Task[Any]:
    """A task of the kernel's own (a pause loop, a timer): not one of the workflow's tasks."""
    return asyncio.get_running_loop().create_task(coro, context=INTERNAL.copy())
