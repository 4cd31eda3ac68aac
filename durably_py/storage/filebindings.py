"""The file adapter's identity bindings (`bind`, `lookup`): one small file per identity under ``index/``, named by
the identity's SHA-256 and holding the run id (a regular file, or a symlink whose target is the run id when made
in a batch), changed atomically. A part of `FileStorage`, in a module of its own as its inbox and queue are."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ValidationError
from .base import FULL_ERRNOS, lookup_each, storage_full, validate_run_id
from .filelocks import OsLock, fsync_dir, read_link_or_file


class FileBindings:
    """The binding methods of `FileStorage` (which provides the index folder, the temp-file writer and `lookup`)."""

    index_dir: Path
    fsyncs: int
    _index_path_str: str
    _link_bindings: bool

    if TYPE_CHECKING:
        def _write_tmp(self, directory: str | Path, stem: str, data: bytes, *, durable: bool) -> str: ...
        @staticmethod
        def _unlink(path: str) -> None: ...
        def lookup(self, identity: str) -> str | None: ...

    def _do_bind(self, identity: str, run_id: str, expect: str | None) -> bool:
        """Point `identity` at `run_id` if it still points at `expect` (None: at nothing); False if not.

        The index file (named by the identity's SHA-256) is replaced atomically under a lock on its own
        ``.lock`` file, so two processes creating the same run at once agree on one of them."""
        if not self._bind(identity, run_id, expect):
            return False
        fsync_dir(self.index_dir)
        self.fsyncs += 1
        return True

    def _bind(self, identity: str, run_id: str, expect: str | None, *, durable: bool = True) -> bool:
        """`bind` but for making the rename durable (an fsync of the index directory, the caller's).

        A first binding (`expect` None, nothing bound) is a hard link of a temp file holding the run id: it
        fails if the name exists, so it needs no lock; anything else is decided under the binding's own lock
        file, where a damaged binding counts as none."""
        path = self._index_path(identity)
        if expect is None and not durable and self._link_bindings:
            # made durable by the caller's syncfs: a symlink whose target is the run id is created only if the
            # name is free, in one step, with no temp file and no data block (a regular file where there are
            # no symlinks); the index folder is made only when the link finds it missing (once, not per child)
            try:
                try:
                    os.symlink(run_id, path)
                except FileNotFoundError:
                    os.makedirs(self._index_path_str, exist_ok=True)
                    os.symlink(run_id, path)
                return True
            except FileExistsError:
                pass
            except (OSError, NotImplementedError) as exc:  # pragma: no cover - a file system without symlinks
                if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
                    raise storage_full(exc, "write", self._index_path_str) from exc
                self._link_bindings = False
        os.makedirs(self._index_path_str, exist_ok=True)
        if expect is None:
            tmp = self._write_tmp(self._index_path_str, "bind", run_id.encode(), durable=durable)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                pass
            except OSError:  # pragma: no cover - filesystems without hard links: the locked way
                pass
            finally:
                os.unlink(tmp)
        lock = OsLock(path + ".lock")
        deadline = time.monotonic() + 10
        while not lock.acquire():
            if time.monotonic() > deadline:
                raise ValidationError(f"the index entry of {identity!r} stayed locked for 10 s",
                                      hint="Another process is stuck binding this run; retry, or check the state "
                                           "dir's disk.")
            time.sleep(0.001)
        try:
            if self.lookup(identity) != expect:
                return False
            tmp = self._write_tmp(self._index_path_str, "bind", run_id.encode(), durable=durable)
            try:
                if expect is None and not os.path.lexists(path):
                    os.link(tmp, path)  # fails if another process's first binding came in meanwhile
                else:
                    os.replace(tmp, path)
            except FileExistsError:
                return False
            finally:
                self._unlink(tmp)
            return True
        finally:
            lock.release()

    def _do_lookup(self, identity: str) -> str | None:
        """The run `identity` is bound to, if any."""
        path = self._index_path(identity)
        data = read_link_or_file(path, 512)  # a symlink: a binding made in a batch (`_bind`)
        if data is None:
            return None
        try:
            return validate_run_id(data.decode("utf-8", "replace").strip())
        except ValidationError:
            return None

    def _do_lookup_many(self, identities: list[str]) -> list[str | None]:
        """The run each identity is bound to (None where none), in order: one `lookup` each, since every
        binding is a small file of its own and a batch has no cheaper way to read them."""
        return lookup_each(self, identities)

    def _index_path(self, identity: str) -> str:
        """Where an identity's binding lives: its SHA-256, never the identity itself."""
        digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()
        return os.path.join(self._index_path_str, digest)

    def _unbind(self, identity: str, run_id: str) -> None:
        """Remove the binding of `identity` if it still names `run_id` (under the binding's own lock)."""
        path = self._index_path(identity)
        lock = OsLock(path + ".lock")
        deadline = time.monotonic() + 10
        while not lock.acquire():
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)
        try:
            if self.lookup(identity) == run_id:
                self._unlink(path)
        finally:
            lock.release()
