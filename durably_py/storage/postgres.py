"""Runs in one PostgreSQL database (psycopg 3), shared safely by engines on many machines.

Tables live in their own schema (``durably`` by default), created on first use: ``runs`` (one row per run: header
line, times, lease epoch/owner/expiry, last line, log size), ``records`` (the log as appended chunks of lines, in
``seq`` order), ``identities`` (identity -> run id, keyed by the identity's SHA-256 so any identity fits an index),
``signals`` (each run's inbox of unacknowledged signal lines, in ``seq`` order), ``queue``, ``joins``, ``workers``
and ``limits`` (one JSON document per flow-control key, changed under a transaction-scoped advisory lock on the
key, against the database clock).

The connection runs in autocommit mode: most operations are one statement, atomic on its own and one round
trip; a claim and a rewrite are explicit transactions. Every commit runs with ``synchronous_commit = on`` (set
on the connection), so one that returned survives a crash of the database server or its machine: a recorded
step, a run's end, an enqueue, a signal and a queue move are on disk before the caller hears of them. The
writes under a lease (appends, syncs, releases, ends) go to the group committer (`pgcommit`): one thread and
connection that commits whatever the process's runs handed in meanwhile in one transaction, so one WAL flush
for all of them; `RunLog` hands a step's record in with `append_soon` and waits for its commit before the step's
result goes back. A worker's claims (`claim_due`) are committed without a flush of their own: the claimed run's
first durable write flushes the WAL up to them.

Leases are time-based and measured on the database clock (``clock_timestamp()``), so machines whose clocks
disagree still agree on who holds a run. A claim locks the run's row (``SELECT ... FOR UPDATE``), so two machines
claiming at once get distinct epochs and only one wins; every write is ``WHERE epoch = ? AND owner = ?``-fenced,
so an owner whose lease lapsed keeps appending only until someone else actually claims. One connection is shared
by the threads of a process behind a lock; a broken connection is dropped and reopened on the next call.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import (
    CorruptLogError,
    LeaseLostError,
    RunNotFoundError,
    StorageBusyError,
    StorageFullError,
    ValidationError,
)
from ..records import is_end_line, kind_of
from .base import (
    Check,
    Choose,
    Lease,
    Log,
    NewRun,
    RunInfo,
    bind_and_create,
    checked,
    claimed,
    decode_record,
    decode_worker,
    ended,
    last_line,
    parse_log,
    validate_lines,
    validate_run_id,
)
from .catalog import OPEN, RunFilter, header_fields, queue_fields, state_after
from .front import StorageFront, amended_values
from .partials import PartialsKeptApart, PostgresPartials
from .pgcommit import PostgresCommitter, Write
from .pgdriver import BUSY_DOCS, MAX_TTL
from .pgdriver import psycopg_module as _psycopg
from .pginbox import PostgresInbox
from .pglimits import PostgresLimits
from .pgqueue import PostgresDueQueue
from .valuestore import LINE_MIN, enabled, externalise, resolve_line

if TYPE_CHECKING:
    import psycopg

SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")
LOCK_WAIT = 10.0  # seconds a claim, an amend or a delete waits for a run's row another transaction holds locked
QUIET_FOR = 0.5  # seconds a claim's finding of an empty inbox answers the run's first `inbox` (`_claim_rows`)
_FENCE = "run_id = %s AND epoch = %s AND owner = %s"
_TABLES = """
CREATE TABLE IF NOT EXISTS {s}.runs (
    run_id TEXT PRIMARY KEY,
    header BYTEA NOT NULL,
    created TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    updated TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    epoch BIGINT NOT NULL DEFAULT 0,
    owner TEXT,
    lease_expires TIMESTAMPTZ,
    last BYTEA NOT NULL,
    size BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.records (
    run_id TEXT NOT NULL,
    seq BIGSERIAL,
    data BYTEA NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS {s}.identities (
    digest TEXT PRIMARY KEY,
    identity TEXT NOT NULL,
    run_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.signals (
    seq BIGSERIAL PRIMARY KEY,
    run_id TEXT NOT NULL,
    id TEXT NOT NULL,
    data BYTEA NOT NULL
);
CREATE INDEX IF NOT EXISTS signals_by_run ON {s}.signals (run_id, seq);
CREATE TABLE IF NOT EXISTS {s}.queue (
    run_id TEXT PRIMARY KEY,
    due DOUBLE PRECISION,
    priority BIGINT NOT NULL DEFAULT 0,
    created DOUBLE PRECISION NOT NULL,
    wait TEXT[] NOT NULL DEFAULT '{{}}'
);
ALTER TABLE {s}.queue ADD COLUMN IF NOT EXISTS queue_name TEXT NOT NULL DEFAULT 'default';
ALTER TABLE {s}.queue ADD COLUMN IF NOT EXISTS partition_name TEXT;
CREATE TABLE IF NOT EXISTS {s}.joins (
    parent TEXT NOT NULL,
    child TEXT NOT NULL,
    PRIMARY KEY (parent, child)
);
CREATE INDEX IF NOT EXISTS joins_by_child ON {s}.joins (child);
CREATE TABLE IF NOT EXISTS {s}.workers (
    owner TEXT PRIMARY KEY,
    info BYTEA NOT NULL,
    expires TIMESTAMPTZ NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.limits (
    key TEXT PRIMARY KEY,
    doc BYTEA NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.blobs (
    digest TEXT PRIMARY KEY,
    data BYTEA NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.run_blobs (
    run_id TEXT NOT NULL,
    digest TEXT NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (run_id, digest)
);
CREATE INDEX IF NOT EXISTS queue_parts ON {s}.queue (queue_name, partition_name, priority, due, created, run_id)
    WHERE partition_name IS NOT NULL;
CREATE INDEX IF NOT EXISTS queue_due_order ON {s}.queue (priority DESC, due, created, run_id) WHERE due IS NOT NULL;
DROP INDEX IF EXISTS {s}.queue_by_due;
"""
"""The tables, created or brought up to date in one transaction when the newest relation (`queue_due_order`) is
missing. ``queue_due_order`` is the due query's whole order, down to the run id: runs enqueued in one batch share
their due and created times, and an index without the run id made each claim sort all of them."""


_CATALOG = """
ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS workflow TEXT;
ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS key TEXT;
ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS parent TEXT;
ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS state TEXT NOT NULL DEFAULT 'open';
CREATE INDEX IF NOT EXISTS runs_by_updated ON {s}.runs (updated DESC, run_id DESC);
CREATE INDEX IF NOT EXISTS runs_by_state ON {s}.runs (state, updated DESC);
CREATE INDEX IF NOT EXISTS runs_by_workflow ON {s}.runs (workflow, updated DESC);
CREATE INDEX IF NOT EXISTS runs_by_key ON {s}.runs (key);
CREATE INDEX IF NOT EXISTS runs_by_parent ON {s}.runs (parent) WHERE parent IS NOT NULL
"""


def _ensure_catalog(conn: Any, schema: str) -> None:
    """The run catalog's columns and indexes on ``runs``; a schema from before them gets them filled in from
    each run's header and log (once, under the schema's advisory lock)."""
    found = conn.execute("SELECT 1 FROM information_schema.columns WHERE table_schema = %s AND table_name = 'runs'"
                         " AND column_name = 'state'", (schema,)).fetchone()
    if found is not None:
        return
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"durably-schema:{schema}",))
        again = conn.execute("SELECT 1 FROM information_schema.columns WHERE table_schema = %s"
                             " AND table_name = 'runs' AND column_name = 'state'", (schema,)).fetchone()
        if again is not None:
            return
        for statement in _CATALOG.format(s=f'"{schema}"').split(";"):
            if statement.strip():
                conn.execute(statement)
        runs = conn.execute(f'SELECT run_id, header FROM "{schema}".runs').fetchall()
        for run_id, header_line in runs:
            chunks = conn.execute(f'SELECT data FROM "{schema}".records WHERE run_id = %s ORDER BY seq',
                                  (run_id,)).fetchall()
            header = decode_record(bytes(header_line))
            good = kind_of(header) == "run"
            state = state_after(OPEN, b"".join(bytes(c[0]) for c in chunks)) if good else OPEN
            conn.execute(f'UPDATE "{schema}".runs SET workflow = %s, key = %s, parent = %s, state = %s'
                         " WHERE run_id = %s", (*header_fields(header), state, run_id))


FULL_SQLSTATES = {
    "53100": "Free disk space on the database server (or raise its quota or file size limit), then run the same "
             "command again: the run resumes from its last complete record.",
    "53400": "Raise the server's limit the message names (e.g. temp_file_limit), then run the same command again: "
             "the run resumes from its last complete record.",
}
"""The SQLSTATEs of a write refused for lack of space: disk_full, and configuration_limit_exceeded (a
temp_file_limit or similar quota). Each is a `StorageFullError` with its hint."""


def storage_full(exc: BaseException, schema: str) -> StorageFullError | None:
    """`StorageFullError` for a psycopg error whose SQLSTATE says the server is out of space, else None.

    The statement (or transaction) failed as a whole, so nothing of the write was kept."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate not in FULL_SQLSTATES:
        return None
    diag = getattr(exc, "diag", None)
    detail = getattr(diag, "message_primary", None) or str(exc).strip()
    error = StorageFullError(
        f"could not write to PostgreSQL schema {schema}: {detail} (SQLSTATE {sqlstate}); nothing of this write "
        "was kept", hint=FULL_SQLSTATES[sqlstate], path=f"PostgreSQL schema {schema}")
    error.errno = errno.ENOSPC
    return error


TRANSACTION_DOCS = "docs/policies.md#transactional-steps"


class PostgresTransaction:
    """An application's transaction on the store's database that a run's records join (`commit`): PostgreSQL
    commits both at once or neither. The connection (psycopg 3, sync) is the application's for the transaction's
    length: its statements run in the transaction already begun, and ``conn.transaction()`` blocks in it are
    savepoints; committing or rolling back is this object's (an application that commits itself is told so)."""

    __slots__ = ("storage", "connection", "_open")

    def __init__(self, storage: PostgresStorage, connection: psycopg.Connection[Any]) -> None:
        self.storage = storage
        self.connection = connection
        self._open = True

    def commit(self, lease: Lease, data: bytes) -> None:
        """Append `data` to the lease's run (fenced by its epoch and owner, as an append is) and commit everything."""
        conn = self.connection
        status = conn.info.transaction_status.name
        if status != "INTRANS":
            self.rollback()
            if status == "INERROR":
                raise ValidationError("a statement of ctx.transaction's function failed and the function went on",
                                      hint="Let the error propagate (the transaction rolls back and the step fails "
                                           "or retries), or wrap the statement in `with conn.transaction():` (a "
                                           "savepoint) to recover from it.", docs=TRANSACTION_DOCS)
            raise ValidationError("the transaction of ctx.transaction was committed or rolled back by its function",
                                  hint="Leave commit and rollback to ctx.transaction (raise to roll back; use "
                                       "`with conn.transaction():` for a savepoint); what the function committed "
                                       "stays committed.", docs=TRANSACTION_DOCS)
        try:
            self.storage.append_in(conn, lease, data)
            conn.execute("COMMIT")
        except BaseException as exc:
            try:
                self.rollback()
            except Exception:  # noqa: BLE001 - a broken connection: the server rolls the transaction back
                pass
            full = storage_full(exc, self.storage.schema)
            if full is not None:
                raise full from exc
            raise
        self._open = False

    def rollback(self) -> None:
        """Roll the transaction back (a no-op once it ended)."""
        if self._open:
            self._open = False
            conn = self.connection
            if not conn.closed and not conn.broken and conn.info.transaction_status.name != "IDLE":
                conn.execute("ROLLBACK")

    def close(self) -> None:
        """Roll back what is still open and give the connection back to the storage."""
        try:
            self.rollback()
        except Exception:  # noqa: BLE001 - a broken connection is closed, not kept
            self.connection.close()
            return
        self.storage.reuse(self.connection)


class _Raced(Exception):
    """A batched `create_bound` that another process raced (or that names an existing run): rolled back."""


def _digest(identity: str) -> str:
    """The key an identity is stored under: fixed-size, so any identity fits a btree index."""
    return hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()


class PostgresStorage(PartialsKeptApart, PostgresDueQueue, PostgresInbox, PostgresLimits, StorageFront):
    """Runs as rows of one PostgreSQL schema; the connection opens (and the tables appear) on first use."""

    def __init__(self, dsn: str, *, schema: str = "durably", compact_above_bytes: int | None = None,
                 lock_wait: float = LOCK_WAIT, values_once: bool | None = None) -> None:
        if not isinstance(dsn, str):
            raise ValidationError(f"a PostgreSQL dsn is a string, got {dsn!r}",
                                  hint="PostgresStorage('postgresql://user@host/db') or 'host=... dbname=...'.")
        if not isinstance(schema, str) or not SCHEMA_RE.fullmatch(schema):
            raise ValidationError(
                f"invalid PostgreSQL schema name {schema!r}: 1-63 lowercase letters, digits or '_', "
                "not starting with a digit",
                hint="schema='durably' (the default) or e.g. schema='durably_staging'.",
            )
        if compact_above_bytes is not None and (
            isinstance(compact_above_bytes, bool) or not isinstance(compact_above_bytes, int) or compact_above_bytes <= 0
        ):
            raise ValidationError(f"compact_above_bytes must be a positive int or None, got {compact_above_bytes!r}")
        if isinstance(lock_wait, bool) or not isinstance(lock_wait, int | float) or not 0.001 <= lock_wait <= 3600:
            raise ValidationError(f"lock_wait must be 0.001 to 3600 seconds, got {lock_wait!r}",
                                  hint="lock_wait=10 (the default) waits 10 s for a run another connection holds "
                                       "locked.", docs=BUSY_DOCS)
        _psycopg()
        self.lock_wait = float(lock_wait)
        self.values_once = values_once
        self.dsn = dsn
        self.schema = schema
        self.compact_above_bytes = compact_above_bytes
        self.fsyncs = 0
        self._conn: psycopg.Connection[Any] | None = None
        self._idle: list[psycopg.Connection[Any]] = []  # connections of finished `transaction()`s, kept for the next
        self._lock = threading.RLock()
        self._synced: dict[tuple[str, int], int] = {}
        self._quiet: dict[str, float] = {}  # runs this process claimed with an empty inbox: until when that answers
        s = f'"{schema}"'
        self._channel = f"durably.{schema}"
        self._runs, self._records, self._identities, self._signals, self._queue, self._joins, self._workers = (
            f"{s}.runs", f"{s}.records", f"{s}.identities", f"{s}.signals", f"{s}.queue", f"{s}.joins",
            f"{s}.workers")
        self._limits = f"{s}.limits"
        self._partials: PostgresPartials = PostgresPartials(self.schema, self._cursor)
        self._blobs = f"{s}.blobs"
        self._run_blobs = f"{s}.run_blobs"  # each run's stored values (`valuestore`)
        self._queue_parts = f"{s}.queue_parts"  # the index of partitioned queue rows (named queues)
        self._queue_order = f"{s}.queue_due_order"  # the index of due rows in the due query's order, the newest
        self._committer = PostgresCommitter(
            dsn, {"runs": self._runs, "records": self._records, "run_blobs": self._run_blobs, "queue": self._queue,
                  "joins": self._joins}, lost=self._lost, parents_due=self._parents_due,
            full=lambda exc: storage_full(exc, schema))

    def __repr__(self) -> str:
        return f"PostgresStorage(schema={self.schema!r})"

    # ---- connection and statements ------------------------------------------------------------
    def _db(self) -> psycopg.Connection[Any]:
        """The shared connection, opened (and the schema created) on first use; call with the lock held."""
        if self._conn is not None and (self._conn.closed or self._conn.broken):
            self._conn = None
        if self._conn is None:
            psycopg = _psycopg()
            conn = psycopg.connect(self.dsn, autocommit=True)
            try:
                conn.execute("SET synchronous_commit = on")  # whatever the server's default: every commit is durable
                if not self._exists(conn, self._limits, self._queue_parts, self._run_blobs,
                                    self._queue_order):  # the newest: older ones upgrade here
                    with conn.transaction():
                        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"durably-schema:{self.schema}",))
                        before_queue = self._exists(conn, self._runs) and not self._exists(conn, self._queue)
                        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
                        for statement in _TABLES.format(s=f'"{self.schema}"').split(";"):
                            if statement.strip():
                                conn.execute(statement)
                        if before_queue:
                            self._queue_unended(conn)
                _ensure_catalog(conn, self.schema)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    @staticmethod
    def _exists(conn: psycopg.Connection[Any], *relations: str) -> bool:
        """Whether every one of `relations` (tables, indexes) exists, asked in one statement."""
        found = conn.execute("SELECT " + ", ".join(["to_regclass(%s) IS NOT NULL"] * len(relations)),
                             relations).fetchone()
        return found is not None and all(found)

    def _queue_unended(self, conn: psycopg.Connection[Any]) -> None:
        """A schema from before the queue: every run that has not ended enters it, due now, so a worker takes
        its interrupted, sleeping and waiting runs over."""
        rows = conn.execute(f"SELECT run_id, last, extract(epoch FROM created)::float8,"
                            f" extract(epoch FROM updated)::float8 FROM {self._runs}").fetchall()
        for run_id, last, created, updated in rows:
            if not is_end_line(bytes(last)):
                conn.execute(f"INSERT INTO {self._queue} (run_id, due, priority, created) VALUES (%s, %s, 0, %s)"
                             " ON CONFLICT (run_id) DO NOTHING", (run_id, updated, created))

    @contextmanager
    def _cursor(self, transaction: bool = False, *, flush: bool = True) -> Iterator[psycopg.Cursor[Any]]:
        """A cursor with the lock held: each statement commits on its own, or all in one `transaction`.

        Unless told not to (`flush` false: a read, or a claim, which takes only rows no lease of this process
        holds), the writes still pending in the group commit (`pgcommit`) are committed first, so what this
        connection writes comes after them: the one place every write on it goes through."""
        if flush:
            self._committer.flush()
        with self._lock:
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = self._db()  # its first use creates the schema: a full disk is reported there too
                if transaction:
                    with conn.transaction(), conn.cursor() as cur:
                        yield cur
                else:
                    with conn.cursor() as cur:
                        yield cur
            except BaseException as exc:
                if conn is not None and conn.broken:
                    self._drop()
                full = storage_full(exc, self.schema)
                if full is not None:
                    raise full from exc
                raise

    def _write(self, query: str, params: tuple[Any, ...]) -> int:
        """Run one writing statement (atomic and durable once it returns); the number of rows it changed."""
        with self._cursor() as cur:
            cur.execute(query, params)
            return cur.rowcount

    def _fetch(self, query: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Run one read-only statement, once more on a new connection if the old one had broken."""
        psycopg = _psycopg()
        for tries_left in (1, 0):
            try:
                with self._cursor(flush=False) as cur:
                    cur.execute(query, params)
                    return cur.fetchall()
            except psycopg.OperationalError:
                if not tries_left or self._conn is not None:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _drop(self) -> None:
        """Forget a broken connection so the next call opens a new one."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # pragma: no cover - closing a dead socket
                pass

    def close(self) -> None:
        """Commit the writes still pending, then close the connections (they reopen on next use)."""
        self._committer.close()
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            while self._idle:
                self._idle.pop().close()

    exclusive = False  # `roles.Transactions`: a transaction locks only the rows it writes

    def transaction(self) -> PostgresTransaction:
        """A transaction on a connection of its own to this database, for an application's tables (any schema of
        the same database) and a run's records together (`roles.Transactions`)."""
        with self._lock:
            self._db()  # the schema exists before the transaction writes to it
            conn = self._idle.pop() if self._idle else None
        try:
            if conn is None or conn.closed or conn.broken:
                conn = _psycopg().connect(self.dsn, autocommit=True)
                conn.execute("SET synchronous_commit = on")
            conn.execute("BEGIN")
        except BaseException as exc:
            if conn is not None:
                conn.close()
            full = storage_full(exc, self.schema)
            if full is not None:
                raise full from exc
            raise
        return PostgresTransaction(self, conn)

    def reuse(self, conn: psycopg.Connection[Any]) -> None:
        """Keep a finished transaction's connection for the next one (a few at most)."""
        if not conn.closed and not conn.broken and conn.info.transaction_status.name == "IDLE":
            with self._lock:
                if len(self._idle) < 4:
                    self._idle.append(conn)
                    return
        conn.close()

    def append_in(self, conn: psycopg.Connection[Any], lease: Lease, data: bytes) -> None:
        """`append` on `conn`, in the transaction it has open; `LeaseLostError` if the lease is not current. The
        run's earlier appends, committed in groups on another connection, are committed first."""
        self._committer.flush()
        if not self._mine(lease) or conn.execute(
            f"WITH fenced AS (UPDATE {self._runs} SET last = %s, size = size + %s"  # a step: `updated` stays (pgcommit)
            f" WHERE {_FENCE} RETURNING run_id) INSERT INTO {self._records} (run_id, data) SELECT run_id, %s FROM fenced",
            (last_line(data), len(data), lease.run_id, lease.epoch, lease.owner, data),
        ).rowcount == 0:
            raise self._lost(lease)

    def _where(self, run_id: str) -> str:
        """How errors name a run's log."""
        return f"run {run_id} in PostgreSQL schema {self.schema}"

    def _missing(self, run_id: str) -> RunNotFoundError:
        return RunNotFoundError(f"no run {run_id} in PostgreSQL schema {self.schema}", run_id=run_id)

    def _lost(self, lease: Lease) -> LeaseLostError:
        if not self._mine(lease):
            return LeaseLostError(f"lease on run {lease.run_id} is not from {self!r}", run_id=lease.run_id)
        return LeaseLostError(f"the lease on run {lease.run_id} is no longer current", run_id=lease.run_id)

    def _mine(self, lease: Lease) -> bool:
        return lease.state.get("postgres") is self

    # ---- runs and leases ----------------------------------------------------------------------
    def _do_create(self, run_id: str, header: bytes, record: dict[str, Any], at: float | None,
                   priority: int) -> None:
        """Create a run whose log starts with the `header` line, queued due at `at` (None: now), in one
        statement; `ValidationError` if the id exists."""
        fields = header_fields(record)
        header = bytes(header)
        now = time.time()
        created = self._write(  # the CTEs run to completion whatever the SELECT reads; the notification at commit
            f"WITH created AS (INSERT INTO {self._runs} (run_id, header, last, size, workflow, key, parent, state)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, 'open') ON CONFLICT (run_id) DO NOTHING RETURNING run_id),"
            f" queued AS (INSERT INTO {self._queue} (run_id, due, priority, created, queue_name, partition_name)"
            " SELECT run_id, %s, %s, %s, %s, %s FROM created ON CONFLICT (run_id) DO NOTHING),"
            f" logged AS (INSERT INTO {self._records} (run_id, data) SELECT run_id, %s FROM created)"
            " SELECT pg_notify(%s, '') FROM created",
            (run_id, header, header, len(header), *fields, now if at is None else at, priority, now,
             *queue_fields(record), header, self._channel),
        )
        if created == 0:
            raise ValidationError(f"run {run_id} already exists in PostgreSQL schema {self.schema}", run_id=run_id)

    def _do_read(self, run_id: str) -> Log | None:
        """All records of a run (None if unknown), read in one statement."""
        rows = self._fetch(
            f"SELECT (SELECT string_agg(r.data, ''::bytea ORDER BY r.seq) FROM {self._records} r"
            f" WHERE r.run_id = runs.run_id) FROM {self._runs} runs WHERE runs.run_id = %s",
            (run_id,),
        )
        if not rows:
            return None
        records, _, torn = parse_log(bytes(rows[0][0] or b""), self._where(run_id), lambda: self._values(run_id))
        return Log(records, torn, self._where(run_id))

    def _do_claim(self, run_id: str, owner: str, ttl: float, check: Check | None, reopen: bool) -> Lease | None:
        """Take the lease if it is free, released or expired (database clock); bumps the epoch, appends the claim.
        The run's row lock is waited for at most `lock_wait` seconds (then `StorageBusyError` names its holder);
        an ended run (without `reopen`) is refused and taken out of the queue in the same transaction."""
        ttl = min(ttl, MAX_TTL)
        with self._locking(run_id) as cur:
            cur.execute(
                f"SELECT epoch, owner IS NOT NULL AND lease_expires >= clock_timestamp() FROM {self._runs}"
                " WHERE run_id = %s FOR UPDATE",
                (run_id,),
            )
            row = cur.fetchone()
            if row is None:
                raise self._missing(run_id)
            epoch, live = row
            if live:
                return None
            return self._claim_locked(cur, run_id, epoch, owner, ttl, check, reopen)

    @contextmanager
    def _locking(self, run_id: str) -> Iterator[psycopg.Cursor[Any]]:
        """A transaction whose row locks wait at most `lock_wait` seconds: then `StorageBusyError` says which
        session holds the run (nothing was written)."""
        psycopg = _psycopg()
        try:
            with self._cursor(transaction=True) as cur:
                cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(self.lock_wait * 1000)}ms",))
                yield cur
        except psycopg.errors.LockNotAvailable:
            raise self._busy(run_id) from None

    def _busy(self, run_id: str) -> StorageBusyError:
        """What holds a run's row locked, as far as the server tells: the session whose transaction locked it."""
        try:
            rows = self._fetch(
                "SELECT a.pid, a.usename, a.application_name, host(a.client_addr), a.state,"
                " extract(epoch FROM clock_timestamp() - a.xact_start)::float8, left(a.query, 160)"
                f" FROM {self._runs} r JOIN pg_stat_activity a ON a.backend_xid = r.xmax"
                " WHERE r.run_id = %s", (run_id,))
        except Exception:  # noqa: BLE001 - the refusal stands without the holder's name
            rows = []
        if rows:
            pid, user, app, client, state, age, query = rows[0]
            who = (f"session {pid} (user {user}" + (f", application {app!r}" if app else "")
                   + (f", from {client}" if client else "") + f"), {state or 'active'} (its transaction open "
                   f"{age or 0:.0f} s; its last statement: {query!r})")
            hint = (f"End that transaction (commit or roll it back, or SELECT pg_terminate_backend({pid})), then "
                    "run the same command again; nothing was written.")
        else:
            who = "another session's open transaction (the server did not say which)"
            hint = ("Find it in pg_stat_activity (state 'idle in transaction') and end it, then run the same "
                    "command again; nothing was written.")
        return StorageBusyError(
            f"run {run_id} in PostgreSQL schema {self.schema} stayed locked for {self.lock_wait:g} s by {who}",
            hint=hint, docs=BUSY_DOCS, run_id=run_id)

    def _claim_locked(self, cur: psycopg.Cursor[Any], run_id: str, epoch: int, owner: str, ttl: float,
                      check: Check | None, reopen: bool = False) -> Lease | None:
        """With the run's row locked and its lease free: check the log, cut a torn tail, append the claim; an
        ended run (without `reopen`) leaves the queue instead (None)."""
        data, records, good, torn = self._locked_log(cur, run_id, check)
        if not reopen and ended(records):
            self._unschedule(cur, run_id)
            return None
        self._cut_torn(cur, run_id, data, good)
        epoch += 1
        line = claimed(records, epoch, owner)
        cur.execute(
            f"WITH claimed AS (UPDATE {self._runs} SET epoch = %s, owner = %s,"
            " lease_expires = clock_timestamp() + make_interval(secs => %s),"
            " updated = clock_timestamp(), last = %s, size = %s WHERE run_id = %s RETURNING run_id)"
            f" INSERT INTO {self._records} (run_id, data) SELECT run_id, %s FROM claimed",
            (epoch, owner, ttl, line, good + len(line), run_id, line),
        )
        return Lease(run_id, owner, epoch, {"postgres": self}, records, torn, self._where(run_id), good + len(line))

    def _claim_rows(self, cur: psycopg.Cursor[Any], rows: list[tuple[Any, ...]], owner: str, ttl: float,
                    check: Check | None) -> list[Lease]:
        """With the due runs' rows locked and their leases free, each row (run id, epoch, size, last line, log,
        whether its inbox holds anything) as `PostgresDueQueue._CLAIMABLE` reads them: `_claim_locked` of them all,
        every claim written in one statement. A log read before a write that committed while its row was being
        locked is read again. A log that is damaged, or that `check` refuses, is passed over; an ended run leaves
        the queue."""
        leases, lines, quiet = [], [], []
        for run_id, epoch, size, last, data, signalled in rows:
            data = bytes(data or b"")
            if size != len(data) or bytes(last) != last_line(data):
                cur.execute(f"SELECT string_agg(data, ''::bytea ORDER BY seq) FROM {self._records} WHERE run_id = %s",
                            (run_id,))
                data = bytes(cur.fetchone()[0] or b"")  # type: ignore[index]
            where = self._where(run_id)
            try:
                records, good, torn = parse_log(data, where, partial(self._values, run_id, cur))
                records = checked(records, where, check)
            except CorruptLogError:
                continue
            if ended(records):
                self._unschedule(cur, run_id)
                continue
            self._cut_torn(cur, run_id, data, good)
            epoch += 1
            line = claimed(records, epoch, owner)
            lines.append(line)
            leases.append(Lease(run_id, owner, epoch, {"postgres": self}, records, torn, where, good + len(line)))
            if not signalled:
                quiet.append(run_id)
        if leases:
            cur.execute(
                "WITH u AS (SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bytea[], %s::bigint[])"
                f" AS u(run_id, epoch, line, size)), claimed AS (UPDATE {self._runs} r SET epoch = u.epoch, owner = %s,"
                " lease_expires = clock_timestamp() + make_interval(secs => %s), updated = clock_timestamp(),"
                " last = u.line, size = u.size FROM u WHERE r.run_id = u.run_id RETURNING r.run_id)"
                f" INSERT INTO {self._records} (run_id, data) SELECT u.run_id, u.line FROM u JOIN claimed"
                " ON claimed.run_id = u.run_id",
                ([lease.run_id for lease in leases], [lease.epoch for lease in leases], lines,
                 [lease.size for lease in leases], owner, ttl))
        now = time.monotonic()
        expires = now + QUIET_FOR
        if len(self._quiet) > 1000:  # runs never looked at: forgotten once their answer has lapsed
            self._quiet = {run_id: until for run_id, until in self._quiet.items() if until > now}
        for run_id in quiet:
            self._quiet[run_id] = expires
        return leases

    def _locked_log(self, cur: psycopg.Cursor[Any], run_id: str,
                    check: Check | None) -> tuple[bytes, list[Any], int, str | None]:
        """With the run's row locked: its log's bytes, checked records, the length of its whole lines, the torn tail."""
        # A statement of its own, so it sees every record committed before the row lock was granted.
        cur.execute(
            f"SELECT string_agg(data, ''::bytea ORDER BY seq) FROM {self._records} WHERE run_id = %s", (run_id,)
        )
        data = bytes(cur.fetchone()[0] or b"")  # type: ignore[index]
        records, good, torn = parse_log(data, self._where(run_id), lambda: self._values(run_id, cur))
        return data, checked(records, self._where(run_id), check), good, torn

    def _cut_torn(self, cur: psycopg.Cursor[Any], run_id: str, data: bytes, good: int) -> None:
        """Drop a torn last line (a write cut off by a crash) before appending after it."""
        if good < len(data):
            cur.execute(f"DELETE FROM {self._records} WHERE run_id = %s", (run_id,))
            cur.execute(f"INSERT INTO {self._records} (run_id, data) VALUES (%s, %s)", (run_id, data[:good]))

    def _do_amend(self, run_id: str, choose: Choose, check: Check | None) -> bool:
        """Append the lines `choose` returns to a run no live owner holds (database clock) in one transaction
        with the run's row locked, without a claim or a new epoch; a lapsed owner loses its lease (owner
        cleared, which every fenced write checks). False while a live owner holds it."""
        with self._locking(run_id) as cur:
            cur.execute(
                f"SELECT owner IS NOT NULL AND lease_expires >= clock_timestamp(), state FROM {self._runs}"
                " WHERE run_id = %s FOR UPDATE",
                (run_id,),
            )
            row = cur.fetchone()
            if row is None:
                raise self._missing(run_id)
            if row[0]:
                return False
            state = row[1] or OPEN
            data, records, good, _ = self._locked_log(cur, run_id, check)
            line = choose(records, self._where(run_id))
            if line is None:
                return True
            self._cut_torn(cur, run_id, data, good)
            if amended_values(choose):
                self._keep_values(cur, run_id, amended_values(choose))
            cur.execute(
                f"UPDATE {self._runs} SET owner = NULL, lease_expires = NULL, updated = clock_timestamp(),"
                " last = %s, size = %s, state = %s WHERE run_id = %s",
                (last_line(line), good + len(line), state_after(state, line), run_id),
            )
            cur.execute(f"INSERT INTO {self._records} (run_id, data) VALUES (%s, %s)", (run_id, line))
        self.fsyncs += 1
        return True

    def _do_heartbeat(self, lease: Lease, ttl: float) -> bool:
        """Extend the lease to `ttl` seconds from now (database clock); False when it was lost."""
        ttl = min(ttl, MAX_TTL)
        if not self._mine(lease):
            return False
        return self._write(
            f"UPDATE {self._runs} SET lease_expires = clock_timestamp() + make_interval(secs => %s) WHERE {_FENCE}",
            (ttl, lease.run_id, lease.epoch, lease.owner),
        ) > 0

    def release(self, lease: Lease) -> None:
        """Give the lease up; a stale lease leaves the current one alone."""
        if not self._mine(lease):
            return
        try:  # after the lease's appends still pending, in the next group commit
            self._committer.call(Write("end", lease))
        except LeaseLostError:
            pass
        self._synced.pop((lease.run_id, lease.epoch), None)

    def lease_of(self, run_id: str) -> tuple[str, float] | None:
        """The owner of the run's unexpired lease and when it lapses unless renewed (epoch seconds, this
        machine's clock; the database's clock decides how much is left), or None while no owner holds it."""
        validate_run_id(run_id)
        rows = self._fetch(
            f"SELECT owner, extract(epoch from lease_expires - clock_timestamp()) FROM {self._runs} "
            "WHERE run_id = %s AND owner IS NOT NULL AND lease_expires >= clock_timestamp()", (run_id,))
        return (rows[0][0], time.time() + float(rows[0][1])) if rows else None

    def _do_held(self, run_id: str) -> bool:
        """True while an owner holds an unexpired lease (database clock)."""
        rows = self._fetch(
            f"SELECT owner IS NOT NULL AND lease_expires >= clock_timestamp() FROM {self._runs} WHERE run_id = %s",
            (run_id,),
        )
        return bool(rows and rows[0][0])

    claims_ahead = True
    """A claim is a round trip to the server: a worker whose slots are all busy claims the runs for the slots that
    free next on a thread meanwhile (`Worker._claim_ahead`)."""

    groups_appends = True
    """Appends are committed in groups (`pgcommit`): `RunLog` hands a step's record in with `append_soon` and
    awaits its commit before the step's result goes back to the workflow."""

    def append_soon(self, lease: Lease, data: bytes) -> Future[Any] | asyncio.Future[Any]:
        """`append` without waiting: the lines go into the next group commit, in order after the lease's earlier
        writes; the future holds None once they are durable, or the error that kept them out (`LeaseLostError`
        for a lease no longer current: then nothing after it is kept either). Called on a thread running an
        asyncio loop, the future is that loop's (awaitable there); else a `concurrent.futures.Future`."""
        if type(data) is not bytes or not data.endswith(b"\n"):
            data = validate_lines(data)
        blobs: dict[str, bytes] | None = None
        if len(data) >= LINE_MIN and enabled(self.values_once):
            kept = lease.state.setdefault("kept_values", set())
            data, blobs = externalise(data, kept)
            kept.update(blobs)  # the same group commit keeps them, before the lines that refer to them
        if not self._mine(lease):
            lost: Future[Any] = Future()
            lost.set_exception(self._lost(lease))
            return lost
        return self._committer.submit(Write("append", lease, data, blobs or None), soon=True)

    def _do_append(self, lease: Lease, data: bytes) -> None:
        """Append complete lines in the next group commit, fenced by the lease's epoch and owner; returns once
        it is durable."""
        if not self._mine(lease):
            raise self._lost(lease)
        self._committer.call(Write("append", lease, bytes(data)))

    def _do_append_values(self, lease: Lease, data: bytes, blobs: dict[str, bytes]) -> None:
        """Keep the run's new stored values and append the lines that refer to them in the next group commit,
        fenced by the lease's epoch and owner (a lost lease keeps neither)."""
        if not self._mine(lease):
            raise self._lost(lease)
        self._committer.call(Write("append", lease, bytes(data), blobs))

    def _do_keep_values(self, lease: Lease, blobs: dict[str, bytes]) -> None:
        """Keep the run's new stored values (before a `rewrite` that refers to them)."""
        with self._cursor(transaction=True) as cur:
            self._keep_values(cur, lease.run_id, blobs)

    def _keep_values(self, cur: psycopg.Cursor[Any], run_id: str, blobs: dict[str, bytes]) -> None:
        cur.executemany(f"INSERT INTO {self._run_blobs} (run_id, digest, data) VALUES (%s, %s, %s)"
                        " ON CONFLICT DO NOTHING", [(run_id, digest, value) for digest, value in blobs.items()])

    def _values(self, run_id: str, cur: psycopg.Cursor[Any] | None = None) -> dict[str, bytes]:
        """The stored values of a run by digest (`valuestore`), in the transaction of `cur` when given."""
        query, params = f"SELECT digest, data FROM {self._run_blobs} WHERE run_id = %s", (run_id,)
        if cur is None:
            rows = self._fetch(query, params)
        else:
            cur.execute(query, params)
            rows = cur.fetchall()
        return {digest: bytes(data) for digest, data in rows}

    def sync(self, lease: Lease) -> None:
        """Wait for the lease's appends still pending to be committed and check the lease, in the next group
        commit (every commit is durable: ``synchronous_commit = on``); count a durable commit when the log grew."""
        if not self._mine(lease):
            raise self._lost(lease)
        self._count(lease, self._committer.call(Write("sync", lease)))

    def _count(self, lease: Lease, size: int) -> None:
        key = (lease.run_id, lease.epoch)
        if self._synced.get(key) != size:
            self._synced[key] = size
            self.fsyncs += 1

    def sync_all(self, leases: list[Lease]) -> None:
        """`sync` the leases in one group commit."""
        for lease in leases:
            if not self._mine(lease):
                raise self._lost(lease)
        futures = [self._committer.submit(Write("sync", lease)) for lease in leases]
        for lease, future in zip(leases, futures, strict=True):
            self._count(lease, future.result())

    def finish_all(self, leases: list[Lease]) -> list[BaseException | None]:
        """End the leases in the next group commit, after their appends still pending: each lease checked and
        released and its run's queue row (and joins) deleted; one WAL flush for the group."""
        futures = [self._committer.submit(Write("end", lease, unschedule=True)) if self._mine(lease) else None
                   for lease in leases]
        errors: list[BaseException | None] = []
        for lease, future in zip(leases, futures, strict=True):
            if future is None:
                errors.append(self._lost(lease))
                continue
            error = future.exception()
            if error is not None and not isinstance(error, LeaseLostError):
                raise error
            errors.append(error)
            self._synced.pop((lease.run_id, lease.epoch), None)
        self.fsyncs += 1
        return errors

    def finish_soon(self, leases: list[Lease]) -> list[asyncio.Future[Any]]:
        """`finish_all` without waiting, from a thread running an asyncio loop: each lease's end goes into the next
        group commit with the records the loop's current pass hands in (`append_soon`), and its future (the
        loop's) holds None once it is durable, or the error that kept it out (`LeaseLostError` for a lease no
        longer current). No worker thread stands between the loop and the committer."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = []
        for lease in leases:
            if self._mine(lease):
                future = self._committer.submit(Write("end", lease, unschedule=True), soon=True)
                assert isinstance(future, asyncio.Future)
            else:
                future = loop.create_future()
                future.set_exception(self._lost(lease))
            futures.append(future)
            self._synced.pop((lease.run_id, lease.epoch), None)
        self.fsyncs += 1
        return futures

    def _do_size(self, run_id: str) -> int:
        """Bytes of the run's log."""
        rows = self._fetch(f"SELECT size FROM {self._runs} WHERE run_id = %s", (run_id,))
        if not rows:
            raise self._missing(run_id)
        return int(rows[0][0])

    def _do_rewrite(self, lease: Lease, data: bytes) -> None:
        """Replace the whole log with `data` in one durable transaction; the lease stays current."""
        header = data[: data.index(b"\n") + 1]
        if not self._mine(lease):
            raise self._lost(lease)
        with self._cursor(transaction=True) as cur:
            cur.execute(
                f"UPDATE {self._runs} SET header = %s, last = %s, size = %s, updated = clock_timestamp(), state = %s"
                f" WHERE {_FENCE}",
                (header, last_line(data), len(data), state_after(OPEN, data), lease.run_id, lease.epoch, lease.owner),
            )
            if cur.rowcount == 0:
                raise self._lost(lease)
            cur.execute(f"DELETE FROM {self._records} WHERE run_id = %s", (lease.run_id,))
            cur.execute(f"INSERT INTO {self._records} (run_id, data) VALUES (%s, %s)", (lease.run_id, data))
        self.fsyncs += 1
        self._synced[(lease.run_id, lease.epoch)] = len(data)

    # ---- identities ---------------------------------------------------------------------------
    def _do_bind(self, identity: str, run_id: str, expect: str | None) -> bool:
        """Point `identity` at `run_id` if it still points at `expect` (None: at nothing); False if not."""
        if expect is None:
            return self._write(
                f"INSERT INTO {self._identities} (digest, identity, run_id) VALUES (%s, %s, %s)"
                " ON CONFLICT (digest) DO NOTHING",
                (_digest(identity), identity, run_id),
            ) == 1
        return self._write(
            f"UPDATE {self._identities} SET run_id = %s WHERE digest = %s AND run_id = %s",
            (run_id, _digest(identity), expect),
        ) == 1

    def _do_lookup(self, identity: str) -> str | None:
        """The run `identity` is bound to, if any."""
        rows = self._fetch(f"SELECT run_id FROM {self._identities} WHERE digest = %s", (_digest(identity),))
        return rows[0][0] if rows else None

    def _do_lookup_many(self, identities: list[str]) -> list[str | None]:
        """The run each identity is bound to (None where none), in order, in one query (``= ANY`` of their
        digests): one round trip for the whole batch, none for an empty one."""
        digests = [_digest(identity) for identity in identities]
        if not digests:
            return []
        rows = self._fetch(f"SELECT digest, run_id FROM {self._identities} WHERE digest = ANY(%s)", (digests,))
        found = {digest: run_id for digest, run_id in rows}
        return [found.get(digest) for digest in digests]

    def _do_create_bound(self, runs: list[NewRun], headers: list[dict[str, Any]]) -> str | None:
        """Bind and create the runs in one transaction: one durable commit and a handful of statements for the
        whole batch (each one row per run, from arrays), not a commit per bind and per create. The identities
        are locked first (``FOR UPDATE``), so the batch stops at the first one not bound as its run expects,
        as a bind would. A batch that names one identity twice, or that another process races (a binding or a
        run id that appears meanwhile), is rolled back and made one bind and one create at a time instead."""
        fields = [header_fields(header) for header in headers]
        places = [queue_fields(header) for header in headers]
        digests = [_digest(run.identity) for run in runs]
        if not runs:
            return None
        if len(set(digests)) != len(digests):
            return bind_and_create(self, runs)
        try:
            lost = self._create_batch(runs, digests, fields, places)
        except _Raced:
            return bind_and_create(self, runs)
        self.fsyncs += 1
        return lost

    def _create_batch(self, runs: list[NewRun], digests: list[str],
                      fields: list[tuple[str | None, str | None, str | None]],
                      places: list[tuple[str, str | None]]) -> str | None:
        """`create_bound` of distinct identities as one transaction; `_Raced` (rolled back) if it cannot stand."""
        with self._cursor(transaction=True) as cur:
            cur.execute(f"SELECT digest, run_id FROM {self._identities} WHERE digest = ANY(%s) FOR UPDATE",
                        (digests,))
            bound = dict(cur.fetchall())
            take, lost = len(runs), None
            for i, run in enumerate(runs):
                if bound.get(digests[i]) != run.expect:
                    take, lost = i, run.identity
                    break
            if take == 0:
                return lost
            fresh = [i for i in range(take) if runs[i].expect is None]
            moved = [i for i in range(take) if runs[i].expect is not None]
            if fresh:
                cur.execute(f"INSERT INTO {self._identities} (digest, identity, run_id)"
                            " SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]) ON CONFLICT (digest) DO NOTHING",
                            ([digests[i] for i in fresh], [runs[i].identity for i in fresh],
                             [runs[i].run_id for i in fresh]))
                if cur.rowcount != len(fresh):
                    raise _Raced()
            if moved:
                cur.execute(f"UPDATE {self._identities} AS i SET run_id = u.run_id"
                            " FROM unnest(%s::text[], %s::text[], %s::text[]) AS u(digest, run_id, expect)"
                            " WHERE i.digest = u.digest AND i.run_id = u.expect",
                            ([digests[i] for i in moved], [runs[i].run_id for i in moved],
                             [runs[i].expect for i in moved]))
                if cur.rowcount != len(moved):
                    raise _Raced()
            now = time.time()
            cur.execute(
                f"WITH created AS (INSERT INTO {self._runs} (run_id, header, last, size, workflow, key, parent, state)"
                " SELECT r, h, h, length(h), w, k, p, 'open'"
                " FROM unnest(%s::text[], %s::bytea[], %s::text[], %s::text[], %s::text[]) AS u(r, h, w, k, p)"
                " ON CONFLICT (run_id) DO NOTHING RETURNING run_id, header),"
                f" queued AS (INSERT INTO {self._queue} (run_id, due, priority, created, queue_name, partition_name)"
                " SELECT c.run_id, coalesce(u.due, %s), u.priority, %s, u.q, u.pt FROM created c"
                " JOIN unnest(%s::text[], %s::float8[], %s::bigint[], %s::text[], %s::text[])"
                " AS u(r, due, priority, q, pt) ON u.r = c.run_id"
                " ON CONFLICT (run_id) DO NOTHING)"
                f" INSERT INTO {self._records} (run_id, data) SELECT run_id, header FROM created",
                ([run.run_id for run in runs[:take]], [bytes(run.header) for run in runs[:take]],
                 *([f[j] for f in fields[:take]] for j in range(3)), now, now,
                 [run.run_id for run in runs[:take]], [run.at for run in runs[:take]],
                 [run.priority for run in runs[:take]], *([p[j] for p in places[:take]] for j in range(2))),
            )
            if cur.rowcount != take:
                raise _Raced()  # a run id that exists: one at a time, `create` says which
            cur.execute("SELECT pg_notify(%s, '')", (self._channel,))
        return lost

    # ---- listing ------------------------------------------------------------------------------
    def _do_info(self, run_id: str) -> RunInfo | None:
        """One run's header, last record and held flag (None if unknown)."""
        found = self._infos("WHERE run_id = %s", (run_id,))
        return found[0] if found else None

    def _do_list_runs(self, limit: int | None, offset: int, where: dict[str, Any]) -> list[RunInfo]:
        """Runs matching the filter (`catalog.RunFilter`), most recently updated first, from indexed columns."""
        clause, params = RunFilter.of(**where).where("%s", "to_timestamp({})")
        return self._infos((f"WHERE {clause} " if clause else "")
                           + "ORDER BY updated DESC, run_id DESC LIMIT %s OFFSET %s", (*params, limit, offset))

    def count_runs(self, **where: Any) -> int:
        """How many runs match the filter."""
        clause, params = RunFilter.of(**where).where("%s", "to_timestamp({})")
        rows = self._fetch(f"SELECT count(*) FROM {self._runs}" + (f" WHERE {clause}" if clause else ""),
                           tuple(params))
        return int(rows[0][0])

    def _do_delete(self, run_id: str) -> int | None:
        """Remove a run, its records, inbox, queue row and identity bindings in one transaction; the bytes
        freed, None (nothing removed) while an owner holds its lease, 0 for an unknown run."""
        with self._locking(run_id) as cur:
            cur.execute(f"SELECT owner IS NOT NULL AND lease_expires >= clock_timestamp() FROM {self._runs}"
                        " WHERE run_id = %s FOR UPDATE", (run_id,))
            row = cur.fetchone()
            if row is None:
                return 0
            if row[0]:
                return None
            cur.execute(f"SELECT coalesce(sum(length(data)), 0) FROM {self._records} WHERE run_id = %s", (run_id,))
            freed = int(cur.fetchone()[0])  # type: ignore[index]
            cur.execute(f"SELECT coalesce(sum(length(data)), 0) FROM {self._signals} WHERE run_id = %s", (run_id,))
            freed += int(cur.fetchone()[0])  # type: ignore[index]
            cur.execute(f"SELECT coalesce(sum(length(data)), 0) FROM {self._run_blobs} WHERE run_id = %s", (run_id,))
            freed += int(cur.fetchone()[0])  # type: ignore[index]
            for table in (self._records, self._signals, self._run_blobs, self._queue, self._identities, self._runs):
                cur.execute(f"DELETE FROM {table} WHERE run_id = %s", (run_id,))
            self._partials.delete(cur, run_id)
        return freed

    def _infos(self, clause: str, params: tuple[Any, ...]) -> list[RunInfo]:
        rows = self._fetch(
            "SELECT run_id, header, last, owner IS NOT NULL AND lease_expires >= clock_timestamp(),"
            f" extract(epoch FROM updated)::float8, epoch, state FROM {self._runs} {clause}",
            params,
        )
        infos = []
        for run_id, header_line, last, held, updated, epoch, state in rows:
            header = decode_record(bytes(header_line)) or {}
            last = resolve_line(bytes(last), partial(self._values, run_id))
            infos.append(RunInfo(run_id, header, decode_record(last) or header, bool(held), updated, epoch, state))
        return infos

    # ---- workers ------------------------------------------------------------------------------
    def _do_advertise(self, owner: str, line: bytes, ttl: float) -> None:
        """Upsert the worker's row, live until `ttl` seconds from now (database clock); rows of workers gone
        a minute are dropped."""
        ttl = min(ttl, MAX_TTL)
        with self._cursor(transaction=True) as cur:
            cur.execute(f"INSERT INTO {self._workers} (owner, info, expires)"
                        " VALUES (%s, %s, clock_timestamp() + make_interval(secs => %s)) ON CONFLICT (owner)"
                        " DO UPDATE SET info = excluded.info, expires = excluded.expires", (owner, line, ttl))
            cur.execute(f"DELETE FROM {self._workers} WHERE expires < clock_timestamp() - interval '1 minute'")

    def _do_retire(self, owner: str) -> None:
        """Delete the worker's row."""
        self._write(f"DELETE FROM {self._workers} WHERE owner = %s", (owner,))

    def workers(self) -> list[dict[str, Any]]:
        """The rows of live workers (database clock)."""
        rows = self._fetch(f"SELECT info FROM {self._workers} WHERE expires >= clock_timestamp()", ())
        return [found for row in rows if (found := decode_worker(bytes(row[0]))) is not None]

    # ---- blobs --------------------------------------------------------------------------------
    def _do_keep_blob(self, digest: str, data: bytes) -> None:
        self._write(f"INSERT INTO {self._blobs} (digest, data) VALUES (%s, %s) ON CONFLICT (digest) DO NOTHING",
                    (digest, data))

    def _do_blob(self, digest: str) -> bytes | None:
        rows = self._fetch(f"SELECT data FROM {self._blobs} WHERE digest = %s", (digest,))
        return bytes(rows[0][0]) if rows else None
