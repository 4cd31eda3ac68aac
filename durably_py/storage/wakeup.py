"""Local wake-ups: processes sharing one state directory or SQLite file tell each other's idle workers at once
that due work may have appeared, instead of leaving it for their next poll.

Each watching process binds a unix datagram socket and registers it as an empty file in a ``wake/`` folder
beside the store (``.durably/wake/`` for files, ``<database>.wake/`` for SQLite); on Linux the socket lives in
the abstract namespace (no socket file, no path length limit), elsewhere at the registered path. A process that
made work due (created or woke a run, made a parent due, released a run still queued) sends one empty
datagram to every registered socket but its own, without waiting: a full or missing receiver is skipped, a
socket nobody binds any more (its process died) is unregistered. The receiving process's thread calls its
callback, which pokes the worker loop. Nothing here is durable or needed for correctness: a lost wake-up
costs one poll interval, as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

_ABSTRACT = sys.platform.startswith("linux")
_MAX_PATH = 100  # sun_path holds 104-108 bytes; a longer socket path is not watched (polling only)


class LocalWakeups:
    """The wake-up registry of one store: `notify` from any writer, `watch` from a worker's process."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(folder)
        self._names: list[str] = []
        self._listed = -1  # the folder's mtime when `_names` was listed
        self._own: set[str] = set()
        self._sender: socket.socket | None = None
        self._lock = threading.Lock()

    def _address(self, name: str) -> str | bytes:
        if _ABSTRACT:
            return b"\0durably-wake-" + name.encode()
        return os.path.join(self.folder, name)

    def watch(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Call `callback` (from a thread of its own) whenever another process notifies; the function that
        stops it, or None where this system cannot watch (no unix sockets, or a socket path too long)."""
        if not hasattr(socket, "AF_UNIX"):  # pragma: no cover - Windows
            return None
        name = f"{os.getpid()}-{os.urandom(6).hex()}"
        address = self._address(name)
        if isinstance(address, str) and len(address.encode()) > _MAX_PATH:
            return None
        try:
            os.makedirs(self.folder, exist_ok=True)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return None
        try:
            sock.bind(address)
            if _ABSTRACT:
                Path(self.folder, name).touch()
        except OSError:
            sock.close()
            return None
        sock.settimeout(0.5)
        stopped = threading.Event()
        self._own.add(name)

        def listen() -> None:
            while not stopped.is_set():
                try:
                    sock.recv(16)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not stopped.is_set():
                    callback()

        thread = threading.Thread(target=listen, name="durably-wakeups", daemon=True)
        thread.start()

        def stop() -> None:
            stopped.set()
            self._own.discard(name)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, name))
            sock.close()

        return stop

    def notify(self) -> None:
        """Tell every other watching process that due work may have appeared (never blocks, never fails)."""
        try:
            mtime = os.stat(self.folder).st_mtime_ns
        except OSError:
            return  # nobody ever watched this store
        with self._lock:
            if mtime != self._listed:
                try:
                    self._names = [n for n in os.listdir(self.folder) if not n.startswith(".")]
                except OSError:
                    return
                self._listed = mtime
            names = [n for n in self._names if n not in self._own]
            if not names:
                return
            if self._sender is None:
                try:
                    self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sender.setblocking(False)
                except OSError:
                    return
            sender = self._sender
        for name in names:
            try:
                sender.sendto(b"!", self._address(name))
            except (BlockingIOError, InterruptedError):
                continue  # its buffer is full of wake-ups already
            except OSError as exc:
                if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):  # its process died: forget it
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.folder, name))
