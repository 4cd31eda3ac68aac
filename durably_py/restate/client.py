"""Operate durably runs on Restate: start, wait, signal, list, inspect, cancel (ingress and admin/SQL APIs).

A run id is the Restate workflow key: the caller's `key=`, or `<workflow>-<digest of the input>`, so the
same workflow and input find the same run, as on files.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from typing import Any

from .._codec import decode, digest, dump_value, encode, load_error, load_value
from .._state.history import RunState, StepState
from ..errors import AwakeableNotFoundError, DurablyError, RunNotFoundError, RunParkedError, ValidationError

PREFIX = "durably."
DOCS = "docs/restate.md"
_PARKED_COMMANDS = ("Sleep", "GetPromise")


def endpoints(ingress: str | None, admin: str | None) -> tuple[str, str]:
    """The ingress and admin URLs from the arguments, else DURABLY_RESTATE / DURABLY_RESTATE_ADMIN."""
    ingress = ingress or os.environ.get("DURABLY_RESTATE")
    if not ingress:
        raise ValidationError("no Restate ingress URL", hint="Pass --restate URL or set DURABLY_RESTATE.",
                              docs=DOCS)
    admin = admin or os.environ.get("DURABLY_RESTATE_ADMIN")
    if not admin:
        parsed = urllib.parse.urlsplit(ingress)
        admin = f"{parsed.scheme}://{parsed.hostname}:9070"
    return ingress.rstrip("/"), admin.rstrip("/")


def run_key(workflow: str, input: Any, key: str | None) -> str:
    """The Restate workflow key of a run: `key`, or the workflow name plus a digest of the canonical input."""
    return key if key is not None else f"{workflow}-{digest(input)[:16]}"


def _time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


class RestateClient:
    """Runs of durably workflows on one Restate cluster, through its ingress and admin APIs."""

    def __init__(self, ingress: str | None = None, admin: str | None = None, timeout: float = 30.0) -> None:
        self.ingress, self.admin = endpoints(ingress, admin)
        self.timeout = timeout

    # ---- HTTP -------------------------------------------------------------------------------------------
    def _call(self, method: str, url: str, body: bytes | None = None, timeout: float | None = None) -> tuple[int, Any]:
        request = urllib.request.Request(url, data=body, method=method,
                                         headers={"content-type": "application/json", "accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                raw = response.read()
                return response.status, (decode(raw) if raw else None)
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return exc.code, decode(raw) if raw else None
            except Exception:  # noqa: BLE001 - a non-JSON error body is shown as text
                return exc.code, {"message": raw.decode(errors="replace")}
        except OSError as exc:
            raise ValidationError(f"cannot reach Restate at {url.split('/', 3)[:3][-1]}: {exc}",
                                  hint="Start restate-server, or pass --restate/--restate-admin "
                                       "(DURABLY_RESTATE/DURABLY_RESTATE_ADMIN).", docs=DOCS) from None

    def sql(self, query: str) -> list[dict[str, Any]]:
        """Rows of a query over Restate's introspection tables (sys_invocation, sys_journal, ...).

        A query spans every partition; while a cluster node is down the admin API answers HTTP 5xx until the
        node's partitions have new leaders (seconds), so those answers are retried for up to `timeout`."""
        deadline, pause = time.monotonic() + self.timeout, 0.05
        while True:
            status, answer = self._call("POST", f"{self.admin}/query", encode({"query": query}))
            if status == 200:
                return list(answer.get("rows", []))
            if status < 500 or time.monotonic() + pause > deadline:
                raise ValidationError(f"Restate admin query failed: HTTP {status} {answer}", docs=DOCS)
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    @staticmethod
    def _quote(text: str) -> str:
        return "'" + text.replace("'", "''") + "'"

    # ---- runs -------------------------------------------------------------------------------------------
    def start(self, workflow: str, input: Any = None, *, key: str | None = None) -> str:
        """Start (or find) the run of `workflow` for `input`/`key`; return its run id."""
        wire = dump_value(input, "input")
        run_id = run_key(workflow, load_value(wire), key)
        url = f"{self.ingress}/{PREFIX}{workflow}/{urllib.parse.quote(run_id, safe='')}/run/send"
        status, answer = self._call("POST", url, encode(wire))
        if status == 404:
            raise RunNotFoundError(f"Restate has no workflow {PREFIX}{workflow}",
                                   hint="Serve it with `durably serve --restate --import SCRIPT` first.", docs=DOCS)
        if status >= 300:
            raise ValidationError(f"Restate refused to start {workflow}: HTTP {status} {answer}", docs=DOCS)
        return run_id

    def _invocation(self, run_id: str) -> dict[str, Any]:
        rows = self.sql("SELECT * FROM sys_invocation WHERE target_handler_name = 'run' AND "
                        f"target_service_name LIKE 'durably.%' AND target_service_key = {self._quote(run_id)} "
                        "ORDER BY created_at DESC LIMIT 1")
        if not rows:
            raise RunNotFoundError(f"no run {run_id!r} on Restate at {self.ingress}",
                                   hint="`durably list --restate URL` shows the runs.", docs=DOCS)
        return rows[0]

    def result(self, run_id: str, *, wait: bool = True, timeout: float | None = None) -> Any:
        """The run's result (waiting for it), or its error raised with its own class."""
        inv = self._invocation(run_id)
        workflow = inv["target_service_name"]
        url = f"{self.ingress}/restate/workflow/{workflow}/{urllib.parse.quote(run_id, safe='')}/attach"
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not wait:
                inv = self._invocation(run_id)
                if inv.get("status") != "completed":
                    if self._parked(inv):
                        parked_as = self._status(inv, self._journal(inv["id"]))
                        raise RunParkedError(f"run {run_id} is parked ({parked_as})",
                                             hint=f"Send the signal with `durably signal {run_id} NAME --restate "
                                                  "URL`; Restate resumes the run on its own.",
                                             docs=DOCS, run_id=run_id, status=parked_as)
                    time.sleep(0.05)
                    continue
            status, answer = self._call("GET", url, timeout=timeout or 3600)
            if status == 200:
                return load_value(answer)
            if status in (502, 503, 504) and (deadline is None or time.monotonic() < deadline):
                continue
            raise self._error(answer, status)

    @staticmethod
    def _error(answer: Any, status: int) -> BaseException:
        meta = (answer or {}).get("metadata") or {}
        if "durably-error" in meta:
            return load_error(json.loads(meta["durably-error"]))
        message = (answer or {}).get("message", "")
        if status == 409 or "cancel" in str(message).lower():
            from ..errors import RunCancelledError
            return RunCancelledError(f"the run was cancelled ({message})", hint="Start it again with a new key.")
        return DurablyError(f"Restate answered HTTP {status}: {message}", docs=DOCS)

    def signal(self, run_id: str, name: str, payload: Any = None) -> int:
        """Queue signal `name` for the run; its next `ctx.wait_for(name)` returns `payload`. Returns the slot."""
        inv = self._invocation(run_id)
        url = f"{self.ingress}/{inv['target_service_name']}/{urllib.parse.quote(run_id, safe='')}/signal"
        status, answer = self._call("POST", url, encode({"name": name, "payload": dump_value(payload, "payload")}))
        if status != 200:
            raise DurablyError(f"Restate refused the signal: HTTP {status} {answer}", docs=DOCS)
        return int(answer["slot"])

    def resolve_awakeable(self, awakeable: str, value: Any = None, *, error: str | None = None) -> None:
        """Resolve a Restate awakeable `ctx.awakeable` created (its id is Restate's) with `value`, or reject it
        with the message `error`, through the ingress (`/restate/awakeables/{id}/resolve` or `/reject`). Restate
        keeps the first resolution and ignores a later one; an id it does not know is an error."""
        quoted = urllib.parse.quote(awakeable, safe="")
        if error is not None:
            url, body = f"{self.ingress}/restate/awakeables/{quoted}/reject", error.encode()
        else:
            url, body = f"{self.ingress}/restate/awakeables/{quoted}/resolve", encode(dump_value(value, "value"))
        status, answer = self._call("POST", url, body)
        if status == 404 or status == 400:
            raise AwakeableNotFoundError(f"Restate knows no awakeable {awakeable!r}: HTTP {status} {answer}",
                                         docs=DOCS, awakeable=awakeable)
        if status >= 300:
            raise DurablyError(f"Restate refused to resolve awakeable {awakeable!r}: HTTP {status} {answer}",
                               docs=DOCS)

    def cancel(self, run_id: str) -> RunState:
        """Cancel the run (Restate ends it at its next journal boundary; no compensation runs)."""
        inv = self._invocation(run_id)
        if inv.get("status") != "completed":
            status, answer = self._call("PATCH", f"{self.admin}/invocations/{inv['id']}/cancel")
            if status >= 300 and status != 404:
                raise DurablyError(f"Restate refused to cancel {run_id}: HTTP {status} {answer}", docs=DOCS)
        deadline = time.monotonic() + self.timeout
        while True:
            state = self.inspect(run_id, steps=False)
            if state.status in ("cancelled", "completed", "failed") or time.monotonic() > deadline:
                return state
            time.sleep(0.05)

    # ---- views ------------------------------------------------------------------------------------------
    def _journal(self, inv_id: str) -> list[dict[str, Any]]:
        return self.sql(f"SELECT index, entry_type, name, entry_json FROM sys_journal WHERE id = {self._quote(inv_id)} "
                        "ORDER BY index")

    def _parked(self, inv: dict[str, Any]) -> bool:
        if inv.get("status") == "suspended":
            return True
        pending = _pending_commands(self._journal(inv["id"]))
        return bool(pending) and all(kind in _PARKED_COMMANDS for kind in pending.values())

    def _status(self, inv: dict[str, Any], journal: list[dict[str, Any]] | None = None) -> str:
        status = inv.get("status")
        if status == "completed":
            failure = inv.get("completion_failure") or ""
            if inv.get("completion_result") == "success":
                return "completed"
            return "cancelled" if failure.startswith("[409]") else "failed"
        if status == "paused":
            return "paused"
        if status == "suspended" or journal is not None:
            pending = _pending_commands(journal if journal is not None else self._journal(inv["id"]))
            if pending and all(kind in _PARKED_COMMANDS for kind in pending.values()):
                return "waiting" if "GetPromise" in pending.values() else "sleeping"
            if status == "suspended":
                return "waiting"
        return "running"

    def _state(self, inv: dict[str, Any], journal: list[dict[str, Any]] | None) -> RunState:
        service = inv["target_service_name"]
        status = self._status(inv, journal)
        state = RunState(run_id=inv["target_service_key"], status=status, workflow=service[len(PREFIX):],
                         key=inv["target_service_key"], input=None, created_at=_time(inv.get("created_at"))
                         or datetime.now(UTC), updated_at=_time(inv.get("modified_at")), attempt=1)
        if status in ("failed", "cancelled"):
            state.error = {"type": "restate", "message": inv.get("completion_failure", "")}
        return state

    def list(self, *, status: str | list[str] | None = None, workflow: str | None = None, key: str | None = None,
             key_prefix: str | None = None, since: datetime | None = None, until: datetime | None = None,
             offset: int = 0, limit: int | None = None) -> list[RunState]:
        """Runs of durably workflows on this cluster, newest first, filtered like `Engine.list`."""
        where = "target_handler_name = 'run' AND target_service_name LIKE 'durably.%'"
        if workflow is not None:
            where += f" AND target_service_name = {self._quote(PREFIX + workflow)}"
        if key is not None:
            where += f" AND target_service_key = {self._quote(key)}"
        rows = self.sql(f"SELECT * FROM sys_invocation WHERE {where} ORDER BY created_at DESC")
        states = [self._state(inv, None) for inv in rows]
        wanted = [status] if isinstance(status, str) else status
        states = [s for s in states if (not wanted or s.status in wanted)
                  and (key_prefix is None or (s.key or "").startswith(key_prefix))
                  and (since is None or (s.updated_at or s.created_at) >= since)
                  and (until is None or (s.updated_at or s.created_at) < until)]
        states = states[offset:]
        return states[:limit] if limit else states

    def inspect(self, run_id: str, *, steps: bool = True) -> RunState:
        """The run's status, result or error, and its steps rebuilt from the Restate journal."""
        inv = self._invocation(run_id)
        journal = self._journal(inv["id"]) if steps or inv.get("status") != "completed" else None
        state = self._state(inv, journal)
        if journal is None:
            return state
        state.steps, state.input, result = _steps(journal)
        if state.status == "completed":
            state.result = result
        elif state.status == "failed" and result is not None:
            state.error = result
        return state


def _lite(entry: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(entry.get("entry_json") or "{}")
    except ValueError:
        return {}


def _pending_commands(journal: list[dict[str, Any]]) -> dict[int, str]:
    """Completion id -> command kind, for every command whose completion has not arrived."""
    pending: dict[int, str] = {}
    for entry in journal:
        body = _lite(entry)
        if "Command" in body:
            for kind, fields in body["Command"].items():
                if isinstance(fields, dict):
                    cid = fields.get("completion_id", fields.get("result_completion_id"))
                    if isinstance(cid, int):
                        pending[cid] = kind
        elif "Notification" in body:
            completion = body["Notification"].get("Completion", {})
            for fields in completion.values():
                if isinstance(fields, dict) and isinstance(fields.get("completion_id"), int):
                    pending.pop(fields["completion_id"], None)
    return pending


def _path(text: str) -> tuple[int, ...] | None:
    parts = text.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def _steps(journal: list[dict[str, Any]]) -> tuple[list[StepState], Any, Any]:
    """StepStates from a journal: `run` entries named `label@path[#attempt]` and their completions."""
    names: dict[int, str] = {}
    outcomes: dict[int, Any] = {}
    when: dict[int, datetime | None] = {}
    input_value = result = None
    for entry in journal:
        body = _lite(entry)
        command = body.get("Command", {})
        if "Input" in command:
            payload = command["Input"].get("payload")
            if payload:
                input_value = load_value(decode(bytes(payload)))
        if "Output" in command:
            out = command["Output"].get("result", {})
            if "Success" in out:
                result = load_value(decode(bytes(out["Success"])))
            elif "Failure" in out:
                meta = {m.get("key"): m.get("value") for m in out["Failure"].get("metadata", []) or []}
                result = json.loads(meta["durably-error"]) if "durably-error" in meta else \
                    {"type": "restate", "message": out["Failure"].get("message", "")}
        for kind in ("Run", "Sleep"):
            if kind in command and entry.get("name"):
                names[command[kind]["completion_id"]] = entry["name"]
        completion = body.get("Notification", {}).get("Completion", {})
        for kind in ("Run", "Sleep"):
            fields = completion.get(kind)
            if isinstance(fields, dict):
                res = fields.get("result")
                outcomes[fields["completion_id"]] = decode(bytes(res["Success"])) if isinstance(res, dict) and \
                    "Success" in res and res["Success"] else None
                when[fields["completion_id"]] = _time(entry.get("appended_at"))
    steps: dict[tuple[int, ...], StepState] = {}
    for cid, name in names.items():
        label, _, where = name.rpartition("@")
        where, _, attempt = where.partition("#")
        path = _path(where)
        if path is None or not label or attempt.startswith("start"):
            continue
        step = steps.get(path)
        if step is None:
            step = steps[path] = StepState(path=path, label=label, status="running", attempts=0)
        step.attempts = max(step.attempts, int(attempt) if attempt.isdigit() else 1)
        if cid not in outcomes:
            continue
        outcome = outcomes[cid]
        step.finished_at = when.get(cid)
        if label == "ctx.sleep":
            step.status = "ok"
        elif isinstance(outcome, dict) and "ok" in outcome:
            step.status, step.output, step.error, step.ms = "ok", load_value(outcome["ok"]), None, outcome.get("ms")
        elif isinstance(outcome, dict) and "err" in outcome:
            step.status, step.error, step.ms = "failed", outcome["err"], outcome.get("ms")
    return sorted(steps.values(), key=lambda s: s.path), input_value, result
