"""Awakeables: a wait that an outside system ends by id (or by a callback URL), also while no process runs the run.

``a = await ctx.awakeable(timeout=3600)`` gives an `Awakeable`: its `id` (and `url`, a callback URL carrying an
unguessable token, when the engine knows the console's base URL) go to the outside system, and ``await a``
parks the run until someone resolves it (`Engine.resolve_awakeable`, `durably resolve-awakeable`, a POST to
the URL) or its deadline passes. The id is the run id and the awakeable's step path, so a resumed run that asks
again at the same place gets the same awakeable back, with a resolution that arrived meanwhile.

This module holds what every mode shares: the handle, the id's shape, the callback URL and the argument checks.
The local kernel's part is `_replay.awakeables`; resolving is the engine's (`_engine.awakeables`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Generator
from datetime import datetime
from typing import Any, Generic, TypeVar

from ..errors import AwakeableNotFoundError, ValidationError

__all__ = ["SIGNAL", "Awakeable", "awakeable_id", "callback_url", "check_name", "parse_id"]

T = TypeVar("T")

SIGNAL = "$awakeable:"  # + the awakeable's path: the inbox message that carries its resolution, and its wake-up
DOCS = "docs/authoring.md#awakeables-and-callbacks"
_PATH = re.compile(r"\d+(\.\d+)*")


def awakeable_id(run_id: str, path: str) -> str:
    """The id of the awakeable created at `path` of run `run_id` (the same every time the run asks there)."""
    return f"{run_id}:{path}"


def parse_id(awakeable: Any) -> tuple[str, str]:
    """The run id and path an awakeable id names; `AwakeableNotFoundError` when it is no awakeable id."""
    if isinstance(awakeable, str):
        run_id, sep, path = awakeable.rpartition(":")
        if sep and run_id and _PATH.fullmatch(path):
            return run_id, path
    raise AwakeableNotFoundError(f"{awakeable!r} is not an awakeable id (RUN_ID:PATH, as `a.id` gives it)",
                                 docs=DOCS, awakeable=awakeable)


def callback_url(base: str | None, awakeable: str, token: str) -> str | None:
    """The URL an outside system POSTs a resolution to (`durably ui` serves it), or None without a base URL."""
    if not base:
        return None
    return f"{base.rstrip('/')}/callbacks/{awakeable}/{token}"


def check_name(name: Any) -> str | None:
    """Validate `name=` of `ctx.awakeable` (a label shown by `inspect` and the console)."""
    if name is not None and (not isinstance(name, str) or not name or len(name) > 200):
        raise ValidationError(f"ctx.awakeable name= must be 1-200 characters of text, got {name!r}",
                              hint="Name what the outside system answers, e.g. name='payment confirmed'.", docs=DOCS)
    return name


class Awakeable(Generic[T]):
    """An awakeable the workflow created: hand `id` (or `url`) to an outside system, then ``await`` it (or
    ``await a.result()``) for the value it resolves it with. Awaiting it parks the run, holding no process when a
    worker serves it, until it is resolved (the value), rejected (`AwakeableRejectedError`) or its deadline
    passes (`AwakeableTimeoutError`). Like every handle it may be awaited any number of times."""

    __slots__ = ("id", "url", "deadline", "name", "_handle")

    def __init__(self, id: str, url: str | None, deadline: datetime | None, name: str | None,
                 handle: Awaitable[T]) -> None:
        self.id = id  # what `resolve_awakeable(id, value)` and `durably resolve-awakeable ID` take
        self.url = url  # the callback URL (None when the engine has no callback_url)
        self.deadline = deadline  # when it fails unresolved (None: never)
        self.name = name
        self._handle = handle

    def result(self) -> Awaitable[T]:
        """The outcome as a handle (locally an `asyncio.Future`): await it, or hand it to `ctx.first` /
        `asyncio.gather`."""
        return self._handle

    def __await__(self) -> Generator[Any, None, T]:
        return self._handle.__await__()

    def __repr__(self) -> str:
        return f"<durably awakeable {self.id}{'' if self.name is None else f' {self.name!r}'}>"
