"""What a workflow may ask of the engine that runs it (`ctx.engine`): look at runs and act on them, by id or key.

The authoring layer declares it and never imports the engine; `durably_py.Engine` implements it (mypy checks
that where the engine hands itself to the kernel, `_replay.ports.EngineServices`). Each method is the
engine's, with the engine's documentation."""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Protocol

from .._state.history import RunState, SignalSent
from .._state.timeline import Span


class EngineAPI(Protocol):
    """The part of `Engine` a workflow reaches through `ctx.engine`, typically from a step."""

    async def inspect(self, run: str) -> RunState: ...

    async def list(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                   key: str | None = None, key_prefix: str | None = None,
                   since: datetime | None = None, until: datetime | None = None, search: str | None = None,
                   limit: int | None = None, offset: int = 0, parent: str | None = None,
                   without_patch: str | None = None) -> builtins.list[RunState]: ...

    async def count(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                    key: str | None = None, key_prefix: str | None = None,
                    since: datetime | None = None, until: datetime | None = None, search: str | None = None,
                    parent: str | None = None, without_patch: str | None = None) -> int: ...

    async def records(self, run: str) -> builtins.list[dict[str, Any]]: ...

    async def export(self, run: str) -> bytes: ...

    async def timeline(self, run: str) -> builtins.list[Span]: ...

    async def signal(self, run: str, name: str, payload: Any = None, *, strict: bool = False) -> SignalSent: ...

    async def cancel(self, run: str, *, timeout: float = 30.0, compensate: bool = False,
                     cleanup: float | None = None) -> RunState: ...

    async def pause(self, run: str, *, timeout: float = 30.0) -> RunState: ...

    async def resume(self, run: str, *, timeout: float = 30.0) -> RunState: ...
