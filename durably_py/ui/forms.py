"""Approval forms: the console's `POST /api/runs/{run}/submit`, a value for a run's open `ctx.wait_for`.

A `ctx.wait_for(name, schema=...)` records its schema's JSON Schema in its `wait` record, and `inspect` shows
it in the waiting step's output (`{"signal", "deadline", "schema"}`); the run page renders it as a form. A
submitted value is checked against that JSON Schema here, on the server, before it becomes the signal:
a value that does not fit, a missing field, a wrong type or a name no open wait waits for is a
`ValidationError` (400, naming the field) and nothing is sent. The console never imports the workflow's
code to do this: the recorded JSON Schema is all it reads. A wait recorded without a schema (no `schema=`,
a validator function, or a log written before schemas were recorded) takes any JSON value.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .._authoring.jsonschema import check
from .._engine.engine import Engine
from .._state.history import RunState, StepState
from ..errors import ValidationError

__all__ = ["open_waits", "submit"]

DOCS = "docs/ui.md#approval-forms"


def open_waits(state: RunState) -> list[StepState]:
    """The run's `ctx.wait_for` steps that no signal answered yet, in path order."""
    return [s for s in state.steps if s.label == "ctx.wait_for" and s.status == "waiting"
            and isinstance(s.output, dict)]


async def submit(engine: Engine, read: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]], run: str,
                 body: dict[str, Any]) -> dict[str, Any]:
    """Check `body` ({"name", "value"}, optionally "path": the wait's path) against the run's open wait for
    `name` and its recorded JSON Schema, then send the signal. `read` runs an engine read off the event loop.

    Refusals are `ValidationError`s with `field` (the top-level field at fault, if any) and `path` (`$.amount`)
    in their details; nothing is sent then."""
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise ValidationError("submit needs the name of the wait the value is for", hint='Send {"name": "approval", '
                              '"value": ...}: the name the workflow passes to ctx.wait_for.', docs=DOCS)
    if "value" not in body:
        raise ValidationError(f"submit needs the value for wait {name!r}", hint='Send {"name": ..., "value": ...} '
                              "(null is a value).", docs=DOCS)
    value = body["value"]
    state: RunState = await read(lambda: engine.inspect(run))
    waits = open_waits(state)
    chosen = [s for s in waits if s.output.get("signal") == name]
    where = body.get("path")
    if where is not None:
        chosen = [s for s in chosen if ".".join(map(str, s.path)) == str(where)]
    if not chosen:
        names = ", ".join(dict.fromkeys(repr(s.output.get("signal")) for s in waits))
        at = f" at path {where}" if where is not None else ""
        raise ValidationError(
            f"run {state.run_id} has no open wait for {name!r}{at} (it is {state.status}"
            + (f"; it waits for {names})" if names else "; nothing in it waits)") + "; nothing was sent",
            hint="Submit to a wait the run page shows as a form; `durably inspect RUN` lists the open waits.",
            docs=DOCS, run_id=state.run_id, awaited=[s.output.get("signal") for s in waits])
    for wait in chosen:  # waits sharing a name each may read the signal: the value must fit every one of them
        schema = wait.output.get("schema")
        if schema is None:
            continue
        problem = check(schema, value)
        if problem is not None:
            field = f"field {problem.field!r}" if problem.field else "the value"
            raise ValidationError(
                f"{problem.text()} (the schema of ctx.wait_for({name!r}) at path "
                f"{'.'.join(map(str, wait.path))}); nothing was sent",
                hint=f"Correct {field} and submit again.", docs=DOCS, run_id=state.run_id,
                field=problem.field, path=problem.path)
    sent = await engine.signal(state.run_id, name, value, strict=True)
    return {"run": state.run_id, "signal": name, "payload": value, "sent": True, "status": sent.status}
