"""Runs in one SQLite database (stdlib ``sqlite3``, WAL, ``synchronous=NORMAL``), shareable by processes.

Tables: ``runs`` (one row per run: its number ``num``, header line, times (``updated``, indexed for the catalog, at a claim, park,
end or operator record), lease epoch/owner/expiry, last line and log size as of that write (a step leaves the row
alone: it is the fenced insert of its records and nothing else, so for an open run a reader takes the last line and
the size from the records, `_infos`), and a
count of durable commits: a commit that changes nothing writes nothing, so `sync` bumps it to force a WAL write),
``records`` (the log as appended chunks of lines, keyed by ``seq`` = the run's ``num`` * 2**32 + the append's
number: a run's records are one range of the table's own key, so an append writes that b-tree alone and a new
run's header goes at its end; before schema 10 they carried the run's id, with an index on it, and are moved on
first open, `_move_records`), ``identities`` (identity -> run id) and
``run_blobs`` (each run's stored values, `valuestore`: written in the transaction of the record that first refers
to them), ``signals`` (each run's inbox of unacknowledged signal lines, in ``seq`` order; sends commit durably) and
``queue`` (one row per run that has not ended: due time, priority, the signals that wake it; the due query
reads this small table and its index, never the logs of ended runs), ``workers`` (live workers' advertisements)
and ``limits`` (one JSON document per flow-control key, changed in one ``BEGIN IMMEDIATE`` transaction).
Each append is one committed transaction, so it survives a crash of the process; with ``synchronous=NORMAL``
it may not survive a machine crash until `sync`, which commits once with ``synchronous=FULL`` (the WAL is
fsynced, carrying every earlier commit with it) and counts that as one fsync.

Leases are time-based: a claim holds for `ttl` seconds (renewed by `heartbeat`), after which another owner
may claim. Every claim bumps the run's epoch and appends are ``WHERE epoch = ?``-fenced (a step's insert reads
the fence from the run's row in the same statement), so an expired lease keeps appending only until someone else
actually claims. One connection is shared by the
threads of a process behind a lock; other processes coordinate through SQLite's own locking.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import (
    CorruptLogError,
    LeaseLostError,
    NotSupportedError,
    RunNotFoundError,
    StorageBusyError,
    StorageFullError,
    ValidationError,
)
from ..records import is_end_line, is_open_line, kind_of, may_change_state
from .base import (
    Check,
    Choose,
    Lease,
    LimitStep,
    Log,
    NewRun,
    QueueEntry,
    QueueStats,
    RunInfo,
    checked,
    claimed,
    decode_record,
    decode_signal,
    decode_worker,
    ended,
    last_line,
    parse_log,
    sorted_stats,
    sync_each,
    validate_run_id,
)
from .catalog import OPEN, RunFilter, header_fields, queue_fields, state_after
from .front import StorageFront, amended_values
from .partials import SQLITE_TABLE
from .sqlitegate import WriteGate
from .valuestore import LINE_MIN, TOKEN, resolve_line
from .wakeup import LocalWakeups

SCHEMA_VERSION = 10  # 2 added signals, 3 the queue, 4 joins, 5 workers, 6 queue_next, 7 limits, 8 named queues (`_ensure_places`), 9 queue_due, 10 records keyed by run number (`_move_records`); every statement below is idempotent, so older files just upgrade
_RUNS = """CREATE TABLE IF NOT EXISTS {name} (
    num INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL UNIQUE,
    epoch INTEGER NOT NULL DEFAULT 0,
    owner TEXT,
    lease_expires REAL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    size INTEGER NOT NULL,
    syncs INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'open',
    workflow TEXT,
    key TEXT,
    parent TEXT,
    touched REAL,
    header BLOB NOT NULL,
    last BLOB NOT NULL
)"""
"""The runs table since schema 10: ``num`` (the rowid, so VACUUM keeps it) numbers a run's records; the lease's
columns come first, so a step's fence reads them without a long header's overflow pages."""
_RUN_COLUMNS = ("run_id", "header", "created", "updated", "epoch", "owner", "lease_expires", "last", "size", "syncs",
                "workflow", "key", "parent", "state", "touched")
_RECORDS = """CREATE TABLE IF NOT EXISTS {name} (
    seq INTEGER PRIMARY KEY,
    data BLOB NOT NULL
)"""
"""The log since schema 10: a run's appends in ``seq`` order, ``seq`` = the run's ``num`` * `SPAN` + its append's
number (0: the header), so a run's records are one range of the table's own key: no second index to write per
append, and a new run's header goes at the table's end."""
SPAN = 1 << 32
"""Sequence numbers per run."""
_SCHEMA = _RUNS.format(name="runs") + ";" + _RECORDS.format(name="records") + """;
CREATE TABLE IF NOT EXISTS identities (
    identity TEXT PRIMARY KEY,
    run_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS signals (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    id TEXT NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS signals_by_run ON signals (run_id, seq);
CREATE TABLE IF NOT EXISTS queue (
    run_id TEXT PRIMARY KEY,
    due REAL,
    priority INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    wait TEXT NOT NULL DEFAULT '[]',
    queue_name TEXT NOT NULL DEFAULT 'default',
    partition_name TEXT
);
CREATE INDEX IF NOT EXISTS queue_due ON queue (priority DESC, due, created, run_id) WHERE due IS NOT NULL;
DROP INDEX IF EXISTS queue_by_due;
CREATE INDEX IF NOT EXISTS queue_next ON queue (due) WHERE due IS NOT NULL;
CREATE TABLE IF NOT EXISTS joins (
    parent TEXT NOT NULL,
    child TEXT NOT NULL,
    PRIMARY KEY (parent, child)
);
CREATE INDEX IF NOT EXISTS joins_by_child ON joins (child);
CREATE TABLE IF NOT EXISTS workers (
    owner TEXT PRIMARY KEY,
    info BLOB NOT NULL,
    expires REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS limits (
    key TEXT PRIMARY KEY,
    doc BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY,
    data BLOB NOT NULL
);
"""
_RUN_BLOBS = """CREATE TABLE IF NOT EXISTS run_blobs (
    run_id TEXT NOT NULL,
    digest TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (run_id, digest)
)"""  # created at every open (idempotent), so it needs no schema version of its own
_FENCE = "run_id = ? AND epoch = ? AND owner IS NOT NULL"
_OF_RUN = f"records.seq BETWEEN runs.num * {SPAN} AND runs.num * {SPAN} + {SPAN - 1}"
"""The records of the run of a statement over ``runs`` (a range of ``records``' key)."""
_LOG_SIZE = f"(SELECT coalesce(sum(length(data)), 0) FROM records WHERE {_OF_RUN})"
"""A run's log size from its records, in a statement over ``runs``."""
_LAST_SEQ = f"(SELECT max(seq) FROM records WHERE {_OF_RUN})"
"""The sequence number of a run's latest append (one seek), in a statement over ``runs``."""
_LAST_CHUNK = f"(SELECT data FROM records WHERE {_OF_RUN} ORDER BY seq DESC LIMIT 1)"
"""A run's latest append (one or more lines), in a statement over ``runs``."""
_STEP = "INSERT INTO records (seq, data) SELECT ?, ? FROM runs WHERE num = ? AND " + _FENCE
"""A step's fenced insert at the sequence number its lease expects (`_insert_fenced`)."""
_STEP_AT_END = (f"INSERT INTO records (seq, data) SELECT coalesce({_LAST_SEQ} + 1, num * {SPAN}), ? FROM runs WHERE "
                + _FENCE)
"""A step's fenced insert after the run's latest append, wherever that is."""
TRANSACTION_DOCS = "docs/policies.md#transactional-steps"
_LOOKUP_CHUNK = 500  # identities per SELECT of `lookup_many` (SQLite before 3.32 binds at most 999 variables)


class SqliteStorage(StorageFront):
    """Runs as rows of one SQLite database file; the connection opens on first use."""

    def __init__(self, path: str | os.PathLike[str] = ".durably/durably.db", *, timeout: float = 30.0,
                 values_once: bool | None = None) -> None:
        self.path = os.fspath(path)
        self.values_once = values_once
        self.timeout = timeout
        self.compact_above_bytes: int | None = None
        self.fsyncs = 0
        self._conn: sqlite3.Connection | None = None
        self._steps: sqlite3.Cursor | None = None  # the connection's cursor for steps' inserts (`append`)
        self._lock = threading.RLock()

        self._synced: dict[tuple[str, int], int | None] = {}  # (run, epoch) -> its latest append's seq at `sync`
        self._idle: list[sqlite3.Connection] = []  # connections of finished `transaction()`s, kept for the next
        self.wakeups = LocalWakeups(f"{self.path}.wake" if self.path != ":memory:" else os.devnull)
        self._gate = WriteGate(f"{self.path}.gate", timeout) if self.path != ":memory:" else None

    def __repr__(self) -> str:
        return f"SqliteStorage({self.path!r})"

    def _db(self) -> sqlite3.Connection:
        """The shared connection, opened (and the schema created) on first use; call with the lock held."""
        if self._conn is None:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False,
                                   factory=_Connection)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            with _transaction(conn):
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version < SCHEMA_VERSION:
                    keyed_by_id = "run_id" in {row[1] for row in conn.execute("PRAGMA table_info(records)")}
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    _ensure_places(conn)
                    if 0 < version < 3:
                        _queue_unended(conn)
                    if keyed_by_id:  # before schema 10: the catalog as that layout had it, then the records moved
                        _ensure_catalog(conn)
                        _move_records(conn)
                    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                _ensure_catalog(conn)
                conn.execute(_RUN_BLOBS)
            if self._gate is not None:  # after the schema's transaction, which creates a new file's WAL (slow, not waited)
                self._gate.version = partial(_data_version, conn)
                conn.gate = self._gate
            self._conn = conn
            self._steps = conn.cursor()
        return self._conn

    def close(self) -> None:
        """Close the connection (it reopens on next use)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = self._steps = None
            while self._idle:
                self._idle.pop().close()
            if self._gate is not None:
                self._gate.close()

    exclusive = True  # `roles.Transactions`: a transaction holds the database's one write lock

    def transaction(self) -> SqliteTransaction:
        """A write transaction (``BEGIN IMMEDIATE``) on a connection of its own to this database file, for an
        application's tables in the same file and a run's records together (`roles.Transactions`)."""
        if self.path == ":memory:":
            raise NotSupportedError("ctx.transaction needs a SQLite database file, not ':memory:'",
                                    hint="SqliteStorage('app.db'): the application's tables and the runs in one file.",
                                    docs=TRANSACTION_DOCS, feature="ctx.transaction", mode="sqlite :memory:")
        with self._lock:
            self._db()  # the schema exists before the transaction writes to it
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA synchronous=NORMAL")
        try:
            conn.execute("BEGIN IMMEDIATE")
        except BaseException as exc:
            conn.close()
            full = _full(exc)
            if full is exc:
                raise
            raise full from exc
        return SqliteTransaction(self, conn)

    def reuse(self, conn: sqlite3.Connection) -> None:
        """Keep a finished transaction's connection for the next one (a few at most)."""
        with self._lock:
            if len(self._idle) < 4:
                self._idle.append(conn)
                return
        conn.close()

    def _sync_wal(self) -> None:
        """fsync the write-ahead log from this thread, holding no lock: every transaction committed before the
        call is then on disk (what ``synchronous=FULL`` does at a commit, without holding the write lock
        meanwhile); a checkpoint already made what it moved into the database file durable."""
        for path in (f"{self.path}-wal", self.path):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            break
        self.fsyncs += 1

    def _do_create(self, run_id: str, header: bytes, record: dict[str, Any], at: float | None,
                   priority: int) -> None:
        """Create a run whose log starts with the `header` line, queued due at `at` (None: now), in one
        transaction; `ValidationError` if the id exists."""
        fields = header_fields(record)
        with self._lock, _transaction(self._db()) as db:
            self._insert_run(db, run_id, bytes(header), fields, queue_fields(record), at, priority)
        self.wakeups.notify()

    def _insert_run(self, db: sqlite3.Connection, run_id: str, header: bytes, fields: tuple[Any, ...],
                    place: tuple[str, str | None], at: float | None, priority: int) -> None:
        """Insert a new run's row, header record and queue entry (inside the caller's transaction)."""
        now = time.time()
        try:
            num = db.execute(
                "INSERT INTO runs (run_id, header, created, updated, last, size, workflow, key, parent, state)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, header, now, now, header, len(header), *fields, OPEN),
            ).lastrowid
        except sqlite3.IntegrityError:
            raise ValidationError(f"run {run_id} already exists in {self.path}", run_id=run_id) from None
        assert num is not None  # the row's num, its rowid
        db.execute("INSERT INTO records (seq, data) VALUES (?, ?)", (num * SPAN, header))
        db.execute("INSERT OR REPLACE INTO queue (run_id, due, priority, created, queue_name, partition_name)"
                   " VALUES (?, ?, ?, ?, ?, ?)", (run_id, now if at is None else at, priority, now, *place))

    def _do_read(self, run_id: str) -> Log | None:
        """All records of a run (None if unknown)."""
        with self._lock, _transaction(self._db(), "BEGIN") as db:
            row = db.execute("SELECT num FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                return None
            data = _log_of(db, row[0])[0]
            values = _run_values(db, run_id) if TOKEN in data else {}
        records, _, torn = parse_log(data, self._where(run_id), lambda: values)
        return Log(records, torn, self._where(run_id))

    def _where(self, run_id: str) -> str:
        """How errors name a run's log."""
        return f"run {run_id} in {self.path}"

    def _do_claim(self, run_id: str, owner: str, ttl: float, check: Check | None, reopen: bool) -> Lease | None:
        """Take the lease if it is free, released or expired; bumps the epoch and appends the claim record. An
        ended run (without `reopen`) is refused and taken out of the queue, in the same transaction."""
        with self._lock, self._claiming(run_id) as db:
            return self._claim_in(db, run_id, owner, ttl, check, reopen)

    def _claim_in(self, db: sqlite3.Connection, run_id: str, owner: str, ttl: float, check: Check | None,
                  reopen: bool) -> Lease | None:
        """`claim` inside the caller's write transaction."""
        row = db.execute("SELECT num, epoch, owner, lease_expires FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFoundError(f"no run {run_id} in {self.path}", run_id=run_id)
        num, epoch, holder, expires = row
        now = time.time()
        if holder is not None and expires >= now:
            return None
        data, records, good, torn, seq = self._checked_log(db, run_id, num, check)
        if not reopen and ended(records):
            _unschedule(db, run_id)
            return None
        seq = _cut_torn(db, num, data, good, seq) + 1
        epoch += 1
        line = claimed(records, epoch, owner)
        db.execute("INSERT INTO records (seq, data) VALUES (?, ?)", (seq, line))
        db.execute(
            "UPDATE runs SET epoch = ?, owner = ?, lease_expires = ?, updated = ?, last = ?, size = ?"
            " WHERE num = ?",
            (epoch, owner, now + ttl, now, line, good + len(line), num),
        )
        return Lease(run_id, owner, epoch, {"sqlite": self, "seq": seq + 1}, records, torn, self._where(run_id),
                     good + len(line))

    @contextmanager
    def _claiming(self, run_id: str) -> Iterator[sqlite3.Connection]:
        """A write transaction for a claim or an amend: waits for the database's write lock at most `timeout`
        seconds, then says so (another connection holds it: a process stopped inside a transaction, or an
        open `sqlite3` shell) instead of SQLite's bare "database is locked"."""
        try:
            with _transaction(self._db()) as db:
                yield db
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            raise StorageBusyError(
                f"run {run_id}: the SQLite database {self.path} stayed locked by another connection for "
                f"{self.timeout:g} s ({exc})", run_id=run_id,
                hint="Another process holds a write transaction open (a stopped process, or a `sqlite3` shell "
                     "inside BEGIN): end it, then run the same command again; nothing was written.",
                docs="docs/storage.md#waiting-for-a-locked-run") from None

    def _checked_log(self, db: sqlite3.Connection, run_id: str, num: int,
                     check: Check | None) -> tuple[bytes, list[Any], int, str | None, int | None]:
        """Inside a transaction: the log's bytes, its checked records, the length of its whole lines, the torn tail,
        the sequence number of its latest append."""
        data, seq = _log_of(db, num)
        records, good, torn = parse_log(data, self._where(run_id), lambda: _run_values(db, run_id))
        return data, checked(records, self._where(run_id), check), good, torn, seq

    def _do_amend(self, run_id: str, choose: Choose, check: Check | None) -> bool:
        """Append the lines `choose` returns to a run no live owner holds in one transaction, without a claim or
        a new epoch; a lapsed owner loses its lease (owner cleared). False while a live owner holds it."""
        with self._lock:
            db = self._db()
            with self._claiming(run_id):
                row = db.execute("SELECT num, owner, lease_expires, state FROM runs WHERE run_id = ?",
                                 (run_id,)).fetchone()
                if row is None:
                    raise RunNotFoundError(f"no run {run_id} in {self.path}", run_id=run_id)
                num, holder, expires, state = row
                now = time.time()
                if holder is not None and expires >= now:
                    return False
                data, records, good, _, seq = self._checked_log(db, run_id, num, check)
                line = choose(records, self._where(run_id))
                if line is None:
                    return True
                seq = _cut_torn(db, num, data, good, seq)
                db.executemany("INSERT OR IGNORE INTO run_blobs (run_id, digest, data) VALUES (?, ?, ?)",
                               [(run_id, digest, value) for digest, value in amended_values(choose).items()])
                db.execute("INSERT INTO records (seq, data) VALUES (?, ?)", (seq + 1, line))
                db.execute("UPDATE runs SET owner = NULL, lease_expires = NULL, updated = ?, last = ?, size = ?,"
                           " state = ? WHERE num = ?",
                           (now, last_line(line), good + len(line), state_after(state or OPEN, line), num))
            with _durable(self, db) as tx:  # the WAL, with the commit above, on disk
                tx.execute("UPDATE runs SET syncs = syncs + 1 WHERE run_id = ?", (run_id,))
        return True

    def _do_heartbeat(self, lease: Lease, ttl: float) -> bool:
        """Extend the lease to `ttl` seconds from now; False when it was lost."""
        if lease.state.get("sqlite") is not self:
            return False
        with self._lock, _transaction(self._db()) as db:
            cur = db.execute(
                f"UPDATE runs SET lease_expires = ? WHERE {_FENCE}", (time.time() + ttl, lease.run_id, lease.epoch)
            )
            return cur.rowcount > 0

    def release(self, lease: Lease) -> None:
        """Give the lease up; a stale lease leaves the current one alone."""
        if lease.state.get("sqlite") is not self:
            return
        with self._lock, _transaction(self._db()) as db:
            db.execute(
                f"UPDATE runs SET owner = NULL, lease_expires = NULL WHERE {_FENCE}", (lease.run_id, lease.epoch)
            )
            self._synced.pop((lease.run_id, lease.epoch), None)

    def lease_of(self, run_id: str) -> tuple[str, float] | None:
        """The owner of the run's unexpired lease and when it lapses unless renewed (epoch seconds), or None
        while no owner holds it."""
        validate_run_id(run_id)
        with self._lock:
            row = self._db().execute("SELECT owner, lease_expires FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None or row[0] is None or row[1] is None or row[1] < time.time():
            return None
        return str(row[0]), float(row[1])

    def _do_held(self, run_id: str) -> bool:
        """True while an owner holds an unexpired lease."""
        with self._lock:
            row = self._db().execute("SELECT owner, lease_expires FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return row is not None and row[0] is not None and row[1] >= time.time()

    def _fenced(self, db: sqlite3.Connection, lease: Lease, sets: str, params: tuple[object, ...]) -> None:
        """Run ``UPDATE runs SET <sets>`` for the lease's row, or raise `LeaseLostError` if it is not current."""
        if lease.state.get("sqlite") is not self:
            raise LeaseLostError(f"lease on run {lease.run_id} is not from {self!r}", run_id=lease.run_id)
        cur = db.execute(f"UPDATE runs SET {sets} WHERE {_FENCE}", (*params, lease.run_id, lease.epoch))
        if cur.rowcount == 0:
            raise LeaseLostError(f"the lease on run {lease.run_id} is no longer current", run_id=lease.run_id)

    def _do_append(self, lease: Lease, data: bytes) -> None:
        """Append complete lines in one committed transaction, fenced by the lease's epoch."""
        data = bytes(data)
        if not may_change_state(data):
            self._append_step(lease, data)
            return
        with self._lock, _transaction(self._db()) as db:  # an end, reopen or reset: the catalog's state too
            self._append_changing(db, lease, data)

    def _append_changing(self, db: sqlite3.Connection, lease: Lease, data: bytes) -> None:
        """Inside a transaction: append lines that may change the run's catalog state, with its row (state, time,
        last line, size), fenced by the lease's epoch."""
        row = db.execute(f"SELECT state, num, {_LAST_SEQ} FROM runs WHERE run_id = ?", (lease.run_id,)).fetchone()
        self._fenced(db, lease, f"state = ?, updated = ?, touched = NULL, last = ?, size = {_LOG_SIZE} + ?",
                     (state_after(row[0] if row else OPEN, data), time.time(), last_line(data), len(data)))
        seq = row[1] * SPAN if row[2] is None else row[2] + 1
        db.execute("INSERT INTO records (seq, data) VALUES (?, ?)", (seq, data))
        lease.state["seq"] = seq + 1

    def _do_append_values(self, lease: Lease, data: bytes, blobs: dict[str, bytes]) -> None:
        """Keep the run's new stored values and append the lines that refer to them in one transaction, fenced
        by the lease's epoch (a lost lease keeps neither)."""
        with self._lock, _transaction(self._db()) as db:
            if may_change_state(data):
                self._append_changing(db, lease, data)
            else:  # a step: the fenced insert, as `_append_step`, and the run's row left alone
                if lease.state.get("sqlite") is not self:
                    raise LeaseLostError(f"lease on run {lease.run_id} is not from {self!r}", run_id=lease.run_id)
                _insert_fenced(db, lease, data)
            db.executemany("INSERT OR IGNORE INTO run_blobs (run_id, digest, data) VALUES (?, ?, ?)",
                           [(lease.run_id, digest, value) for digest, value in blobs.items()])

    def _do_keep_values(self, lease: Lease, blobs: dict[str, bytes]) -> None:
        """Keep the run's new stored values (before a `rewrite` that refers to them)."""
        with self._lock, _transaction(self._db()) as db:
            db.executemany("INSERT OR IGNORE INTO run_blobs (run_id, digest, data) VALUES (?, ?, ?)",
                           [(lease.run_id, digest, value) for digest, value in blobs.items()])

    def append(self, lease: Lease, data: bytes) -> None:
        """Append complete record lines (`StorageFront.append`). A step's record takes `_append_step` at once:
        one short line (no value to keep apart) that is no end, reopen or reset (the kinds that change the run's
        catalog state, `catalog.state_after`). These are the front's and `_do_append`'s
        checks, written out here because every step comes this way; anything else takes their path."""
        if type(data) is bytes and 0 < len(data) < LINE_MIN and data.find(b"\n") == len(data) - 1 \
                and not is_end_line(data) and not is_open_line(data):
            self._append_step(lease, data)
        else:
            super().append(lease, data)

    def _append_step(self, lease: Lease, data: bytes) -> None:
        """Append lines that change no catalog state as one statement, its own commit: the fenced insert of the
        records, and nothing else. The run's row (its last line, size and time) is left as the claim wrote it:
        readers of an open run take those from the records (`_infos`, `_do_size`), so a step writes the pages of
        the records alone, and no crash can leave the row and the log apart. The insert goes through one cursor
        kept for it (`_steps`), not a new one per statement."""
        if lease.state.get("sqlite") is not self:
            raise LeaseLostError(f"lease on run {lease.run_id} is not from {self!r}", run_id=lease.run_id)
        with self._lock:
            gate = self._gate
            taken = gate is not None and gate.on and gate.enter()
            try:
                steps = self._steps
                if steps is None:  # the connection is not open yet
                    self._db()
                    steps = self._steps
                    assert steps is not None
                _insert_fenced(steps, lease, data)
            except sqlite3.Error as exc:
                full = _full(exc)
                if full is exc:
                    raise
                raise full from exc
            finally:
                if taken:
                    gate.leave()

    def sync(self, lease: Lease) -> None:
        """Commit once with ``synchronous=FULL`` so the WAL, with every earlier commit, is on disk."""
        key = (lease.run_id, lease.epoch)
        with self._lock:
            db = self._db()
            row = db.execute(f"SELECT {_LAST_SEQ} FROM runs WHERE " + _FENCE, (lease.run_id, lease.epoch)).fetchone()
            if row is not None and self._synced.get(key) == row[0] and lease.state.get("sqlite") is self:
                return
            with _durable(self, db) as tx:
                self._fenced(tx, lease, "syncs = syncs + 1", ())
            self._synced[key] = row[0]

    def sync_all(self, leases: list[Lease]) -> None:
        """`sync` each lease (a grouped commit costs what separate ones do here)."""
        sync_each(self, leases)

    def finish_all(self, leases: list[Lease]) -> list[BaseException | None]:
        """One transaction for all the leases (each run's lease checked and released, its queue row and joins
        deleted), then one fsync of the WAL, taken without the connection's lock (`_sync_wal`), which makes
        their ends durable with it. Nothing of it is durable before the fsync, but a later durable commit of
        anyone carries it (the WAL is one sequence)."""
        errors: list[BaseException | None] = []
        woke = False
        with self._lock, _transaction(self._db()) as db:
            for lease in leases:
                try:
                    self._fenced(db, lease, "syncs = syncs + 1, owner = NULL, lease_expires = NULL", ())
                except LeaseLostError as exc:
                    errors.append(exc)
                    continue
                woke = _unschedule(db, lease.run_id) or woke
                errors.append(None)
        if self.path != ":memory:":
            self._sync_wal()
        for lease in leases:
            self._synced.pop((lease.run_id, lease.epoch), None)
        if woke:
            self.wakeups.notify()
        return errors

    def _do_size(self, run_id: str) -> int:
        """Bytes of the run's log: an open run's summed from its records (a step leaves its row alone), an ended
        run's from its row (written at its end)."""
        with self._lock:
            row = self._db().execute(f"SELECT CASE WHEN state = ? THEN {_LOG_SIZE} ELSE size END FROM runs"
                                     " WHERE run_id = ?", (OPEN, run_id)).fetchone()
        if row is None:
            raise RunNotFoundError(f"no run {run_id} in {self.path}", run_id=run_id)
        return row[0]

    def _do_rewrite(self, lease: Lease, data: bytes) -> None:
        """Replace the whole log with `data` in one durable transaction; the lease stays current."""
        header = data[: data.index(b"\n") + 1]
        with self._lock, _durable(self, self._db()) as db:
            self._fenced(
                db,
                lease,
                "header = ?, last = ?, size = ?, updated = ?, state = ?",
                (header, last_line(data), len(data), time.time(), state_after(OPEN, data)),
            )
            seq = _drop_log(db, db.execute("SELECT num FROM runs WHERE run_id = ?", (lease.run_id,)).fetchone()[0])
            db.execute("INSERT INTO records (seq, data) VALUES (?, ?)", (seq, data))
        self._synced[(lease.run_id, lease.epoch)] = seq
        lease.state["seq"] = seq + 1

    def _do_bind(self, identity: str, run_id: str, expect: str | None) -> bool:
        """Point `identity` at `run_id` if it still points at `expect` (None: at nothing); False if not."""
        with self._lock, _transaction(self._db()) as db:
            row = db.execute("SELECT run_id FROM identities WHERE identity = ?", (identity,)).fetchone()
            if (row[0] if row else None) != expect:
                return False
            db.execute("INSERT OR REPLACE INTO identities (identity, run_id) VALUES (?, ?)", (identity, run_id))
            return True

    def _do_lookup(self, identity: str) -> str | None:
        """The run `identity` is bound to, if any."""
        with self._lock:
            row = self._db().execute("SELECT run_id FROM identities WHERE identity = ?", (identity,)).fetchone()
        return None if row is None else row[0]

    def _do_lookup_many(self, identities: list[str]) -> list[str | None]:
        """The run each identity is bound to (None where none), in order: one SELECT per `_LOOKUP_CHUNK`
        identities (a statement binds a bounded number of variables)."""
        found: dict[str, str] = {}
        with self._lock:
            for start in range(0, len(identities), _LOOKUP_CHUNK):
                chunk = identities[start : start + _LOOKUP_CHUNK]
                marks = ", ".join("?" * len(chunk))
                found.update(self._db().execute(
                    f"SELECT identity, run_id FROM identities WHERE identity IN ({marks})", chunk).fetchall())
        return [found.get(identity) for identity in identities]

    def _do_create_bound(self, runs: list[NewRun], headers: list[dict[str, Any]]) -> str | None:
        """Bind and create each run in order in one transaction, committed durably (one fsync for the batch);
        at an identity bound to another run, the runs before it are committed and that identity returned.
        The identities are looked up `_LOOKUP_CHUNK` at a time and each table written by one `executemany`."""
        fields = [header_fields(header) for header in headers]
        lost = None
        with self._lock, _durable(self, self._db()) as db:
            names = list(dict.fromkeys(run.identity for run in runs))
            current: dict[str, str | None] = {}
            for start in range(0, len(names), _LOOKUP_CHUNK):
                chunk = names[start : start + _LOOKUP_CHUNK]
                current.update(db.execute(f"SELECT identity, run_id FROM identities WHERE identity IN"
                                          f" ({', '.join('?' * len(chunk))})", chunk).fetchall())
            take = len(runs)
            for i, run in enumerate(runs):  # in order: a run binds its identity before the next one looks
                if current.get(run.identity) != run.expect:
                    lost, take = run.identity, i
                    break
                current[run.identity] = run.run_id
            batch, now = runs[:take], time.time()
            first = db.execute("SELECT coalesce(max(num), 0) + 1 FROM runs").fetchone()[0]
            ids = [run.run_id for run in batch]
            for start in range(0, len(ids), _LOOKUP_CHUNK):
                chunk = ids[start : start + _LOOKUP_CHUNK]
                row = db.execute(f"SELECT run_id FROM runs WHERE run_id IN ({', '.join('?' * len(chunk))})"
                                 " LIMIT 1", chunk).fetchone()
                if row is not None:
                    raise ValidationError(f"run {row[0]} already exists in {self.path}", run_id=row[0])
            if len(set(ids)) < len(ids):
                twice = next(run_id for run_id in ids if ids.count(run_id) > 1)
                raise ValidationError(f"run {twice} is given twice in one batch", run_id=twice)
            db.executemany("INSERT OR REPLACE INTO identities (identity, run_id) VALUES (?, ?)",
                           [(run.identity, run.run_id) for run in batch])
            db.executemany(
                "INSERT INTO runs (num, run_id, header, created, updated, last, size, workflow, key, parent, state)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(num, run.run_id, bytes(run.header), now, now, bytes(run.header), len(run.header), *found, OPEN)
                 for num, run, found in zip(range(first, first + take), batch, fields, strict=False)])
            db.executemany("INSERT INTO records (seq, data) VALUES (?, ?)",
                           [(num * SPAN, bytes(run.header)) for num, run in zip(range(first, first + take), batch,
                                                                                strict=False)])
            db.executemany("INSERT OR REPLACE INTO queue (run_id, due, priority, created, queue_name,"
                           " partition_name) VALUES (?, ?, ?, ?, ?, ?)",
                           [(run.run_id, now if run.at is None else run.at, run.priority, now, *queue_fields(header))
                            for run, header in zip(batch, headers, strict=False)])
        if take:
            self.wakeups.notify()
        return lost

    def _do_info(self, run_id: str) -> RunInfo | None:
        """One run's header, last record and held flag (None if unknown)."""
        found = self._infos("WHERE run_id = ?", (run_id,))
        return found[0] if found else None

    def _do_list_runs(self, limit: int | None, offset: int, where: dict[str, Any]) -> list[RunInfo]:
        """Runs matching the filter (`catalog.RunFilter`), most recently updated first, from the runs table's
        indexed columns."""
        clause, params = RunFilter.of(**where).where()
        return self._infos((f"WHERE {clause} " if clause else "") + "ORDER BY updated DESC, run_id DESC LIMIT ? OFFSET ?",
                           (*params, -1 if limit is None else limit, offset))

    def count_runs(self, **where: Any) -> int:
        """How many runs match the filter."""
        clause, params = RunFilter.of(**where).where()
        with self._lock:
            row = self._db().execute("SELECT count(*) FROM runs" + (f" WHERE {clause}" if clause else ""),
                                     params).fetchone()
        return int(row[0])

    def _do_delete(self, run_id: str) -> int | None:
        """Remove a run, its records, inbox, queue row and identity bindings in one transaction; the bytes
        freed, None (nothing removed) while an owner holds its lease, 0 for an unknown run."""
        with self._lock, _transaction(self._db()) as db:
            row = db.execute("SELECT owner, lease_expires, num FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                return 0
            if row[0] is not None and row[1] is not None and row[1] >= time.time():
                return None
            freed = db.execute("SELECT coalesce(sum(length(data)), 0) FROM records WHERE seq BETWEEN ? AND ?",
                               _span(row[2])).fetchone()[0]
            freed += db.execute("SELECT coalesce(sum(length(data)), 0) FROM signals WHERE run_id = ?",
                                (run_id,)).fetchone()[0]
            freed += db.execute("SELECT coalesce(sum(length(data)), 0) FROM run_blobs WHERE run_id = ?",
                                (run_id,)).fetchone()[0]
            _drop_log(db, row[2])
            for table in ("signals", "run_blobs", "queue", "identities", "runs"):
                db.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
            self._partials_table(db)
            db.execute("DELETE FROM partials WHERE run_id = ?", (run_id,))
        return int(freed)

    # ---- stream partials (`partials.SQLITE_TABLE`, created on first use) -------------------------
    def _partials_table(self, db: sqlite3.Connection) -> None:
        """Create the partials table once per connection (call with the lock held)."""
        if getattr(self, "_partials_made", None) is not db:
            for statement in SQLITE_TABLE.split(";"):
                db.execute(statement)
            self._partials_made = db

    def _do_append_partials(self, run_id: str, path: str, attempt: int, chunks: list[bytes]) -> None:
        with self._lock:
            db = self._db()
            self._partials_table(db)
            with _transaction(db):  # synchronous=NORMAL: no fsync
                db.executemany("INSERT INTO partials (run_id, path, attempt, data) VALUES (?, ?, ?, ?)",
                               [(run_id, path, attempt, chunk) for chunk in chunks])

    def _do_read_partials(self, run_id: str, path: str, offset: int) -> list[bytes]:
        with self._lock:
            db = self._db()
            self._partials_table(db)
            rows = db.execute("SELECT data FROM partials WHERE run_id = ? AND path = ? ORDER BY seq LIMIT -1 OFFSET ?",
                              (run_id, path, offset)).fetchall()
        return [bytes(row[0]) for row in rows]

    def _do_drop_partials(self, run_id: str, path: str | None) -> None:
        with self._lock:
            db = self._db()
            self._partials_table(db)
            if path is None:
                db.execute("DELETE FROM partials WHERE run_id = ?", (run_id,))
            else:
                db.execute("DELETE FROM partials WHERE run_id = ? AND path = ?", (run_id, path))

    def _do_partial_paths(self, run_id: str) -> dict[str, int]:
        with self._lock:
            db = self._db()
            self._partials_table(db)
            rows = db.execute("SELECT path, count(*) FROM partials WHERE run_id = ? GROUP BY path",
                              (run_id,)).fetchall()
        return {path: int(n) for path, n in rows}

    def _require(self, db: sqlite3.Connection, run_id: str) -> None:
        """Raise `RunNotFoundError` unless the run exists."""
        if db.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is None:
            raise RunNotFoundError(f"no run {run_id} in {self.path}", run_id=run_id)

    def _do_send(self, run_id: str, line: bytes, signal_id: str) -> None:
        """Insert one signal line in a durable transaction (no lease needed); `RunNotFoundError` if unknown."""
        with self._lock, _durable(self, self._db()) as db:
            self._require(db, run_id)
            db.execute("INSERT INTO signals (run_id, id, data) VALUES (?, ?, ?)", (run_id, signal_id, line))
            name = (decode_signal(line) or {}).get("name")
            woke = isinstance(name, str) and bool(name) and self._wake(db, run_id, name)
        if woke:
            self.wakeups.notify()

    def _do_inbox(self, run_id: str) -> list[dict[str, Any]]:
        """The run's unacknowledged signals, in send order; `RunNotFoundError` if unknown."""
        with self._lock:  # one statement: the run's existence and its signals in one snapshot
            rows = self._db().execute("SELECT s.data FROM runs r LEFT JOIN signals s ON s.run_id = r.run_id"
                                      " WHERE r.run_id = ? ORDER BY s.seq", (run_id,)).fetchall()
        if not rows:
            raise RunNotFoundError(f"no run {run_id} in {self.path}", run_id=run_id)
        return [signal for signal in (decode_signal(row[0]) for row in rows if row[0] is not None) if signal]

    def _do_ack(self, run_id: str, signal_id: str) -> None:
        """Delete every stored copy of signal `signal_id` (none stored: nothing happens)."""
        with self._lock, _transaction(self._db()) as db:
            self._require(db, run_id)
            db.execute("DELETE FROM signals WHERE run_id = ? AND id = ?", (run_id, signal_id))

    # ---- the queue ------------------------------------------------------------------------------
    def _do_schedule(self, run_id: str, at: float | None, wait: tuple[str, ...], priority: int | None) -> None:
        """Upsert the run's queue row."""
        names = json.dumps(list(wait))
        with self._lock, _transaction(self._db()) as db:
            self._require(db, run_id)
            cur = db.execute("UPDATE queue SET due = ?, wait = ?, priority = coalesce(?, priority) WHERE run_id = ?",
                             (at, names, priority, run_id))
            if cur.rowcount == 0:
                db.execute("INSERT INTO queue (run_id, due, priority, created, wait, queue_name, partition_name)"
                           " VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (run_id, at, priority or 0, time.time(), names, *self._place(db, run_id)))
            db.execute("DELETE FROM joins WHERE parent = ?", (run_id,))
        self.wakeups.notify()

    def _do_join_wait(self, run_id: str, children: tuple[str, ...]) -> bool:
        """In one transaction: the run's row due only when woken, and a `joins` row per child still queued."""
        with self._lock, _transaction(self._db()) as db:
            self._require(db, run_id)
            db.execute("DELETE FROM joins WHERE parent = ?", (run_id,))
            db.executemany("INSERT OR IGNORE INTO joins (parent, child) SELECT ?, run_id FROM queue WHERE run_id = ?",
                           [(run_id, child) for child in children])
            waiting = db.execute("SELECT 1 FROM joins WHERE parent = ? LIMIT 1", (run_id,)).fetchone() is not None
            due = None if waiting else time.time()
            cur = db.execute("UPDATE queue SET due = ?, wait = '[]' WHERE run_id = ?", (due, run_id))
            if cur.rowcount == 0:
                db.execute("INSERT INTO queue (run_id, due, priority, created, queue_name, partition_name)"
                           " VALUES (?, ?, 0, ?, ?, ?)", (run_id, due, time.time(), *self._place(db, run_id)))
        if not waiting:
            self.wakeups.notify()
        return not waiting

    def _do_unschedule(self, run_id: str) -> None:
        """Delete the run's queue row and its `joins` rows; a parent left waiting for nothing is due now."""
        with self._lock, _transaction(self._db()) as db:
            woke = _unschedule(db, run_id)
        if woke:
            self.wakeups.notify()

    def _wake(self, db: sqlite3.Connection, run_id: str, name: str | None) -> bool:
        row = db.execute("SELECT due, wait FROM queue WHERE run_id = ?", (run_id,)).fetchone()
        now = time.time()
        if row is None or (name is not None and name not in json.loads(row[1])) or (row[0] is not None
                                                                                    and row[0] <= now):
            return False
        db.execute("UPDATE queue SET due = ? WHERE run_id = ?", (now, run_id))
        return True

    def _do_wake(self, run_id: str, name: str | None) -> bool:
        """Make the run due now if its row waits for `name` (None: unconditionally)."""
        with self._lock, _transaction(self._db()) as db:
            woke = self._wake(db, run_id, name)
        if woke:
            self.wakeups.notify()
        return woke

    def _place(self, db: sqlite3.Connection, run_id: str) -> tuple[str, str | None]:
        """The queue and partition a run's header names, for a queue row written anew (a run queued again)."""
        row = db.execute("SELECT header FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return queue_fields(None if row is None else decode_record(row[0]))

    def _do_entry(self, run_id: str) -> QueueEntry | None:
        """The run's queue row."""
        with self._lock:
            row = self._db().execute("SELECT due, priority, wait, created, queue_name, partition_name FROM queue"
                                     " WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else QueueEntry(run_id, row[0], row[1], tuple(json.loads(row[2])), row[3],
                                                   row[4], row[5])

    def _do_due(self, limit: int, now: float | None, skip: tuple[str, ...], names: frozenset[str] | None,
                queues: frozenset[str] | None, full: frozenset[str]) -> list[str]:
        """Due, unheld runs (of `names` and `queues`, when given, none of `full`) from the queue table's indexes."""
        with self._lock:
            return _due(self._db(), time.time() if now is None else now, limit, skip, names, queues, full)

    def _do_queue_stats(self, now: float) -> list[QueueStats]:
        """One GROUP BY over the queue table (and each row's lease)."""
        with self._lock:
            rows = self._db().execute(
                f"SELECT queue_name, partition_name, {_STATS} FROM (SELECT q.queue_name, q.partition_name, q.due,"
                " coalesce(r.owner IS NOT NULL AND r.lease_expires >= ?, 0) AS held"
                " FROM queue q LEFT JOIN runs r ON r.run_id = q.run_id)"
                " GROUP BY queue_name, partition_name", (now, now, now, time.time())).fetchall()
        return sorted_stats(QueueStats(*row) for row in rows)

    def next_due(self, now: float | None = None) -> float | None:
        """The earliest time after `now` at which a queued run falls due (None: none is to)."""
        now = time.time() if now is None else now
        with self._lock:
            row = self._db().execute("SELECT min(due) FROM queue WHERE due > ?", (now,)).fetchone()
        return row[0]

    def watch(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Local wake-ups (`wakeup.LocalWakeups`) among the processes sharing this database file."""
        return None if self.path == ":memory:" else self.wakeups.watch(callback)

    def _do_claim_due(self, owner: str, ttl: float, limit: int, skip: tuple[str, ...], check: Check | None,
                      names: frozenset[str] | None, queues: frozenset[str] | None,
                      full: frozenset[str]) -> list[Lease]:
        """Claim up to `limit` due runs in one write transaction (the due query and every claim in it; a
        damaged log is passed over before anything of its claim is written)."""
        leases: list[Lease] = []
        if limit == 0:
            return leases
        with self._lock, self._claiming("due runs") as db:
            for run_id in _due(db, time.time(), 2 * limit + 2, skip, names, queues, full):
                if len(leases) >= limit:
                    break
                try:
                    lease = self._claim_in(db, run_id, owner, ttl, check, False)
                except CorruptLogError:
                    continue
                if lease is not None:
                    leases.append(lease)
        return leases

    # ---- workers --------------------------------------------------------------------------------
    def _do_advertise(self, owner: str, line: bytes, ttl: float) -> None:
        """Upsert the worker's row, live until `ttl` seconds from now; rows of workers gone a minute are dropped."""
        now = time.time()
        with self._lock, _transaction(self._db()) as db:
            db.execute("INSERT OR REPLACE INTO workers (owner, info, expires) VALUES (?, ?, ?)", (owner, line, now + ttl))
            db.execute("DELETE FROM workers WHERE expires < ?", (now - 60,))

    def _do_retire(self, owner: str) -> None:
        """Delete the worker's row."""
        with self._lock, _transaction(self._db()) as db:
            db.execute("DELETE FROM workers WHERE owner = ?", (owner,))

    def workers(self) -> list[dict[str, Any]]:
        """The rows of live workers."""
        with self._lock:
            rows = self._db().execute("SELECT info FROM workers WHERE expires >= ?", (time.time(),)).fetchall()
        return [found for row in rows if (found := decode_worker(row[0])) is not None]

    # ---- limits ---------------------------------------------------------------------------------
    def _do_limit(self, key: str, step: LimitStep) -> Any:
        """Run `step` on the key's row in one ``BEGIN IMMEDIATE`` transaction (the database's write lock, so every
        process sharing the file takes its turn), `now` from `time.time()`, the lease columns of ``runs`` read in
        it for `live`; committed as every append is, so it survives a kill of the process (a machine crash may
        lose it until the next durable commit)."""
        with self._lock, _transaction(self._db()) as db:
            row = db.execute("SELECT doc FROM limits WHERE key = ?", (key,)).fetchone()
            stored = None if row is None else bytes(row[0])
            now = time.time()

            def live(run_id: str, epoch: int) -> bool:
                if epoch < 0:  # held while the run has not ended (`Limits.limit`)
                    return db.execute("SELECT 1 FROM runs WHERE run_id = ? AND state = ?",
                                      (run_id, OPEN)).fetchone() is not None
                return db.execute("SELECT 1 FROM runs WHERE run_id = ? AND epoch = ? AND owner IS NOT NULL"
                                  " AND lease_expires >= ?", (run_id, epoch, time.time())).fetchone() is not None

            data, result = step(stored, now, live)
            if data is None:
                if stored is not None:
                    db.execute("DELETE FROM limits WHERE key = ?", (key,))
            elif data != stored:
                db.execute("INSERT OR REPLACE INTO limits (key, doc) VALUES (?, ?)", (key, data))
        return result

    def _do_limits(self, prefix: str) -> dict[str, bytes]:
        """The rows whose key starts with `prefix` (compared as text, character by character)."""
        with self._lock:
            rows = self._db().execute("SELECT key, doc FROM limits WHERE substr(key, 1, ?) = ?",
                                      (len(prefix), prefix)).fetchall()
        return {key: bytes(doc) for key, doc in rows}

    # ---- blobs ----------------------------------------------------------------------------------
    def _do_keep_blob(self, digest: str, data: bytes) -> None:
        with self._lock, _transaction(self._db()) as db:
            db.execute("INSERT OR IGNORE INTO blobs (digest, data) VALUES (?, ?)", (digest, data))

    def _do_blob(self, digest: str) -> bytes | None:
        with self._lock:
            row = self._db().execute("SELECT data FROM blobs WHERE digest = ?", (digest,)).fetchone()
        return None if row is None else bytes(row[0])

    def _infos(self, clause: str, params: tuple[Any, ...]) -> list[RunInfo]:
        """The catalog rows `clause` selects; an open run's last record comes from its latest append (a step
        leaves the row alone), and its time is the later of the row's and that record's ``ts``."""
        now = time.time()
        with self._lock:
            db = self._db()
            rows = (
                db
                .execute(f"SELECT run_id, header, CASE WHEN state = ? THEN {_LAST_CHUNK} ELSE last END, owner,"
                         " lease_expires, max(updated, coalesce(touched, 0)), epoch, state FROM runs "
                         + clause, (OPEN, *params))
                .fetchall()
            )
            rows = [(run_id, header, resolve_line(bytes(last_line(last or header)), partial(_run_values, db, run_id)), *rest)
                    for run_id, header, last, *rest in rows]
        infos = []
        for run_id, header_line, last_bytes, owner, expires, updated, epoch, state in rows:
            header = decode_record(header_line) or {}
            held = owner is not None and expires is not None and expires >= now
            last = decode_record(last_bytes) or header
            ts = last.get("ts")
            if state == OPEN and isinstance(ts, (int, float)) and not isinstance(ts, bool) and ts > updated:
                updated = float(ts)
            infos.append(RunInfo(run_id, header, last, held, updated, epoch, state))
        return infos


_CATALOG_COLUMNS = {"workflow": "TEXT", "key": "TEXT", "parent": "TEXT", "state": "TEXT NOT NULL DEFAULT 'open'"}
_CATALOG_INDEXES = """
CREATE INDEX IF NOT EXISTS runs_by_updated ON runs (updated DESC, run_id DESC);
CREATE INDEX IF NOT EXISTS runs_by_state ON runs (state, updated DESC);
CREATE INDEX IF NOT EXISTS runs_by_workflow ON runs (workflow, updated DESC);
CREATE INDEX IF NOT EXISTS runs_by_key ON runs (key);
CREATE INDEX IF NOT EXISTS runs_by_parent ON runs (parent) WHERE parent IS NOT NULL
"""


def _insert_fenced(db: sqlite3.Connection | sqlite3.Cursor, lease: Lease, data: bytes) -> None:
    """Insert the records `data` of the lease's run if its lease is current (one statement: the fence is read in
    the insert), else raise `LeaseLostError`.

    The lease knows the sequence number its next append takes (``state["seq"]``, from its claim and each append
    since): while the fence holds, nothing but this lease appends to the run, so the insert needs no look at the
    run's records. A number already taken (an append of this lease on another connection, `SqliteTransaction`)
    fails the insert, which is then made after the run's latest append as found; the number only ever grows, so
    an append is never put before one already made."""
    state = lease.state
    seq = state.get("seq")
    if seq is not None:
        try:
            done = db.execute(_STEP, (seq, data, seq // SPAN, lease.run_id, lease.epoch)).rowcount
        except sqlite3.IntegrityError:  # the number is taken
            done = -1
        if done > 0:
            if state["seq"] <= seq:
                state["seq"] = seq + 1
            return
        if done == 0:
            raise LeaseLostError(f"the lease on run {lease.run_id} is no longer current", run_id=lease.run_id)
    cur = db.execute(_STEP_AT_END, (data, lease.run_id, lease.epoch))
    seq = cur.lastrowid
    if cur.rowcount == 0 or seq is None:
        raise LeaseLostError(f"the lease on run {lease.run_id} is no longer current", run_id=lease.run_id)
    if state.get("seq", 0) <= seq:
        state["seq"] = seq + 1


def _data_version(db: sqlite3.Connection) -> int:
    """SQLite's ``data_version`` of `db`: it changes when another connection commits to the database."""
    return int(db.execute("PRAGMA data_version").fetchone()[0])


def _run_values(db: sqlite3.Connection, run_id: str) -> dict[str, bytes]:
    """The stored values of a run by digest (`valuestore`)."""
    return {digest: bytes(data) for digest, data in
            db.execute("SELECT digest, data FROM run_blobs WHERE run_id = ?", (run_id,))}


def _ensure_catalog(db: sqlite3.Connection) -> None:
    """The run catalog's columns and indexes on ``runs``; a database from before them gets them filled in
    from each run's header and log (once: such a database's records still carry their run's id, as they did
    before schema 10, `_move_records`)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
    missing = [name for name in _CATALOG_COLUMNS if name not in have]
    for name in missing:
        db.execute(f"ALTER TABLE runs ADD COLUMN {name} {_CATALOG_COLUMNS[name]}")
    if missing:
        for run_id, header in db.execute("SELECT run_id, header FROM runs").fetchall():
            data = b"".join(row[0] for row in db.execute("SELECT data FROM records WHERE run_id = ? ORDER BY seq",
                                                         (run_id,)))
            good = kind_of(decode_record(header)) == "run"
            db.execute("UPDATE runs SET workflow = ?, key = ?, parent = ?, state = ? WHERE run_id = ?",
                       (*header_fields(decode_record(header)), state_after(OPEN, data) if good else OPEN, run_id))
    if "touched" not in have:
        db.execute("ALTER TABLE runs ADD COLUMN touched REAL")
    for statement in _CATALOG_INDEXES.split(";"):
        if statement.strip():
            db.execute(statement)


def _due(db: sqlite3.Connection, now: float, limit: int, skip: tuple[str, ...], names: frozenset[str] | None,
         queues: frozenset[str] | None = None, full: frozenset[str] = frozenset()) -> list[str]:
    """The due query (`SqliteStorage.due`) in the queue's fair order (`base.fair_order`). While no queued row
    has a partition (one probe of the empty partial index ``queue_parts``), it is the walk of ``queue_due``
    in order that stops at `limit`, as before partitions existed. Otherwise one statement of two parts: the
    rows without a partition walk ``queue_due`` the same way; the rows with one, found through
    ``queue_parts``, are ranked in their (queue, partition, priority) by ROW_NUMBER(), and a rank past `limit`
    cannot make the first `limit`."""
    if names is not None and not names or queues is not None and not queues:
        return []  # no workflow, or no queue, is served
    where, params = _kept(now, skip, names, queues, full)
    if db.execute("SELECT 1 FROM queue INDEXED BY queue_parts WHERE partition_name IS NOT NULL LIMIT 1").fetchone() \
            is None:
        rows = db.execute(  # +q.due: walk queue_due in order, to the run id (a batch enqueued at once ties up to it)
            f"SELECT q.run_id FROM queue q JOIN runs r ON r.run_id = q.run_id WHERE {where}"
            " ORDER BY q.priority DESC, q.due, q.created, q.run_id LIMIT ?", (*params, limit)).fetchall()
        return [row[0] for row in rows]
    rows = db.execute(
        "SELECT run_id FROM (SELECT * FROM ("
        "SELECT q.run_id, q.priority, 1 AS nth, q.due, q.created FROM queue q JOIN runs r ON r.run_id = q.run_id"
        f" WHERE q.partition_name IS NULL AND {where} ORDER BY q.priority DESC, q.due, q.created, q.run_id LIMIT ?)"
        " UNION ALL SELECT * FROM (SELECT q.run_id, q.priority, ROW_NUMBER() OVER (PARTITION BY q.queue_name,"
        " q.partition_name, q.priority ORDER BY q.due, q.created, q.run_id) AS nth, q.due, q.created"
        " FROM queue q INDEXED BY queue_parts JOIN runs r ON r.run_id = q.run_id"
        f" WHERE q.partition_name IS NOT NULL AND {where}) WHERE nth <= ?)"
        " ORDER BY priority DESC, nth, due, created, run_id LIMIT ?",
        (*params, limit, *params, limit, limit)).fetchall()
    return [row[0] for row in rows]


_STATS = ("count(CASE WHEN NOT held AND due <= ? THEN 1 END), count(CASE WHEN NOT held AND due > ? THEN 1 END),"
          " count(CASE WHEN held THEN 1 END), count(CASE WHEN NOT held AND due IS NULL THEN 1 END),"
          " min(CASE WHEN NOT held AND due <= ? THEN due END)")
"""What `queue_stats` counts per group of rows with columns ``due`` and ``held`` (parameters: now, thrice)."""


def _kept(now: float, skip: tuple[str, ...], names: frozenset[str] | None, queues: frozenset[str] | None,
          full: frozenset[str]) -> tuple[str, list[Any]]:
    """The condition (over ``queue q JOIN runs r``) a due row meets, and its parameters (`names` and `queues`
    None, or not empty: `_due` answers an empty one itself)."""
    def marks(values: Any) -> str:
        return ",".join("?" * len(values))

    where = "q.due IS NOT NULL AND +q.due <= ? AND (r.owner IS NULL OR r.lease_expires < ?)"
    params: list[Any] = [now, time.time()]
    if skip:
        where += f" AND q.run_id NOT IN ({marks(skip)})"
        params.extend(skip)
    if names:
        where += f" AND +r.workflow IN ({marks(names)})"  # +: never through runs_by_workflow (every run, ended too)
        params.extend(names)
    if queues:
        where += f" AND q.queue_name IN ({marks(queues)})"
        params.extend(queues)
    if full:
        where += (f" AND q.queue_name NOT IN ({marks(full)}) AND (q.partition_name IS NULL"
                  f" OR q.queue_name || '/' || q.partition_name NOT IN ({marks(full)}))")
        params.extend([*full, *full])
    return where, params


def _ensure_places(db: sqlite3.Connection) -> None:
    """The queue table's named-queue columns and the partial index of its partitioned rows; a database from
    before them gets the columns, its rows in the queue "default" without a partition (their runs' headers
    name none: the engine wrote neither field then)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(queue)")}
    if "queue_name" not in have:
        db.execute("ALTER TABLE queue ADD COLUMN queue_name TEXT NOT NULL DEFAULT 'default'")
    if "partition_name" not in have:
        db.execute("ALTER TABLE queue ADD COLUMN partition_name TEXT")
    db.execute("CREATE INDEX IF NOT EXISTS queue_parts ON queue (queue_name, partition_name, priority, due, created,"
               " run_id) WHERE partition_name IS NOT NULL")  # run_id: ranked in index order, without a sort


def _unschedule(db: sqlite3.Connection, run_id: str) -> bool:
    """Inside a transaction: delete the run's queue row and its `joins` rows; a parent left waiting for
    nothing is due now (True when one was made due)."""
    db.execute("DELETE FROM queue WHERE run_id = ?", (run_id,))
    db.execute("DELETE FROM joins WHERE parent = ?", (run_id,))
    parents = [row[0] for row in db.execute("DELETE FROM joins WHERE child = ? RETURNING parent", (run_id,))]
    now = time.time()
    woke = False
    for parent in parents:
        if db.execute("SELECT 1 FROM joins WHERE parent = ? LIMIT 1", (parent,)).fetchone() is None:
            woke = db.execute("UPDATE queue SET due = ? WHERE run_id = ? AND (due IS NULL OR due > ?)",
                              (now, parent, now)).rowcount > 0 or woke
    return woke


def _queue_unended(db: sqlite3.Connection) -> None:
    """A database from before the queue: every run that has not ended enters it, due now, so a worker takes
    its interrupted, sleeping and waiting runs over."""
    for run_id, last, created, updated in db.execute("SELECT run_id, last, created, updated FROM runs").fetchall():
        if not is_end_line(last):
            db.execute("INSERT OR IGNORE INTO queue (run_id, due, priority, created) VALUES (?, ?, 0, ?)",
                       (run_id, updated, created))


class SqliteTransaction:
    """An application's transaction on the store's database file that a run's records join (`commit`): SQLite
    commits both at once or neither. The connection is the application's for the transaction's length, with
    ``isolation_level=None``: its statements run in the transaction already begun; committing or rolling back
    is this object's (an application that commits itself is told so at `commit`)."""

    __slots__ = ("storage", "connection", "_open")

    def __init__(self, storage: SqliteStorage, connection: sqlite3.Connection) -> None:
        self.storage = storage
        self.connection = connection
        self._open = True

    def commit(self, lease: Lease, data: bytes) -> None:
        """Append `data` to the lease's run (fenced by its epoch, as an append is) and commit everything."""
        conn = self.connection
        if not conn.in_transaction:
            self._open = False
            raise ValidationError("the transaction of ctx.transaction was committed or rolled back by its function",
                                  hint="Leave commit and rollback to ctx.transaction (raise to roll back; use "
                                       "SAVEPOINT for a partial undo); what the function committed stays committed.",
                                  docs=TRANSACTION_DOCS)
        try:
            if lease.state.get("sqlite") is not self.storage:
                raise LeaseLostError(f"lease on run {lease.run_id} is not from {self.storage!r}", run_id=lease.run_id)
            _insert_fenced(conn, lease, data)  # a step's record: the run's row stays as it is (`_append_step`)
            conn.execute("COMMIT")
        except BaseException as exc:
            self.rollback()
            full = _full(exc)
            if full is exc:
                raise
            raise full from exc
        self._open = False

    def rollback(self) -> None:
        """Roll the transaction back (a no-op once it ended)."""
        if self._open:
            self._open = False
            if self.connection.in_transaction:
                self.connection.execute("ROLLBACK")

    def close(self) -> None:
        """Roll back what is still open and give the connection back to the storage."""
        try:
            self.rollback()
        except sqlite3.Error:
            self.connection.close()
            return
        self.storage.reuse(self.connection)


def _full(exc: BaseException) -> BaseException:
    """`StorageFullError` for SQLite's "database or disk is full", else `exc` itself."""
    if isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        error = StorageFullError(f"could not write to the SQLite database: {exc}; nothing of this write was kept")
        error.errno = errno.ENOSPC
        return error
    return exc


class _Connection(sqlite3.Connection):
    """The storage's own connection: it knows the database's write gate (`sqlitegate`), which `_transaction`
    takes around a write transaction."""

    gate: WriteGate | None = None


@contextmanager
def _transaction(db: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE") -> Iterator[sqlite3.Connection]:
    """Run the body in one transaction (a write lock up front by default, inside the connection's write gate
    where it has one); commit on success, else roll back."""
    gate = getattr(db, "gate", None) if begin == "BEGIN IMMEDIATE" else None
    taken = gate is not None and gate.enter()
    try:
        started = time.perf_counter()
        db.execute(begin)
        if gate is not None:
            gate.took(started)
        try:
            yield db
            db.execute("COMMIT")
        except BaseException as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            full = _full(exc)
            if full is exc:
                raise
            raise full from exc
    finally:
        if taken:
            gate.leave()  # type: ignore[union-attr]


@contextmanager
def _durable(storage: SqliteStorage, db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction committed with ``synchronous=FULL`` (an fsync of the WAL), counted in `fsyncs`."""
    db.execute("PRAGMA synchronous=FULL")
    try:
        with _transaction(db):
            yield db
    finally:
        db.execute("PRAGMA synchronous=NORMAL")
    storage.fsyncs += 1


def _cut_torn(db: sqlite3.Connection, num: int, data: bytes, good: int, seq: int | None) -> int:
    """Drop a torn last line (a write cut off by a crash) before appending after it; the sequence number of the
    run's latest append afterwards (`seq` before)."""
    if good < len(data):
        first = _drop_log(db, num)
        db.execute("INSERT INTO records (seq, data) VALUES (?, ?)", (first, data[:good]))
        return first
    return num * SPAN - 1 if seq is None else seq


def _span(num: int) -> tuple[int, int]:
    """The first and last of the sequence numbers that hold run number `num`'s records (a range of their key)."""
    return num * SPAN, num * SPAN + SPAN - 1


def _drop_log(db: sqlite3.Connection, num: int) -> int:
    """Delete every record of run number `num`; the sequence number its header takes (the range's first)."""
    span = _span(num)
    db.execute("DELETE FROM records WHERE seq BETWEEN ? AND ?", span)
    return span[0]


def _log_of(db: sqlite3.Connection, num: int) -> tuple[bytes, int | None]:
    """The whole log of run number `num` as one byte string, and the sequence number of its latest append."""
    rows = db.execute("SELECT seq, data FROM records WHERE seq BETWEEN ? AND ? ORDER BY seq", _span(num)).fetchall()
    return b"".join(row[1] for row in rows), rows[-1][0] if rows else None


def _move_records(db: sqlite3.Connection) -> None:
    """Schema 10, inside the opening transaction: a database whose records carry their run's id (and an index on
    it, a second b-tree written by every append) gets its runs numbered and each run's records keyed by that
    number and their order (`_RECORDS`), in the order they had; nothing else changes. Every column of the old
    runs table is copied (`_ensure_catalog` has added the catalog's first); the catalog's indexes are made again
    on the new table by `_ensure_catalog` afterwards."""
    columns = ", ".join(_RUN_COLUMNS)
    db.execute("DROP TABLE IF EXISTS runs_v10")
    db.execute("DROP TABLE IF EXISTS records_v10")
    db.execute(_RUNS.format(name="runs_v10"))
    db.execute(f"INSERT INTO runs_v10 (num, {columns}) SELECT rowid, {columns} FROM runs ORDER BY rowid")
    db.execute(_RECORDS.format(name="records_v10"))
    db.execute(f"INSERT INTO records_v10 (seq, data) SELECT r.num * {SPAN} + row_number() OVER"
               " (PARTITION BY r.num ORDER BY o.seq) - 1, o.data FROM records o JOIN runs_v10 r ON r.run_id = o.run_id"
               " ORDER BY 1")
    db.execute("DROP TABLE records")
    db.execute("DROP TABLE runs")
    db.execute("ALTER TABLE runs_v10 RENAME TO runs")
    db.execute("ALTER TABLE records_v10 RENAME TO records")
