"""A client of a remote console's JSON API (`durably ui`): list, inspect and operate the runs of a store
from another machine, over HTTP, with the console's token.

```python
from durably_py.client import Client

client = Client("http://build-7:8765/", token="...")       # or $DURABLY_UI_TOKEN
for state in client.list(status="failed"):
    print(state.run_id, state.error)
client.signal("order-17", "approval", {"ok": True})
print(client.retry("order-17"))                             # the run's result, once it ended
```

Every method mirrors the `Engine` method of the same name and returns the same public types (`RunState`,
`StepState`, `SignalSent`, `Span`), decoded from the JSON the console sends. A refusal raises the same
`DurablyError` subclass the engine raised in the console (rebuilt from the answer's `error` type name, message,
hint and docs): `RunNotFoundError` for an unknown run, `ValidationError` for a bad value, and so on. A console
that cannot be reached is a `RemoteError`; a missing or wrong token a `RemoteAuthError`. Only the standard
library speaks HTTP here (`urllib.request`). See docs/ui.md#python-client.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec

from . import errors
from ._state.history import RunState, SignalSent
from ._state.timeline import Span
from .errors import (
    DurablyError,
    RemoteAuthError,
    RemoteError,
    RunCancelledError,
    RunParkedError,
    ValidationError,
    WorkflowFailedError,
)

PAGE = 1000  # runs per request of a listing (the console's most)
ENDED = ("completed", "failed", "cancelled")
PARKED = ("waiting", "sleeping", "paused")
HALTED = ("needs_attention", "stale", "corrupt")  # a run no process continues until someone acts on it
DOCS = "docs/ui.md#python-client"


class _Missing:
    """The default of `resolve_effect(value=)`: no value given (None is a value an operator may record)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


@dataclass
class Listing:
    """One page of `Client.list_page`: the runs, how many match in all (when asked), the console's notes about
    due runs no live worker serves, and where the console keeps its runs."""

    runs: list[RunState]
    count: int | None = None
    notes: list[str] = field(default_factory=list)
    where: str = ""


def _path_text(path: Any) -> Any:
    """A step path as the API takes it: "2.0.1" for a tuple or list of ints, anything else as given."""
    if isinstance(path, tuple | list) and all(isinstance(i, int) for i in path):
        return ".".join(map(str, path))
    return path


def decode_state(data: dict[str, Any]) -> RunState:
    """A `RunState` from its JSON (`RunState.to_dict`), decoded with msgspec; the numbers of `budget`, `spent`
    and each step's `ms` kept as sent (an int stays an int), so it prints as the engine's own."""
    state = msgspec.convert(data, RunState)
    state.budget, state.spent = data.get("budget"), data.get("spent") or {}
    for step, raw in zip(state.steps, data.get("steps") or [], strict=False):
        step.ms = raw.get("ms")
    return state


def rebuild_error(status: int, body: Any, url: str) -> DurablyError:
    """The `DurablyError` an API error answer describes: the class its `error` names (a `durably_py.errors`
    class), else one that fits the HTTP status, carrying the answer's message, hint and docs."""
    if not isinstance(body, dict) or not isinstance(body.get("message"), str):
        return RemoteError(f"{url} answered HTTP {status} without an error this client understands",
                           hint="Check that the URL is a `durably ui` console (its address as `durably ui` "
                                "printed it, without a path).", docs=DOCS, url=url)
    name = body.get("error")
    cls: Any = getattr(errors, name, None) if isinstance(name, str) else None
    if status in (401, 403):
        return RemoteAuthError(f"the console at {url} refused the request ({status}): {body['message']}",
                               docs=body.get("docs") or None, url=url)
    elif not (isinstance(cls, type) and issubclass(cls, DurablyError)):
        cls = {400: ValidationError, 413: ValidationError, 409: DurablyError}.get(status)
        if cls is None:  # not an error of the engine's: a route this console lacks, a timeout, a crash
            return RemoteError(f"the console at {url} answered HTTP {status}: {body['message']}",
                               hint=body.get("hint") or "Check the URL, and that the console runs this version of "
                                                        "durably-py.", docs=body.get("docs") or DOCS, url=url)
    exc = cls.__new__(cls)  # past any __init__ of its own: the answer carries the message, hint and docs
    DurablyError.__init__(exc, body["message"], hint=body.get("hint") or None, docs=body.get("docs") or None,
                          url=url)
    return exc


class Client:
    """The runs of a remote console (`durably ui`) at `url`, through its JSON API.

    `token` is the console's token (default `$DURABLY_UI_TOKEN`; a URL as `durably ui` prints it, with
    `?token=...`, also gives it). `timeout` bounds each HTTP request in seconds."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 60.0) -> None:
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValidationError(f"{url!r} is not a console URL", hint="Give the URL `durably ui` printed, e.g. "
                                  "http://127.0.0.1:8765/.", docs=DOCS)
        given = urllib.parse.parse_qs(parts.query).get("token")
        self.url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
        self.token = token or (given[0] if given else None) or os.environ.get("DURABLY_UI_TOKEN") or None
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # ---- HTTP ----------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                query: Iterable[tuple[str, Any]] = (), *, timeout: float | None = None) -> Any:
        """One API request; its JSON answer, or the `DurablyError` an error answer describes raised."""
        pairs = [(name, value) for name, value in query if value is not None]
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(pairs)}" if pairs else "")
        headers = {"Accept": "application/json"}
        data = None
        if method == "POST":
            headers["Content-Type"] = "application/json"
            data = msgspec.json.encode(body or {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RemoteError(f"cannot reach the console at {self.url}: {reason}", url=self.url, docs=DOCS) from None
        try:
            answer = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            answer = None
        if status >= 400:
            raise rebuild_error(status, answer, self.url)
        if answer is None and raw:
            raise rebuild_error(status, answer, self.url)
        return answer

    def _get(self, path: str, query: Iterable[tuple[str, Any]] = ()) -> Any:
        return self.request("GET", path, query=query)

    def operate(self, run: str, op: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        """`POST /api/runs/{run}/{op}` with `body`: an operation's JSON answer."""
        return self.request("POST", f"/api/runs/{urllib.parse.quote(run, safe='')}/{op}", body, timeout=timeout)

    @staticmethod
    def _run(run: str) -> str:
        return f"/api/runs/{urllib.parse.quote(run, safe='')}"

    # ---- reads ---------------------------------------------------------------------------------------
    def list_page(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                  key_prefix: str | None = None, since: datetime | None = None, until: datetime | None = None,
                  without_patch: str | None = None, offset: int = 0, limit: int = PAGE,
                  count: bool = False) -> Listing:
        """One page of runs, newest activity first (`limit` at most 1000), as `Engine.list` gives them; with
        `count`, how many runs match in all."""
        statuses = [status] if isinstance(status, str) else list(status or [])
        query: list[tuple[str, Any]] = [("status", s) for s in statuses]
        query += [("workflow", workflow), ("key_prefix", key_prefix), ("without_patch", without_patch),
                  ("since", since.isoformat() if since else None), ("until", until.isoformat() if until else None),
                  ("offset", offset), ("limit", limit), ("count", "1" if count else None)]
        answer = self._get("/api/list", query)
        return Listing(runs=[decode_state(row) for row in answer["runs"]], count=answer.get("count"),
                       notes=answer.get("notes") or [], where=answer.get("where") or "")

    def list(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
             key_prefix: str | None = None, since: datetime | None = None, until: datetime | None = None,
             without_patch: str | None = None, offset: int = 0, limit: int | None = None) -> builtins.list[RunState]:
        """Runs newest activity first, filtered as `Engine.list` filters them; all that match when `limit` is
        None (read a page of 1000 at a time)."""
        found: builtins.list[RunState] = []
        while limit is None or len(found) < limit:
            want = PAGE if limit is None else min(PAGE, limit - len(found))
            page = self.list_page(status=status, workflow=workflow, key_prefix=key_prefix, since=since, until=until,
                                  without_patch=without_patch, offset=offset + len(found), limit=want).runs
            found += page
            if len(page) < want:
                break
        return found

    def count(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
              key_prefix: str | None = None, since: datetime | None = None, until: datetime | None = None,
              without_patch: str | None = None) -> int:
        """How many runs `list` gives for the same filters."""
        page = self.list_page(status=status, workflow=workflow, key_prefix=key_prefix, since=since, until=until,
                              without_patch=without_patch, limit=1, count=True)
        return page.count or 0

    def inspect(self, run: str) -> RunState:
        """A run (by id or key) with its steps, as `Engine.inspect` gives it."""
        return decode_state(self._get(self._run(run)))

    def timeline(self, run: str) -> builtins.list[Span]:
        """Where a run's time went (`Engine.timeline`): every attempt, backoff, sleep and wait as a `Span`."""
        return [msgspec.convert(span, Span) for span in self._get(f"{self._run(run)}/timeline")]

    def log(self, run: str) -> dict[str, Any]:
        """A run's log as `durably logs` prints it: {"records": N, "lines": [{"t", "text"}]} (its last 2,000
        records), then its unread signals."""
        answer: dict[str, Any] = self._get(f"{self._run(run)}/log")
        return answer

    def notes(self, runs: Iterable[str]) -> builtins.list[str]:
        """What the console says of these runs (by id) when they are due and no live worker serves their workflow."""
        notes: builtins.list[str] = self._get("/api/notes", [("run", run) for run in runs])
        return notes

    # ---- operations ----------------------------------------------------------------------------------
    def signal(self, run: str, name: str, payload: Any = None, *, strict: bool = False) -> SignalSent:
        """Deliver signal `name` to a run (`Engine.signal`); `strict` refuses one its waits do not wait for."""
        answer = self.operate(run, "signal", {"name": name, "payload": payload, "strict": strict})
        return SignalSent(run_id=answer["run_id"], name=name, status=answer["status"], awaited=answer["awaited"],
                          held=answer["held"])

    def cancel(self, run: str, *, timeout: float = 10.0, compensate: bool = False,
               cleanup: float | None = None) -> RunState:
        """Cancel a run (`Engine.cancel`) and return its state once it ended, or once `timeout` (at most 300 s)
        passed."""
        answer = self.operate(run, "cancel", {"timeout": timeout, "compensate": compensate, "cleanup": cleanup},
                            timeout=self.timeout + timeout)
        return self.inspect(answer["run_id"])

    def pause(self, run: str, *, timeout: float = 10.0) -> RunState:
        """Pause a run (`Engine.pause`); its state once paused, or once `timeout` passed."""
        answer = self.operate(run, "pause", {"timeout": timeout}, timeout=self.timeout + timeout)
        return self.inspect(answer["run_id"])

    def resume(self, run: str, *, timeout: float = 10.0) -> RunState:
        """Resume a paused run (`Engine.resume`)."""
        answer = self.operate(run, "resume", {"timeout": timeout}, timeout=self.timeout + timeout)
        return self.inspect(answer["run_id"])

    def start_retry(self, run: str, *, from_step: Any = None) -> str:
        """Start a retry in the console's process (`Engine.retry`): the run's id once it runs again."""
        answer = self.operate(run, "retry", {"from_step": _path_text(from_step)})
        run_id: str = answer["run_id"]
        return run_id

    def retry(self, run: str, *, from_step: Any = None, wait: bool = True, poll: float = 0.25) -> Any:
        """Resume a failed or interrupted run in the console's process (`Engine.retry`; `from_step` a path
        ``(2, 0, 1)``, "2.0.1" or a label) and return its value once it completed; a run that fails raises
        `WorkflowFailedError` with its error; `wait=False` raises `RunParkedError` as soon as it parks."""
        before = self.inspect(run)
        run_id = self.start_retry(before.run_id, from_step=from_step)
        return outcome_of(self.settled(run_id, wait=wait, poll=poll, after=before.attempt))

    @staticmethod
    def resolve_body(path: Any, *, value: Any = MISSING, rerun: bool = False,
                     fail: str | bool | None = None) -> dict[str, Any]:
        """The body of `POST /api/runs/{run}/resolve` for a decision about the cut-off step at `path`."""
        body: dict[str, Any] = {"path": _path_text(path), "rerun": rerun, "fail": fail}
        if value is not MISSING:
            body["value"] = value
        return body

    def plan_resolve(self, run: str, path: Any, *, value: Any = MISSING, rerun: bool = False,
                     fail: str | bool | None = None) -> dict[str, Any]:
        """What `resolve_effect` would record, checked by the console as it checks it (a refusal raises) and
        nothing written: {"run_id", "path", "label", "decision", "input", "error"}."""
        body = self.resolve_body(path, value=value, rerun=rerun, fail=fail)
        answer: dict[str, Any] = self.operate(run, "resolve", {**body, "dry_run": True})
        return answer

    def start_resolve(self, run: str, path: Any, *, value: Any = MISSING, rerun: bool = False,
                      fail: str | bool | None = None, here: bool = True) -> dict[str, Any]:
        """Record a decision about a cut-off step (`Engine.resolve_effect`) and continue the run in the
        console's process (or, `here=False`, leave it due for a worker): the API's answer."""
        body = self.resolve_body(path, value=value, rerun=rerun, fail=fail)
        answer: dict[str, Any] = self.operate(run, "resolve", {**body, "for_worker": not here})
        return answer

    def resolve_effect(self, run: str, path: Any, *, value: Any = MISSING, rerun: bool = False,
                       fail: str | bool | None = None, here: bool = True, wait: bool = True,
                       poll: float = 0.25) -> Any:
        """Decide about the cut-off unsafe step at `path` of a run that needs attention, as
        `Engine.resolve_effect` does: `value=` (its verified result), `rerun=True` or `fail=` (True or a
        message). The run continues in the console's process and its value is returned as `retry` does;
        `here=False` leaves it due for a worker and returns its `RunState`."""
        before = self.inspect(run)
        answer = self.start_resolve(before.run_id, path, value=value, rerun=rerun, fail=fail, here=here)
        if not here:
            return self.inspect(answer["run_id"])
        return outcome_of(self.settled(answer["run_id"], wait=wait, poll=poll, after=before.attempt))

    # ---- waiting ---------------------------------------------------------------------------------------
    def settled(self, run: str, *, wait: bool = True, poll: float = 0.25, timeout: float | None = None,
                after: int | None = None) -> RunState:
        """The run's state once it ended (or, without `wait`, parked), or stopped where no process continues
        it (needs_attention, stale, or interrupted for a few seconds), or once `timeout` seconds passed.
        `after`: a workflow attempt the run had before an operation continued it; its state is looked at once a
        later attempt began (within 30 s)."""
        began = time.monotonic()
        while True:
            state = self.inspect(run)
            if after is not None and state.attempt <= after and time.monotonic() - began < 30:
                time.sleep(poll)  # the console has not started its attempt yet: the state is the old one
                continue
            if state.status in ENDED or state.status in HALTED or (not wait and state.status in PARKED):
                return state
            if state.status == "interrupted" and time.monotonic() - began > 3:
                return state  # no process runs it: the console's process stopped running it
            if timeout is not None and time.monotonic() - began > timeout:
                return state
            time.sleep(poll)

    def result(self, run: str, *, wait: bool = True, poll: float = 0.25) -> Any:
        """A run's value once it completed (see `settled`); its failure as `WorkflowFailedError`, a park (without
        `wait`) as `RunParkedError`, a run left unfinished as a `DurablyError` naming its status."""
        return outcome_of(self.settled(run, wait=wait, poll=poll))

    # ---- async -----------------------------------------------------------------------------------------
    async def alist(self, **filters: Any) -> builtins.list[RunState]:
        """`list` without blocking the event loop (on a worker thread)."""
        return await asyncio.to_thread(lambda: self.list(**filters))

    async def ainspect(self, run: str) -> RunState:
        """`inspect` without blocking the event loop."""
        return await asyncio.to_thread(self.inspect, run)

    async def asignal(self, run: str, name: str, payload: Any = None, *, strict: bool = False) -> SignalSent:
        """`signal` without blocking the event loop."""
        return await asyncio.to_thread(lambda: self.signal(run, name, payload, strict=strict))

    async def acancel(self, run: str, **options: Any) -> RunState:
        """`cancel` without blocking the event loop."""
        return await asyncio.to_thread(lambda: self.cancel(run, **options))

    async def aresume(self, run: str) -> RunState:
        """`resume` without blocking the event loop."""
        return await asyncio.to_thread(self.resume, run)

    async def aretry(self, run: str, **options: Any) -> Any:
        """`retry` without blocking the event loop."""
        return await asyncio.to_thread(lambda: self.retry(run, **options))

    async def aresolve_effect(self, run: str, path: Any, **options: Any) -> Any:
        """`resolve_effect` without blocking the event loop."""
        return await asyncio.to_thread(lambda: self.resolve_effect(run, path, **options))


def outcome_of(state: RunState) -> Any:
    """A settled run's value, or the error that says why it has none (see `Client.result`)."""
    if state.status == "completed":
        return state.result
    if state.status == "failed":
        error = state.error or {}
        kind = str(error.get("type") or "Exception").rpartition(":")[2].rpartition(".")[2]
        raise WorkflowFailedError(f"{kind}: {error.get('message', '')}", run_id=state.run_id, type_name=kind,
                                  hint=f"`durably inspect {state.run_id}` shows the failed step.")
    if state.status == "cancelled":
        raise RunCancelledError(f"run {state.run_id} was cancelled", run_id=state.run_id)
    if state.status in PARKED:
        raise RunParkedError(f"run {state.run_id} is {state.status}", run_id=state.run_id, status=state.status)
    raise DurablyError(f"run {state.run_id} is {state.status}", run_id=state.run_id, status=state.status,
                       hint=f"`durably inspect {state.run_id}` shows where it stopped.")


__all__ = ["MISSING", "Client", "Listing", "decode_state", "outcome_of", "rebuild_error"]
