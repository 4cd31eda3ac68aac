"""Clocks: the real one, and a fake one tests advance by hand or automatically."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from datetime import UTC, datetime, timedelta


class Clock:
    """Wall-clock time and durable waits measured in real seconds."""

    busy = 0

    def now(self) -> datetime:
        """The current time, timezone-aware (UTC)."""
        return datetime.now(UTC)

    async def sleep_until(self, when: datetime) -> None:
        """Wait until `when` (returns at once if it has passed)."""
        delay = (when - self.now()).total_seconds()
        if delay > 0:
            await asyncio.sleep(delay)


class FakeClock(Clock):
    """Virtual time: waits complete when `advance()` passes them, or at once when `auto` and nothing else runs."""

    def __init__(self, start: datetime | None = None, *, auto: bool = True) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self.auto = auto
        self.busy = 0
        self._sleepers: list[tuple[datetime, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._driver: asyncio.Task[None] | None = None

    def now(self) -> datetime:
        """The virtual time."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move virtual time forward and wake every wait that is due."""
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self._now += timedelta(seconds=seconds)
        self._wake()

    def _wake(self) -> None:
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    async def sleep_until(self, when: datetime) -> None:
        """Wait in virtual time."""
        if when <= self._now:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (when, next(self._seq), fut))
        if self.auto and (self._driver is None or self._driver.done()):
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        await fut

    async def _drive(self) -> None:
        """Jump to the earliest wake time whenever no step is executing and the loop has gone quiet."""
        while self._sleepers:
            for _ in range(20):
                await asyncio.sleep(0)
            if self.busy:
                await asyncio.sleep(0.001)
                continue
            self._sleepers = [s for s in self._sleepers if not s[2].done()]
            heapq.heapify(self._sleepers)
            if self._sleepers:
                self._now = max(self._now, self._sleepers[0][0])
                self._wake()
