"""The console's routes for remote control (`durably_py.client`, `durably ... --remote URL`): runs as
`Engine.list` gives them, with any filters `durably list` takes, and what `durably list` and `inspect` note
about due runs no live worker serves. The operations themselves are the console's (`/api/runs/{run}/{op}`).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .._engine.code import unserved_notes
from ..errors import DurablyError, RunNotFoundError, ValidationError
from .app import MAX_LIMIT, STATUSES, Json, error_body

if TYPE_CHECKING:
    from .app import Console

DOCS = "docs/ui.md#json-api"
LIST_STATUSES = (*STATUSES, "corrupt")


def _refusal(exc: DurablyError) -> Json:
    status = 404 if isinstance(exc, RunNotFoundError) else 400 if isinstance(exc, ValidationError) else 409
    return Json(error_body(exc), status_code=status)


def _when(text: str | None, name: str) -> datetime | None:
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValidationError(f"{name}={text!r} is not an ISO 8601 time", hint="Write times like "
                              "2026-05-01T12:00:00Z.", docs=DOCS) from None
    return when if when.tzinfo is not None else when.astimezone()


def _number(text: str | None, name: str, default: int, low: int, high: int | None) -> int:
    try:
        value = int(text) if text not in (None, "") else default
    except ValueError:
        raise ValidationError(f"{name}={text!r} is not an integer", hint=f"Pass {name} as a whole number.",
                              docs=DOCS) from None
    if value < low or (high is not None and value > high):
        raise ValidationError(f"{name}={value} is out of range", hint=f"limit is 1-{MAX_LIMIT}; offset is 0 or more.",
                              docs=DOCS)
    return value


def filters(request: Request) -> dict[str, Any]:
    """The filters of `GET /api/list`, as `Engine.list` takes them: `status` (repeated: any of them),
    `workflow`, `key_prefix`, `since`, `until` (ISO 8601) and `without_patch`."""
    q = request.query_params
    statuses = q.getlist("status")
    for status in statuses:
        if status not in LIST_STATUSES:
            raise ValidationError(f"unknown status {status!r}", hint=f"Use one of: {', '.join(LIST_STATUSES)}.",
                                  docs=DOCS)
    return {"status": statuses or None, "workflow": q.get("workflow") or None,
            "key_prefix": q.get("key_prefix") or None, "since": _when(q.get("since"), "since"),
            "until": _when(q.get("until"), "until"), "without_patch": q.get("without_patch") or None}


def remote_routes(console: Console) -> list[Route]:
    """`GET /api/list` and `GET /api/notes` over the console's engine."""
    engine = console.engine

    async def list_runs(request: Request) -> Response:
        """A page of runs as `durably list --json` gives them (no `steps_done`: nothing but the catalog is
        read), with how many match in all (`count=1`), the notes and where the runs are kept."""
        refused = console.guard(request, mutating=False)
        if refused is not None:
            return refused
        try:
            chosen = filters(request)
            offset = _number(request.query_params.get("offset"), "offset", 0, 0, None)
            limit = _number(request.query_params.get("limit"), "limit", MAX_LIMIT, 1, MAX_LIMIT)
            states = await console.read(lambda: engine.list(**chosen, offset=offset, limit=limit))
            count = None
            if request.query_params.get("count") == "1":
                count = await console.read(lambda: engine.count(**chosen))
            notes = await console.read(lambda: _notes([(s.run_id, s.workflow, s.status) for s in states]))
        except DurablyError as exc:
            return _refusal(exc)
        return Json({"runs": [s.to_dict() for s in states], "count": count, "notes": notes,
                     "where": engine.runs.where()})

    async def _notes(runs: list[tuple[str, str, str]]) -> list[str]:
        return unserved_notes(engine.storage, runs, time.time())

    async def notes(request: Request) -> Response:
        """`GET /api/notes?run=ID&run=...`: the notes `durably inspect` prints about these runs."""
        refused = console.guard(request, mutating=False)
        if refused is not None:
            return refused

        async def read() -> list[str]:
            found = [await engine.inspect(run) for run in request.query_params.getlist("run")]
            return await _notes([(s.run_id, s.workflow, s.status) for s in found])
        try:
            return Json(await console.read(read))
        except DurablyError as exc:
            return _refusal(exc)

    return [Route("/api/list", list_runs), Route("/api/notes", notes)]
