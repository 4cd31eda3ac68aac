"""Worker threads for sync step functions that never hold up the interpreter's exit.

`concurrent.futures.ThreadPoolExecutor` joins its threads when Python exits, so a sync step abandoned
after its timeout (still blocked in a socket read, say) would keep a finished script from exiting.
These workers are daemon threads: abandoned work dies with the process, as a killed process's would.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class DaemonPool(Executor):
    """Up to `max_workers` daemon threads, started on demand and reused while idle."""

    def __init__(self, max_workers: int = 64, name: str = "durably-step") -> None:
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None]
        self._work = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._max = max_workers
        self._name = name
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run `fn(*args, **kwargs)` on an idle worker, or a new one while fewer than `max_workers` exist."""
        if self._closed:
            raise RuntimeError("cannot submit to a closed DaemonPool")
        future: Future[Any] = Future()
        self._work.put((future, fn, args, kwargs))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                if len(self._threads) < self._max:
                    thread = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}",
                                              daemon=True)
                    self._threads.append(thread)
                    thread.start()
        return future

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
                    future.set_exception(exc)
            del item, future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; idle workers exit (busy ones finish their call first, or die with the process)."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()
