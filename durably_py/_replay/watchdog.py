"""One timer for the timeouts of every running step of a run."""

from __future__ import annotations

import asyncio
from typing import Any

from .._authoring.calls import Attempt


class Watchdog:
    """One timer for the timeouts of every running step of a run (cheaper than a timer per step)."""

    def __init__(self) -> None:
        self.running: dict[int, tuple[float, asyncio.Task[Any], Attempt]] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.armed = float("inf")
        self.ids = iter(range(1 << 62))

    def add(self, timeout: float, task: asyncio.Task[Any] | None, att: Attempt) -> int:
        """Watch the attempt running in `task`; cancel it `timeout` seconds from now unless removed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        watch = next(self.ids)
        if task is not None:
            self.running[watch] = (deadline, task, att)
            if deadline < self.armed:
                self.arm(loop, deadline)
        return watch

    def remove(self, watch: int) -> None:
        self.running.pop(watch, None)

    def arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = loop.call_at(when, self.fire, loop)
        self.armed = when

    def fire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel every attempt past its deadline (marking it timed out) and re-arm for the next one."""
        self.timer, self.armed = None, float("inf")
        now = loop.time()
        upcoming = float("inf")
        for watch, (deadline, task, att) in list(self.running.items()):
            if deadline <= now:
                del self.running[watch]
                att.cancel()
                task.cancel()
            else:
                upcoming = min(upcoming, deadline)
        if upcoming != float("inf"):
            self.arm(loop, upcoming)

