"""`once(conn)`: a step's writes to the user's own database, committed at most once per operation.

A step killed after its database transaction committed and before its outcome was recorded runs again on
resume. `once` records the step's `attempt().operation_id` in a marker table inside the same transaction
as the step's writes, so the second execution finds the marker (and the first execution's result) instead
of writing again. It takes a `sqlite3.Connection` or a psycopg 3 `Connection`, told apart by their module:
neither sqlite3 nor psycopg is imported until a connection of theirs is passed.
"""

from __future__ import annotations

import re
from types import TracebackType
from typing import Any, cast

from .._codec import decode, dump_output, encode, load_value
from ..errors import ValidationError
from .calls import current_attempt
from .context import AttemptContext

DOCS = "docs/policies.md#idempotency"
DEFAULT_TABLE = "durably_done"
_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?")
_SAVEPOINT = "durably_once"


def _check_table(table: str) -> str:
    if not isinstance(table, str) or not _TABLE_NAME.fullmatch(table):
        raise ValidationError(f"once(table={table!r}) is not a plain table name",
                              hint="Name the marker table with letters, digits and underscores (a PostgreSQL "
                                   "schema prefix `schema.table` is allowed), e.g. table='shop_done'.",
                              docs=DOCS)
    return table


def _default_key() -> str:
    att = current_attempt.get(None)
    if att is None:
        raise ValidationError("once() was called outside a running step and without key=",
                              hint="Call it inside the function passed to ctx.step() (its key is then "
                                   "attempt().operation_id), or pass key= with your own idempotency key.",
                              docs=DOCS)
    return cast(AttemptContext, att).operation_id


def _dialect(conn: Any) -> str:
    """'sqlite' or 'psycopg' for the connections `once` takes; a `ValidationError` naming any other."""
    kind = type(conn)
    module = kind.__module__ or ""
    if module == "sqlite3" or module.startswith("sqlite3."):
        return "sqlite"
    if module == "psycopg" or module.startswith("psycopg."):
        if kind.__name__.startswith("Async") or hasattr(conn, "__aenter__"):
            raise ValidationError("once() takes a sync psycopg Connection, not an AsyncConnection",
                                  hint="Open a psycopg.Connection for the step (an async step may use a sync "
                                       "connection), or run the write in a def step.", docs=DOCS)
        return "psycopg"
    raise ValidationError(f"once() takes a sqlite3.Connection or a psycopg 3 Connection, not {module}.{kind.__name__}",
                          hint="Pass the DB-API connection itself (for SQLAlchemy, `connection.connection."
                               "driver_connection`), or keep your own marker table keyed by "
                               "attempt().operation_id.", docs=DOCS)


class Once:
    """One operation's marker in the user's database, as `with once(conn) as op:` sees it.

    `op.done` is True when an earlier execution of the same operation (the same `key`) committed: skip the
    writes and return `op.result`, which is what that execution passed to `op.record()`. When `op.done` is
    False this execution is the first to get this far: do the writes, then `return op.record(value)`."""

    __slots__ = ("conn", "key", "table", "done", "result", "_dialect", "_owns", "_tx", "_active")

    def __init__(self, conn: Any, key: str | None = None, *, table: str = DEFAULT_TABLE) -> None:
        self._dialect = _dialect(conn)
        self.conn = conn
        self.table = _check_table(table)
        if key is None:
            key = _default_key()
        elif not isinstance(key, str) or not key:
            raise ValidationError(f"once(key={key!r}) is not a non-empty string",
                                  hint="Pass a string idempotency key, or leave key= out inside a step.", docs=DOCS)
        self.key: str = key
        self.done = False
        self.result: Any = None
        self._owns = False
        self._tx: Any = None
        self._active = False

    # ---- the transaction -------------------------------------------------------------------------
    def __enter__(self) -> Once:
        if self._active:
            raise ValidationError("this once() block is already open", hint="Call once(conn) again for another "
                                  "block.", docs=DOCS)
        if self._dialect == "sqlite":
            self._enter_sqlite()
        else:
            self._enter_psycopg()
        self._active = True
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._active = False
        keep = kind is None and not self.done  # a repeat keeps nothing: its writes were made once already
        if self._dialect == "sqlite":
            self._exit_sqlite(keep)
        else:
            self._exit_psycopg(keep, kind, error, tb)

    def _enter_sqlite(self) -> None:
        conn = self.conn
        self._owns = not conn.in_transaction
        conn.execute("BEGIN IMMEDIATE" if self._owns else f"SAVEPOINT {_SAVEPOINT}")
        try:
            conn.execute(f"CREATE TABLE IF NOT EXISTS {self.table} (operation_id TEXT PRIMARY KEY, result TEXT, "
                         "done_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)")
            inserted = conn.execute(f"INSERT INTO {self.table} (operation_id) VALUES (?) "
                                    "ON CONFLICT (operation_id) DO NOTHING", (self.key,)).rowcount
            if inserted != 1:
                row = conn.execute(f"SELECT result FROM {self.table} WHERE operation_id = ?", (self.key,)).fetchone()
                self._repeat(row[0])
        except BaseException:
            self._exit_sqlite(False)
            raise

    def _exit_sqlite(self, keep: bool) -> None:
        conn = self.conn
        if self._owns:
            if keep:
                conn.commit()
            else:
                conn.rollback()
        else:
            if not keep:
                conn.execute(f"ROLLBACK TO {_SAVEPOINT}")
            conn.execute(f"RELEASE {_SAVEPOINT}")

    def _enter_psycopg(self) -> None:
        conn = self.conn
        status = conn.info.transaction_status.name
        if status == "INERROR":
            raise ValidationError("once() was called in a PostgreSQL transaction that already failed",
                                  hint="Roll the transaction back, then call once() again.", docs=DOCS)
        self._owns = status == "IDLE"
        self._tx = conn.transaction()  # a transaction, or a savepoint inside the caller's
        self._tx.__enter__()
        try:
            if conn.execute("SELECT to_regclass(%s)", (self.table,)).fetchone()[0] is None:
                try:
                    with conn.transaction():  # a savepoint: a concurrent first creation may win the race
                        conn.execute(f"CREATE TABLE IF NOT EXISTS {self.table} (operation_id TEXT PRIMARY KEY, "
                                     "result TEXT, done_at TIMESTAMPTZ NOT NULL DEFAULT now())")
                except Exception as exc:
                    if getattr(exc, "sqlstate", None) not in ("23505", "42P07"):  # not "created meanwhile"
                        raise
            inserted = conn.execute(f"INSERT INTO {self.table} (operation_id) VALUES (%s) "
                                    "ON CONFLICT (operation_id) DO NOTHING", (self.key,)).rowcount
            if inserted != 1:
                row = conn.execute(f"SELECT result FROM {self.table} WHERE operation_id = %s", (self.key,)).fetchone()
                self._repeat(row[0])
        except BaseException as exc:
            self._tx.__exit__(type(exc), exc, exc.__traceback__)
            raise

    def _exit_psycopg(self, keep: bool, kind: type[BaseException] | None, error: BaseException | None,
                      tb: TracebackType | None) -> None:
        if kind is None and not keep:
            from psycopg import Rollback  # the connection is psycopg's: it is imported already

            rollback = Rollback(self._tx)
            self._tx.__exit__(Rollback, rollback, None)
        else:
            self._tx.__exit__(kind, error, tb)

    # ---- the result ------------------------------------------------------------------------------
    def _repeat(self, stored: str | None) -> None:
        self.done = True
        self.result = None if stored is None else load_value(decode(stored))

    def record(self, value: Any) -> Any:
        """Store `value` (JSON plus datetime, as a step's result) as this operation's result, in the same
        transaction, and return it as a repeat will (`op.result` after a re-execution): ``return op.record(v)``."""
        if not self._active:
            raise ValidationError("op.record() was called outside its `with once(conn) as op:` block",
                                  hint="Call op.record(value) inside the block, in the transaction of the writes.",
                                  docs=DOCS)
        if self.done:
            raise ValidationError(f"operation {self.key!r} committed before: its result is recorded already",
                                  hint="Return op.result when op.done is True instead of writing again.", docs=DOCS)
        wire, value = dump_output(value)
        mark = "?" if self._dialect == "sqlite" else "%s"
        self.conn.execute(f"UPDATE {self.table} SET result = {mark} WHERE operation_id = {mark}",
                          (encode(wire).decode(), self.key))
        self.result = value
        return value

    @staticmethod
    def forget(conn: Any, key: str, *, table: str = DEFAULT_TABLE) -> bool:
        """Delete operation `key`'s marker in `conn`'s current transaction (a compensation that undoes the
        operation's writes calls it in the same transaction, so a retried run writes again); True if it existed.
        Commit is the caller's."""
        dialect = _dialect(conn)
        table = _check_table(table)
        if dialect == "sqlite":
            try:
                return bool(conn.execute(f"DELETE FROM {table} WHERE operation_id = ?", (key,)).rowcount)
            except Exception as exc:  # sqlite3.OperationalError; a failed statement leaves the transaction as it was
                if "no such table" in str(exc):
                    return False
                raise
        if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is None:
            return False
        return bool(conn.execute(f"DELETE FROM {table} WHERE operation_id = %s", (key,)).rowcount)

    def __repr__(self) -> str:
        return f"Once(key={self.key!r}, done={self.done}, result={self.result!r})"


def once(conn: Any, key: str | None = None, *, table: str = DEFAULT_TABLE) -> Once:
    """Commit a step's writes to your own database at most once per operation: ``with once(conn) as op:``.

    Entering inserts the operation's marker (`key`, by default `attempt().operation_id`) into `table` (created
    if missing) as the first write of a transaction: one it begins (`BEGIN IMMEDIATE` on SQLite) and commits
    when the block ends, or, when `conn` is already inside a transaction, a savepoint in it whose commit stays
    yours. `op.done` tells whether the operation committed before; then the block's writes are rolled back at
    its end and `op.result` holds the first execution's `op.record(value)`. An exception rolls the block back.
    Two executions of one operation at once conflict on the marker: the second waits for the first to end and
    then sees `op.done`. `conn` is a `sqlite3.Connection` or a psycopg 3 `Connection`.

        with durably_py.once(conn) as op:
            if op.done:
                return op.result
            conn.execute("UPDATE inventory SET n = n - 1 WHERE sku = ?", (sku,))
            return op.record({"shipped": order_id})
    """
    return Once(conn, key, table=table)
