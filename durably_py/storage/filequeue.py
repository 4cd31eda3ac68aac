"""The file adapter's queue: one entry file per run that has not ended (``queue/<run_id>.json``), and the join
files of runs parked until their children end (``joins/<run_id>/<child>``); the layout is described in
`file.py`. `FileStorage` owns one `FileQueue` and keeps the catalog and the logs itself."""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from .base import (
    DEFAULT_QUEUE,
    FULL_ERRNOS,
    QueueEntry,
    QueueStats,
    RunInfo,
    count_queues,
    decode_record,
    fair_order,
    is_run_id,
    queue_allows,
    storage_full,
)
from .catalog import queue_fields
from .filedue import DueJournal, entry_fields, sooner
from .filelocks import flocked, read_link_or_file
from .wakeup import LocalWakeups

_MTIME_GRAIN_NS = 50_000_000  # a directory's mtime older than this is past any change in the same clock tick
_ENTRY = msgspec.json.Decoder()
_L = TypeVar("_L")


class FileQueue:
    """Queue entries and join files of one state directory, changed under one flock among processes."""

    def __init__(self, dir: Path, *, write_tmp: Callable[..., str], held: Callable[[str], bool],
                 info: Callable[[str], RunInfo | None], wakeups: LocalWakeups) -> None:
        self.dir = dir / "queue"
        self.joins_dir = dir / "joins"
        self.runs_dir = dir / "runs"
        self._path = str(self.dir)
        self._joins_path = str(self.joins_dir)
        self._runs_path = str(self.runs_dir)
        self._write_tmp = write_tmp  # (directory, stem, data, *, durable) -> the temp file's path
        self._held = held  # run id -> True while a live process holds the run
        self._info = info  # run id -> its `RunInfo` (for queueing a state dir from before the queue)
        self.wakeups = wakeups
        self._ready_dir = False
        self._links = True  # entries are stored as symlinks (False: this file system has none, regular files)
        self._workflows: dict[str, str | None] = {}  # run id -> its header's workflow, for `due(workflows=)`
        self._listed: tuple[int, list[QueueEntry]] | None = None  # (queue dir mtime, its entries), see `entries`
        self.journal = DueJournal(self._path, str(self.dir / ".lock"), self._read_all, _entry, self.read)

    # ---- entries --------------------------------------------------------------------------------
    def _entry_path(self, run_id: str) -> Path:
        return self.dir / f"{run_id}.json"

    def queued(self, run_id: str) -> bool:
        """True when the run has a queue entry."""
        return os.path.lexists(os.path.join(self._path, f"{run_id}.json"))

    def _ensure(self) -> None:
        """Create the queue directory; a state dir from before the queue gets an entry, due now, for every run
        that has not ended, so a worker takes its interrupted, sleeping and waiting runs over."""
        if self._ready_dir:
            return
        try:
            self.dir.mkdir(parents=True)
        except FileExistsError:
            self._ready_dir = True
            return
        try:
            names = os.listdir(self.runs_dir)
        except FileNotFoundError:
            names = []
        with flocked(str(self.dir / ".lock")):
            for name in names:
                run_id = name[:-6]
                if not name.endswith(".jsonl") or name.startswith(".") or not is_run_id(run_id):
                    continue
                info = self._info(run_id)
                if info is not None and not info.ended and self.read(run_id) is None:
                    self.write(QueueEntry(run_id, info.updated_at, 0, (), info.updated_at,
                                          *queue_fields(info.header)), None)
        self._ready_dir = True

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Serialise changes to queue entries among threads and processes (a blocking flock)."""
        self._ensure()
        with flocked(str(self.dir / ".lock")):
            yield

    def write(self, entry: QueueEntry, old: QueueEntry | None) -> None:
        """Atomically replace a run's queue entry `old` (None: it has none) with `entry` (call with the queue
        lock held); its queue ("q") and partition ("pt") only when not the default queue and none. The due
        journal's line goes before the file when the run becomes due no later, else after
        (`filedue.sooner`)."""
        first = sooner(entry, old)
        if first:
            self.journal.append([self.journal.set_line(entry)])
        self._write_file(entry, old)
        if not first:
            self.journal.append([self.journal.set_line(entry)])

    def _write_file(self, entry: QueueEntry, old: QueueEntry | None) -> None:
        """Write the entry's file in place of `old` (None: it has none), leaving the due journal to the caller."""
        data = msgspec.json.encode(entry_fields(entry))
        path = os.path.join(self._path, f"{entry.run_id}.json")
        if old is not None or not self._new_link(path, data):
            tmp = self._link_tmp(entry.run_id, data) if self._links else None
            if tmp is None:
                tmp = self._write_tmp(self._path, entry.run_id, data, durable=False)
            try:
                os.replace(tmp, path)
            except BaseException:
                _unlink(tmp)
                raise

    def _new_link(self, path: str, data: bytes) -> bool:
        """Create a run's first entry as a symlink in place: one step, whole or not at all, so no temp link
        and rename; False when it is to be written the other way (an unreadable entry is in the way, no
        symlinks here, or an entry too long for a target)."""
        if not self._links:
            return False
        try:
            return self._symlink(data, path)
        except FileExistsError:
            return False

    def _link_tmp(self, run_id: str, data: bytes) -> str | None:
        """A new hidden symlink whose target is the entry's JSON, to be renamed into place; None when the entry
        is to be a regular file: this file system has no symlinks, or the JSON is too long for a target.

        An entry is a symlink because its target lives in the inode (on ext4 up to 59 bytes, most entries):
        writing one allocates no data block and removing one frees none, which on a journaling file system
        costs as much as a commit when it follows a sync, as a run's end does. Nothing follows the link."""
        tmp = os.path.join(self._path, f".{run_id}.{os.getpid()}.{os.urandom(6).hex()}.lnk")
        return tmp if self._symlink(data, tmp) else None

    def _symlink(self, target: bytes, path: str) -> bool:
        """Create `path` as a symlink to `target`; False when the entry is to be a regular file instead (this file
        system has no symlinks, then never again, or the target is too long); `FileExistsError` if `path` exists,
        `StorageFullError` for a full disk."""
        try:
            os.symlink(target, os.fsencode(path))
        except FileExistsError:
            raise
        except (NotImplementedError, AttributeError):  # pragma: no cover - no symlinks (Windows)
            self._links = False
            return False
        except OSError as exc:
            if exc.errno in FULL_ERRNOS:
                raise storage_full(exc, "write", self._path) from exc
            if exc.errno != errno.ENAMETOOLONG:  # pragma: no cover - a file system without symlinks
                self._links = False
            return False
        return True

    def read(self, run_id: str) -> QueueEntry | None:
        """The run's queue entry (None: not queued, or not a readable entry): a symlink's target, or a
        regular file's content (entries too long for a target, and from before entries were symlinks)."""
        path = os.path.join(self._path, f"{run_id}.json")
        data = read_link_or_file(path, 65536)
        if data is None:
            return None
        try:
            raw = _ENTRY.decode(data)
        except msgspec.DecodeError:
            return None
        return _entry(run_id, raw)

    def add(self, entry: QueueEntry) -> bool:
        """Queue a run about to be created (call with the queue lock held); False when it has an entry or a
        log already (the log's creation then fails loudly)."""
        return self.add_many([entry])[0]

    def add_many(self, entries: list[QueueEntry]) -> list[bool]:
        """`add` of a batch (call with the queue lock held): every new entry's due-journal line in one append,
        before any of their files (a new entry makes its run due sooner, `filedue.sooner`), then the files; for
        each entry whether it was added (False: it had an entry or a log already)."""
        added = [not self.queued(entry.run_id)
                 and not os.path.exists(os.path.join(self._runs_path, f"{entry.run_id}.jsonl")) for entry in entries]
        self.journal.append([self.journal.set_line(entry) for entry, new in zip(entries, added, strict=True) if new])
        for entry, new in zip(entries, added, strict=True):
            if new:
                self._write_file(entry, None)
        return added

    def discard(self, run_id: str) -> None:
        """Delete the run's entry file, if any (a run whose log could not be created, or a deleted run), then
        say so in the due journal."""
        _unlink(os.path.join(self._path, f"{run_id}.json"))
        self.journal.append([self.journal.drop_line(run_id)])

    # ---- moving runs ----------------------------------------------------------------------------
    def schedule(self, run_id: str, at: float | None, wait: tuple[str, ...], priority: int | None) -> None:
        """Write the run's queue entry: due at `at` (None: only when woken), woken early by `wait` signals;
        `priority` None keeps the entry's. What it waited for in a join is dropped."""
        with self.lock():
            old = self.read(run_id)
            if old is not None:
                self.write(replace(old, at=at, wait=wait, priority=old.priority if priority is None else priority),
                           old)
            else:
                self.write(QueueEntry(run_id, at, priority or 0, wait, time.time(), *self._place_of(run_id)), None)
            self._drop_joins(run_id)

    def _drop_joins(self, run_id: str) -> None:
        """Forget the children a run waited for in a join (call with the queue lock held)."""
        folder = self.joins_dir / run_id
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return
        for name in names:
            (folder / name).unlink(missing_ok=True)
        folder.rmdir()

    def join_wait(self, run_id: str, children: tuple[str, ...]) -> bool:
        """One file per child still queued under joins/<run_id>/, then the run's entry due only when woken (or
        now, when no child is queued); all under the queue flock."""
        with self.lock():
            self._drop_joins(run_id)
            queued = [c for c in dict.fromkeys(children) if self.queued(c)]
            if queued:
                folder = self.joins_dir / run_id
                folder.mkdir(parents=True, exist_ok=True)
                for child in queued:
                    (folder / child).touch()
            old = self.read(run_id)
            now = time.time()
            due = None if queued else now
            self.write(replace(old, at=due, wait=()) if old is not None
                       else QueueEntry(run_id, due, 0, (), now, *self._place_of(run_id)), old)
        if not queued:
            self.wakeups.notify()
        return not queued

    def unschedule(self, run_id: str) -> None:
        """Take the run out of the queue (a no-op when it has neither an entry nor a join: a child its parent
        ran in place is waited for in no join)."""
        if self.queued(run_id) or os.path.exists(os.path.join(self._joins_path, run_id)):
            self.unschedule_all([run_id])

    def unschedule_all(self, run_ids: list[str], headers: list[Any] | None = None) -> None:
        """Take the runs out of the queue under one hold of the queue lock: each run's file in its parent's
        join goes first (the last one makes the parent due), then its own joins and its entry. `headers`: the
        runs' headers where the caller has them (a lease's first record), so no log is opened for them."""
        parents = [self._parent_of(run_id) if headers is None or not isinstance(headers[i], dict)
                   or headers[i].get("t") != "run" else _parent_in(headers[i]) for i, run_id in enumerate(run_ids)]
        with self.lock():
            for run_id, parent in zip(run_ids, parents, strict=True):
                self._unqueue(run_id, parent)
            self.journal.append([self.journal.drop_line(run_id) for run_id in run_ids])

    def _header_of(self, run_id: str) -> dict[str, Any]:
        """A run's decoded header ({}: no log, or no header line)."""
        try:
            with open(os.path.join(self._runs_path, f"{run_id}.jsonl"), "rb") as f:
                return decode_record(f.readline()) or {}
        except FileNotFoundError:
            return {}

    def _parent_of(self, run_id: str) -> str | None:
        """The parent run a run's header names (None: none, or no log)."""
        return _parent_in(self._header_of(run_id))

    def _place_of(self, run_id: str) -> tuple[str, str | None]:
        """The queue and partition a run's header names, for an entry written anew (a run queued again)."""
        return queue_fields(self._header_of(run_id))

    def _unqueue(self, run_id: str, parent: str | None) -> None:
        """`unschedule` of one run with the queue lock held: its file in its parent's join goes first (the last
        one makes the parent due), then its own joins and its entry (the caller then tells the due journal)."""
        if parent is not None:
            folder = self.joins_dir / parent
            (folder / run_id).unlink(missing_ok=True)
            try:
                last = not any(True for _ in os.scandir(folder))
            except FileNotFoundError:
                last = False
            if last:  # also when a crash came between the last file's removal and the parent's wake-up
                old = self.read(parent)
                now = time.time()
                if old is not None and (old.at is None or old.at > now):
                    self.write(replace(old, at=now), old)
                    self.wakeups.notify()
                folder.rmdir()
        self._drop_joins(run_id)
        self._entry_path(run_id).unlink(missing_ok=True)

    def wake(self, run_id: str, name: str | None) -> bool:
        """Make the run due now if its entry waits for `name` (None: unconditionally)."""
        if not self.queued(run_id):
            return False  # not queued (an entry written after this look is as if written after the wake)
        with self.lock():
            old = self.read(run_id)
            if old is None or (name is not None and name not in old.wait):
                return False
            now = time.time()
            if old.at is not None and old.at <= now:
                return False
            self.write(replace(old, at=now), old)
        self.wakeups.notify()
        return True

    # ---- finding due runs -----------------------------------------------------------------------
    def entries(self) -> list[QueueEntry]:
        """Every queue entry (unfinished runs only), read from the entry files, in no particular order. The
        entries read last are kept and given again while the queue directory is unchanged since (its mtime,
        trusted once it is older than the file system's timestamp granularity)."""
        if not self._ready_dir and self.runs_dir.exists():
            self._ensure()
        try:
            mtime = os.stat(self._path).st_mtime_ns
        except FileNotFoundError:
            return []
        if self._listed is not None and self._listed[0] == mtime:
            return self._listed[1]
        out = self._read_all()
        settled = time.time_ns() - mtime > _MTIME_GRAIN_NS  # a change within the same tick would keep the mtime
        self._listed = (mtime, out) if settled else None
        return out

    def _read_all(self) -> list[QueueEntry]:
        """Every entry file's entry (the due journal's rebuild calls this with the queue lock held)."""
        try:
            names = os.listdir(self._path)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if name.endswith(".json") and not name.startswith(".") and is_run_id(name[:-5]):
                found = self.read(name[:-5])
                if found is not None:
                    out.append(found)
        return out

    def claim_due(self, limit: int, skip: tuple[str, ...], names: frozenset[str] | None,
                  queues: frozenset[str] | None, full: frozenset[str], claim: Callable[[str], _L | None]) -> list[_L]:
        """Claim up to `limit` due runs with `claim` (None: another process has it, or it is not to run), going
        down the due runs in `due`'s order. No held-probe first: the claim's own lock attempt is the probe, so
        a run free now costs one lock, and one held by another worker one failed attempt (a run this process
        holds, none)."""
        if limit <= 0 or not self._looked():
            return []
        at = time.time()
        eligible = self._eligible(at, skip, names, queues, full, probe=False)

        def take(ready: list[QueueEntry]) -> list[_L]:
            leases: list[_L] = []
            for entry in fair_order(ready, eligible):
                lease = claim(entry.run_id)
                if lease is not None:
                    leases.append(lease)
                    if len(leases) >= limit:
                        break
            return leases

        return self.journal.look(at, take)

    def _looked(self) -> bool:
        """Ready to look at the due journal: False when there is no queue yet (nothing is due)."""
        if not self._ready_dir:
            if self.runs_dir.exists():
                self._ensure()
            elif not os.path.isdir(self._path):
                return False
        return True

    def due(self, limit: int, now: float | None, skip: tuple[str, ...], names: frozenset[str] | None,
            queues: frozenset[str] | None = None, full: frozenset[str] = frozenset()) -> list[str]:
        """Due runs in the queue's fair order (`base.fair_order`), from this process's view of the due journal
        (`filedue.DueJournal`), so a look costs the same whatever the backlog: entries due by `now` whose run
        no live process holds, in `queues` and not `full` (the entry says its queue and partition), and, for
        `names`, whose header names one of them (read once per run, headers never change). Each candidate's
        entry file is read before it is returned: one that disagrees with the view corrects it."""
        if not self._looked():
            return []
        at = time.time() if now is None else now
        eligible = self._eligible(at, skip, names, queues, full, probe=True)
        return self.journal.look(at, lambda ready: [e.run_id for e in itertools.islice(fair_order(ready, eligible),
                                                                                       limit)])

    def _eligible(self, at: float, skip: tuple[str, ...], names: frozenset[str] | None,
                  queues: frozenset[str] | None, full: frozenset[str], *, probe: bool) -> Callable[[QueueEntry], bool]:
        """Whether an entry of the view is to be returned by a look at time `at`: due, not skipped, in the
        queues asked for and not full, of the workflows `names` asks for, its entry file agreeing (or, after
        correcting the view, due all the same), its log there, and (with `probe`) no process holding it."""
        journal = self.journal

        def eligible(entry: QueueEntry) -> bool:
            if entry.at is None or entry.at > at or entry.run_id in skip or not queue_allows(entry, queues, full):
                return False
            if names is not None and self._workflow_of(entry.run_id) not in names:
                return False
            fresh = self.read(entry.run_id)
            if fresh != entry:
                journal.correct(entry.run_id)
                if fresh is None or fresh.at is None or fresh.at > at:
                    return False
            if probe and self._held(entry.run_id):
                return False
            return os.path.exists(os.path.join(self._runs_path, f"{entry.run_id}.jsonl"))

        return eligible

    def _workflow_of(self, run_id: str) -> str | None:
        """The workflow a run's header names (None: no log, or no header yet)."""
        if run_id in self._workflows:
            return self._workflows[run_id]
        try:
            with open(os.path.join(self._runs_path, f"{run_id}.jsonl"), "rb") as f:
                name = (decode_record(f.readline()) or {}).get("workflow")
        except FileNotFoundError:
            return None
        if not isinstance(name, str):
            return None
        if len(self._workflows) >= 100_000:
            self._workflows.clear()
        self._workflows[run_id] = name
        return name

    def next_due(self, now: float | None = None) -> float | None:
        """The earliest time after `now` at which a queued run falls due (None: none is to), from the due
        journal's view (never later than the entry files say; an early answer costs a look that finds
        nothing and corrects the view)."""
        if not self._looked():
            return None
        return self.journal.next_due(time.time() if now is None else now)

    def stats(self, now: float) -> list[QueueStats]:
        """`queue_stats` from every entry whose run has a log (an entry whose log was never created is not a
        run), each run's lock probed: for operators, not for a worker's loop."""
        found = [(entry, self._held(entry.run_id)) for entry in self.entries()
                 if os.path.exists(os.path.join(self._runs_path, f"{entry.run_id}.jsonl"))]
        return count_queues(found, now)


def _parent_in(header: dict[str, Any]) -> str | None:
    """The parent run a decoded header names (None: none)."""
    parent = header.get("parent")
    return parent if isinstance(parent, str) and is_run_id(parent) else None


def _entry(run_id: str, raw: Any) -> QueueEntry | None:
    """A queue entry from its stored JSON, or None when it is not one."""
    if not isinstance(raw, dict):
        return None
    at, priority, wait, created = raw.get("at"), raw.get("p", 0), raw.get("w") or [], raw.get("c", 0.0)
    if (at is not None and not isinstance(at, int | float)) or not isinstance(priority, int) \
            or not isinstance(wait, list) or not isinstance(created, int | float):
        return None
    queue, partition = raw.get("q"), raw.get("pt")  # absent in entries from before named queues
    return QueueEntry(run_id, None if at is None else float(at), priority,
                      tuple(w for w in wait if isinstance(w, str)), float(created),
                      queue if isinstance(queue, str) and queue else DEFAULT_QUEUE,
                      partition if isinstance(partition, str) and partition else None)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
