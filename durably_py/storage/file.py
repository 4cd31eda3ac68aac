"""Runs as JSON-lines files under one directory; a lease is an OS file lock that dies with its process.

Layout under ``dir``::

    runs/<run_id>.jsonl   the log, one record per line, only ever appended to (or atomically replaced)
    runs/<run_id>.lock    locked by the process holding the lease (the OS drops the lock if it dies); holds JSON
                          about the last claimant (owner, pid, host, epoch, at), padded to 4 KiB and written in
                          place by one write, so others can say who holds it (older state dirs kept it in
                          runs/<run_id>.owner, which is still read when the lock file holds none)
    runs/<run_id>.inbox/  signals not yet acknowledged, one file each, <time_ns:020d>-<random hex>.json holding
                          the signal line; written as a hidden .tmp file, fsynced, then renamed in (any process
                          may send, lease or not), so a reader sees a whole signal or none
    index/<sha256>        the run id an identity (key) is bound to; the identity itself never becomes a path; a
                          binding made in a batch (`create_bound`: children, `enqueue_many`) is a symlink whose
                          target is the run id, others a file holding it
    queue/<run_id>.json   the queue entry of a run that has not ended: {"at": due time or null, "c": created,
                          "p": priority (absent: 0), "w": [signal names that wake it] (absent: none), "q": its
                          named queue (absent: the default queue), "pt": its partition (absent: none)}, stored as
                          a symlink's target (a regular file where symlinks are not supported or the entry is too
                          long; `filequeue.py` says why); replaced atomically (temp link or file, and rename)
                          under the flock of queue/.lock, deleted when the run ends
    queue/.due.jsonl      the due journal: one line per change to an entry, appended under the same flock, so a
                          worker finds due runs by reading only the lines added since its last look; derived
                          from the entry files and rebuilt from them when missing, compacted or from before the
                          last boot (`filedue.py`)
    catalog.db            the run catalog `list_runs` and `count_runs` answer from (workflow, key, parent, state,
                          last activity per run; `fileindex.py`): written at create, queue changes and delete,
                          never per step, and repaired from the logs whenever it is missing or behind them
    workers/<sha256>.json  a live worker's advertisement (owner, what it serves), beside workers/<sha256>.lock,
                          which its process holds locked while it lives (`advertise`, `workers`)
    joins/<run_id>/<child>  one empty file per child run a run parked in a join still waits for (`join_wait`);
                          the child's end removes its file (under the queue flock) and the last one makes the
                          run due, before the child's own queue entry goes, so a crash in between is redone
    runs/<run_id>.blobs   the run's stored values (`valuestore`, `filevalues.py`): lines "<sha256> <bytes>",
                          appended before the log line that refers to them, fsynced before the log is
    blobs/<sha256>        bytes kept once under their sha256 (`keep_blob`: the source files runs started with):
                          written as a hidden temp file, fsynced, renamed in
    limits/<sha256>.json  a flow-control document (`limit`, `limits`): {"key": key, "doc": document}, replaced
                          by a rename under the flock of limits/.<first two hex digits>.lock (`filelimits.py`)

Leases are OS file locks (`filelocks.py`: the locks, this process's registry of its leases, the claimant
sidecar and the fsync helpers); the queue entries and join files are `filequeue.py`'s.

Appends are fenced by the log's size: each lease remembers how long the log should be, and an append first
checks the descriptor's end (``os.lseek``) before one ``os.write``. That the file was not replaced (its link
count, ``os.fstat``) is checked at every `LOOK_EVERY`-th append and at every sync, rewrite and heartbeat: a log
replaced under a live lease fails the lease before anything appended since is made durable.
The time-to-live of `claim` and `heartbeat` is ignored: the lock lasts exactly as long as the process.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from ..errors import CorruptLogError, LeaseLostError, RunNotFoundError, ValidationError
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
    ended,
    is_run_id,
    iso_now,
    max_epoch,
    parse_log,
    storage_full,
    validate_run_id,
)
from .catalog import OPEN, RunFilter, header_fields, queue_fields
from .filebindings import FileBindings
from .fileinbox import FileInbox
from .filelimits import FileLimits
from .filelocks import (
    CLAIM_TRIES,
    Held,
    OsLock,
    drop,
    fsync_dir,
    held_epoch,
    holder_info,
    lock_run,
    lost,
    probe,
    registered,
    sidecar_epoch,
    syncfs,
    syncfs_call_for,
    write_sidecar,
)
from .filelocks import write_all as _write_all  # looked up here at each call, so a test can stand in for the disk
from .filequeue import FileQueue
from .filevalues import read_values, sync_values, values_path, write_values
from .fileworkers import FileWorkers
from .front import StorageFront, amended_values
from .partials import FilePartials, PartialsKeptApart
from .valuestore import resolve_line
from .wakeup import LocalWakeups

if TYPE_CHECKING:
    from .fileindex import FileCatalog

_T = TypeVar("_T")

_HOST = socket.gethostname()
LOOK_EVERY = 32
"""Appends between two looks (`Held.check`) at whether a held log was replaced; every append checks its size."""
_REFRESH_BATCH = 256  # ended runs whose catalog rows are brought up to date in one transaction
# what opening or linking an unnamed file fails with where the OS, the file system or /proc lacks them
_NO_UNNAMED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL, errno.ENOENT, errno.EXDEV,
                         errno.EPERM, errno.EACCES})


class FileStorage(PartialsKeptApart, FileInbox, FileBindings, StorageFront):
    """Runs as append-only JSON-lines files in a directory, leased through OS file locks."""

    leases_expire = False  # a lease is an OS lock held while the process lives: no renewal can come too late

    def __init__(
        self, dir: str | os.PathLike[str] = ".durably", *, compact_above_bytes: int | None = 1_048_576,
        values_once: bool | None = None,
    ) -> None:
        self.dir = Path(os.path.abspath(dir))
        self.values_once = values_once
        self.runs_dir = self.dir / "runs"
        self._partials: FilePartials = FilePartials(self.runs_dir)
        self.index_dir = self.dir / "index"
        self._link_bindings = True  # bindings made in a batch are symlinks (False: none on this file system)
        self._unnamed_logs = hasattr(os, "O_TMPFILE")  # logs are created as unnamed files, then linked (Linux)
        self._runs_path = str(self.runs_dir)
        self._index_path_str = str(self.index_dir)
        self._runs_real: str | None = None  # the resolved runs directory, once it exists
        self._dir_durable: set[str] = set()
        self._unrefreshed: dict[str, None] = {}  # runs whose catalog row `_refresh_now` brings up to date  # runs created here whose directory entry a group sync made durable
        self.compact_above_bytes = compact_above_bytes
        self.fsyncs = 0
        self._mine: set[Held] = set()
        self._signal_ids: dict[str, dict[str, str]] = {}  # run id -> {inbox file name: signal id}, as last read
        self._last_signal_ns = 0
        self._catalog: FileCatalog | None = None
        self._workers = FileWorkers(self.dir, write_tmp=self._write_tmp)
        self.wakeups = LocalWakeups(self.dir / "wake")
        self.queue = FileQueue(self.dir, write_tmp=self._write_tmp, held=self._do_held, info=self._do_info,
                               wakeups=self.wakeups)
        self.queue_dir = self.queue.dir
        self.joins_dir = self.queue.joins_dir
        self._limit_docs = FileLimits(self.dir, held=self._do_held,
                                      epoch=lambda run_id: sidecar_epoch(self._runs_path, run_id),
                                      open=lambda run_id: (info := self._do_info(run_id)) is not None
                                      and not info.ended)

    def __repr__(self) -> str:
        return f"FileStorage({str(self.dir)!r})"

    def _log(self, run_id: str) -> Path:
        """The log path of a run id (checked by the front)."""
        return self.runs_dir / f"{run_id}.jsonl"

    def _lock_path(self, run_id: str) -> str:
        """The resolved lock path of a run: the key of the in-process lease registry."""
        real = self._runs_real
        if real is None:
            real = os.path.realpath(self._runs_path)
            if os.path.isdir(real):
                self._runs_real = real
        return os.path.join(real, f"{run_id}.lock")

    def _fsync(self, fd: int) -> None:
        """fsync and count it."""
        os.fsync(fd)
        self.fsyncs += 1

    def _write_tmp(self, directory: str | Path, stem: str, data: bytes, *, durable: bool) -> str:
        """Write `data` to a new uniquely named hidden temp file in `directory` (fsynced if `durable`)."""
        tmp = os.path.join(directory, f".{stem}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data)
            if durable:
                self._fsync(fd)
        except OSError as exc:
            os.close(fd)
            os.unlink(tmp)
            raise storage_full(exc, "write", str(directory)) from exc
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def _do_create(self, run_id: str, header: bytes, record: dict[str, Any], at: float | None,
                   priority: int) -> None:
        """Create a run whose log starts with the `header` line, queued due at `at` (None: now); its queue
        entry is written first, so a crash in between leaves an entry without a log, which `due` skips."""
        fields = header_fields(record)
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        with self.queue.lock():
            queued = self.queue.add(QueueEntry(run_id, now if at is None else at, priority, (), now,
                                               *queue_fields(record)))
        self._new_log(run_id, header, queued)
        # the catalog row comes after the log, so no one waiting for the log waits for the catalog; a crash in
        # between leaves a log without a row, which the next listing finds (``runs/`` changed)
        self._indexed(lambda catalog: catalog.put((run_id, *fields, OPEN, now, len(header))))
        self.wakeups.notify()

    def _new_log(self, run_id: str, header: bytes, queued: bool) -> None:
        """Create the log holding `header`, whole or not at all, so no reader ever sees a log without its header:
        an unnamed file (``O_TMPFILE``, Linux) or else a hidden temp file, written, then hard-linked to its name
        (the link fails if the name exists). The unnamed file needs no temp name to make and remove, and a
        process killed before the link leaves nothing behind."""
        log = os.path.join(self._runs_path, f"{run_id}.jsonl")
        try:
            if self._unnamed_logs and self._link_unnamed(log, header):
                return
            tmp = self._write_tmp(self.runs_dir, run_id, header, durable=False)
        except FileExistsError:
            self._exists(run_id, queued)
        except OSError as exc:
            if queued:
                self.queue.discard(run_id)
            raise storage_full(exc, "create", log) from exc
        try:
            try:
                os.link(tmp, log)
            except FileExistsError:
                self._exists(run_id, queued)
            except OSError:  # pragma: no cover - filesystems without hard links
                self._create_exclusive(Path(log), run_id, header)
        finally:
            os.unlink(tmp)

    def _link_unnamed(self, log: str, header: bytes) -> bool:
        """Write `header` to an unnamed file in the runs folder and link it as `log`; False, with nothing made,
        where the OS or file system has no unnamed files (then never tried again); `FileExistsError` if `log`
        exists, any other `OSError` (a full disk) as it comes."""
        try:
            fd = os.open(self._runs_path, os.O_TMPFILE | os.O_WRONLY, 0o644)
        except OSError as exc:
            if exc.errno not in _NO_UNNAMED:
                raise
            self._unnamed_logs = False  # a file system without unnamed files: the temp file way from now on
            return False
        try:
            _write_all(fd, header)
            try:
                # linkat with AT_SYMLINK_FOLLOW (what a dir fd makes `os.link` call; both paths are absolute, so
                # the descriptor given as their folder is not used as one)
                os.link(f"/proc/self/fd/{fd}", log, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=True)
            except FileExistsError:
                raise
            except OSError as exc:
                if exc.errno not in _NO_UNNAMED:
                    raise
                self._unnamed_logs = False  # no /proc to link through: the temp file way from now on
                return False
        finally:
            os.close(fd)
        return True

    def _exists(self, run_id: str, queued: bool) -> NoReturn:
        """The log of a run being created exists already: its queue entry just written goes, and it is a bug."""
        if queued:
            self.queue.discard(run_id)
        raise ValidationError(
            f"run {run_id} already exists in {self.dir}",
            hint="Run ids carry 80 random bits, so this is a bug or a copied state dir: report it; "
                 "nothing was re-bound.",
            run_id=run_id,
        ) from None

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _create_exclusive(self, log: Path, run_id: str, header: bytes) -> None:  # pragma: no cover
        """`create` where hard links are unavailable: O_EXCL plus a single write."""
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise ValidationError(f"run {run_id} already exists in {self.dir}", run_id=run_id) from None
        try:
            _write_all(fd, header)
        finally:
            os.close(fd)

    def _do_read(self, run_id: str) -> Log | None:
        """All records of a run (None if unknown); a torn last line is dropped and named in `Log.torn`."""
        log = self._log(run_id)
        try:
            with open(log, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        records, _, torn = parse_log(data, str(log), self._values(run_id))
        return Log(records, torn, str(log))

    def _values(self, run_id: str) -> Callable[[], Mapping[str, bytes]]:
        """The run's stored values, read when a log line refers to one (`filevalues`)."""
        return lambda: read_values(values_path(self._runs_path, run_id))

    def _do_claim(self, run_id: str, owner: str, ttl: float, check: Check | None, reopen: bool,
                  tries: int = CLAIM_TRIES) -> Lease | None:
        """Lock the run and append a claim record with the next epoch; None while another owner holds the lock.
        An ended run (without `reopen`) is refused, and under its lock taken out of the queue."""
        path = os.path.join(self._runs_path, f"{run_id}.jsonl")
        if not os.path.exists(path):
            raise RunNotFoundError(f"no run {run_id} in {self.dir}", run_id=run_id)
        log = Path(path)
        held = lock_run(self._lock_path(run_id), run_id, log, tries)
        if held is None:
            return None
        try:
            opened = self._open_claimed(held, owner, check, reopen, run_id in self._dir_durable)
            if opened is None:
                self.unschedule(run_id)  # under the run's lock: no retry reopens it meanwhile
        except BaseException:
            self._drop(held)
            raise
        if opened is None:
            self._drop(held)
            return None
        epoch, records, torn = opened
        if run_id in self._dir_durable:
            self._dir_durable.discard(run_id)
            held.dir_synced = True
        self._mine.add(held)
        return Lease(run_id, owner, epoch, {"file": held}, records, torn, path, held.size)

    def _do_amend(self, run_id: str, choose: Choose, check: Check | None) -> bool:
        """Under the run's lock, append and fsync the lines `choose` returns, without a claim record or a new
        epoch; False while another owner holds the lock."""
        log = self._log(run_id)
        if not log.exists():
            raise RunNotFoundError(f"no run {run_id} in {self.dir}", run_id=run_id)
        held = lock_run(self._lock_path(run_id), run_id, log)
        if held is None:
            return False
        try:
            try:
                held.fd = os.open(log, os.O_RDWR | os.O_APPEND)
            except FileNotFoundError:
                raise RunNotFoundError(f"no run {run_id} in {self.dir}", run_id=run_id) from None
            with open(held.fd, "rb", closefd=False) as f:
                data = f.read()
            records, good, _ = parse_log(data, str(log), self._values(run_id))
            line = choose(checked(records, str(log), check), str(log))
            if line is not None:
                self._keep_amended(run_id, amended_values(choose))
                try:
                    if good < len(data):
                        os.ftruncate(held.fd, good)
                    _write_all(held.fd, line)
                    self._fsync(held.fd)
                except OSError as exc:
                    try:
                        os.ftruncate(held.fd, good)  # a line cut short is undone, as a failed append's is
                    except OSError:
                        pass
                    raise storage_full(exc, "append to", str(log)) from exc
                self._indexed(lambda catalog: catalog.refresh(run_id))
        finally:
            self._drop(held)
        return True

    def _open_claimed(self, held: Held, owner: str, check: Check | None, reopen: bool,
                      made_here: bool = False) -> tuple[int, list[Any], str | None] | None:
        """With the lock taken: check the log, cut a torn tail, append the claim record. A run `made_here` (created
        by this process, not claimed since) has no leftover of an older version or a cut-off compaction to look for.

        Returns the epoch, the records with the claim record last, and the torn-tail message; None, with
        nothing written, for an ended run without `reopen`."""
        try:
            fd = os.open(held.log, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            raise RunNotFoundError(f"no run {held.run_id} in {self.dir}", run_id=held.run_id) from None
        held.fd = fd
        if not made_here:
            self._unlink(f"{held.log}.tmp")
        data = _read_whole(fd)
        records, good, torn = parse_log(data, str(held.log), self._values(held.run_id))
        records = checked(records, str(held.log), check)
        if not reopen and ended(records):
            return None
        if good < len(data):
            os.ftruncate(fd, good)
        epoch = max(max_epoch(records), held_epoch(self._runs_path, held, older=not made_here)) + 1
        line = claimed(records, epoch, owner)
        try:
            _write_all(fd, line)
            held.size = good + len(line)
            write_sidecar(
                self._runs_path, held, {"owner": owner, "epoch": epoch, "pid": os.getpid(), "host": _HOST, "at": iso_now()}
            )
        except OSError as exc:
            try:
                os.ftruncate(fd, good)  # a claim line cut short (or left without its sidecar) is undone
            except OSError:
                pass
            raise storage_full(exc, "claim", str(held.log)) from exc
        held.live = True
        return epoch, records, torn

    def holder_info(self, run_id: str) -> dict[str, Any] | None:
        """What the last claimant wrote about itself (owner, pid, host, epoch, at); meaningful while `held`."""
        return holder_info(self._runs_path, validate_run_id(run_id))

    def _drop(self, held: Held) -> None:
        """Close the lease's descriptor, release its lock and forget it."""
        drop(held)
        self._mine.discard(held)

    def _do_heartbeat(self, lease: Lease, ttl: float) -> bool:
        """True while the lease is live (the OS lock needs no renewal; `ttl` is ignored)."""
        held = lease.state.get("file")
        if not isinstance(held, Held):
            return False
        with held.mutex:
            try:
                held.check()
            except LeaseLostError:
                return False
        return True

    def release(self, lease: Lease) -> None:
        """Unlock the run and close the log; releasing a stale or released lease does nothing."""
        held = lease.state.get("file")
        if isinstance(held, Held):
            self._drop(held)

    def _do_held(self, run_id: str) -> bool:
        """True while any process, this one included, holds the run's lock."""
        return probe(self._lock_path(run_id))

    def _do_append(self, lease: Lease, data: bytes) -> None:
        """Append complete lines with one write after checking the log is as this lease left it."""
        held = lease.state.get("file")
        if held is None:
            raise lost(lease)
        with held.mutex:
            if not held.live or held.unlooked >= LOOK_EVERY:
                held.check()
            elif os.lseek(held.fd, 0, os.SEEK_END) != held.size:  # once per step: a third of an fstat's cost
                raise held.changed()
            held.unlooked += 1
            try:
                _write_all(held.fd, data)
            except OSError as exc:
                self._undo_partial_write(held)
                raise storage_full(exc, "append to", str(held.log)) from exc
            held.size += len(data)

    def _do_keep_values(self, lease: Lease, blobs: dict[str, bytes]) -> None:
        """Append the run's new stored values to its runs/<id>.blobs, fsynced by the log's next sync, first."""
        if write_values(values_path(self._runs_path, lease.run_id), blobs):
            lease.state["values_new"] = True
        lease.state["values_dirty"] = True

    def _keep_amended(self, run_id: str, blobs: dict[str, bytes]) -> None:
        """Keep the stored values an `amend`'s lines refer to, durably, before the lines are written."""
        if blobs:
            self._fsync_values(run_id, write_values(values_path(self._runs_path, run_id), blobs))

    def _sync_values(self, lease: Lease) -> None:
        """fsync the run's stored values written since its last sync (and their new file's directory entry)."""
        if lease.state.pop("values_dirty", False):
            self._fsync_values(lease.run_id, lease.state.pop("values_new", False))

    def _fsync_values(self, run_id: str, new: bool) -> None:
        """fsync the run's values file, and the runs directory when the file is `new`."""
        sync_values(values_path(self._runs_path, run_id))
        self.fsyncs += 1
        if new:
            fsync_dir(self.runs_dir)
            self.fsyncs += 1

    def _undo_partial_write(self, held: Held) -> None:
        """After a failed write, cut the log back to its last whole line, or give the lease up if that fails."""
        try:
            os.ftruncate(held.fd, held.size)
        except OSError:
            held.live = False

    def sync(self, lease: Lease) -> None:
        """fsync the log (and its directory, once per lease) unless nothing was appended since the last sync."""
        held = lease.state.get("file")
        if held is None:
            raise lost(lease)
        with held.mutex:
            held.check()
            self._sync_values(lease)
            if held.synced != held.size:
                self._fsync(held.fd)
                held.synced = held.size
            if not held.dir_synced:
                fsync_dir(self.runs_dir)
                self.fsyncs += 1
                held.dir_synced = True

    def sync_all(self, leases: list[Lease]) -> None:
        """Make every lease's appends durable in one pass: one ``syncfs`` of the state directory's file system
        where the OS has it (Linux), else `sync` of each (an fsync per changed log, one of the runs directory)."""
        todo: list[tuple[Held, int]] = []
        for lease in leases:
            held = lease.state.get("file")
            if not isinstance(held, Held):
                raise lost(lease)
            with held.mutex:
                held.check()
                self._sync_values(lease)
                if held.synced != held.size or not held.dir_synced:
                    todo.append((held, held.size))
        if not todo:
            return
        if len(todo) == 1 and todo[0][0].dir_synced or not syncfs(str(self.runs_dir)):
            for lease in leases:
                self.sync(lease)
            return
        self.fsyncs += 1
        for held, size in todo:
            with held.mutex:
                held.synced = size if held.synced < size else held.synced
                held.dir_synced = True

    def _do_size(self, run_id: str) -> int:
        """Bytes of the run's log file."""
        log = self._log(run_id)
        try:
            return os.stat(log).st_size
        except FileNotFoundError:
            raise RunNotFoundError(f"no run {run_id} in {self.dir}", run_id=run_id) from None

    def _do_rewrite(self, lease: Lease, data: bytes) -> None:
        """Replace the log with `data` via a fsynced temp file and rename; the lease stays valid for appends."""
        held = lease.state.get("file")
        if held is None:
            raise lost(lease)
        with held.mutex:
            held.check()
            self._sync_values(lease)
            tmp = held.log.with_name(held.log.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, data)
                self._fsync(fd)
            finally:
                os.close(fd)
            os.close(held.fd)
            held.fd = -1
            self._indexed(lambda catalog: catalog.rescan(held.run_id))
            try:
                os.replace(tmp, held.log)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            finally:
                held.fd = os.open(held.log, os.O_RDWR | os.O_APPEND)
            fsync_dir(self.runs_dir)
            self.fsyncs += 1
            held.size = held.synced = len(data)

    def _do_create_bound(self, runs: list[NewRun], headers: list[dict[str, Any]]) -> str | None:
        """Bind and create the runs as one batch in two passes, each made durable once: first every binding
        (up to the first one lost), then every queue entry and log. With ``syncfs`` (Linux) each pass is one
        call for all its files; without it each binding is fsynced before its rename and the directories once.
        A crash leaves bindings without logs (a resumed parent finds none and binds again), never a log whose
        binding a machine crash could lose."""
        fields = [header_fields(header) for header in headers]
        grouped = syncfs_call_for() is not None
        lost = None
        bound: list[NewRun] = []
        for run in runs:
            if not self._bind(run.identity, run.run_id, run.expect, durable=not grouped):
                lost = run.identity
                break
            bound.append(run)
        if not bound:
            return lost
        self._sync_dirs(grouped, self._index_path_str)
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        entries = [QueueEntry(run.run_id, now if run.at is None else run.at, run.priority, (), now,
                              *queue_fields(header))
                   for run, header in zip(bound, headers, strict=False) if run.queued]
        added: Iterator[bool] = iter([])
        if entries:
            with self.queue.lock():
                added = iter(self.queue.add_many(entries))  # one due-journal append for the batch
        queued = [run.queued and next(added) for run in bound]
        rows = []
        for run, entry, known in zip(bound, queued, fields, strict=False):
            self._new_log(run.run_id, run.header, entry)
            rows.append((run.run_id, *known, OPEN, now, len(run.header)))
        self._sync_dirs(grouped, self._runs_path, *([str(self.queue_dir)] if entries else []))
        if grouped:
            self._dir_durable.update(run.run_id for run in bound)
        self._indexed(lambda catalog: catalog.put_many(rows))
        if any(queued):
            self.wakeups.notify()
        return lost

    def _sync_dirs(self, grouped: bool, *dirs: str) -> None:
        """Make what was just written in `dirs` durable: one syncfs when `grouped`, else an fsync of each
        directory (their files were fsynced as written, or are made durable by their runs' own syncs)."""
        if grouped and syncfs(self._runs_path if os.path.isdir(self._runs_path) else str(self.dir)):
            self.fsyncs += 1
            return
        for directory in dirs:
            fsync_dir(Path(directory))
            self.fsyncs += 1

    def catalog(self) -> FileCatalog:
        """The run catalog beside the logs (`fileindex.FileCatalog`), opened on first use."""
        if self._catalog is None:
            from .fileindex import FileCatalog

            self._catalog = FileCatalog(self.dir / "catalog.db", self.runs_dir, self._run_names)
        return self._catalog

    def _refresh_later(self, run_id: str) -> None:
        """Bring a run's catalog row up to date with its log (it ended) in the next batch: at the next
        listing or count here, at `close`, or once `_REFRESH_BATCH` wait. Until then another process's
        listing finds the row behind the log and reads its tail itself."""
        self._unrefreshed[run_id] = None
        if len(self._unrefreshed) >= _REFRESH_BATCH:
            self._refresh_now()

    def _refresh_now(self) -> None:
        if self._unrefreshed:
            run_ids, self._unrefreshed = list(self._unrefreshed), {}
            self._indexed(lambda catalog: catalog.refresh_many(run_ids))

    def _indexed(self, change: Callable[[FileCatalog], None]) -> None:
        """Apply `change` to the catalog; a catalog that cannot be written never fails the run (the next
        listing repairs it from the logs)."""
        import sqlite3

        try:
            change(self.catalog())
        except sqlite3.Error:
            pass

    def _catalogued(self, ask: Callable[[FileCatalog], _T]) -> _T:
        """`ask` the catalog; a damaged one (not a database any more) is thrown away and asked again,
        rebuilt from the logs."""
        import sqlite3

        try:
            return ask(self.catalog())
        except sqlite3.OperationalError:
            raise
        except sqlite3.DatabaseError:
            self.catalog().reset()
            return ask(self.catalog())

    def _run_names(self) -> list[str]:
        """The ids of every run that has a log."""
        try:
            names = os.listdir(self.runs_dir)
        except FileNotFoundError:
            return []
        return [name[:-6] for name in names
                if name.endswith(".jsonl") and not name.startswith(".") and is_run_id(name[:-6])]

    def _do_list_runs(self, limit: int | None, offset: int, where: dict[str, Any]) -> list[RunInfo]:
        """Runs matching the filter (`catalog.RunFilter`), most recently active first, from the catalog; each
        run's `RunInfo` read from its log's first and last lines."""
        self._refresh_now()
        query = RunFilter.of(**where)
        if not self.runs_dir.exists():
            return []
        import sqlite3

        try:
            ids = self._catalogued(lambda catalog: catalog.query(query, limit, offset))
        except (sqlite3.Error, OSError):  # no usable index here (a read-only state dir): read the logs
            ids = self.catalog().scan(query, limit, offset)[0]
        infos = []
        for run_id in ids:
            info = self.info(run_id)
            if info is not None:
                infos.append(info)
        return infos

    def count_runs(self, **where: Any) -> int:
        """How many runs match the filter, from the catalog."""
        self._refresh_now()
        query = RunFilter.of(**where)
        if not self.runs_dir.exists():
            return 0
        import sqlite3

        try:
            return self._catalogued(lambda catalog: catalog.count(query))
        except (sqlite3.Error, OSError):  # no usable index here (a read-only state dir): read the logs
            return self.catalog().scan(query, None, 0)[1]

    def _do_delete(self, run_id: str) -> int | None:
        """Remove a run for good: its identity binding (while it still names this run), queue entry, log,
        sidecars, inbox and catalog row. The bytes freed; None, with nothing removed, while a process holds
        the run; 0 for an unknown run. The log goes first after the binding, so a crash part-way leaves
        leftovers no listing shows, which a later `delete` removes."""
        log = self._log(run_id)
        lock = OsLock(self._lock_path(run_id))
        mine = registered(self._lock_path(run_id))
        if mine or not lock.acquire(create=False) and os.path.exists(lock.path):
            return None
        try:
            try:
                with open(log, "rb") as f:
                    identity = (decode_record(f.readline()) or {}).get("identity")
            except FileNotFoundError:
                identity = None
            if isinstance(identity, str) and identity:
                self._unbind(identity, run_id)
            with self.queue.lock():
                self.queue.discard(run_id)
            freed = 0
            inbox = self.runs_dir / f"{run_id}.inbox"
            paths = [log, *(inbox / name for name in _listdir(inbox)), self.runs_dir / f"{run_id}.owner",
                     Path(values_path(self._runs_path, run_id))]
            for path in paths:
                try:
                    freed += path.stat().st_size
                    path.unlink()
                except FileNotFoundError:
                    pass
            try:
                inbox.rmdir()
            except FileNotFoundError:
                pass
            freed += self._partials.drop(run_id, None)
            self._signal_ids.pop(run_id, None)
            self._indexed(lambda catalog: catalog.remove(run_id))
            Path(lock.path).unlink(missing_ok=True)
            return freed
        finally:
            lock.release()

    def reindex(self) -> int:
        """Rebuild the run catalog from the logs (it repairs itself; this is for a state dir edited by hand);
        the number of runs indexed."""
        self._refresh_now()
        return self.catalog().rebuild()

    def _do_info(self, run_id: str) -> RunInfo | None:
        """One run's `RunInfo` from its log's ends (None if unknown or the log vanished meanwhile)."""
        try:
            with open(self.runs_dir / f"{run_id}.jsonl", "rb") as f:
                st = os.fstat(f.fileno())
                header = decode_record(f.readline()) or {}
                last = _last_record(f, st.st_size, self._values(run_id)) or header
        except FileNotFoundError:
            return None
        return RunInfo(run_id, header, last, probe(self._lock_path(run_id)), st.st_mtime,
                       sidecar_epoch(self._runs_path, run_id))

    # ---- the queue (`filequeue.FileQueue`) ---------------------------------------------------------
    def _do_schedule(self, run_id: str, at: float | None, wait: tuple[str, ...], priority: int | None) -> None:
        """Write the run's queue entry: due at `at` (None: only when woken), woken early by `wait` signals."""
        if not self._log(run_id).exists():
            raise RunNotFoundError(f"no run {run_id} in {self.dir}", run_id=run_id)
        self.queue.schedule(run_id, at, wait, priority)
        self._indexed(lambda catalog: catalog.refresh(run_id, lazy=True))
        self.wakeups.notify()

    def _do_join_wait(self, run_id: str, children: tuple[str, ...]) -> bool:
        """Park the run until the children still queued end (`FileQueue.join_wait`)."""
        if not self._log(run_id).exists():
            raise RunNotFoundError(f"no run {run_id} in {self.dir}", run_id=run_id)
        return self.queue.join_wait(run_id, children)

    def _do_unschedule(self, run_id: str) -> None:
        """Take the run out of the queue and its parent's join (`FileQueue.unschedule`); its catalog row is
        brought up to date later, in a batch."""
        self.queue.unschedule(run_id)
        self._refresh_later(run_id)

    def finish_all(self, leases: list[Lease]) -> list[BaseException | None]:
        """One `sync_all` (a single ``syncfs`` on Linux) for every lease's log, then every run out of the queue
        under one hold of the queue lock, then every lease released. A log that cannot be made durable (or a
        lease no longer current) keeps its run queued: its end is recorded again by whoever claims it next."""
        errors: list[BaseException | None] = [None] * len(leases)
        live = []
        for i, lease in enumerate(leases):
            held = lease.state.get("file")
            try:
                if not isinstance(held, Held):
                    raise lost(lease)
                with held.mutex:
                    held.check()
                live.append(lease)
            except LeaseLostError as exc:
                errors[i] = exc
        try:
            self.sync_all(live)
        except Exception:  # noqa: BLE001 - each lease on its own then, to tell which failed
            for i, lease in enumerate(leases):
                if errors[i] is None:
                    try:
                        self.sync(lease)
                    except Exception as exc:  # noqa: BLE001 - this run's outcome
                        errors[i] = exc
        finished = [lease for lease, error in zip(leases, errors, strict=True) if error is None]
        done = [lease.run_id for lease in finished]
        try:
            if done:
                self.queue.unschedule_all(done, [lease.records[0] if lease.records else None for lease in finished])
                for run_id in done:
                    self._refresh_later(run_id)
        finally:
            for lease in leases:
                self.release(lease)
        return errors


    def _do_wake(self, run_id: str, name: str | None) -> bool:
        """Make the run due now if its entry waits for `name` (None: unconditionally)."""
        return self.queue.wake(run_id, name)

    def _do_entry(self, run_id: str) -> QueueEntry | None:
        """The run's queue entry, if it is queued."""
        return self.queue.read(run_id)

    def entries(self) -> list[QueueEntry]:
        """Every queue entry (unfinished runs only), in no particular order (`FileQueue.entries`)."""
        return self.queue.entries()

    def _do_due(self, limit: int, now: float | None, skip: tuple[str, ...], names: frozenset[str] | None,
                queues: frozenset[str] | None, full: frozenset[str]) -> list[str]:
        """Due runs no live process holds, from the queue directory (`FileQueue.due`)."""
        return self.queue.due(limit, now, skip, names, queues, full)

    def next_due(self, now: float | None = None) -> float | None:
        """The earliest time after `now` at which a queued run falls due (None: none is to)."""
        return self.queue.next_due(now)

    def watch(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Local wake-ups (`wakeup.LocalWakeups`) among the processes sharing this state directory."""
        return self.wakeups.watch(callback)

    def _do_claim_due(self, owner: str, ttl: float, limit: int, skip: tuple[str, ...], check: Check | None,
                      names: frozenset[str] | None, queues: frozenset[str] | None,
                      full: frozenset[str]) -> list[Lease]:
        """Claim up to `limit` due runs, in queue order as `FileQueue.claim_due` finds them; each claim is the
        run's own flock, tried once (a run another worker takes first is passed over), so workers never share
        a run and never wait for each other."""
        def claim(run_id: str) -> Lease | None:
            try:
                return self._do_claim(run_id, owner, ttl, check, False, 1)
            except (RunNotFoundError, CorruptLogError):
                return None

        return self.queue.claim_due(limit, skip, names, queues, full, claim)

    def _do_queue_stats(self, now: float) -> list[QueueStats]:
        """Counted from every queue entry (`FileQueue.stats`)."""
        return self.queue.stats(now)

    # ---- limits (`filelimits.FileLimits`) -------------------------------------------------------------
    def _do_limit(self, key: str, step: LimitStep) -> Any:
        """Change the key's document under its flock (`filelimits.FileLimits.limit`)."""
        return self._limit_docs.limit(key, step)

    def _do_limits(self, prefix: str) -> dict[str, bytes]:
        """The documents whose key starts with `prefix` (`filelimits.FileLimits.documents`)."""
        return self._limit_docs.documents(prefix)

    # ---- blobs ---------------------------------------------------------------------------------------
    def _do_keep_blob(self, digest: str, data: bytes) -> None:
        """Write blobs/<digest> once: a temp file, fsynced, renamed in, the folder fsynced (a full disk is a
        `StorageFullError`, as for every write here)."""
        folder = self.dir / "blobs"
        path = folder / digest
        if path.exists():
            return
        folder.mkdir(parents=True, exist_ok=True)
        tmp = self._write_tmp(folder, digest, data, durable=True)
        try:
            os.replace(tmp, path)
        except BaseException:
            self._unlink(tmp)
            raise
        fsync_dir(folder)

    def _do_blob(self, digest: str) -> bytes | None:
        try:
            return (self.dir / "blobs" / digest).read_bytes()
        except FileNotFoundError:
            return None

    # ---- workers (`fileworkers.FileWorkers`) -----------------------------------------------------------
    def _worker_paths(self, owner: str) -> tuple[str, str]:
        """The advertisement and lock file of worker `owner`."""
        return self._workers.paths(owner)

    def _do_advertise(self, owner: str, line: bytes, ttl: float) -> None:
        """Write the worker's advertisement and hold its lock from now until `retire` or this process's end
        (`ttl` is ignored: the lock says whether the worker lives)."""
        self._workers.advertise(owner, line)

    def _do_retire(self, owner: str) -> None:
        """Remove the worker's advertisement and release its lock."""
        self._workers.retire(owner)

    def workers(self) -> list[dict[str, Any]]:
        """The advertisements whose lock a live process holds."""
        return self._workers.workers()

    def close(self) -> None:
        """Release every lease this instance still holds (for shutdown and tests)."""
        for held in list(self._mine):
            self._drop(held)
        self._workers.retire_all()
        self.queue.journal.close()
        self._refresh_now()
        if self._catalog is not None:
            self._catalog.close()


def _read_whole(fd: int) -> bytes:
    """The whole file open at `fd`, read from its start by position (no file object, no seek: a claim's read)."""
    chunks = []
    offset = 0
    want = 65536
    while True:
        chunk = os.pread(fd, want, offset)
        chunks.append(chunk)
        offset += len(chunk)
        if len(chunk) < want:  # a regular file reads short only at its end
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        want = 1 << 20


def _listdir(directory: Path) -> list[str]:
    """The names in `directory` ([] when it does not exist)."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _last_record(f: Any, size: int, values: Callable[[], Mapping[str, bytes]]) -> dict[str, Any] | None:
    """The last complete line of `f` that is a record (its stored values resolved), read backwards from the end
    in growing chunks."""
    chunk = 4096
    while True:
        start = max(0, size - chunk)
        f.seek(start)
        buf = f.read(size - start)
        lines = buf[: buf.rfind(b"\n") + 1].split(b"\n")[:-1]
        for line in reversed(lines[1:] if start else lines):
            record = decode_record(resolve_line(line, values))
            if record is not None:
                return record
        if start == 0:
            return None
        chunk *= 8
