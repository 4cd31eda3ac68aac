"""Transactional steps (`ctx.transaction`): a step whose function writes through a database connection inside the
same transaction that records its outcome, so the application's write and the step's `ok` record are committed
together or not at all.

`TransactionSteps.call` allocates the step's path as `ctx.step` does (a recorded outcome replays like any step's);
its live attempts go through `Steps`, which hands each one to `attempt` here instead of calling the function.

The `ok` record is appended in the transaction (fenced by the run's lease) and everything commits at the step's
turn (`Turns`), so the log holds the outcome exactly where the workflow saw it. Before that, on PostgreSQL
(whose transactions lock only their rows) the function runs on the run's executor while the run goes on, its
transaction open until the turn comes. On SQLite the whole attempt runs at the turn, on the run's event loop
thread, before anything else of the run: its transaction holds the database's one write lock, which every other
append of the process would wait for, and a loop that went on could block in such an append while the
transaction waited for the loop to commit. An `async def` function runs on an event loop of its own (on the
worker thread, or a helper thread); the connection is the sync one.

A kill before the commit leaves neither the write nor the record: the step never happened, and the resumed
run runs it again. A kill after it leaves both: the resumed run answers the step from its record. No `start`
record is written: a transaction cannot be half done."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

from .. import records
from .._authoring.calls import StepOptions
from .._authoring.handles import Handle, handle
from .._authoring.transactions import not_transactional, transaction_options
from .._codec import dump_value, load_value
from ..storage.roles import AppTransaction, Transactions

if TYPE_CHECKING:
    from .._authoring.paths import Scope
    from .log import RunLog


class TransactionSteps:
    """`ctx.transaction` of one execution of a run: path allocation, and one attempt in the storage's transaction."""

    def __init__(self, log: RunLog, operator: Any, replay_next: Callable[..., tuple[str, Scope, Handle | None]],
                 execute: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        self.log = log
        self.operator = operator  # the kernel: what a handle asks to run or replay it (`handles.Operator`)
        self.replay_next = replay_next
        self.execute = execute

    def call(self, fn: Callable[..., Any], /, *args: Any, **options: Any) -> Handle[Any]:
        """`ctx.transaction(fn, *args, **options)`: the step's handle, its path allocated now."""
        label, opts = transaction_options(fn, **options)
        path, scope, replayed = self.replay_next(label, opts)
        if replayed is not None:  # a recorded outcome replays on any storage (a shadow replay's memory copy too)
            return replayed
        if not isinstance(self.log.storage, Transactions):
            raise not_transactional(self.log.storage)
        scope.pending += 1
        return handle(self.operator, scope.loop, self.execute, (scope, path, label, fn, args, opts), path, label)


async def attempt(log: RunLog, live_turn: Callable[[], Awaitable[None]], executor: Executor, path: str, label: str,
                  fn: Callable[..., Any], args: tuple[Any, ...], opts: StepOptions, number: int, started: float) -> Any:
    """Run one attempt of a transactional step and commit it with its `ok` record at the step's turn; its value,
    as the workflow gets it. An exception (the function's, or a lost lease) rolls everything back.

    On a storage whose transaction locks the whole database (`Transactions.exclusive`: SQLite) the attempt runs
    whole at its turn, on this thread. Elsewhere (PostgreSQL) the function runs on `executor` while the run goes
    on, and its transaction stays open until the step's turn comes to commit it."""
    storage = log.storage
    assert isinstance(storage, Transactions)
    log.fence()
    if storage.exclusive:
        await live_turn()
        tx, wire = prepare(storage, fn, args, opts, aside)
    else:
        future = executor.submit(contextvars.copy_context().run, prepare, storage, fn, args, opts, awaited)
        try:
            tx, wire = await asyncio.wrap_future(future)
        except BaseException:  # cut off (cancelled, torn down): the function may still run; its transaction is
            future.add_done_callback(close_when_done)  # closed once it returns
            raise
    try:
        if not storage.exclusive:
            await live_turn()
        log.commit(tx, records.Ok(path=path, label=label, value=wire, attempt=number,
                                  ms=(time.perf_counter() - started) * 1000, ts=time.time()))
    finally:
        tx.close()
    value = load_value(wire)
    return value if opts.schema is None else opts.schema.convert(value, "output")


def prepare(storage: Transactions, fn: Callable[..., Any], args: tuple[Any, ...], opts: StepOptions,
            wait: Callable[[Any], Any]) -> tuple[AppTransaction, Any]:
    """Open a transaction, run `fn(conn, *args)` in it (an awaitable it returns awaited by `wait`) and return the
    transaction, still open, with the result's recorded form; an exception rolls the transaction back."""
    tx = storage.transaction()
    try:
        value = fn(tx.connection, *args)
        if inspect.isawaitable(value):
            value = wait(value)
        return tx, dump_value(value if opts.schema is None else opts.schema.to_builtins(value), "output")
    except BaseException:
        tx.close()
        raise


def close_when_done(future: Future[tuple[AppTransaction, Any]]) -> None:
    """Close the transaction of an attempt nobody waits for any more (rolled back) once its function returned."""
    if not future.cancelled() and future.exception() is None:
        future.result()[0].close()


def awaited(awaitable: Any) -> Any:
    """Await `awaitable` to its end on an event loop of its own, on this (worker) thread."""
    async def main() -> Any:
        return await awaitable

    return asyncio.run(main())


def aside(awaitable: Any) -> Any:
    """Await `awaitable` (an `async def` transaction function's) to its end on an event loop of its own in a helper
    thread, in this context (so `attempt()` answers there), while this thread waits."""
    context = contextvars.copy_context()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, context.run(awaited, awaitable)))
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="durably-transaction", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
