"""The file adapter's inbox (`Inbox`): each signal one file in ``runs/<run_id>.inbox/``, written as a hidden
temp file, fsynced, then renamed in (any process may send, lease or not), so a reader sees a whole signal or
none; acknowledged signals are deleted. A part of `FileStorage`, in a module of its own as its queue is."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import RunNotFoundError
from .base import decode_signal
from .filelocks import fsync_dir, registered


class FileInbox:
    """The inbox methods of `FileStorage` (which provides the folders, the temp-file writer and `wake`)."""

    dir: Path
    runs_dir: Path
    fsyncs: int
    _signal_ids: dict[str, dict[str, str]]  # run id -> {inbox file name: signal id}, as last read
    _last_signal_ns: int

    if TYPE_CHECKING:
        def _log(self, run_id: str) -> Path: ...
        def _lock_path(self, run_id: str) -> str: ...
        def _write_tmp(self, directory: str | Path, stem: str, data: bytes, *, durable: bool) -> str: ...
        @staticmethod
        def _unlink(path: str) -> None: ...
        def wake(self, run_id: str, name: str | None = None) -> bool: ...

    def _inbox_dir(self, run_id: str) -> Path:
        """The inbox directory of an existing run; `RunNotFoundError` if the run is unknown (a run this process
        holds the lease of exists: no look)."""
        if not registered(self._lock_path(run_id)) and not self._log(run_id).exists():
            raise RunNotFoundError(f"no run {run_id} in {self.dir}", run_id=run_id)
        return self.runs_dir / f"{run_id}.inbox"

    def _do_send(self, run_id: str, line: bytes, signal_id: str) -> None:
        """Store one signal as its own file, fsynced then renamed into the run's inbox (no lease needed)."""
        directory = self._inbox_dir(run_id)
        try:
            directory.mkdir()
            created = True
        except FileExistsError:
            created = False
        ns = self._last_signal_ns = max(time.time_ns(), self._last_signal_ns + 1)
        tmp = self._write_tmp(directory, "signal", line, durable=True)
        try:
            os.replace(tmp, directory / f"{ns:020d}-{os.urandom(8).hex()}.json")
        except BaseException:
            self._unlink(tmp)
            raise
        fsync_dir(directory)
        self.fsyncs += 1
        if created:
            fsync_dir(self.runs_dir)
            self.fsyncs += 1
        name = (decode_signal(line) or {}).get("name")
        if isinstance(name, str) and name:
            self.wake(run_id, name)

    def _do_inbox(self, run_id: str) -> list[dict[str, Any]]:
        """The run's unacknowledged signals, oldest first, from one listing of its inbox (garbled files skipped)."""
        directory = self._inbox_dir(run_id)
        ids: dict[str, str] = {}
        signals = []
        for name in _signal_files(directory):
            signal = _read_signal(directory / name)
            if signal is not None:
                ids[name] = signal["id"]
                signals.append(signal)
        self._signal_ids[run_id] = ids
        return signals

    def _do_ack(self, run_id: str, signal_id: str) -> None:
        """Delete every inbox file holding signal `signal_id`, reading only files `inbox` has not seen."""
        directory = self._inbox_dir(run_id)
        known = self._signal_ids.get(run_id, {})
        for name in _signal_files(directory):
            found = known.get(name)
            if found is None:
                signal = _read_signal(directory / name)
                found = None if signal is None else signal["id"]
            if found == signal_id:
                (directory / name).unlink(missing_ok=True)
                known.pop(name, None)


def _signal_files(directory: Path) -> list[str]:
    """The signal file names in an inbox directory, oldest first (temp files of sends in flight left out)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(name for name in names if name.endswith(".json") and not name.startswith("."))


def _read_signal(path: Path) -> dict[str, Any] | None:
    """The signal stored at `path`, or None if it vanished (acked meanwhile) or is not a signal."""
    try:
        return decode_signal(path.read_bytes())
    except (FileNotFoundError, IsADirectoryError):
        return None
