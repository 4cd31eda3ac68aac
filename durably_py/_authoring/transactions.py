"""What `ctx.transaction`'s arguments mean, in every mode: its options (a subset of `ctx.step`'s), and the
error that names the alternative where the storage cannot join an application's writes to a step's record."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ArgumentError, NotSupportedError
from .calls import StepOptions, label_of, not_callable

DOCS = "docs/policies.md#transactional-steps"
ALTERNATIVE = ("Use SqliteStorage or PostgresStorage with the application's tables in the same database, or run "
               "the write in a ctx.step inside `with durably_py.once(conn) as op:` (docs/policies.md#idempotency), "
               "keyed by attempt().operation_id.")


def transaction_options(fn: Callable[..., Any], /, name: str | None = None, retry: Any = None,
                        compensate: Callable[[Any], Any] | None = None, schema: Any = None,
                        concurrency_key: str | None = None, concurrency_limit: int | None = None,
                        uses: str | None = None, **unknown: Any) -> tuple[str, StepOptions]:
    """The label and validated options of a `ctx.transaction` call: `ctx.step`'s, less `timeout=` (a statement
    cannot be cut off safely in the middle of a transaction) and `replay=` (a transaction is never half done)."""
    if not callable(fn):
        raise not_callable(fn)
    if unknown:
        raise ArgumentError(
            f"ctx.transaction() got unknown keyword argument(s) {', '.join(map(repr, unknown))}",
            hint="It takes name=, retry=, compensate=, schema=, concurrency_key=, concurrency_limit= and uses=; "
                 "arguments for the function are positional: ctx.transaction(fn, a, b) calls fn(conn, a, b). "
                 "Bound a transaction's time with the database's own statement timeout.", docs=DOCS)
    label = name or label_of(fn)
    opts = StepOptions(label, retry, None, compensate, concurrency_key, concurrency_limit, uses, schema, "safe")
    opts.transactional = True
    return label, opts


def not_transactional(storage: Any, mode: str | None = None) -> NotSupportedError:
    """`ctx.transaction` on a storage (or in a mode) that cannot commit an application's write and a record
    together, naming the alternative."""
    where = mode or f"{type(storage).__name__}"
    return NotSupportedError(
        f"ctx.transaction needs the run's log in the application's database (SQLite or PostgreSQL storage); "
        f"{where} cannot commit a write and the step's record together",
        hint=ALTERNATIVE, docs=DOCS, feature="ctx.transaction", mode=where)
