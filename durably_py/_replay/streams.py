"""Streamed steps: the chunks a step emits while it runs (`attempt().emit(chunk)`, or what an async or sync
generator step yields), kept as partials in the storage's `Partials` role so that readers see them live and the
step's next attempt, after its process was killed, continues from them (`attempt().partials`).

Chunks are written in batches, never with an fsync: a batch goes out once `FLUSH_CHUNKS` chunks are waiting or
`FLUSH_SECONDS` after the first of them, and whatever waits when the attempt ends. A SIGKILL therefore loses at
most the chunks of the last `FLUSH_SECONDS` (and fewer than `FLUSH_CHUNKS` of them); every earlier one is in the
store. When the step completes, its record holds its result and its partials are dropped, unless it was called
with ``keep_partials=True``.

A generator step's result is its whole stream joined: `join`."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._authoring.calls import current_attempt
from .._codec import decode, dump_value, encode, load_value

if TYPE_CHECKING:
    from ..storage.roles import Partials

__all__ = ["FLUSH_CHUNKS", "FLUSH_SECONDS", "StepStream", "Streams", "join", "streamed", "streaming"]

FLUSH_CHUNKS = 64
"""A batch of partials is written once this many chunks wait."""
FLUSH_SECONDS = 0.1
"""...or this long after the first of them was emitted, whichever comes first."""


def join(chunks: list[Any]) -> Any:
    """A generator step's result: its str chunks joined into one str; any other stream (numbers, dicts, mixed,
    or no chunk at all) is the list of its chunks."""
    if chunks and all(type(c) is str for c in chunks):
        return "".join(chunks)
    return list(chunks)


def streaming(fn: Callable[..., Any]) -> bool:
    """True for a generator function (async or sync): `ctx.step` streams what it yields."""
    return inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn)


_WRAPPED: dict[Any, Callable[..., Any]] = {}


def streamed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The step function that runs generator function `fn`: each yielded chunk is emitted as the step's stream,
    and it returns the whole stream (the partials of earlier attempts, then this attempt's chunks) joined."""
    try:
        return _WRAPPED[fn]
    except (KeyError, TypeError):
        pass
    if inspect.isasyncgenfunction(fn):

        async def run_async(*args: Any) -> Any:
            stream = current_attempt.get().kernel.stream(current_attempt.get().path)
            number = current_attempt.get().number
            async for chunk in fn(*args):
                stream.emit(chunk, number)
            return join(stream.chunks)

        wrapper: Callable[..., Any] = run_async
    else:

        def run_sync(*args: Any) -> Any:
            stream = current_attempt.get().kernel.stream(current_attempt.get().path)
            number = current_attempt.get().number
            for chunk in fn(*args):
                stream.emit(chunk, number)
            return join(stream.chunks)

        wrapper = run_sync
    functools.update_wrapper(wrapper, fn)
    del wrapper.__wrapped__  # type: ignore[attr-defined]  # `inspect` must see the wrapper, not the generator
    try:
        if len(_WRAPPED) >= 1024:
            _WRAPPED.clear()
        _WRAPPED[fn] = wrapper
    except TypeError:
        pass
    return wrapper


class StepStream:
    """The stream of the step at one path in this process: every chunk so far (earlier attempts' included), and
    the batch not yet written. `emit` may be called from any thread (a `def` step runs on a worker thread)."""

    def __init__(self, streams: Streams, path: str, prior: list[Any]) -> None:
        self.streams = streams
        self.path = path
        self.chunks: list[Any] = prior  # every chunk of the stream so far, as emitted
        self.number = 0  # the attempt emitting now
        self.base = len(prior)  # chunks before that attempt started: its `attempt().partials`
        self.batch: list[bytes] = []
        self.batch_attempt = 1
        self.first = 0.0  # when the batch's first chunk came (monotonic)
        self.armed = False
        self.lock = threading.Lock()

    def partials(self, number: int) -> list[Any]:
        """The chunks streamed before attempt `number` started (by earlier attempts, in this or earlier processes)."""
        with self.lock:
            self.start(number)
            return list(self.chunks[:self.base])

    def start(self, number: int) -> None:
        if number != self.number:
            self.number = number
            self.base = len(self.chunks)

    def emit(self, chunk: Any, number: int) -> None:
        """Add one chunk (JSON plus datetime, as step values) to the stream; written within `FLUSH_SECONDS`."""
        data = encode(chunk if type(chunk) is str else dump_value(chunk, "chunk"))
        now = time.monotonic()
        with self.lock:
            if number != self.number:
                self.start(number)
            batch = self.batch
            if batch and number != self.batch_attempt:
                self._flush()
                batch = self.batch
            self.chunks.append(chunk)
            if not batch:
                self.first = now
                self.batch_attempt = number
            batch.append(data)
            if len(batch) >= FLUSH_CHUNKS or now - self.first >= FLUSH_SECONDS:
                self._flush()
                return
            arm = not self.armed
            self.armed = True
        if arm:
            self.streams.later(self.flush)

    def flush(self) -> None:
        """Write the waiting batch, if any."""
        with self.lock:
            self.armed = False
            self._flush()

    def _flush(self) -> None:
        if self.batch:
            batch, self.batch = self.batch, []
            self.streams.storage.append_partials(self.streams.run_id, self.path, self.batch_attempt, batch)
            self.streams.written += len(batch)


class Streams:
    """The streams of one execution of a run, by step path: opened at a step's first chunk (or its first look at
    `attempt().partials`), ended when the step completes (`finished`)."""

    def __init__(self, storage: Partials, run_id: str) -> None:
        self.storage = storage
        self.run_id = run_id
        self.open: dict[str, StepStream] = {}
        self.loop: asyncio.AbstractEventLoop | None = None  # the run's event loop, for timed flushes
        self.written = 0  # chunks written (for tests and benchmarks)
        self.lock = threading.Lock()

    def stream(self, path: str) -> StepStream:
        """The stream of the step at `path`, opened with the partials stored for it (a cut-off attempt's)."""
        with self.lock:
            found = self.open.get(path)
            if found is None:
                prior = [load_value(decode(c)) for c in self.storage.read_partials(self.run_id, path, 0)]
                found = self.open[path] = StepStream(self, path, prior)
            return found

    def later(self, flush: Callable[[], None]) -> None:
        """Run `flush` `FLUSH_SECONDS` from now on the run's loop (from any thread); at once without a loop."""
        loop = self.loop
        if loop is None or loop.is_closed():
            flush()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.call_later(FLUSH_SECONDS, flush)
        else:
            loop.call_soon_threadsafe(loop.call_later, FLUSH_SECONDS, flush)

    def flush(self, path: str) -> None:
        """An attempt of the step at `path` ended without completing it: write what waits (the next attempt
        reads it)."""
        stream = self.open.get(path)
        if stream is not None:
            stream.flush()

    def finished(self, path: str, keep: bool) -> None:
        """The step at `path` completed (its record is written): its partials are dropped, or written out and
        kept with `keep`."""
        stream = self.open.pop(path, None)
        if stream is None:
            return
        if keep:
            stream.flush()
            return
        with stream.lock:
            stream.batch = []
        self.storage.drop_partials(self.run_id, path)
