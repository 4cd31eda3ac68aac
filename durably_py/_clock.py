"""Clocks: the real one, and a fake one tests advance by hand or automatically.

The clock rule: every durable deadline (a sleep's wake time, a `wait_for` deadline, a retry backoff) is
recorded as a wall-clock instant, because only wall time means the same thing to another process or after a
restart. A live process converts that instant to a span once, when it starts waiting, and waits the span out
on the monotonic clock, so a wall-clock jump while it waits (NTP, a suspended laptop, an operator setting the
date) ends no wait early or late.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Clock:
    """Wall-clock time for recorded instants; monotonic time for waiting them out."""

    busy = 0

    def now(self) -> datetime:
        """The current wall-clock time, timezone-aware (UTC)."""
        return datetime.now(UTC)

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps (only differences mean anything)."""
        return time.monotonic()

    def deadline(self, when: datetime) -> float:
        """The monotonic instant at which wall-clock instant `when` falls, as seen from now."""
        return self.monotonic() + (when - self.now()).total_seconds()

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of monotonic time."""
        await asyncio.sleep(max(seconds, 0))

    async def sleep_until(self, when: datetime) -> None:
        """Wait until wall-clock instant `when`, measured now and waited out on the monotonic clock."""
        delay = (when - self.now()).total_seconds()
        if delay > 0:
            await self.sleep(delay)


class FakeClock(Clock):
    """Virtual time: waits complete when `advance()` passes them, or at once when `auto` and nothing else runs.

    `advance()` moves both clocks; `jump()` moves only the wall clock, as NTP or an operator would, and wakes
    nothing. `on_advance`, when set (a `TestEngine` sets it), is called by `advance()` with the instant it
    moves to, before the clock gets there: it fires the timers due on the way, each at its own instant, by
    moving the clock there with `reach()`."""

    def __init__(self, start: datetime | None = None, *, auto: bool = True) -> None:
        self._start = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._mono = 0.0
        self._skew = 0.0
        self.auto = auto
        self.busy = 0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._added = 0  # sleepers registered so far: the driver waits for quiet after the latest of them
        self._driver: asyncio.Task[None] | None = None
        self.on_advance: Callable[[datetime], None] | None = None

    def now(self) -> datetime:
        """The virtual wall-clock time."""
        return self._start + timedelta(seconds=self._mono + self._skew)

    def monotonic(self) -> float:
        """The virtual monotonic time."""
        return self._mono

    def advance(self, seconds: float) -> None:
        """Move virtual time forward and wake every wait that is due (with `on_advance`: in order, each timer
        at its own instant)."""
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        target = self._mono + seconds
        if self.on_advance is not None:
            self.on_advance(self._start + timedelta(seconds=target + self._skew))
        self._mono = max(self._mono, target)
        self._wake()

    def reach(self, when: datetime) -> None:
        """Move virtual time forward to wall-clock instant `when` (if it is later than now) and wake every wait
        due by then; `on_advance` is not called."""
        ahead = (when - self.now()).total_seconds()
        if ahead > 0:
            self._mono += ahead
        self._wake()

    def jump(self, seconds: float) -> None:
        """Move only the wall clock (either way): waits already under way are not shortened or lengthened."""
        self._skew += seconds

    def _wake(self) -> None:
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        while self._sleepers and self._sleepers[0][0] <= self._mono:
            _, _, fut = heapq.heappop(self._sleepers)
            if fut.done():
                continue
            if fut.get_loop() is current:
                fut.set_result(None)
                continue
            try:  # a wait of another event loop (a TestEngine fires timers on a loop of its own)
                fut.get_loop().call_soon_threadsafe(_settle, fut)
            except RuntimeError:  # its loop is closed: nothing waits for it any more
                pass

    async def sleep(self, seconds: float) -> None:
        """Wait in virtual monotonic time."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._mono + seconds, next(self._seq), fut))
        self._added += 1
        loop = asyncio.get_running_loop()
        if self.auto and (self._driver is None or self._driver.done() or self._driver.get_loop() is not loop):
            # in a context of its own: it is the clock's, not one of the tasks of the run whose wait started it
            self._driver = loop.create_task(self._drive(), context=contextvars.Context())
        await fut

    async def sleep_until(self, when: datetime) -> None:
        """Wait in virtual time until wall-clock instant `when` (measured now)."""
        await self.sleep((when - self.now()).total_seconds())

    async def _drive(self) -> None:
        """Jump to the earliest wake time whenever no step is executing and the loop has gone quiet."""
        while self._sleepers:
            added = self._added
            for _ in range(20):
                await asyncio.sleep(0)
            if added != self._added:
                continue  # a wait began meanwhile: its run may be about to park on it rather than sleep
            if self.busy:
                await asyncio.sleep(0.001)
                continue
            self._sleepers = [s for s in self._sleepers if not s[2].done()]
            heapq.heapify(self._sleepers)
            if self._sleepers:
                self._mono = max(self._mono, self._sleepers[0][0])
                self._wake()
