"""The file adapter's worker advertisements (`Fleet`): ``workers/<sha256>.json`` says what a live worker
serves, beside ``workers/<sha256>.lock``, which its process holds locked while it lives, so a dead worker's
advertisement is known dead without a clock."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ValidationError
from .base import decode_worker
from .filelocks import OsLock, probe


class FileWorkers:
    """The advertisements of the workers sharing one state directory, and the locks this process holds."""

    def __init__(self, dir: Path, *, write_tmp: Callable[..., str]) -> None:
        self.dir = os.path.join(dir, "workers")
        self._write_tmp = write_tmp  # (directory, stem, data, *, durable) -> the temp file's path
        self._advertised: dict[str, OsLock] = {}  # owner -> the lock this process holds for its advertisement

    def paths(self, owner: str) -> tuple[str, str]:
        """The advertisement and lock file of worker `owner`."""
        name = hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return os.path.join(self.dir, f"{name}.json"), os.path.join(self.dir, f"{name}.lock")

    def advertise(self, owner: str, line: bytes) -> None:
        """Write the worker's advertisement and hold its lock from now until `retire` or this process's end;
        files of dead workers are removed."""
        path, lock_path = self.paths(owner)
        folder = self.dir
        os.makedirs(folder, exist_ok=True)
        if owner not in self._advertised:
            lock = OsLock(lock_path)
            if not lock.acquire():
                raise ValidationError(f"worker {owner} is advertised by another process", hint="Give each worker "
                                      "its own owner name.", docs="docs/deploying.md#what-a-worker-serves")
            self._advertised[owner] = lock
            for name in _listdir(folder):
                if name.endswith(".lock") and os.path.join(folder, name) != lock_path \
                        and not probe(os.path.join(folder, name)):  # each owner's own lock: it died
                    _unlink(os.path.join(folder, name[:-5] + ".json"))
                    _unlink(os.path.join(folder, name))
        tmp = self._write_tmp(folder, "worker", line, durable=False)
        os.replace(tmp, path)

    def retire(self, owner: str) -> None:
        """Remove the worker's advertisement and release its lock."""
        path, _ = self.paths(owner)
        lock = self._advertised.pop(owner, None)
        if lock is not None:
            _unlink(path)
            lock.release()

    def retire_all(self) -> None:
        """Retire every worker this process advertises (at close)."""
        for owner in list(self._advertised):
            self.retire(owner)

    def workers(self) -> list[dict[str, Any]]:
        """The advertisements whose lock a live process holds."""
        folder = self.dir
        out = []
        for name in _listdir(folder):
            if name.endswith(".json") and not name.startswith("."):
                if probe(os.path.join(folder, name[:-5] + ".lock")):
                    try:
                        with open(os.path.join(folder, name), "rb") as f:
                            found = decode_worker(f.read())
                    except FileNotFoundError:
                        continue
                    if found is not None:
                        out.append(found)
        return out


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
