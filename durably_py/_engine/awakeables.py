"""Resolving awakeables from outside their run (`Awakeables`): by id (`Engine.resolve_awakeable`, the CLI, the
console's API) or by the callback token (the callback URL), also while no process runs the run.

A resolution is checked against what the run recorded when it created the awakeable (its `awk` record): the id
names a run and a path that has one, the token is that record's, it is not resolved yet (nothing recorded at
its path, no resolution waiting in the inbox), its deadline has not passed, its run has not ended, and the value
matches its JSON Schema. Only then is it put in the run's inbox as the message ``$awakeable:PATH``, which wakes a
parked run through the queue as a signal does; the run records it in its turn. Any refusal changes nothing.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import msgspec

from .. import records as log_format
from .._authoring.awakeables import DOCS, SIGNAL, parse_id
from .._authoring.jsonschema import check
from .._codec import dump_value, from_iso, to_iso
from .._state.history import History, path_tuple
from ..errors import (
    AwakeableNotFoundError,
    AwakeableResolvedError,
    AwakeableTokenError,
    CorruptLogError,
    ValidationError,
)
from ..storage.base import validate_name

if TYPE_CHECKING:
    from .._clock import Clock
    from ..storage.base import Storage

MISSING: Any = object()


@dataclass(frozen=True)
class AwakeableResolution:
    """What `Engine.resolve_awakeable` / `reject_awakeable` delivered: the awakeable, its run and path, whether it
    was a rejection, and whether a process held the run then (it continues by itself; else a worker or a retry
    continues it)."""

    awakeable: str
    run_id: str
    path: tuple[int, ...]
    rejected: bool
    held: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON form (`--json`, the console)."""
        return {"awakeable": self.awakeable, "run_id": self.run_id, "path": list(self.path),
                "rejected": self.rejected, "held": self.held, "resolved": True}


def open_awakeables(history: History) -> list[log_format.Awake]:
    """The awakeables of a run that have no outcome yet."""
    return [rec for path, rec in history.awakeables.items() if path not in history.done]


class Awakeables:
    """Resolving and rejecting awakeables of an engine's runs."""

    def __init__(self, storage: Storage, clock: Clock) -> None:
        self.storage = storage
        self.clock = clock

    def find(self, awakeable: Any) -> tuple[str, str, History, log_format.Awake]:
        """The run id, path, history and record of an awakeable id; `AwakeableNotFoundError` when none has it."""
        run_id, path = parse_id(awakeable)
        try:
            log = self.storage.read(run_id)
        except CorruptLogError:
            log = None
        rec = None
        history = None
        if log is not None:
            history = History(log.records, log.where or f"run {run_id}")
            rec = history.awakeables.get(path)
        if history is None or rec is None:
            why = "no such run" if log is None else f"run {run_id} created no awakeable at step {path}"
            raise AwakeableNotFoundError(f"no awakeable {awakeable!r} ({why})", docs=DOCS, awakeable=awakeable,
                                         run_id=run_id)
        return run_id, path, history, rec

    async def resolve(self, awakeable: str, value: Any = MISSING, *, error: str | None = None,
                      token: str | None = None) -> AwakeableResolution:
        """Resolve the awakeable with `value` (or reject it with the message `error`); with `token`, only when it
        is the awakeable's callback token. Refused with nothing changed: an unknown id
        (`AwakeableNotFoundError`), a wrong token (`AwakeableTokenError`), one resolved already, past its
        deadline or of an ended run (`AwakeableResolvedError`), a value that does not match its schema
        (`ValidationError`)."""
        run_id, path, history, rec = self.find(awakeable)
        if token is not None and not secrets.compare_digest(str(token).encode(), rec.token.encode()):
            raise AwakeableTokenError(f"the callback token is not the one of awakeable {rec.id}", docs=DOCS,
                                      awakeable=rec.id)
        self.refuse_settled(run_id, path, history, rec)
        rejected = error is not None
        if rejected:
            if not isinstance(error, str) or not error:
                raise ValidationError(f"a rejection needs a message, got {error!r}", docs=DOCS,
                                      hint="reject_awakeable(id, 'the payment was declined')")
            validate_name(error, "a rejection message")
            payload: dict[str, Any] = {"error": error}
        else:
            value = None if value is MISSING else value
            wire = dump_value(value, "value")
            problem = check(rec.schema, msgspec.to_builtins(value)) if rec.schema is not None else None
            if problem is not None:
                what = f"field {problem.field!r}" if problem.field else "the value"
                raise ValidationError(f"awakeable {rec.id}: {problem.text()}", path=problem.path, field=problem.field,
                                      hint=f"Correct {what} and resolve it again: it must match the schema the "
                                           "workflow declared (`durably inspect RUN --json` shows it); nothing was "
                                           "changed.", docs=DOCS)
            payload = {"value": wire}
        name = SIGNAL + path
        message_id = secrets.token_hex(8)
        try:
            line = log_format.encode(log_format.Signal(id=message_id, name=name, payload=payload,
                                                       at=to_iso(self.clock.now())))
        except UnicodeEncodeError:
            raise ValidationError(f"the value for awakeable {rec.id} holds text that is not UTF-8 (a lone "
                                  "surrogate)", hint="Send text that encodes as UTF-8.", docs=DOCS) from None
        self.storage.send(run_id, line)
        self.first_wins(run_id, path, rec, message_id)
        return AwakeableResolution(rec.id, run_id, path_tuple(path), rejected, self.storage.held(run_id))

    def refuse_settled(self, run_id: str, path: str, history: History, rec: log_format.Awake) -> None:
        """`AwakeableResolvedError` when the awakeable can take no resolution any more."""
        done = history.done.get(path)
        waiting = any(m.get("name") == SIGNAL + path for m in self.storage.inbox(run_id))
        if done is not None or waiting:
            how = "rejected" if isinstance(done, log_format.Err) and (done.error or {}).get("type", "").endswith(
                ":AwakeableRejectedError") else "timed out" if isinstance(done, log_format.Err) and (
                done.error or {}).get("type", "").endswith(":AwakeableTimeoutError") else "resolved"
            raise AwakeableResolvedError(f"awakeable {rec.id} was {how} already; the first resolution stands and "
                                         "nothing was changed", docs=DOCS, awakeable=rec.id, run_id=run_id)
        if history.end is not None:
            raise AwakeableResolvedError(f"run {run_id} of awakeable {rec.id} is {history.end.status}; nothing will "
                                         "read a resolution, so nothing was sent", docs=DOCS, awakeable=rec.id,
                                         run_id=run_id, hint=f"`durably retry {run_id}` resumes a failed run.")
        if rec.deadline is not None:
            deadline: datetime = from_iso(rec.deadline)
            if self.clock.now() >= deadline:
                raise AwakeableResolvedError(f"awakeable {rec.id} passed its deadline {rec.deadline}; it can no "
                                             "longer be resolved, and nothing was changed", docs=DOCS,
                                             awakeable=rec.id, run_id=run_id, deadline=rec.deadline,
                                             hint="The run gets AwakeableTimeoutError; create a new awakeable "
                                                  "to ask again.")

    def first_wins(self, run_id: str, path: str, rec: log_format.Awake, mine: str) -> None:
        """Two resolutions sent at the same moment: the first in the inbox (or the one the run recorded) stands,
        and a later one is taken back (`AwakeableResolvedError`)."""
        first = next((m for m in self.storage.inbox(run_id) if m.get("name") == SIGNAL + path), None)
        lost = first is not None and first.get("id") != mine
        if not lost:
            log = self.storage.read(run_id)
            done = History(log.records, log.where).done.get(path) if log is not None else None
            lost = done is not None and getattr(done, "signal", None) != mine
        if lost:
            self.storage.ack(run_id, mine)
            raise AwakeableResolvedError(f"awakeable {rec.id} was resolved already; the first resolution stands "
                                         "and nothing was changed", docs=DOCS, awakeable=rec.id, run_id=run_id)
