"""The awakeables of one execution of a run (`Awakeables`): creating them and waiting for their resolution.

`ctx.awakeable()` allocates a path like any durable wait and records an `awk` record there the first time (its
id, the callback token, the deadline and the schema as JSON Schema), durable before the workflow can hand the id
out. Awaiting it rests like `ctx.wait_for`: the resolution arrives as a message named ``$awakeable:PATH`` in the
run's inbox (written by `Engine.resolve_awakeable` from any process, while the run is parked or not), which wakes
a parked run through the queue exactly as a signal does; its deadline is the rest's wake time. The outcome is
recorded at the awakeable's path as any wait's: an `ok` with the value, or an `err`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from .. import records
from .._authoring.awakeables import SIGNAL, Awakeable, awakeable_id, callback_url, check_name
from .._authoring.policies import check_timeout
from .._authoring.schema import Schema, compile_schema
from .._clock import Clock
from .._codec import dump_error, from_iso, load_value, to_iso
from .._state.history import path_tuple
from ..errors import AwakeableRejectedError, AwakeableTimeoutError
from .control import Control, signal_time
from .log import RunLog
from .stops import Rest
from .tasks import current_task
from .turns import Turns

if TYPE_CHECKING:
    from .._authoring.handles import Handle
    from ..storage.base import Storage

LABEL = "ctx.awakeable"


class _Value:
    """The options a replayed awakeable's value is read with: its schema, nothing to compensate."""

    __slots__ = ("schema", "compensate")

    def __init__(self, schema: Schema | None) -> None:
        self.schema = schema
        self.compensate = None


class Awakeables:
    """Creating the run's awakeables and waiting for their resolutions."""

    def __init__(self, *, storage: Storage, log: RunLog, control: Control, turns: Turns, clock: Clock,
                 replay_next: Callable[..., tuple[str, Any, Handle[Any] | None]],
                 op: Callable[..., Handle[Any]], base_url: Callable[[], str | None]) -> None:
        self.storage = storage
        self.log = log
        self.history = log.history
        self.run_id = log.run_id
        self.control = control
        self.turns = turns
        self.clock = clock
        self.replay_next = replay_next
        self.op = op
        self.base_url = base_url

    async def create(self, timeout: float | None, schema: Any, name: str | None) -> Awakeable[Any]:
        """`ctx.awakeable`: allocate the path now, record the awakeable there the first time (durably, before its
        id can leave the run), and return it; its outcome replays from the log once recorded."""
        timeout = check_timeout(timeout, "ctx.awakeable timeout=")
        name = check_name(name)
        compiled = compile_schema(schema, "schema of ctx.awakeable")
        path, scope, replayed = self.replay_next(LABEL, _Value(compiled), "awakeable value")
        rec = self.history.awakeables.get(path)
        if rec is None and replayed is None:
            hooks = self.control.hooks
            if hooks is not None:
                hooks.unrecorded(path, LABEL, LABEL)
            deadline = self.clock.now() + timedelta(seconds=timeout) if timeout else None
            rec = records.Awake(path=path, id=awakeable_id(self.run_id, path), token=secrets.token_urlsafe(24),
                                deadline=to_iso(deadline) if deadline else None, name=name,
                                schema=compiled.json_schema() if compiled is not None else None, ts=time.time())
            self.log.write(rec)
            self.log.sync()
        if rec is None:  # resolved long ago and its record compacted away: the outcome replays all the same
            return Awakeable(awakeable_id(self.run_id, path), None, None, name, replayed)  # type: ignore[arg-type]
        deadline_at = from_iso(rec.deadline) if rec.deadline else None
        handle = replayed or self.op(scope, path, LABEL, self.wait, path, rec, compiled)
        return Awakeable(rec.id, callback_url(self.base_url(), rec.id, rec.token), deadline_at, rec.name, handle)

    async def wait(self, h: Handle[Any], path: str, rec: records.Awake, schema: Schema | None) -> Any:
        """Awaiting the awakeable `rec`: rest until its resolution is in the inbox (recorded in its turn) or its
        deadline passes (`AwakeableTimeoutError`, recorded)."""
        control, log, clock = self.control, self.log, self.clock
        deadline: datetime | None = from_iso(rec.deadline) if rec.deadline else None
        expires = clock.deadline(deadline) if deadline is not None else None
        h.driver = current_task()
        name = SIGNAL + path
        checked = False
        what = rec.id if rec.name is None else f"{rec.name!r} ({rec.id})"
        rest = Rest("waiting", f"waiting for awakeable {what}", parkable=not control.wait,
                    at=deadline.timestamp() if deadline is not None else None, signal=name, path=path, label=LABEL)
        with control.resting(rest):
            while True:
                await control.boundary(force=True)
                message = self.resolution(name)
                if message is not None and not self.turns.live_now():
                    await self.turns.live(signal_time(message))
                    message = self.resolution(name)
                if message is not None:
                    return self.settle(path, rec, message, schema)
                if deadline is not None and expires is not None and clock.monotonic() >= expires:
                    await control.live_turn(deadline.timestamp())
                    error = AwakeableTimeoutError(
                        f"awakeable {what} was not resolved by its deadline {to_iso(deadline)}", name=rec.name or "",
                        path=list(path_tuple(path)), awakeable=rec.id, deadline=rec.deadline)
                    log.write(records.Err(attempt=1, path=path, label=LABEL, error=dump_error(error), ts=time.time()))
                    log.step_done()
                    raise error
                if not checked:
                    control.check_durable_wait(h)
                    checked = True
                self.turns.wake()
                pause = control.poll if expires is None else min(control.poll, expires - clock.monotonic())
                await clock.sleep(pause)

    def settle(self, path: str, rec: records.Awake, message: dict[str, Any], schema: Schema | None) -> Any:
        """Record the resolution `message` carried (durably, then take it out of the inbox) and return the value,
        or raise the rejection."""
        log = self.log
        payload = message.get("payload")
        payload = payload if isinstance(payload, dict) else {}
        if "error" in payload:
            error = AwakeableRejectedError(str(payload.get("error")), awakeable=rec.id)
            log.write(records.Err(attempt=1, path=path, label=LABEL, error=dump_error(error), ts=time.time()))
            log.sync()
            self.storage.ack(self.run_id, message["id"])
            raise error
        wire = payload.get("value")
        log.write(records.Ok(attempt=1, path=path, label=LABEL, value=wire, ms=0, signal=message["id"], ts=time.time()))
        log.sync()
        self.storage.ack(self.run_id, message["id"])
        value = load_value(wire)
        if schema is not None:
            value = schema.convert(value, f"awakeable {rec.id}")
        return value

    def resolution(self, name: str) -> dict[str, Any] | None:
        """The first resolution of the awakeable whose message is `name` in the run's inbox (None: none yet)."""
        for message in self.storage.inbox(self.run_id):
            if message.get("name") == name:
                return message
        return None
