"""The file adapter's flow-control documents (`Limits`): ``limits/<sha256 of the key>.json`` holds one line
``{"key": key, "doc": document}`` per version, the last complete line the current one, so any key names a
file safely and a listing still knows each key.

A change is serialised by an OS file lock (a blocking flock on ``limits/.<first two hex digits of the
digest>.lock``: 256 stripes, so changes to different keys rarely wait for each other and the lock files never
outnumber them) among processes, and by a threading lock per stripe among the threads of one. A change appends
its version under that lock (creating no file, which costs far more on most file systems than an append), so a
process killed at any moment leaves the old version last or the new one whole: a torn last line is passed over
and cut before the next append. Past `COMPACT_AT` bytes the file is rewritten to its current version
(``.<digest>.tmp`` renamed over it). Nothing is fsynced: a change survives the kill of any process once `limit`
returned, but a machine crash may lose the latest change.

A lease here is an OS lock held while its process lives, so `live(run_id, epoch)` asks whether some process
holds the run's lock and whether the epoch its claimant wrote in the lock file is `epoch`. A process killed
with SIGKILL drops its locks at once, so its permits come back at the next `limit` call.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from ..errors import CorruptLogError
from .base import LimitStep, storage_full
from .filelocks import flocked, write_all

COMPACT_AT = 16 * 1024  # bytes of versions a document file keeps before it is rewritten to its current one


class _Stored(msgspec.Struct):
    """One document file: the key it belongs to and the document's JSON, kept as it was encoded."""

    key: str
    doc: msgspec.Raw


_DECODER = msgspec.json.Decoder(_Stored)


class FileLimits:
    """The limit documents of one state directory; `FileStorage` owns one and answers `limit`/`limits` with it."""

    def __init__(self, dir: os.PathLike[str] | str, *, held: Callable[[str], bool],
                 epoch: Callable[[str], int], open: Callable[[str], bool]) -> None:
        self.dir = os.path.join(dir, "limits")
        self._held = held  # run id -> True while some live process holds the run's lock
        self._epoch = epoch  # run id -> the epoch of the run's last claim, as its claimant wrote it
        self._open = open  # run id -> True while the run exists and has not ended
        self._mutexes: dict[str, threading.Lock] = {}  # stripe -> the lock this process's threads take first
        self._guard = threading.Lock()
        self._ready = False  # the limits directory exists

    def _path(self, key: str) -> tuple[str, str]:
        """The document file's digest and path of `key` (any text: its SHA-256 names the file)."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        return digest, os.path.join(self.dir, f"{digest}.json")

    @contextmanager
    def _locked(self, stripe: str) -> Iterator[None]:
        """Hold stripe `stripe` against this process's other threads, then against every other process."""
        with self._guard:
            mutex = self._mutexes.setdefault(stripe, threading.Lock())
        with mutex:
            if not self._ready:
                os.makedirs(self.dir, exist_ok=True)
                self._ready = True
            with flocked(os.path.join(self.dir, f".{stripe}.lock")):
                yield

    def limit(self, key: str, step: LimitStep) -> Any:
        """Run `step` on the key's document under its stripe's lock, `now` from `time.time()`; write what it
        returns (temp file, then rename) or remove the file; return what it returns second."""
        digest, path = self._path(key)
        with self._locked(digest[:2]):
            stored, good, size = self._read(path, key)
            data, result = step(stored, time.time(), self._live)
            if data is None:
                if size:
                    os.unlink(path)
            elif data != stored:
                self._write(digest, path, msgspec.json.encode(_Stored(key, msgspec.Raw(data))) + b"\n", good, size)
        return result

    def _live(self, run_id: str, epoch: int) -> bool:
        """True while some process holds the run's lock and its last claim was at `epoch`. The epoch is read
        before and after the lock is probed, so a claim replacing the lease meanwhile is seen; in the instant
        between a new claimant taking the lock and writing its epoch, or while an operator's amend holds the
        lock, the previous lease still counts as live: a permit comes back a moment late, never early."""
        if epoch < 0:  # held while the run has not ended
            return self._open(run_id)
        before = self._epoch(run_id)
        if before != epoch or not self._held(run_id):
            return False
        return self._epoch(run_id) == epoch

    @staticmethod
    def _read(path: str, key: str) -> tuple[bytes | None, int, int]:
        """The current document's JSON bytes (None: none), the bytes up to the end of the last complete line,
        and the file's size; `CorruptLogError` for a last complete line that is not a version (damaged outside
        durably: a limit never silently starts afresh)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, 0, 0
        return _current(data, key, path), data.rfind(b"\n") + 1, len(data)

    def _write(self, digest: str, path: str, line: bytes, good: int, size: int) -> None:
        """Append the version `line` (cutting a torn tail first), or past `COMPACT_AT` bytes replace the file
        with it via ``.<digest>.tmp`` (one per key: its writers hold its lock)."""
        tmp = os.path.join(self.dir, f".{digest}.tmp")
        try:
            if good + len(line) <= COMPACT_AT:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    if size != good:
                        os.ftruncate(fd, good)
                    write_all(fd, line)
                finally:
                    os.close(fd)
                return
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, line)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise storage_full(exc, "write the limit document", path) from exc

    def documents(self, prefix: str) -> dict[str, bytes]:
        """The stored JSON bytes of every document whose key starts with `prefix` (read without the lock: a
        version is appended whole or not at all, and a torn one is passed over); files that are not documents
        are left out."""
        try:
            names = os.listdir(self.dir)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        found: dict[str, bytes] = {}
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.dir, name), "rb") as f:
                    stored = _last(f.read())
            except (FileNotFoundError, msgspec.DecodeError):
                continue
            if stored is not None and stored.key.startswith(prefix):
                found[stored.key] = bytes(stored.doc)
        return found


def _last(data: bytes) -> _Stored | None:
    """The last complete version in a document file's bytes (None: none yet); `DecodeError` if it is damaged."""
    end = data.rfind(b"\n")
    if end < 0:
        return None  # nothing, or a first version torn by a kill
    return _DECODER.decode(data[data.rfind(b"\n", 0, end) + 1:end])


def _current(data: bytes, key: str, path: str) -> bytes | None:
    """The current document of `key` in its file's bytes, as `FileLimits._read` says."""
    try:
        stored = _last(data)
    except msgspec.DecodeError as exc:
        raise CorruptLogError(f"the document file of limit {key!r}, {path}, is damaged ({exc})", path=path,
                              line=None, field=key, hint="Remove the file: that limit starts afresh.") from None
    return bytes(stored.doc) if stored is not None and stored.key == key else None
