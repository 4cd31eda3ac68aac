"""Reading streamed steps (`Engine.stream`): a step's chunks from any offset, live while it runs, from the
storage's partials; once the step completed and its partials were folded into its record, from its result.

The stream of a step whose partials are gone (folded into its record when it completed) is its result: a list
result is its chunks; any other result reads as one chunk. A reader that was following a step live when it
completed gets the rest from its result when the result continues what it read (a str that starts with the text
read, a list that starts with the chunks read), so it sees every chunk once, in order; the last ones may come as
one chunk."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from .. import records as r
from .._codec import decode, load_value
from .._state.history import History
from ..errors import ValidationError
from ..storage import Storage

__all__ = ["StreamReader", "interleave", "parse_step_path"]

DOCS = "docs/authoring.md#streamed-steps"
MISSING = object()


def parse_step_path(path: Any) -> str:
    """A step path given as ``2``, ``(2, 0, 1)``, ``[2, 0, 1]`` or ``"2.0.1"``, in the log's form ``"2.0.1"``."""
    if isinstance(path, int) and not isinstance(path, bool) and path >= 0:
        return str(path)
    if isinstance(path, str) and re.fullmatch(r"\d+(\.\d+)*", path.strip()):
        return path.strip()
    if isinstance(path, tuple | list) and path and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in path):
        return ".".join(map(str, path))
    raise ValidationError(f"{path!r} is not a step path",
                          hint="Give a path like 2, (3, 1, 0) or '3.1.0'; `durably inspect RUN` shows each step's "
                               "path.", docs=DOCS)


def _check_offset(offset: Any) -> int:
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValidationError(f"offset= must be an int >= 0, got {offset!r}",
                              hint="offset=0 reads a stream from its first chunk.", docs=DOCS)
    return offset


def _outcome(history: History, path: str) -> Any:
    """The step's recorded result (MISSING while it has none: running, retrying, failed, never started)."""
    rec = history.done.get(path)
    return load_value(rec.value) if isinstance(rec, r.Ok) else MISSING


def _tail(result: Any, seen: list[Any], offset: int, before: int | None) -> list[Any]:
    """What of a completed step's `result` comes after the chunks a reader saw (`seen`, from `offset`; `before`
    the length of the str chunks before `offset`, None if unknown)."""
    if isinstance(result, list):
        return result[offset + len(seen):] if result[offset:offset + len(seen)] == seen else []
    if not seen and offset == 0:
        return [result]
    if isinstance(result, str) and before is not None and all(isinstance(c, str) for c in seen):
        text = "".join(seen)
        if result[before:before + len(text)] == text and len(result) > before + len(text):
            return [result[before + len(text):]]
    return []


class StreamReader:
    """`Engine.stream` and the chunks `durably logs --follow` interleaves with a run's records."""

    def __init__(self, storage: Storage, resolve: Callable[[str], str],
                 read: Callable[[str], tuple[History, str | None]]) -> None:
        self.storage = storage
        self.resolve = resolve
        self.read = read

    async def stream(self, run: str, path: Any, *, offset: int = 0, follow: bool = False,
                     poll: float = 0.05) -> AsyncGenerator[Any, None]:
        """The chunks of the step at `path` of run `run` (by id or key) from index `offset`, each once, in order;
        with `follow`, then each chunk as it is written, until the step completes or fails for good or the run
        ends."""
        run_id = self.resolve(run)
        where = parse_step_path(path)
        n = _check_offset(offset)
        self.read(run_id)  # an unknown run: RunNotFoundError now, not at the first poll
        seen: list[Any] = []
        before: int | None = None  # the length of the str chunks before `offset` (-1: not all str), once known
        last = False
        while True:
            found = self.storage.read_partials(run_id, where, 0 if before is None else n)
            if before is None:
                if len(found) < n:
                    found = []
                else:
                    head = [load_value(decode(c)) for c in found[:n]]
                    before = sum(map(len, head)) if all(isinstance(c, str) for c in head) else -1
                    found = found[n:]
            for data in found:
                chunk = load_value(decode(data))
                seen.append(chunk)
                n += 1
                yield chunk
            if found:
                continue
            history, _ = self.read(run_id)
            ended = where in history.done or history.end is not None
            if ended and not last:
                last = True  # one more read: the last batch may have been written after the one above
                continue
            if ended:
                result = _outcome(history, where)
                if result is not MISSING and not self.storage.read_partials(run_id, where, 0):
                    for chunk in _tail(result, seen, offset, None if before == -1 else before or 0):
                        yield chunk
                return
            if not follow:
                return
            await asyncio.sleep(poll)

    async def chunks(self, run: str, *, poll: float = 0.1) -> AsyncIterator[dict[str, Any]]:
        """Every batch of chunks written to any step of the run from now on (and those stored already), as
        ``{"t": "chunks", "path": [..], "offset": n, "chunks": [...]}`` objects, until the run ends."""
        run_id = self.resolve(run)
        offsets: dict[str, int] = {}
        while True:
            for where, count in sorted(self.storage.partial_paths(run_id).items()):
                at = offsets.get(where, 0)
                if count > at:
                    found = [load_value(decode(c)) for c in self.storage.read_partials(run_id, where, at)]
                    offsets[where] = at + len(found)
                    if found:
                        yield {"t": "chunks", "path": [int(i) for i in where.split(".")], "offset": at,
                               "chunks": found}
            await asyncio.sleep(poll)


async def interleave(records: AsyncIterator[dict[str, Any]],
                     chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """The items of `records` and of `chunks` as each comes, until `records` ends."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    failed: list[BaseException] = []

    async def pump(source: AsyncIterator[dict[str, Any]], last: bool) -> None:
        try:
            async for item in source:
                await queue.put(item)
        except Exception as exc:  # noqa: BLE001 - handed to the reader below
            failed.append(exc)
        if last or failed:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(records, True)), asyncio.ensure_future(pump(chunks, False))]
    try:
        while (item := await queue.get()) is not None:
            yield item
        if failed:
            raise failed[0]
    finally:
        for task in tasks:
            task.cancel()
