"""The file adapter's locks and durability calls: OS file locks that die with their process, this process's
registry of the leases it holds, the claimant record kept in each run's lock file (its sidecar), and the
fsync, directory fsync and ``syncfs`` helpers.

Locks use ``fcntl.flock`` directly on POSIX rather than ``filelock.FileLock``: a held-check must be a
non-blocking probe that never waits, filelock's per-object reentrancy and thread-local lock state (by default)
make a lease taken in one thread unreleasable from another, and flock's per-open-file semantics are exactly
what we want (a fresh open of the lock file conflicts with any holder, in this process or another). Without
fcntl (Windows) the same calls fall back to ``filelock.FileLock(thread_local=False, is_singleton=False)``.
Leases held by this process are also kept in a module-level registry keyed by the resolved lock path, so a
second claim or `held` in the same process is answered without relying on platform lock semantics.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from ..errors import LeaseLostError
from .base import Lease

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

CLAIM_TRIES = 3
OWNER_BLOCK = 4096  # the claimant JSON in a lock file is padded to this many bytes (one block, one write)
REGISTRY: dict[str, Held] = {}  # resolved lock path -> the lease this process holds on it
REGISTRY_LOCK = threading.Lock()


@contextmanager
def flocked(path: str) -> Iterator[None]:
    """Hold an exclusive, blocking OS lock on the file at `path` (created if missing) against every other
    process while the block runs; the OS drops it if this process dies (filelock where there is no flock)."""
    if fcntl is None:  # pragma: no cover - Windows
        import filelock

        with filelock.FileLock(path, thread_local=False, is_singleton=False):
            yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


class OsLock:
    """A non-blocking lock on one file that the OS releases when the holding process dies."""

    __slots__ = ("path", "_fd", "_filelock")

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._filelock: Any = None

    def acquire(self, *, shared: bool = False, create: bool = True) -> bool:
        """Try once to take the lock; False if someone holds it (or the file is missing and `create` is off)."""
        if fcntl is None:  # pragma: no cover - Windows
            import filelock

            if not create and not os.path.exists(self.path):
                return False
            lock = filelock.FileLock(self.path, thread_local=False, is_singleton=False)
            try:
                lock.acquire(blocking=False)
            except filelock.Timeout:
                return False
            self._filelock = lock
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def read(self) -> bytes | None:
        """The start of the held lock file's content (None where the lock has no descriptor of its own)."""
        if self._fd is None:
            return None
        return os.pread(self._fd, 65536, 0)

    def write(self, data: bytes) -> bool:
        """Write `data` over the start of the held lock file in one write; False where the lock has no
        descriptor of its own (Windows)."""
        if self._fd is None:
            return False
        os.pwrite(self._fd, data, 0)
        return True

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases the flock)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        if self._filelock is not None:  # pragma: no cover - Windows
            lock, self._filelock = self._filelock, None
            lock.release()


def probe(lock_path: str) -> bool:
    """True if some process (this one included) holds the lock at `lock_path`."""
    with REGISTRY_LOCK:
        if lock_path in REGISTRY:
            return True
    lock = OsLock(lock_path)
    if lock.acquire(shared=True, create=False):
        lock.release()
        return False
    return os.path.exists(lock_path)


class Held:
    """This process's side of one lease: the lock, the append descriptor and the log size it expects."""

    __slots__ = ("run_id", "log", "lock", "fd", "size", "synced", "dir_synced", "live", "mutex", "unlooked")

    def __init__(self, run_id: str, log: Path, lock: OsLock) -> None:
        self.run_id = run_id
        self.log = log
        self.lock = lock
        self.fd = -1
        self.size = 0
        self.synced = -1
        self.dir_synced = False
        self.live = False
        self.mutex = threading.Lock()
        self.unlooked = 0  # appends since `check` last looked whether the log was replaced

    def check(self) -> None:
        """Raise `LeaseLostError` unless this lease is live and the log is exactly as this process left it."""
        if not self.live:
            raise LeaseLostError(f"the lease on run {self.run_id} was released", run_id=self.run_id)
        st = os.fstat(self.fd)
        if st.st_size != self.size or st.st_nlink == 0:
            raise self.changed()
        self.unlooked = 0

    def changed(self) -> LeaseLostError:
        """The error for a log that is not as this lease left it (grown, cut or replaced by someone else)."""
        return LeaseLostError(f"the log of run {self.run_id} was changed by someone else ({self.log})",
                              run_id=self.run_id)


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` (one syscall unless the OS writes short)."""
    written = os.write(fd, data)
    while written < len(data):
        written += os.write(fd, memoryview(data)[written:])


def read_link_or_file(path: str, limit: int) -> bytes | None:
    """A small record kept as a symlink's target, or as a regular file's first `limit` bytes (one written where
    there are no symlinks, or before records were symlinks); None if there is none."""
    try:
        return os.readlink(os.fsencode(path))
    except FileNotFoundError:
        return None
    except OSError:  # a regular file
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return os.read(fd, limit)
        finally:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or create in directory `path` durable (a no-op where directories cannot be opened)."""
    if os.name != "posix":  # pragma: no cover - Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_syncfs_call: Any = None


def syncfs_call_for() -> Any:
    """libc's ``syncfs`` (Linux), loaded on first use; None where the OS has none."""
    global _syncfs_call
    if _syncfs_call is None:
        _syncfs_call = False
        if sys.platform.startswith("linux") and os.environ.get("DURABLY_NO_SYNCFS") != "1":
            try:
                import ctypes

                _syncfs_call = ctypes.CDLL(None, use_errno=True).syncfs
            except (OSError, AttributeError):  # pragma: no cover - a libc without syncfs
                pass
    return _syncfs_call or None


def syncfs(path: str) -> bool:
    """``syncfs(2)`` of the file system holding `path` (every file's data and metadata on it, one call):
    True once done, False where the OS has no syncfs; an `OSError` when the file system reports a write error."""
    call = syncfs_call_for()
    if call is None:
        return False
    import ctypes

    fd = os.open(path, os.O_RDONLY)
    try:
        if call(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), path)
    finally:
        os.close(fd)
    return True


def lost(lease: Lease) -> LeaseLostError:
    """The error for a lease that does not belong to any file storage (or was never granted)."""
    return LeaseLostError(f"lease on run {lease.run_id} is not a live file-storage lease", run_id=lease.run_id)




def read_owner(path: str) -> dict[str, Any] | None:
    """The claimant JSON stored in `path` (None: no file, empty, or not a JSON object)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
    finally:
        os.close(fd)
    return owner_of(data)


def owner_of(data: bytes) -> dict[str, Any] | None:
    """The claimant JSON object in `data` (None: empty, or not a JSON object)."""
    if not data.strip():
        return None
    try:
        info = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return info if isinstance(info, dict) else None


def lock_run(lock_path: str, run_id: str, log: Path, tries: int = CLAIM_TRIES) -> Held | None:
    """Take the run's lock at `lock_path` (registered in this process); None while another owner holds it.
    `tries` attempts a millisecond apart (a held-probe elsewhere holds the lock shared for microseconds); a
    worker claiming due runs tries once, as a run it loses stays due."""
    held = Held(run_id, log, OsLock(lock_path))
    with REGISTRY_LOCK:
        if lock_path in REGISTRY:
            return None
        REGISTRY[lock_path] = held
    try:
        for attempt in range(tries):
            if held.lock.acquire():
                return held
            if attempt + 1 < tries:
                time.sleep(0.001)  # a held-probe elsewhere holds the lock shared for microseconds
    except BaseException:
        unregister(held)
        raise
    unregister(held)
    return None


def registered(lock_path: str) -> bool:
    """True while this process holds a lease on the lock at `lock_path`."""
    with REGISTRY_LOCK:
        return lock_path in REGISTRY


def unregister(held: Held) -> None:
    """Forget `held` in the process registry, if it is still the registered lease."""
    with REGISTRY_LOCK:
        if REGISTRY.get(held.lock.path) is held:
            del REGISTRY[held.lock.path]


def drop(held: Held) -> None:
    """Close the lease's descriptor, release its lock and forget it in the registry."""
    with held.mutex:
        held.live = False
        if held.fd >= 0:
            fd, held.fd = held.fd, -1
            os.close(fd)
        held.lock.release()
    unregister(held)


def holder_info(runs_path: str, run_id: str) -> dict[str, Any] | None:
    """What the last claimant of a run in `runs_path` wrote about itself (owner, pid, host, epoch, at)."""
    for suffix in (".lock", ".owner"):  # .owner: written by older versions, and where locks have no descriptor
        info = read_owner(os.path.join(runs_path, run_id + suffix))
        if info is not None:
            return info
    return None


def sidecar_epoch(runs_path: str, run_id: str) -> int:
    """The epoch of the last claim per the owner sidecar (survives compactions that drop claim records)."""
    info = holder_info(runs_path, run_id)
    epoch = info.get("epoch") if info else None
    return epoch if isinstance(epoch, int) else 0


def held_epoch(runs_path: str, held: Held, *, older: bool = True) -> int:
    """`sidecar_epoch` read through the lock descriptor `held` holds (no second open of the lock file); `older`
    False: the run is too new to have the ``.owner`` sidecar of older versions."""
    data = held.lock.read()
    if data is None:
        return sidecar_epoch(runs_path, held.run_id)
    info = owner_of(data)
    if info is None and not older:
        return 0
    if info is None:  # a new lock file, or one no claimant wrote: the ``.owner`` sidecar of older versions
        info = read_owner(os.path.join(runs_path, f"{held.run_id}.owner"))
        if info is None:
            return 0
    epoch = info.get("epoch")
    return epoch if isinstance(epoch, int) else 0


def write_sidecar(runs_path: str, held: Held, info: dict[str, Any]) -> None:
    """Record the claimant in the lock file it holds (one write of a padded block: a reader sees the old
    or the new one); where the lock has no descriptor, atomically replace the ``.owner`` sidecar."""
    data = msgspec.json.encode(info)
    if held.lock.write(data.ljust(max(OWNER_BLOCK, len(data)))):
        return
    path = os.path.join(runs_path, f"{held.run_id}.owner")  # pragma: no cover - Windows
    fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
    os.replace(f"{path}.tmp", path)
