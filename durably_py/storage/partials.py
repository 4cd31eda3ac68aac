"""Stream partials: the chunks a streaming step emitted while it runs, kept beside its run's log so a reader
sees them live and the step's next attempt (after a kill) continues from them.

Partials are a side channel, not part of the log: the log stays append-only and small, a finished step's
record holds its result, and its partials are dropped then (unless the step keeps them). They are written in
batches with no fsync: they survive a killed process (the OS has them), a machine crash may lose the last ones.

`PartialsFront` is the argument check every adapter shares (as `front.StorageFront` does for the other roles);
each adapter stores the chunks' JSON bytes as they are given, one per chunk, in order:

- files: ``runs/<run>.partials/<path>.jsonl``, one line ``{"attempt":N,"chunk":<json>}`` per chunk
  (`FilePartials`); a torn last line from a kill is ignored, and cut before the next append;
- SQLite and PostgreSQL: a ``partials`` table (run, path, seq, attempt, data), created on first use
  (`SQLITE_TABLE`, `PostgresPartials`);
- memory: a list per step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

from ..errors import ValidationError
from .base import validate_run_id

__all__ = ["FilePartials", "PartialsFront", "PostgresPartials", "SQLITE_TABLE", "validate_step_path"]

DOCS = "docs/storage.md#stream-partials"
_PATH = re.compile(r"\d{1,9}(\.\d{1,9}){0,63}")


def validate_step_path(path: Any) -> str:
    """A step path in the log's form ("3", "2.0.1"); `ValidationError` otherwise."""
    if not isinstance(path, str) or not _PATH.fullmatch(path):
        raise ValidationError(f"{path!r} is not a step path", hint="A step path is like '3' or '2.0.1' "
                              "(`durably inspect RUN` shows each step's path).", docs=DOCS)
    return path


def _check_chunks(chunks: Any) -> list[bytes]:
    try:  # each chunk bytes, not empty, on one line: checked at C speed (a flush holds dozens)
        joined = b"\x00".join(chunks) if isinstance(chunks, list) and all(chunks) else None
    except TypeError:
        joined = None
    if joined is None or b"\n" in joined or b"\r" in joined:
        raise ValidationError("partial chunks must be a list of one-line JSON documents (bytes)",
                              hint="Emit chunks with attempt().emit(chunk); the step encodes them.", docs=DOCS)
    return chunks


class PartialsFront:
    """The `Partials` role's public methods: arguments checked once here, then the adapter's `_do_...`."""

    def append_partials(self, run_id: str, path: str, attempt: int, chunks: list[bytes]) -> None:
        """Add `chunks` (each one chunk's JSON bytes) after the step's stored ones, without an fsync."""
        validate_run_id(run_id)
        validate_step_path(path)
        if type(attempt) is not int or attempt < 1:
            raise ValidationError(f"attempt must be an int >= 1, got {attempt!r}", docs=DOCS)
        if chunks:
            self._do_append_partials(run_id, path, attempt, _check_chunks(chunks))

    def read_partials(self, run_id: str, path: str, offset: int = 0) -> list[bytes]:
        """The step's stored chunks from index `offset` on, in the order they were appended ([] when none)."""
        validate_run_id(run_id)
        validate_step_path(path)
        if type(offset) is not int or offset < 0:
            raise ValidationError(f"offset must be an int >= 0, got {offset!r}", docs=DOCS)
        return self._do_read_partials(run_id, path, offset)

    def drop_partials(self, run_id: str, path: str | None = None) -> None:
        """Remove the step's stored chunks (every step's when `path` is None); a no-op when there are none."""
        validate_run_id(run_id)
        if path is not None:
            validate_step_path(path)
        self._do_drop_partials(run_id, path)

    def partial_paths(self, run_id: str) -> dict[str, int]:
        """The paths of the run's steps with stored chunks, and how many each has."""
        validate_run_id(run_id)
        return self._do_partial_paths(run_id)

    def _do_append_partials(self, run_id: str, path: str, attempt: int, chunks: list[bytes]) -> None:
        raise NotImplementedError

    def _do_read_partials(self, run_id: str, path: str, offset: int) -> list[bytes]:
        raise NotImplementedError

    def _do_drop_partials(self, run_id: str, path: str | None) -> None:
        raise NotImplementedError

    def _do_partial_paths(self, run_id: str) -> dict[str, int]:
        raise NotImplementedError


class PartialsStore(Protocol):
    """Where an adapter keeps partials apart from its own code (`FilePartials`, `PostgresPartials`)."""

    def append(self, run_id: str, path: str, attempt: int, chunks: list[bytes]) -> None: ...
    def read(self, run_id: str, path: str, offset: int) -> list[bytes]: ...
    def drop(self, run_id: str, path: str | None) -> object: ...
    def paths(self, run_id: str) -> dict[str, int]: ...


class PartialsKeptApart:
    """The `Partials` role's `_do_...` methods of an adapter that keeps its partials in `_partials` (a
    `PartialsStore`); listed before `StorageFront` among the adapter's bases."""

    _partials: PartialsStore

    def _do_append_partials(self, run_id: str, path: str, attempt: int, chunks: list[bytes]) -> None:
        self._partials.append(run_id, path, attempt, chunks)

    def _do_read_partials(self, run_id: str, path: str, offset: int) -> list[bytes]:
        return self._partials.read(run_id, path, offset)

    def _do_drop_partials(self, run_id: str, path: str | None) -> None:
        self._partials.drop(run_id, path)

    def _do_partial_paths(self, run_id: str) -> dict[str, int]:
        return self._partials.paths(run_id)


_PREFIX = b'{"attempt":'
_CHUNK = b',"chunk":'


class FilePartials:
    """Partials on files: ``<runs>/<run>.partials/<path>.jsonl``."""

    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir = runs_dir

    def folder(self, run_id: str) -> Path:
        return self.runs_dir / f"{run_id}.partials"

    def append(self, run_id: str, path: str, attempt: int, chunks: list[bytes]) -> None:
        folder = self.folder(run_id)
        head = _PREFIX + str(attempt).encode() + _CHUNK
        data = b"".join(head + c + b"}\n" for c in chunks)
        file = folder / f"{path}.jsonl"
        try:
            fd = os.open(file, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        except FileNotFoundError:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(file, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn line from a killed writer: cut it first
                _cut_torn(file, size)
            os.write(fd, data)
        finally:
            os.close(fd)

    def read(self, run_id: str, path: str, offset: int) -> list[bytes]:
        try:
            data = (self.folder(run_id) / f"{path}.jsonl").read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return []
        return _chunks(data)[offset:]

    def drop(self, run_id: str, path: str | None) -> int:
        """Remove the step's file (every file and the folder when `path` is None); the bytes freed."""
        folder = self.folder(run_id)
        names = [f"{path}.jsonl"] if path is not None else _names(folder)
        freed = 0
        for name in names:
            try:
                file = folder / name
                freed += file.stat().st_size
                file.unlink()
            except FileNotFoundError:
                pass
        try:
            folder.rmdir()  # only once empty
        except OSError:
            pass
        return freed

    def paths(self, run_id: str) -> dict[str, int]:
        folder = self.folder(run_id)
        found = {}
        for name in _names(folder):
            if name.endswith(".jsonl"):
                found[name[:-6]] = len(self.read(run_id, name[:-6], 0))
        return {path: n for path, n in found.items() if n}


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _cut_torn(file: Path, size: int) -> None:
    with open(file, "rb+") as f:
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)


def _chunks(data: bytes) -> list[bytes]:
    """The chunks of a partials file: whole lines of the expected shape; a torn or damaged line is skipped."""
    out = []
    for line in data.split(b"\n")[:-1]:  # the last piece has no newline: empty, or a torn line
        at = line.find(_CHUNK)
        if line.startswith(_PREFIX) and at > 0 and line.endswith(b"}"):
            out.append(line[at + len(_CHUNK):-1])
    return out


SQLITE_TABLE = """
CREATE TABLE IF NOT EXISTS partials (
    seq INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    path TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS partials_by_step ON partials (run_id, path, seq)
"""


_POSTGRES_TABLE = """
CREATE TABLE IF NOT EXISTS {s}.partials (
    seq BIGSERIAL PRIMARY KEY,
    run_id TEXT NOT NULL,
    path TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    data BYTEA NOT NULL
);
CREATE INDEX IF NOT EXISTS partials_by_step ON {s}.partials (run_id, path, seq)
"""


class PostgresPartials:
    """Partials in PostgreSQL: the ``partials`` table of the adapter's schema, created on first use, written by
    transactions whose commit waits for no fsync (``synchronous_commit = off``). `cursor(transaction=True)` is
    the adapter's: a cursor in one transaction, under its lock."""

    def __init__(self, schema: str, cursor: Callable[..., AbstractContextManager[Any]]) -> None:
        self.schema = schema
        self.table = f'"{schema}".partials'
        self.cursor = cursor
        self.made: object = None  # the connection the table is known to exist on

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        with self.cursor(transaction=True) as cur:
            if self.made is not cur.connection:
                if cur.execute("SELECT to_regclass(%s)", (self.table,)).fetchone()[0] is None:
                    cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"durably-schema:{self.schema}",))
                    for statement in _POSTGRES_TABLE.format(s=f'"{self.schema}"').split(";"):
                        if statement.strip():
                            cur.execute(statement)
                self.made = cur.connection
            cur.execute("SET LOCAL synchronous_commit = off")
            yield cur

    def append(self, run_id: str, path: str, attempt: int, chunks: list[bytes]) -> None:
        with self._transaction() as cur:
            cur.executemany(f"INSERT INTO {self.table} (run_id, path, attempt, data) VALUES (%s, %s, %s, %s)",
                            [(run_id, path, attempt, chunk) for chunk in chunks])

    def read(self, run_id: str, path: str, offset: int) -> list[bytes]:
        with self._transaction() as cur:
            cur.execute(f"SELECT data FROM {self.table} WHERE run_id = %s AND path = %s ORDER BY seq OFFSET %s",
                        (run_id, path, offset))
            return [bytes(row[0]) for row in cur.fetchall()]

    def drop(self, run_id: str, path: str | None) -> None:
        with self._transaction() as cur:
            if path is None:
                cur.execute(f"DELETE FROM {self.table} WHERE run_id = %s", (run_id,))
            else:
                cur.execute(f"DELETE FROM {self.table} WHERE run_id = %s AND path = %s", (run_id, path))

    def paths(self, run_id: str) -> dict[str, int]:
        with self._transaction() as cur:
            cur.execute(f"SELECT path, count(*) FROM {self.table} WHERE run_id = %s GROUP BY path", (run_id,))
            return {path: int(n) for path, n in cur.fetchall()}

    def delete(self, cur: Any, run_id: str) -> None:
        """Inside the adapter's transaction deleting a run: its partials go too (if the table exists)."""
        if cur.execute("SELECT to_regclass(%s)", (self.table,)).fetchone()[0] is not None:
            cur.execute(f"DELETE FROM {self.table} WHERE run_id = %s", (run_id,))
