"""The write gate of a SQLite database file: how processes sharing it wait for each other's write transactions.

SQLite's own lock is the one that counts, and stays so: every write still takes it. But a connection that finds
it held waits in SQLite's busy handler, which sleeps 1, 2, 5, 10, ... ms between looks, while a write
transaction of this adapter holds the lock for tens of microseconds. Two workers on one file then spend much of
their time asleep, each waiting a millisecond or more for a lock free long before, and drain no more than one.

The gate is an advisory ``flock`` on a side file (``<database>.gate``), taken around each write transaction of
a process that has seen another writer: a waiter looks again within microseconds of the holder leaving (short
sleeps, growing to 1 ms), so it reaches SQLite's lock when it is free. A process takes the gate from its first
write that waited 1 ms or more (the busy handler's first sleep, or a commit that checkpointed) on; until then it
pays nothing. A write can also take that long on a busy machine with no other writer (the process was not on a
CPU meanwhile), so the gate goes off again once `QUIET` entries in a row found it free, no write waited
meanwhile and no other connection committed to the database since the last such count (SQLite's
``data_version``, `WriteGate.version`): no other process writes then, and each step would pay its two ``flock``
calls for nothing. Writers that never take the gate (an older version, a `sqlite3` shell, an application's own
connection) are waited for by SQLite's busy handler, as before. The gate is never waited for longer than the
storage's `timeout`; after that the write fails as a locked database does. No gate where ``flock`` does not
exist, or the side file cannot be opened (a read-only folder): SQLite's lock alone, as before.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

WAITED = 0.001
"""A write that took this long (seconds) waited for another writer (or checkpointed): the gate goes on."""
QUIET = 500
"""Gate entries in a row that found it free (no write waiting meanwhile), after which the gate goes off again if no
other connection committed to the database since the last such count."""
_NAPS = (0.0, 0.0, 0.0, 0.00005, 0.0001, 0.0002, 0.0005)  # then 1 ms each: a waiter looks again soon


class WriteGate:
    """The gate of one storage's connection; every call is made with that storage's lock held (one thread at a
    time), and `enter`/`leave` nest (a write inside another write of the same process is let through)."""

    __slots__ = ("path", "timeout", "on", "version", "_fd", "_pid", "_depth", "_free", "_seen")

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.on = False  # whether this process takes the gate (from its first write that waited)
        self._fd: int | None = None
        self._pid = 0
        self._depth = 0
        self.version: Callable[[], int] | None = None  # the connection's ``PRAGMA data_version`` (set by its storage)
        self._free = 0  # entries in a row that found the gate free
        self._seen: int | None = None  # `version` when the last count of `QUIET` free entries ended

    def _open(self) -> int | None:
        """The side file's descriptor in this process (a forked child opens its own: a descriptor shared with
        the parent would share its lock); None (the gate stays off) where it cannot be had."""
        if self._fd is not None and self._pid == os.getpid():
            return self._fd
        if fcntl is None:
            self.on = False
            return None
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            self.on = False
            return None
        self._pid, self._depth = os.getpid(), 0
        return self._fd

    def enter(self) -> bool:
        """Take the gate if this process takes it (True: `leave` must follow), waiting at most `timeout`
        seconds, then raising SQLite's own "database is locked"."""
        if not self.on:
            return False
        fd = self._open()
        if fd is None:
            return False
        if self._depth:
            self._depth += 1
            return True
        deadline = 0.0
        naps = iter(_NAPS)
        self._free += 1
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                self._free = 0
            except OSError:  # a file system without flock: SQLite's lock alone
                self.on = False
                return False
            now = time.monotonic()
            if not deadline:
                deadline = now + self.timeout
            elif now >= deadline:
                raise sqlite3.OperationalError(f"database is locked (its write gate {self.path} stayed held)")
            time.sleep(next(naps, 0.001))
        self._depth = 1
        return True

    def leave(self) -> None:
        """Give the gate up (after `enter` returned True)."""
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            if self._free >= QUIET:
                self._quiet()

    def _quiet(self) -> None:
        """`QUIET` entries found the gate free: off until a write waits again, if no other connection committed
        since the gate went on or the last such count (none writes now)."""
        self._free = 0
        seen, self._seen = self._seen, (self.version() if self.version is not None else None)
        if seen == self._seen:
            self.on = False
            self._seen = None

    def took(self, started: float) -> None:
        """A write that began at `started` (`time.perf_counter()`) is done: one that waited turns the gate on (or
        keeps it on)."""
        if time.perf_counter() - started >= WAITED and fcntl is not None:
            self.on = True
            self._free = 0
            self._seen = self.version() if self.version is not None else None

    def close(self) -> None:
        """Close the side file (it reopens on next use)."""
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd, self._depth = None, 0
