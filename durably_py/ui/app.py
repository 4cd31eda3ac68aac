"""The console's Starlette application: pages, the JSON API, live event streams, and request guards.

Every route is a thin shell over the public `Engine` API; its JSON has the shapes `durably ... --json`
prints. Blocking storage reads run on worker threads so one slow listing never stalls a live stream.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import time
import webbrowser
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio.to_thread
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .._engine.engine import Engine
from .._state.history import RunState, SignalSent
from .._view.live import is_step
from .._view.logtext import record_text
from ..errors import DurablyError, RunNotFoundError, ValidationError
from ..records import kind_of
from . import forms

STATIC = Path(__file__).parent / "static"
COOKIE = "durably_ui_token"
STATUSES = ("running", "waiting", "sleeping", "paused", "interrupted", "completed", "failed", "cancelled", "pending",
            "stale", "needs_attention", "over_budget")
MAX_LIMIT = 1000
STEPS_CACHE = 20_000  # runs whose completed-step count is remembered
MAX_CHILDREN = 200  # child runs whose status a run page shows
FIRST_STEPS = 300  # a big run page paints from its first steps while the rest is read and sent
MAX_BODY = 1_048_576
"""Bytes a POST body (and so a signal's payload) may take; a longer one is refused with 413 as it arrives."""
LOG_LINES = 2000  # the log panel shows a run's last this many records


# ---- JSON ----------------------------------------------------------------------------------------

def _default(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return repr(value)


_encoder = msgspec.json.Encoder(enc_hook=_default)


class Json(JSONResponse):
    """JSON as the CLI's --json gives it (datetimes as ISO 8601, anything unknown as its repr), encoded fast."""

    def render(self, content: Any) -> bytes:
        return _encoder.encode(content)


def _dumps(value: Any) -> str:
    return _encoder.encode(value).decode()


def error_body(exc: BaseException) -> dict[str, Any]:
    """An error as the console shows it: type, message, and (for a `DurablyError`) hint and docs."""
    if isinstance(exc, DurablyError):
        return {"error": type(exc).__name__, "message": exc.message, "hint": exc.hint, "docs": exc.docs}
    return {"error": type(exc).__name__, "message": str(exc), "hint": None, "docs": None}


class BodyTooLarge(ValidationError):
    """A POST body longer than `MAX_BODY` bytes (answered with 413)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the request body has {'more than ' if size > MAX_BODY else ''}{size:,} bytes; this "
                         f"console takes at most {MAX_BODY:,}", hint="Send a smaller body: a signal's payload "
                         "travels in it, so keep payloads small and put big data where the workflow can read it.",
                         docs="docs/ui.md#json-api")


def _error(exc: BaseException) -> Json:
    status = 413 if isinstance(exc, BodyTooLarge) else 404 if isinstance(exc, RunNotFoundError) else \
        400 if isinstance(exc, ValidationError) else 403 if isinstance(exc, PermissionError) else 409 if isinstance(exc, DurablyError) else 500
    return Json(error_body(exc), status_code=status)


def _refused(exc: DurablyError) -> Json:
    """`_error`, with the field and path a value's refusal names (a form marks that field)."""
    extra = {key: exc.details[key] for key in ("field", "path") if key in exc.details}
    return Json({**error_body(exc), **extra}, status_code=_error(exc).status_code)


def _refuse(status: int, message: str, hint: str) -> Json:
    return Json({"error": "Forbidden" if status == 403 else "Unauthorized", "message": message, "hint": hint,
                 "docs": "docs/ui.md#security"}, status_code=status)


# ---- the application -------------------------------------------------------------------------------

class Console:
    """The routes of one console over one engine."""

    def __init__(self, engine: Engine, token: str | None, loopback: bool, poll: float) -> None:
        self.engine = engine
        self.token = token
        self.loopback = loopback
        self.poll = poll
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stopping: Callable[[], bool] = lambda: False  # the server sets it: streams end when it stops
        self.steps_done: dict[str, tuple[datetime | None, int | None]] = {}

    # ---- reads on worker threads -------------------------------------------------------------
    async def read(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run a read-only engine call on a worker thread (its storage reads block)."""
        return await anyio.to_thread.run_sync(lambda: asyncio.run(call()))  # type: ignore[arg-type]

    async def first_look(self, run: str) -> tuple[RunState, dict[str, Any] | None]:
        """The run, and for a run of more than `FIRST_STEPS` steps a partial snapshot a page paints at once:
        the run's header, its first steps and every step that is not done, no timeline yet."""
        state: RunState = await self.read(lambda: self.engine.inspect(run))
        if len(state.steps) <= FIRST_STEPS:
            return state, None
        shown = state.steps[:FIRST_STEPS] + [s for s in state.steps[FIRST_STEPS:] if s.status != "ok"][:FIRST_STEPS]
        head = replace(state, steps=shown).to_dict()
        partial = {"steps": len(state.steps), "done": sum(s.status == "ok" for s in state.steps)}
        return state, {"run": head, "timeline": [], "graphs": [], "children": [], "now": time.time(),
                       "partial": partial}

    async def snapshot(self, run: str, known: RunState | None = None) -> dict[str, Any]:
        """The run, its timeline and its graphs, as one JSON-ready object (`known`: the run, already read)."""
        async def gather() -> dict[str, Any]:
            state = known if known is not None else await self.engine.inspect(run)
            spans = await self.engine.timeline(state.run_id)
            graphs = await self.engine.graph(state.run_id)
            children = []
            for child in state.children[:MAX_CHILDREN]:
                try:
                    found = await self.engine.inspect(child)
                except DurablyError:
                    continue
                children.append({"run_id": child, "workflow": found.workflow, "status": found.status,
                                 "created_at": found.created_at, "updated_at": found.updated_at})
            return {"run": state.to_dict(), "timeline": [s.to_dict() for s in spans],
                    "graphs": [g.to_dict() for g in graphs], "children": children, "now": time.time()}
        return await self.read(gather)

    # ---- guards ----------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        if self.token is None:
            return True
        given = request.headers.get("authorization", "")
        if given.startswith("Bearer ") and secrets.compare_digest(given[7:].strip(), self.token):
            return True
        cookie = request.cookies.get(COOKIE)
        return cookie is not None and secrets.compare_digest(cookie, self.token)

    def _host_ok(self, request: Request) -> bool:
        """A loopback console answers only requests naming it by a local name (so a page of another site
        whose name resolves to 127.0.0.1 cannot reach it): localhost or any loopback address; Starlette's
        test client's `testserver` only under the test client itself."""
        if not self.loopback:
            return True
        host = request.headers.get("host", "")
        name = host[: host.index("]") + 1] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
        if name == "testserver":
            return (request.scope.get("client") or ("",))[0] == "testclient"
        return is_loopback(name)

    def guard(self, request: Request, mutating: bool) -> Response | None:
        """A refusal for a request that may not proceed, else None."""
        if not self._host_ok(request):
            return _refuse(403, f"host {request.headers.get('host')!r} is not this console's address",
                           "Open the console at http://127.0.0.1:PORT/ as `durably ui` printed it.")
        if not mutating:
            if not self._authorized(request):
                return _refuse(401, "this console requires its token",
                               "Open the URL with ?token= that `durably ui` printed, or send "
                               "`Authorization: Bearer TOKEN` (the token is $DURABLY_UI_TOKEN when set).")
            return None
        site = request.headers.get("sec-fetch-site")
        if site is not None and site != "same-origin":
            return _refuse(403, f"cross-site request refused (Sec-Fetch-Site: {site})",
                           "Operate runs from the console's own pages, or from a client that sends no Origin.")
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.headers.get('host', '')}":
            return _refuse(403, f"request from origin {origin!r} refused",
                           "Operate runs from the console's own pages, or from a client that sends no Origin.")
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return _refuse(403, "operations must be sent as application/json",
                           "Send a JSON body (at least {}) with Content-Type: application/json.")
        if self.token is not None:
            given = request.headers.get("authorization", "")
            if not (given.startswith("Bearer ") and secrets.compare_digest(given[7:].strip(), self.token)):
                return _refuse(401, "operations on this console require its token",
                               "Send `Authorization: Bearer TOKEN` (the console's pages do so themselves).")
        return None

    # ---- pages -----------------------------------------------------------------------------------
    async def page(self, request: Request) -> Response:
        refused = self.guard(request, mutating=False)
        given = request.query_params.get("token")
        if given is not None and self.token is not None and secrets.compare_digest(given, self.token):
            response: Response = RedirectResponse(request.url.path, status_code=303)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return response
        if refused is not None:
            if refused.status_code == 401:
                return HTMLResponse("<!doctype html><title>durably</title><p>This console requires its token: open "
                                    "the URL with <code>?token=</code> that <code>durably ui</code> printed.</p>",
                                    status_code=401)
            return refused
        html = (STATIC / "index.html").read_text(encoding="utf-8")
        token = self.token if self.token is not None else ""
        return HTMLResponse(html.replace("{{TOKEN}}", token), headers={
            "Cache-Control": "no-store",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                       "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    # ---- reads -----------------------------------------------------------------------------------
    def _filters(self, request: Request) -> dict[str, Any]:
        q = request.query_params
        status = q.get("status") or None
        if status is not None and status not in STATUSES:
            raise ValidationError(f"unknown status {status!r}", hint=f"Use one of: {', '.join(STATUSES)}.",
                                  docs="docs/ui.md#json-api")
        out: dict[str, Any] = {"status": status, "workflow": q.get("workflow") or None, "key": q.get("key") or None,
                               "search": q.get("q") or None}
        for name in ("since", "until"):
            text = q.get(name)
            if text:
                try:
                    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
                except ValueError:
                    raise ValidationError(f"{name}={text!r} is not an ISO 8601 time",
                                          hint="Write times like 2026-05-01T12:00:00Z.",
                                          docs="docs/ui.md#json-api") from None
                if when.tzinfo is None:
                    when = when.astimezone()
                out[name] = when
        for name, default, low in (("limit", 50, 1), ("offset", 0, 0)):
            text = q.get(name)
            try:
                value = int(text) if text not in (None, "") else default
            except ValueError:
                raise ValidationError(f"{name}={text!r} is not an integer", hint=f"Pass {name} as a whole number.",
                                      docs="docs/ui.md#json-api") from None
            if value < low or (name == "limit" and value > MAX_LIMIT):
                raise ValidationError(f"{name}={value} is out of range",
                                      hint=f"limit is 1-{MAX_LIMIT}; offset is 0 or more.",
                                      docs="docs/ui.md#json-api")
            out[name] = value
        return out

    async def _steps_done(self, run_id: str, updated: datetime | None) -> int | None:
        """A run's completed steps, read once per change of its log (a live runs page re-reads only what moved)."""
        cached = self.steps_done.get(run_id)
        if cached is not None and cached[0] == updated:
            return cached[1]
        try:
            done: int | None = sum(s.status == "ok" and is_step(s.label) for s in (await self.engine.inspect(run_id)).steps)
        except DurablyError:
            done = None
        if len(self.steps_done) >= STEPS_CACHE:
            self.steps_done.clear()
        self.steps_done[run_id] = (updated, done)
        return done

    async def _runs(self, filters: dict[str, Any]) -> list[dict[str, Any]]:
        """One page of runs as `durably list --json` gives them, plus each run's completed steps."""
        async def page() -> list[dict[str, Any]]:
            out = []
            for state in await self.engine.list(**filters):
                row = state.to_dict()
                row["steps_done"] = await self._steps_done(state.run_id, state.updated_at)
                out.append(row)
            return out
        return await self.read(page)

    async def runs(self, request: Request) -> Response:
        refused = self.guard(request, mutating=False)
        if refused is not None:
            return refused
        try:
            return Json(await self._runs(self._filters(request)))
        except DurablyError as exc:
            return _error(exc)

    async def queues(self, request: Request) -> Response:
        """Every named queue as `durably queues --json` gives it."""
        refused = self.guard(request, mutating=False)
        if refused is not None:
            return refused
        try:
            return Json([info.to_dict() for info in await self.read(self.engine.queues)])
        except DurablyError as exc:
            return _error(exc)

    async def count(self, request: Request) -> Response:
        """How many runs match the filters of `/api/runs` (limit and offset aside), from the run catalog."""
        refused = self.guard(request, mutating=False)
        if refused is not None:
            return refused
        try:
            filters = self._filters(request)
            del filters["limit"], filters["offset"]
            return Json({"count": await self.read(lambda: self.engine.count(**filters))})
        except DurablyError as exc:
            return _error(exc)

    async def run(self, request: Request) -> Response:
        return await self._read_one(request, lambda run: self.engine.inspect(run), lambda s: s.to_dict())

    async def timeline(self, request: Request) -> Response:
        return await self._read_one(request, lambda run: self.engine.timeline(run),
                                    lambda spans: [s.to_dict() for s in spans])

    async def graph(self, request: Request) -> Response:
        return await self._read_one(request, lambda run: self.engine.graph(run), lambda gs: [g.to_dict() for g in gs])

    async def log(self, request: Request) -> Response:
        """The run's log as `durably logs` prints it (the last `LOG_LINES` records), then its unread signals."""
        async def lines(run: str) -> dict[str, Any]:
            records = await self.engine.records(run)
            unread = self.engine.runs.unread(self.engine.resolve(run))
            shown = [*records[-LOG_LINES:], *({"t": "signal", **m} for m in unread)]
            return {"records": len(records), "lines": [{"t": kind_of(rec), "text": record_text(rec)} for rec in shown]}
        return await self._read_one(request, lines, lambda found: found)

    async def _read_one(self, request: Request, call: Callable[[str], Awaitable[Any]],
                        shape: Callable[[Any], Any]) -> Response:
        refused = self.guard(request, mutating=False)
        if refused is not None:
            return refused
        run = request.path_params["run"]
        try:
            return Json(shape(await self.read(lambda: call(run))))
        except DurablyError as exc:
            return _error(exc)

    # ---- live streams ----------------------------------------------------------------------------
    def _stream(self, source: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(source, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def run_events(self, request: Request) -> Response:
        refused = self.guard(request, mutating=False)
        if refused is not None:
            return refused
        run = request.path_params["run"]

        def mark() -> Any:
            info = self.engine.storage.info(run_id)
            return None if info is None else (info.updated_at, _dumps(info.last), info.held, info.epoch)

        try:
            run_id = await anyio.to_thread.run_sync(lambda: self.engine.resolve(run))
            seen = await anyio.to_thread.run_sync(mark)  # before the first read: no change slips between
            state, partial = await self.first_look(run_id)
        except DurablyError as exc:
            return _error(exc)

        async def events() -> AsyncIterator[str]:
            nonlocal seen
            if partial is not None:
                yield f"event: state\ndata: {_dumps(partial)}\n\n"
            try:
                yield f"event: state\ndata: {_dumps(await self.snapshot(run_id, state))}\n\n"
            except DurablyError as exc:
                yield f"event: failure\ndata: {_dumps(error_body(exc))}\n\n"
                return
            quiet = time.monotonic()
            while not await request.is_disconnected() and not self.stopping():
                await asyncio.sleep(self.poll)
                now = await anyio.to_thread.run_sync(mark)
                if now != seen:
                    seen = now
                    try:
                        yield f"event: state\ndata: {_dumps(await self.snapshot(run_id))}\n\n"
                    except DurablyError as exc:
                        yield f"event: failure\ndata: {_dumps(error_body(exc))}\n\n"
                    quiet = time.monotonic()
                elif time.monotonic() - quiet > 15:
                    yield ": keep-alive\n\n"
                    quiet = time.monotonic()
        return self._stream(events())

    async def step_stream(self, request: Request) -> Response:
        """The chunks of a streamed step as server-sent `chunk` events (id: the chunk's offset, so a reconnecting
        browser resumes after the last one it got; `?offset=N` starts there), then `end` when the step completed,
        failed or its run ended (`Engine.stream`)."""
        refused = self.guard(request, mutating=False)
        if refused is not None:
            return refused
        try:
            last = request.headers.get("last-event-id")
            offset = int(last) + 1 if last and last.isdigit() else int(request.query_params.get("offset", "0"))
        except ValueError:
            return _refuse(400, "offset must be an integer", "Ask /api/runs/RUN/stream/PATH?offset=0.")
        try:
            run_id = await anyio.to_thread.run_sync(lambda: self.engine.resolve(request.path_params["run"]))
            chunks = self.engine.stream(run_id, request.path_params["path"], offset=offset, follow=True)
            first = await anext(chunks, _END)
        except DurablyError as exc:
            return _error(exc)

        async def events() -> AsyncIterator[str]:
            n, chunk = offset, first
            try:
                while chunk is not _END:
                    yield f"id: {n}\nevent: chunk\ndata: {_dumps(chunk)}\n\n"
                    n += 1
                    if await request.is_disconnected() or self.stopping():
                        return
                    chunk = await anext(chunks, _END)
                yield "event: end\ndata: {}\n\n"
            except DurablyError as exc:
                yield f"event: failure\ndata: {_dumps(error_body(exc))}\n\n"
            finally:
                await chunks.aclose()
        return self._stream(events())

    async def runs_events(self, request: Request) -> Response:
        refused = self.guard(request, mutating=False)
        if refused is not None:
            return refused
        try:
            filters = self._filters(request)
        except DurablyError as exc:
            return _error(exc)

        async def events() -> AsyncIterator[str]:
            seen = None
            while not await request.is_disconnected() and not self.stopping():
                began = time.monotonic()
                try:
                    page = await self._runs(filters)
                except DurablyError as exc:
                    yield f"event: failure\ndata: {_dumps(error_body(exc))}\n\n"
                    return
                took = time.monotonic() - began
                text = _dumps(page)
                if text != seen:
                    seen = text
                    yield f"event: runs\ndata: {text}\n\n"
                # A page is an indexed query plus its runs' ends: poll less often should that ever be slow.
                until = time.monotonic() + max(4 * self.poll, 4 * took)
                while time.monotonic() < until and not self.stopping():
                    await asyncio.sleep(self.poll)
        return self._stream(events())

    # ---- operations ------------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object, read as it arrives and refused (`BodyTooLarge`) once past `MAX_BODY`;
        anything that is not a JSON object a signal could carry (malformed, not UTF-8, nested past the
        decoder's depth, an integer of more than 64 bits) is a `ValidationError`."""
        body = await self._json(request, {})
        if not isinstance(body, dict):
            raise ValidationError("the request body must be a JSON object", hint="Send a JSON object, e.g. {}.",
                                  docs="docs/ui.md#json-api")
        return body

    async def _json(self, request: Request, empty: Any = None) -> Any:
        """The request's JSON value (an empty body: `empty`), read as `_body` reads it."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY:
            raise BodyTooLarge(int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise BodyTooLarge(size)
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            return empty
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ValidationError(f"the request body is not JSON this console takes: {why}",
                                  hint="Send a JSON object in UTF-8, e.g. {}, with integers of at most 64 bits.",
                                  docs="docs/ui.md#json-api") from None
        return body

    # ---- awakeables ------------------------------------------------------------------------------
    async def awakeable(self, request: Request) -> Response:
        """`POST /api/awakeables/{id}` with {"value": ...} or {"reject": "message"}: resolve or reject an awakeable
        (the console's token, as every operation)."""
        refused = self.guard(request, mutating=True)
        if refused is not None:
            return refused
        try:
            body = await self._body(request)
            awakeable = request.path_params["id"]
            if "reject" in body:
                done = await self.engine.reject_awakeable(awakeable, body["reject"])
            else:
                done = await self.engine.resolve_awakeable(awakeable, body.get("value"))
        except DurablyError as exc:
            return _refused(exc)
        return Json(done.to_dict())

    async def callback(self, request: Request) -> Response:
        """`POST /callbacks/{id}/{token}` (body: the value, any JSON) and `.../reject` (body: {"message": ...} or a
        JSON string): what an outside system calls with the URL the workflow handed out. The awakeable's own
        token authorizes it, not the console's: a wrong token is 403, an unknown awakeable 404, one resolved
        already or past its deadline 409, a value its schema refuses 400; none changes anything."""
        try:
            value = await self._json(request)
            awakeable, token = request.path_params["id"], request.path_params["token"]
            if request.url.path.endswith("/reject"):
                message = value.get("message") if isinstance(value, dict) else value
                done = await self.engine.reject_awakeable(awakeable, message, token=token)  # type: ignore[arg-type]
            else:
                done = await self.engine.resolve_awakeable(awakeable, value, token=token)
        except DurablyError as exc:
            return _refused(exc)
        return Json(done.to_dict())

    def _timeout(self, body: dict[str, Any]) -> float:
        value = body.get("timeout", 10)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 300:
            raise ValidationError(f"timeout must be a number of seconds from 0 to 300, got {value!r}",
                                  hint="Send e.g. {\"timeout\": 10}.", docs="docs/ui.md#json-api")
        return float(value)

    async def operate(self, request: Request) -> Response:
        refused = self.guard(request, mutating=True)
        if refused is not None:
            return refused
        run = request.path_params["run"]
        op = request.path_params["op"]
        try:
            body = await self._body(request)
            if op == "signal":
                name = body.get("name")
                payload = body.get("payload")
                sent = await self.engine.signal(run, name, payload, strict=body.get("strict") is True)  # type: ignore[arg-type]
                return Json({"run": run, "signal": name, "payload": payload, "sent": True, **sent_fields(sent)})
            if op == "cancel":
                state = await self.engine.cancel(run, timeout=self._timeout(body), **cancel_options(body))
                return Json({"run_id": state.run_id, "status": state.status, "cancelled": state.status == "cancelled"})
            if op == "pause":
                state = await self.engine.pause(run, timeout=self._timeout(body))
                return Json({"run_id": state.run_id, "status": state.status, "paused": state.status == "paused"})
            if op == "resume":
                state = await self.engine.resume(run, timeout=self._timeout(body))
                return Json({"run_id": state.run_id, "status": state.status, "resumed": state.status != "paused"})
            if op == "retry":
                selector = parse_selector(body.get("from_step"))
                return await self._start(lambda found: self.engine.retry(run, from_step=selector, on_run=found))
            if op == "restart":
                return await self._start(lambda found: self.engine.restart(run, on_run=found))
            if op == "resolve":
                return await self._resolve(run, body)
            if op == "submit":
                return await self._submit(run, body)
            if op == "budget":
                return await self._budget(run, body)
        except DurablyError as exc:
            return _error(exc)
        return Json({"error": "NotFound", "message": f"no operation {op!r}", "hint":
                     "Operations: signal, submit, cancel, pause, resume, retry, restart, resolve, budget.",
                     "docs": "docs/ui.md#json-api"}, status_code=404)

    async def _submit(self, run: str, body: dict[str, Any]) -> Response:
        """`POST /api/runs/{run}/submit` with {"name", "value"}: an approval form's value, checked against the
        open wait's recorded JSON Schema before it is sent as the signal (forms.py); a refusal names the field."""
        try:
            return Json(await forms.submit(self.engine, self.read, run, body))
        except DurablyError as exc:
            extra = {key: exc.details[key] for key in ("field", "path") if key in exc.details}
            return Json({**error_body(exc), **extra}, status_code=_error(exc).status_code)

    async def _resolve(self, run: str, body: dict[str, Any]) -> Response:
        """`POST /api/runs/{run}/resolve` with {"path", and one of "value", "rerun": true, "fail": true or a
        message}: record the decision about a cut-off unsafe step and continue the run in this process."""
        from .._engine.effects import MISSING

        value = body["value"] if "value" in body else MISSING
        rerun = body.get("rerun", False)
        fail = body.get("fail")
        path = body.get("path")
        if path is None:
            raise ValidationError("resolve needs the path of the cut-off step",
                                  hint='Send {"path": "1", "value": ...}, {"path": "1", "rerun": true} or '
                                       '{"path": "1", "fail": true}.', docs="docs/ui.md#json-api")
        if body.get("dry_run") is True:  # what would be recorded, checked; nothing written
            from .._engine.effects import plan

            return Json(await anyio.to_thread.run_sync(lambda: plan(self.engine.operations, run, path, value=value,
                                                                    rerun=rerun, fail=fail)))
        if body.get("for_worker") is True:  # record the decision, leave the run due for a worker
            state = await self.engine.resolve_effect(run, path, value=value, rerun=rerun, fail=fail, here=False)
            return Json({"run_id": state.run_id, "status": state.status, "resolved": True})
        return await self._start(lambda found: self.engine.resolve_effect(run, path, value=value, rerun=rerun,
                                                                          fail=fail, on_run=found))

    async def _budget(self, run: str, body: dict[str, Any]) -> Response:
        """`POST /api/runs/{run}/budget` with {"raise": {"usd": 5}} (by that much) or {"set": {"usd": 20}}: raise
        the budget the run spends (`Engine.raise_budget`); a run then due that no process holds continues in this
        server's process unless {"continue": false} (a worker would continue it too)."""
        how = "set" if "set" in body else "raise"
        amounts = body.get(how)
        if not isinstance(amounts, dict) or not amounts:
            raise ValidationError("budget needs the amounts to raise by (or set to)",
                                  hint='Send {"raise": {"usd": 5}} or {"set": {"tokens": 200000}}.',
                                  docs="docs/ui.md#json-api")
        unknown = [k for k in amounts if k not in ("usd", "tokens", "units")]
        if unknown:
            raise ValidationError(f"unknown budget kind {unknown[0]!r}", hint="Use usd, tokens or units.",
                                  docs="docs/policies.md#budgets")
        state = await self.engine.raise_budget(run, to=how == "set", timeout=self._timeout(body), **amounts)
        if body.get("continue", True) is not False and state.status == "interrupted" \
                and not self.engine.storage.held(state.run_id):
            return await self._start(lambda found: self.engine.retry(state.run_id, on_run=found))
        return Json({"run_id": state.run_id, "status": state.status, "budget": state.budget, "raised": True})

    async def _start(self, begin: Callable[[Callable[[str], None]], Awaitable[Any]]) -> Response:
        """Start a retry or restart in this server's process; answer once it runs (or failed to start)."""
        started: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def found(run_id: str) -> None:
            if not started.done():
                started.set_result(run_id)

        task = asyncio.ensure_future(begin(found))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        done, _ = await asyncio.wait({task, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task in done and not started.done():
            exc = task.exception()
            if exc is not None:
                return _error(exc)
        if not started.done():
            return Json({"error": "Timeout", "message": "the run did not start within 30 s", "hint":
                         "Look at the runs page: it may still start.", "docs": "docs/ui.md#operations"},
                        status_code=504)
        run_id = started.result()
        state = await self.read(lambda: self.engine.inspect(run_id))
        return Json({"run_id": run_id, "status": state.status, "started": True})


def parse_selector(value: Any) -> Any:
    """A `from_step` as the API takes it: a path list [3, 1, 0], a path text "3.1.0", a label, or null."""
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, str):
        text = value.strip()
        if text and all(part.isdigit() for part in text.split(".")):
            return tuple(int(part) for part in text.split("."))
        return text
    raise ValidationError(f"from_step must be a path (a list or \"3.1.0\") or a label, got {value!r}",
                          hint="Send {\"from_step\": \"2\"}, {\"from_step\": [3, 1, 0]} or {\"from_step\": \"fetch\"}.",
                          docs="docs/operations.md#retry-from-a-step")


def sent_fields(sent: SignalSent) -> dict[str, Any]:
    """What a signal's answer adds for remote clients: the run's id and status, its waits, and whether a process
    held it (`SignalSent`, as `durably signal --json` tells it)."""
    return {"run_id": sent.run_id, "status": sent.status, "awaited": sent.awaited, "held": sent.held}


def cancel_options(body: dict[str, Any]) -> dict[str, Any]:
    """`compensate` (a bool) and `cleanup` (seconds, or null) of a cancel request, checked."""
    compensate = body.get("compensate", False)
    cleanup = body.get("cleanup")
    if not isinstance(compensate, bool) or not (cleanup is None or (isinstance(cleanup, int | float) and
                                                                  not isinstance(cleanup, bool) and cleanup >= 0)):
        raise ValidationError(f"compensate must be true or false and cleanup a number of seconds, got "
                              f"{compensate!r} and {cleanup!r}", hint='Send e.g. {"compensate": true, "cleanup": 30}.',
                              docs="docs/ui.md#json-api")
    return {"compensate": compensate, "cleanup": cleanup}


_END = object()  # what `anext` gives once a stream has no more chunks


def build(engine: Engine, *, token: str | None, loopback: bool, poll: float) -> Starlette:
    """The Starlette application of a console over `engine`."""
    from .remote import remote_routes

    console = Console(engine, token, loopback, poll)
    routes = [
        Route("/", console.page),
        Route("/runs/{run:path}", console.page),
        Route("/queues", console.page),
        Route("/api/queues", console.queues),
        Route("/api/runs", console.runs),
        Route("/api/events", console.runs_events),
        Route("/api/count", console.count),
        Route("/api/runs/{run}", console.run),
        Route("/api/runs/{run}/timeline", console.timeline),
        Route("/api/runs/{run}/graph", console.graph),
        Route("/api/runs/{run}/log", console.log),
        *remote_routes(console),
        Route("/api/runs/{run}/events", console.run_events),
        Route("/api/runs/{run}/stream/{path}", console.step_stream),
        Route("/api/runs/{run}/{op}", console.operate, methods=["POST"]),
        Route("/api/awakeables/{id}", console.awakeable, methods=["POST"]),
        Route("/callbacks/{id}/{token}", console.callback, methods=["POST"]),
        Route("/callbacks/{id}/{token}/reject", console.callback, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes)
    app.state.console = console
    return app


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (the only binds that need no token)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one); a `ValidationError` when it cannot be had."""
    name = host.strip("[]")
    family = socket.AF_INET6 if ":" in name else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((name, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ValidationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                              hint="Another program (or another `durably ui`) may use that port: pick another "
                                   "with --port, or --port 0 for any free one.", docs="docs/ui.md") from None
    return sock


def run_server(engine: Engine, *, host: str, port: int, open_browser: bool, token: str | None,
               announce: Callable[[str], Any]) -> None:
    """Serve the console with uvicorn until interrupted; print (and optionally open) its URL."""
    import uvicorn

    loopback = is_loopback(host)
    if not loopback and token is None:
        token = secrets.token_urlsafe(24)
    app = build(engine, token=token, loopback=loopback, poll=0.25)
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    url = f"http://{shown}:{bound}/" + (f"?token={token}" if token else "")
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3, lifespan="off")
    server = uvicorn.Server(config)
    app.state.console.stopping = lambda: server.should_exit

    async def main() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            where = getattr(engine.storage, "dir", type(engine.storage).__name__)
            announce(f"durably ui: {url}  (storage: {where}; Ctrl-C stops)")
            if open_browser:
                webbrowser.open(url)
        await task

    asyncio.run(main())
