"""The file adapter's run catalog: one SQLite table beside the logs, rebuilt from them whenever in doubt.

The logs stay the truth; this index only answers "which runs match, newest first" without opening every
log. It lives in ``<dir>/catalog.db`` (stdlib ``sqlite3``, WAL, ``synchronous=OFF``: never an fsync of its
own; a file damaged by a machine crash is thrown away and rebuilt), one row per run: workflow, key, parent (from the header), state (``open`` or the
end status) and when the run was last active.

`FileStorage` writes a row when it creates a run (after its log exists: a crash in between leaves a log
without a row, which the next listing's reconcile finds) and refreshes it when a run is claimed, queued again or taken out of
the queue (it ended). Nothing is written per step or per append. Before answering, a query

- rebuilds the table from the logs when it is missing, unreadable or empty while logs exist;
- reconciles which runs exist with the ``runs/`` directory whenever that directory changed since the last
  reconcile (logs copied in, a row lost to a machine crash, a log deleted by hand);
- re-reads the tail of every open run whose log grew or shrank since its row was written, so a run that
  ended in a process killed before it could say so is listed with its end, and open runs sort by their
  last write.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from ..records import kind_of
from .catalog import OPEN, RunFilter, header_fields, state_after

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    workflow TEXT,
    key TEXT,
    parent TEXT,
    state TEXT NOT NULL,
    updated REAL NOT NULL,
    size INTEGER NOT NULL DEFAULT -1
);
CREATE INDEX IF NOT EXISTS runs_by_updated ON runs (updated DESC, run_id DESC);
CREATE INDEX IF NOT EXISTS runs_by_state ON runs (state, updated DESC);
CREATE INDEX IF NOT EXISTS runs_by_workflow ON runs (workflow, updated DESC);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value);
"""

Row = tuple[str, str | None, str | None, str | None, str, float, int]
"""run_id, workflow, key, parent, state, updated, size (the log bytes the state was read from)."""

_HEADER = msgspec.json.Decoder(dict[str, Any])
_IN_MAX = 500  # run ids looked up by one statement (SQLite allows at least 999 parameters)


class FileCatalog:
    """The index of one state directory's runs; `names` lists the run ids that have a log (from
    `FileStorage`)."""

    def __init__(self, path: Path, runs_dir: Path, names: Callable[[], list[str]]) -> None:
        self.path = path
        self.runs_dir = runs_dir
        self._runs_path = str(runs_dir)
        self._names = names
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._lock = threading.RLock()

    def _db(self) -> sqlite3.Connection:
        """The connection (opened, and the schema made, on first use and again after a fork)."""
        if self._conn is None or self._pid != os.getpid():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                conn = self._open()
            except sqlite3.OperationalError:  # cannot be opened (a read-only state dir): the caller scans logs
                raise
            except sqlite3.DatabaseError:  # a damaged index is thrown away: the logs rebuild it
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{self.path}{suffix}").unlink(missing_ok=True)
                conn = self._open()
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=5.0, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=OFF")  # a cache of the logs: never an fsync, rebuilt if damaged
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
        except BaseException:
            conn.close()
            raise
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    def reset(self) -> None:
        """Throw the index away (it is damaged); the next use rebuilds it from the logs."""
        with self._lock:
            self.close()
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    # ---- writes, from FileStorage -----------------------------------------------------------------
    def put(self, row: Row) -> None:
        """Insert or replace one run's row."""
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)", row)

    def put_many(self, rows: list[Row]) -> None:
        """Insert or replace many runs' rows in one transaction (a batch of child runs)."""
        with self._write() as db:
            db.executemany("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def refresh_many(self, run_ids: list[str]) -> None:
        """`refresh` of many runs with one transaction for all their rows."""
        olds: dict[str, Any] = dict.fromkeys(run_ids)
        ids = list(olds)
        with self._lock:
            db = self._db()
            for first in range(0, len(ids), _IN_MAX):  # one statement (one read lock) for many rows, not one each
                part = ids[first:first + _IN_MAX]
                for run_id, *old in db.execute(
                        "SELECT run_id, workflow, key, parent, state, size FROM runs WHERE run_id IN "
                        f"({','.join('?' * len(part))})", part):
                    olds[run_id] = tuple(old)
        rows = [(run_id, self._scan(run_id, old)) for run_id, old in olds.items()]
        with self._write() as db:
            db.executemany("DELETE FROM runs WHERE run_id = ?", [(run_id,) for run_id, row in rows if row is None])
            db.executemany("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)",
                           [row for _, row in rows if row is not None])

    def refresh(self, run_id: str, *, lazy: bool = False) -> None:
        """Bring one run's row up to date with its log, reading only what was appended since the row was
        written (the whole log when the row is new or the log shrank); the row goes when the log is gone.

        `lazy` (a run about to run again): a row that says open only learns the log's time; its tail is left
        to the next query's repair, which re-reads open rows whose log changed size, so a resumed long run
        does not read its whole log again here."""
        with self._lock:
            old = self._db().execute("SELECT workflow, key, parent, state, size FROM runs WHERE run_id = ?",
                                     (run_id,)).fetchone()
        row = self._scan(run_id, old, lazy)
        with self._write() as db:
            if row is None:
                db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
            else:
                db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)", row)

    def _scan(self, run_id: str, old: Any, lazy: bool = False) -> Row | None:
        """A run's row from its row `old` (None: none yet) and its log's new lines (None: no log); `lazy`:
        an open row's tail is not read (see `refresh`)."""
        try:
            fd = os.open(os.path.join(self._runs_path, f"{run_id}.jsonl"), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if lazy and old is not None and old[3] == OPEN and 0 < old[4] <= st.st_size:
                return (run_id, old[0], old[1], old[2], OPEN, st.st_mtime, old[4])
            start = old[4] if old is not None and 0 < old[4] <= st.st_size else 0
            data = _read_range(fd, start, st.st_size - start)
        finally:
            os.close(fd)
        data = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        if start:
            workflow, key, parent = old[0], old[1], old[2]
            state = state_after(old[3], data)
        else:
            first = data[: data.find(b"\n") + 1]
            try:
                header: Any = _HEADER.decode(first) if first else None
            except msgspec.DecodeError:
                header = None
            workflow, key, parent = header_fields(header)
            good = isinstance(header, dict) and kind_of(header) == "run"
            state = state_after(OPEN, data) if good else OPEN
        return (run_id, workflow, key, parent, state, st.st_mtime, start + len(data))

    def rescan(self, run_id: str) -> None:
        """Make the next refresh of a run read its whole log (it is about to be replaced by a compaction)."""
        with self._write() as db:
            db.execute("UPDATE runs SET size = -1 WHERE run_id = ?", (run_id,))

    def remove(self, run_id: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))

    # ---- queries ------------------------------------------------------------------------------
    def query(self, where: RunFilter, limit: int | None, offset: int) -> list[str]:
        """Ids of matching runs, most recently active first."""
        self.repair()
        clause, params = where.where()
        sql = "SELECT run_id FROM runs" + (f" WHERE {clause}" if clause else "") \
            + " ORDER BY updated DESC, run_id DESC LIMIT ? OFFSET ?"
        with self._lock:
            rows = self._db().execute(sql, (*params, -1 if limit is None else limit, offset)).fetchall()
        return [row[0] for row in rows]

    def count(self, where: RunFilter) -> int:
        self.repair()
        clause, params = where.where()
        with self._lock:
            return int(self._db().execute("SELECT count(*) FROM runs" + (f" WHERE {clause}" if clause else ""),
                                          params).fetchone()[0])

    def state(self, run_id: str) -> str | None:
        with self._lock:
            row = self._db().execute("SELECT state FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else str(row[0])

    # ---- repair -------------------------------------------------------------------------------
    def repair(self) -> None:
        """Bring the index in line with the logs: which runs exist (when ``runs/`` changed), then the ends of
        open runs whose logs changed size."""
        try:
            mtime = os.stat(self.runs_dir).st_mtime_ns
        except FileNotFoundError:
            mtime = 0
        # a change within the file system's timestamp granularity of this look would go unseen: a directory
        # changed in the last two seconds is listed again next time
        stamp = "recent" if time.time_ns() - mtime < 2_000_000_000 else str(mtime)
        with self._lock:
            db = self._db()
            row = db.execute("SELECT value FROM meta WHERE name = 'runs_dir'").fetchone()
            if row is None or row[0] != stamp or stamp == "recent":
                self._reconcile(stamp)
            stale = [run_id for run_id, size in db.execute("SELECT run_id, size FROM runs WHERE state = ?", (OPEN,))
                     if self._size(run_id) != size]
        for run_id in stale:
            self.refresh(run_id)

    def scan(self, where: RunFilter, limit: int | None, offset: int) -> tuple[list[str], int]:
        """Without the index (it cannot be opened or written): the ids of a page of matching runs and how
        many match, from reading every log, newest first."""
        rows = [row for row in (self._scan(run_id, None) for run_id in self._names()) if row is not None]
        found = sorted((row for row in rows if where.matches(row[0], row[4], row[1], row[2], row[3], row[5])),
                       key=lambda row: (row[5], row[0]), reverse=True)
        return [row[0] for row in found[offset: None if limit is None else offset + limit]], len(found)

    def _size(self, run_id: str) -> int:
        try:
            return os.stat(self.runs_dir / f"{run_id}.jsonl").st_size
        except FileNotFoundError:
            return -2

    def _reconcile(self, stamp: str) -> None:
        """Add a row for every log without one and drop rows whose log is gone (a listing of ``runs/``)."""
        names = set(self._names())
        with self._lock:
            known = {row[0] for row in self._db().execute("SELECT run_id FROM runs")}
        rows = [row for row in (self._scan(run_id, None) for run_id in names - known) if row is not None]
        with self._write() as db:
            db.executemany("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
            for run_id in known - names:
                if not (self.runs_dir / f"{run_id}.jsonl").exists():  # created meanwhile: keep it
                    db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
            db.execute("INSERT OR REPLACE INTO meta VALUES ('runs_dir', ?)", (stamp,))

    def rebuild(self) -> int:
        """Drop every row and read them all again from the logs; the number of runs indexed."""
        with self._write() as db:
            db.execute("DELETE FROM runs")
            db.execute("DELETE FROM meta")
        self.repair()
        with self._lock:
            return int(self._db().execute("SELECT count(*) FROM runs").fetchone()[0])


def _read_range(fd: int, start: int, size: int) -> bytes:
    """`size` bytes of the file open at `fd` from `start` (fewer where it ends sooner), by position."""
    data = os.pread(fd, size, start) if size > 0 else b""
    while 0 < len(data) < size:  # a read cut short (rare): the rest
        more = os.pread(fd, size - len(data), start + len(data))
        if not more:
            break
        data += more
    return data
