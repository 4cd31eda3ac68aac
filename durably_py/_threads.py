"""Where sync step functions run: daemon worker threads, or the event loop's thread for quick ones.

`concurrent.futures.ThreadPoolExecutor` joins its threads when Python exits, so a sync step abandoned
after its timeout (still blocked in a socket read, say) would keep a finished script from exiting.
These workers are daemon threads: abandoned work dies with the process, as a killed process's would.
"""

from __future__ import annotations

import asyncio
import asyncio.events as asyncio_events
import contextvars
import queue
import threading
import time
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


_get_running_loop = asyncio_events._get_running_loop
_set_running_loop = asyncio_events._set_running_loop
_copy_context = contextvars.copy_context
_perf_counter = time.perf_counter

QUICK_SECONDS = 0.001
BLOCKING_SECONDS = 0.01
PROMOTE_AFTER = 3


def _key(fn: Callable[..., Any]) -> Any:
    """What identifies a step function across calls: its code object (lambdas made per call share one)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        inner = getattr(fn, "func", None)
        code = getattr(inner, "__code__", None)
    return code if code is not None else fn


class SyncPlacement:
    """Decides, per sync step function, whether a call runs on a worker thread or directly on the event loop.

    A function's first calls run on a worker thread and are timed there. Once its last `PROMOTE_AFTER`
    calls each returned within `QUICK_SECONDS`, it is quick, and the kernel may call it on the event loop
    thread (no hop to a thread and back). A call that then takes longer sends it back to worker threads
    until it is quick `PROMOTE_AFTER` times again; a call on the loop thread that blocked it for
    `BLOCKING_SECONDS` or more also doubles that number (a collector pause is not worth as much). `enabled=False` keeps every
    sync step on worker threads.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.quick: dict[Any, int] = {}
        self.needed: dict[Any, int] = {}

    def is_quick(self, fn: Callable[..., Any], code: Any = None) -> bool:
        """True when `fn` has been quick lately (and inline calls are enabled); `code`: `fn.__code__` if the caller
        has it at hand."""
        if not self.enabled:
            return False
        key = code if code is not None else _key(fn)
        try:
            streak = self.quick.get(key, 0)
        except TypeError:  # an unhashable callable: never inline
            return False
        return streak >= PROMOTE_AFTER and (not self.needed or streak >= self.needed.get(key, PROMOTE_AFTER))

    def record(self, fn: Callable[..., Any], seconds: float, inline: bool) -> None:
        """Note how long a call of `fn` took; a slow call on the loop thread makes promotion twice as hard."""
        try:
            key = _key(fn)
            if seconds < QUICK_SECONDS:
                self.quick[key] = self.quick.get(key, 0) + 1
                return
            self.quick[key] = 0
        except TypeError:
            return
        if inline and seconds >= BLOCKING_SECONDS:
            self.needed[key] = min(self.needed.get(key, PROMOTE_AFTER) * 2, PROMOTE_AFTER << 12)
        if len(self.quick) > 4096:
            self.quick.clear()

    def timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call `fn(*args)` (on a worker thread) and record how long it took."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.record(fn, time.perf_counter() - started, False)

    def inline(self, fn: Callable[..., Any], args: tuple[Any, ...], started: float | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> Any:
        """Call `fn(*args)` on this (the event loop's) thread in a copy of the current context, and time it
        (from `started`, a `time.perf_counter()` reading the caller just took, if given).

        While it runs, no event loop counts as running on this thread, so the function sees what it would
        on a worker thread (`asyncio.run()` inside it works, `asyncio.get_running_loop()` raises). `loop`: the
        running loop, when the caller knows it (looking it up costs a system call on 3.11)."""
        if loop is None:
            loop = _get_running_loop()
        _set_running_loop(None)
        if started is None:
            started = _perf_counter()
        try:
            return _copy_context().run(fn, *args)
        finally:
            _set_running_loop(loop)
            seconds = _perf_counter() - started
            if seconds >= QUICK_SECONDS:  # a quick call changes nothing: the function is quick already
                self.record(fn, seconds, True)
