"""The file queue's due journal: ``queue/.due.jsonl``, one line per change to a queue entry, appended under the
queue's flock, so a process keeps every entry in memory, in due order, and catches up by reading only the
lines appended since its last look. Finding due runs then costs the same at 10 pending as at 100,000: no
listing of the queue directory and no entry read but the few candidates returned.

The entry files (`filequeue.py`) stay the truth; the journal is derived from them and can always be
rebuilt from them (a full listing and read, under the flock): when it is missing (a state directory from
before it, or removed after a failed append), when it was written before the machine last booted (its
first line names the boot, so lines lost with the page cache are never trusted), and to compact it once its
lines outnumber the entries it describes. A rebuild writes a new file and renames it in; readers notice the
new inode and read it from the top.

What keeps the journal safe without fsyncs or a second durable write: a process's view of an entry is never
*less* due than its file. A change that makes a run due sooner (a new entry, a wake, an earlier time) is
appended before the file is written; one that makes it due later or removes it, after. A process killed
between the two leaves a view that is at most early, and every candidate is checked against its file
before it is returned (a file that disagrees corrects the view), so no queued run is ever missed and none is
returned before its file says it is due.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec

from .base import QueueEntry, due_order, is_run_id
from .filelocks import flocked

_T = TypeVar("_T")
JOURNAL = ".due.jsonl"
_LINE = msgspec.json.Decoder()
_ENCODE = msgspec.json.encode
_COMPACT_SLACK = 10_000  # lines beyond four per entry before a reader compacts the journal
_MAX_BYTES = 64 << 20  # a journal no reader compacts (only enqueues, no worker) is dropped at this size


def _boot_id() -> str | None:
    """This boot of the machine (Linux); None where the OS does not say, and then every process rebuilds the
    journal on its first look rather than trust lines that a power loss may have dropped."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:  # pragma: no cover - not Linux
        return None


BOOT = _boot_id()


def entry_fields(entry: QueueEntry) -> dict[str, Any]:
    """The stored fields of a queue entry (as its file holds them; the journal adds the run id): its priority,
    signals, queue and partition only when not 0, none, the default queue and none."""
    fields: dict[str, Any] = {"at": entry.at, "c": entry.created}  # short enough for an inline symlink target
    if entry.priority:
        fields["p"] = entry.priority
    if entry.wait:
        fields["w"] = list(entry.wait)
    if entry.queue != "default":
        fields["q"] = entry.queue
    if entry.partition is not None:
        fields["pt"] = entry.partition
    return fields


def sooner(new: QueueEntry, old: QueueEntry | None) -> bool:
    """True when `new` makes its run due no later than `old` did (or is new): its journal line goes first."""
    if old is None:
        return True
    if new.at is None:
        return old.at is None
    return old.at is None or new.at <= old.at


class DueJournal:
    """The journal file of one queue directory and this process's view of it: every entry by run id, the ones
    due by the last look sorted in `due_order`, the later ones in a heap by due time."""

    def __init__(self, queue_dir: str, lock_path: str,
                 load: Callable[[], Iterable[QueueEntry]], parse: Callable[[str, Any], QueueEntry | None],
                 read: Callable[[str], QueueEntry | None]) -> None:
        self._dir = queue_dir
        self.path = os.path.join(queue_dir, JOURNAL)
        self._lock_path = lock_path
        self._load = load  # every entry, read from the entry files (call with the flock held)
        self._parse = parse  # (run id, decoded fields) -> the entry, or None when not one
        self._read = read  # run id -> its entry file's entry (None: no entry file)
        self._mutex = threading.Lock()
        self._fd: int | None = None
        self._ino = -1
        self._offset = 0
        self._lines = 0
        self.entries: dict[str, QueueEntry] = {}
        self.ready: list[QueueEntry] = []  # entries due by `self._promoted`, in `due_order`
        self._later: list[tuple[float, int, QueueEntry]] = []  # the rest that have a due time; stale ones skipped
        self._seq = itertools.count()
        self._promoted = float("-inf")
        self._fixes: set[str] = set()
        self._appends = 0

    # ---- writing (under the queue flock) ------------------------------------------------------------
    def append(self, lines: list[bytes]) -> None:
        """Append lines to the journal (call with the queue flock held). No journal: nothing to do, the next
        reader builds it from the entry files. A failed append removes it, for the same reason."""
        if not lines:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            return
        try:
            data = b"".join(lines)
            if os.write(fd, data) != len(data):
                raise OSError("short write")
            self._appends += 1
            if not self._appends % 256 and os.fstat(fd).st_size > _MAX_BYTES:
                _unlink(self.path)  # no reader has compacted it for a long while: the next one rebuilds it
        except OSError:
            _unlink(self.path)
        finally:
            os.close(fd)

    @staticmethod
    def set_line(entry: QueueEntry) -> bytes:
        fields = entry_fields(entry)
        fields["r"] = entry.run_id
        return _ENCODE(fields) + b"\n"

    @staticmethod
    def drop_line(run_id: str) -> bytes:
        return b'{"r":"%s","x":1}\n' % run_id.encode()

    # ---- reading ----------------------------------------------------------------------------------
    def look(self, now: float, take: Callable[[list[QueueEntry]], _T]) -> _T:
        """Catch up with the journal and give `take` the entries due by `now` (and possibly a few due later,
        when an earlier look was asked about a later time), in `due_order`, with this view held still; then
        apply the corrections `take` asked for (`correct`)."""
        with self._mutex:
            self._catch_up()
            self._promote(now)
            try:
                return take(self.ready)
            finally:
                fixes, self._fixes = self._fixes, set()
                if fixes:
                    self._fix(fixes)

    def next_due(self, now: float) -> float | None:
        """The earliest due time after `now` in this view."""
        with self._mutex:
            self._catch_up()
            if now < self._promoted:
                return min((e.at for e in self.entries.values() if e.at is not None and e.at > now), default=None)
            self._promote(now)
            later = self._later
            while later and self.entries.get(later[0][2].run_id) is not later[0][2]:
                heapq.heappop(later)
            return later[0][0] if later else None

    def correct(self, run_id: str) -> None:
        """From within `look`'s `take`: the run's entry file disagrees with the view. Once `take` returns, the
        view takes the file's entry as it is under the queue flock, after the lines appended before it: a
        change in flight (its line read, its file not yet written, or the other way round) is never taken for
        the truth, so a correction never leaves the view less due than a file."""
        self._fixes.add(run_id)

    def _fix(self, run_ids: set[str]) -> None:
        if self._fd is None:  # no journal (a state dir it cannot be written to): the next look reads every file
            return
        with flocked(self._lock_path):
            try:
                same = os.stat(self.path).st_ino == self._ino
            except FileNotFoundError:
                same = False
            if not same:
                return  # replaced or gone: the next look reads it anew or rebuilds it
            self._read_more()
            for run_id in run_ids:
                entry = self._read(run_id)
                if entry is None:
                    self._remove(run_id)
                else:
                    self._set(entry)

    def _catch_up(self) -> None:
        """Apply the lines appended since the last look; read a replaced journal from its top, and build a
        missing, untrusted or overgrown one (under the queue flock)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._rebuild()
            return
        if st.st_ino != self._ino:
            if not self._reopen():
                self._rebuild()
            return
        if st.st_size > self._offset:
            self._read_more()
        if self._lines > 4 * len(self.entries) + _COMPACT_SLACK:
            self._rebuild()

    def _reopen(self) -> bool:
        """Read the journal at its path from the top; False when it is not one to trust (gone, no header of
        this boot)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        self._close()
        self._fd, self._ino = fd, os.fstat(fd).st_ino
        self._offset, self._lines = 0, 0
        self._reset()
        header = self._read_more()
        if not header or not isinstance(header, dict) or header.get("boot") != BOOT or BOOT is None:
            return False
        return True

    def _read_more(self) -> Any:
        """Apply the complete lines after the offset; the first line's decoded value when reading from the
        top (the header)."""
        assert self._fd is not None
        chunks: list[bytes] = []
        at = self._offset
        while True:
            chunk = os.pread(self._fd, 1 << 20, at)
            if not chunk:
                break
            chunks.append(chunk)
            at += len(chunk)
        data = b"".join(chunks)
        end = data.rfind(b"\n") + 1
        if not end:
            return None
        header = None
        lines = data[:end].split(b"\n")
        lines.pop()
        if self._offset == 0:
            header = _decode(lines[0])
            lines = lines[1:]
        self._offset += end
        self._lines += len(lines)
        for line in lines:
            raw = _decode(line)
            if not isinstance(raw, dict):
                continue
            run_id = raw.get("r")
            if not isinstance(run_id, str) or not is_run_id(run_id):
                continue
            if raw.get("x"):
                self._remove(run_id)
            else:
                entry = self._parse(run_id, raw)
                if entry is not None:
                    self._set(entry)
        return header

    def _rebuild(self) -> None:
        """Under the queue flock, read every entry file and write a new journal of them (rename in). Where
        that cannot be done (a read-only state dir, a full disk) the view is the entry files as read now, and
        the next look reads them again."""
        self._close()
        self._reset()
        try:
            with flocked(self._lock_path):
                entries = list(self._load())
                data = b"".join([_ENCODE({"v": 1, "boot": BOOT}) + b"\n"] + [self.set_line(e) for e in entries])
                tmp = os.path.join(self._dir, f".due.{os.getpid()}.{threading.get_ident()}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    written = os.write(fd, data)
                finally:
                    os.close(fd)
                try:
                    if written != len(data):
                        raise OSError("short write")
                    os.replace(tmp, self.path)
                except BaseException:
                    _unlink(tmp)
                    raise
                fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            for entry in self._load():
                self._set(entry)
            return
        self._fd, self._ino, self._offset, self._lines = fd, os.fstat(fd).st_ino, len(data), 0
        for entry in entries:
            self._set(entry)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._ino = None, -1

    def close(self) -> None:
        with self._mutex:
            self._close()

    # ---- the view ---------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.entries, self.ready, self._later = {}, [], []
        self._promoted = float("-inf")

    def _set(self, entry: QueueEntry) -> None:
        old = self.entries.get(entry.run_id)
        if old is not None:
            if old == entry:
                return
            self._unready(old)
        self.entries[entry.run_id] = entry
        if entry.at is None:
            return
        if entry.at <= self._promoted:
            bisect.insort(self.ready, entry, key=due_order)
        else:
            heapq.heappush(self._later, (entry.at, next(self._seq), entry))
            if len(self._later) > 2 * len(self.entries) + 1000:  # mostly stale: keep the current ones only
                self._later = [t for t in self._later if self.entries.get(t[2].run_id) is t[2]]
                heapq.heapify(self._later)

    def _remove(self, run_id: str) -> None:
        old = self.entries.pop(run_id, None)
        if old is not None:
            self._unready(old)

    def _unready(self, old: QueueEntry) -> None:
        """Take `old` out of the sorted due list if it is there (a heap item of it goes stale by itself)."""
        if old.at is not None and old.at <= self._promoted:
            ready = self.ready
            i = bisect.bisect_left(ready, due_order(old), key=due_order)
            if i < len(ready) and ready[i] is old:
                del ready[i]

    def _promote(self, now: float) -> None:
        """Move the entries due by `now` from the heap into the sorted list."""
        if now <= self._promoted:
            return
        later, entries, ready = self._later, self.entries, self.ready
        while later and later[0][0] <= now:
            entry = heapq.heappop(later)[2]
            if entries.get(entry.run_id) is entry:
                bisect.insort(ready, entry, key=due_order)
        self._promoted = now


def _decode(line: bytes) -> Any:
    try:
        return _LINE.decode(line)
    except msgspec.DecodeError:
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
