"""`ctx.parallel`'s branches, the same in every mode: checking them, running them to `Ok`/`Err` results, and the
errors of a step started from a strand out of place."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

from ..errors import PurityError, ValidationError
from .paths import Scope, current_scope
from .result import Err, Ok


def checked_branches(items: Iterable[Any], concurrency: int | None) -> list[Any]:
    """The branches as a list, after checking `concurrency=` and that each is an awaitable or a callable."""
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):
        raise ValidationError(f"ctx.parallel concurrency= must be an int >= 1, got {concurrency!r}",
                              hint="Omit concurrency= to run every branch at once.",
                              docs="docs/authoring.md#parallel")
    items = list(items)
    for i, item in enumerate(items):
        if not (inspect.isawaitable(item) or callable(item)):
            raise ValidationError(f"ctx.parallel item {i} is {item!r}, not an awaitable or a callable",
                                  hint="Pass ctx.step(...) awaitables or zero-argument callables.",
                                  docs="docs/authoring.md#parallel")
    return items


async def run_branches(items: list[Any], concurrency: int | None,
                       enter: Callable[[int], None] | None) -> list[Ok[Any] | Err]:
    """Run every branch (at most `concurrency` at once), each first calling `enter(i)` to take its path scope;
    one `Ok`/`Err` per branch, in order. If the caller is cancelled, every branch is cancelled with it."""
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def branch(i: int, item: Any) -> Ok[Any] | Err:
        if enter is not None:
            enter(i)
        if gate is not None:
            await gate.acquire()
        try:
            value = item() if callable(item) and not inspect.isawaitable(item) else item
            if inspect.isawaitable(value):
                value = await value
            return Ok(value)
        except Exception as exc:  # noqa: BLE001 - a branch failure is its Err result
            return Err(exc)
        finally:
            if gate is not None:
                gate.release()

    tasks = [asyncio.ensure_future(branch(i, item)) for i, item in enumerate(items)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for item in items:  # a branch still waiting for its turn never awaits its coroutine: close it, unstarted
            if inspect.iscoroutine(item) and inspect.getcoroutinestate(item) == inspect.CORO_CREATED:
                item.close()
        raise


class First(NamedTuple):
    """What `ctx.first` returns: the `name` (keyword, or position) of the operation that won, and its value."""

    name: str | int
    value: Any


async def first_of(operations: tuple[Awaitable[Any], ...], named: dict[str, Awaitable[Any]], *,
                   cancel_losers: bool) -> First:
    """`ctx.first`: the key (keyword, or position) of the operation that completed first, and its value (its
    exception raised if it failed); the others are cancelled when `cancel_losers`."""
    keys: list[str | int] = [*range(len(operations)), *named]
    items = [*operations, *named.values()]
    if not items:
        raise ValidationError("ctx.first needs at least one operation to wait for",
                              hint="which, value = await ctx.first(signal=ctx.wait_for('go'), timer=ctx.sleep(60))",
                              docs="docs/authoring.md#races")
    futures: dict[asyncio.Future[Any], str | int] = {}
    future: asyncio.Future[Any]
    for key, item in zip(keys, items, strict=True):
        if not inspect.isawaitable(item):
            raise ValidationError(f"ctx.first's operation {key!r} is {item!r}, not an awaitable",
                                  hint="Pass ctx.step(...), ctx.sleep(...), ctx.wait_for(...) or ctx.join(...).",
                                  docs="docs/authoring.md#races")
        future = asyncio.ensure_future(item)  # a handle is its own future; anything else runs in a task of the run
        if future in futures:
            raise ValidationError(f"ctx.first got the same operation twice ({futures[future]!r} and {key!r})",
                                  hint="Race different operations.", docs="docs/authoring.md#races")
        futures[future] = key
    try:
        done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        if cancel_losers:
            for future in futures:
                future.cancel()
        raise
    if cancel_losers:
        for future in pending:
            future.cancel()
    winner = next(f for f in futures if f in done)  # in argument order when several were done already
    return First(futures[winner], winner.result())


def outside_workflow() -> PurityError:
    """The error for a ctx call made while no workflow function of this run is running."""
    return PurityError("ctx was used outside its running workflow",
                       hint="Call ctx methods only while the workflow function runs.")


def strand_scope(failed: Callable[[PurityError], Exception] = lambda error: error) -> Scope:
    """The calling strand's scope: paths may only be allocated by the task that owns it (`failed` turns the
    error of a foreign task into the one the mode raises)."""
    try:
        scope = current_scope.get()
    except LookupError:
        raise outside_workflow() from None
    if scope.owner is not None and scope.owner is not asyncio.current_task():
        raise failed(foreign_strand())
    return scope


def foreign_strand() -> PurityError:
    """The error for a step started from a task the workflow does not own: its path would depend on scheduling."""
    return PurityError(
        "a step was started from a task the workflow does not own (asyncio.create_task / gather of "
        "coroutines that call ctx.step), so its path would depend on scheduling",
        hint="Run concurrent strands with ctx.parallel([...]) or pass ctx.step(...) awaitables to "
             "asyncio.gather directly; each ctx.parallel branch gets its own stable path prefix.",
        docs="docs/authoring.md#paths")
