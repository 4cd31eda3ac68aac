"""Transactional steps (`ctx.transaction`): a step whose function writes through a database connection inside the
same transaction that records its outcome, so the application's write and the step's `ok` record are committed
together or not at all.

`TransactionSteps.call` allocates the step's path as `ctx.step` does (a recorded outcome replays like any step's);
its live attempts go through `Steps`, which hands each one to `attempt` here instead of calling the function.

An attempt runs whole at the step's turn (`Turns`), on the run's event loop thread: the transaction begins, the
function runs with its connection, the `ok` record is appended in the transaction (fenced by the run's lease)
and everything commits, before anything else of the run's workflow code runs, so the log holds the outcome
exactly where the workflow saw it. Holding the loop is also what keeps SQLite from deadlocking: its transaction
holds the database's one write lock, which every other append of the process would wait for. An `async def`
function runs on an event loop of its own in a helper thread meanwhile (the connection is the sync one).

A kill before the commit leaves neither the write nor the record: the step never happened, and the resumed
run runs it again. A kill after it leaves both: the resumed run answers the step from its record. No `start`
record is written: a transaction cannot be half done."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from .. import records
from .._authoring.calls import StepOptions
from .._authoring.handles import Handle, handle
from .._authoring.transactions import not_transactional, transaction_options
from .._codec import dump_value, load_value
from ..storage.roles import Transactions

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


def attempt(log: RunLog, path: str, label: str, fn: Callable[..., Any], args: tuple[Any, ...], opts: StepOptions,
            number: int, started: float) -> Any:
    """Run one attempt of a transactional step at its turn (the caller has it) and commit it with its `ok` record;
    its value, as the workflow gets it. An exception (the function's, or a lost lease) rolls everything back."""
    storage = log.storage
    assert isinstance(storage, Transactions)
    log.fence()
    tx = storage.transaction()
    try:
        value = fn(tx.connection, *args)
        if inspect.isawaitable(value):
            value = aside(value)
        wire = dump_value(value if opts.schema is None else opts.schema.to_builtins(value), "output")
        log.commit(tx, records.Ok(path=path, label=label, value=wire, attempt=number,
                                  ms=(time.perf_counter() - started) * 1000, ts=time.time()))
    finally:
        tx.close()
    value = load_value(wire)
    return value if opts.schema is None else opts.schema.convert(value, "output")


def aside(awaitable: Any) -> Any:
    """Await `awaitable` (an `async def` transaction function's) to its end on an event loop of its own in a helper
    thread, in this context (so `attempt()` answers there), while this thread waits."""
    context = contextvars.copy_context()
    outcome: list[Any] = []

    async def main() -> Any:
        return await awaitable

    def run() -> None:
        try:
            outcome.append((True, context.run(asyncio.run, main())))
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="durably-transaction", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
