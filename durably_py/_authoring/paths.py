"""Step paths: where each durable call of a workflow sits in its run (``"3"``, ``"4.1.0"``), allocated in call
order per sequential strand. A path is the replay contract, so local and Restate mode share this one allocator."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any


class Scope:
    """Allocates the child paths of one sequential strand (the workflow body, a branch, a loop turn)."""

    __slots__ = ("prefix", "n", "owner", "loop", "thread", "labels", "pending", "outer")

    def __init__(self, prefix: str, owner: asyncio.Task[Any] | None,
                 outer: tuple[tuple[str, int], ...] = ()) -> None:
        self.prefix = prefix
        self.n = 0
        self.owner = owner
        # where the owner runs: the caller is the owner when `running_task(loop)` is it on `thread`
        self.loop = owner.get_loop() if owner is not None else None
        self.thread = threading.get_ident()
        self.labels: dict[str, int] = {}
        self.pending = 0
        self.outer = outer  # (prefix, first index) of the positions that come after this strand in its enclosing ones

    def alloc(self) -> str:
        n = self.n
        self.n = n + 1
        return self.prefix + number(n)


NUMBERS: list[str] = []  # str(i) for path indexes from 0, the first NUMBERS_KEPT
NUMBERS_KEPT = 1 << 15
_GROWING = threading.Lock()


def number(n: int) -> str:
    """`str(n)` for a path index, from a table of the first `NUMBERS_KEPT` (a path is built per step)."""
    try:
        return NUMBERS[n]
    except IndexError:
        if n >= NUMBERS_KEPT:
            return str(n)
        with _GROWING:  # grown in place, only appended to: a thread reading it meanwhile reads true entries
            NUMBERS.extend(map(str, range(len(NUMBERS), min(max(n + 1, 2 * len(NUMBERS), 64), NUMBERS_KEPT))))
        return NUMBERS[n]


current_scope: contextvars.ContextVar[Scope] = contextvars.ContextVar("durably_scope")
