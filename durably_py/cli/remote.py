"""The runs of a remote console (`durably ui`), for `--remote URL`: the `Target` the commands ask, over
`durably_py.client`. Reads come from the console's JSON API; operations run there (a retry or a resolve in
the console's own process), and this reports them as the local commands do, with the same output and exit
codes. What only a local store offers is refused with a `NotSupportedError` naming the command (exit 2)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from .. import _config as config
from .. import errors
from .._run_command import (
    EXIT_FAILED,
    EXIT_OK,
    exit_code,
    outcome,
    print_json,
    print_summary,
    report_durably_error,
    report_exception,
)
from .._state.history import RunState, SignalSent
from .._view.live import RunTally, Watcher, is_step, parked_detail
from ..client import MISSING as NO_VALUE
from ..client import PARKED, Client, outcome_of
from ..errors import DurablyError, NotSupportedError, RunParkedError
from .target import EffectPlan, LocalTarget

DOCS = "docs/cli.md#remote-control"
DUE = ("pending", "interrupted")  # the statuses `unserved_notes` counts


def refused(command: str, why: str = "it needs the store itself") -> NotSupportedError:
    """The error for a command (or an option) a remote console does not offer."""
    return NotSupportedError(f"{command} does not work with --remote: {why}",
                             hint="Run it where the store is (on the console's machine), or without --remote "
                                  "and with --dir/--storage naming a store this machine reaches.", docs=DOCS,
                             feature=command, mode="remote")


class WorkflowError(Exception):
    """A failed run's recorded error as the local commands report it: its class name, its message, and its
    recorded traceback (which names the user's frame)."""

    def __init__(self, kind: str, message: str, traceback: str | None) -> None:
        super().__init__(message)
        self.kind = kind
        self.remote_traceback = traceback or ""


def workflow_error(state: RunState) -> BaseException:
    """The error of a failed run as an exception whose class has the recorded class's name: a `DurablyError`
    (with its recorded hint and docs) when it was one, as a local command rebuilds it."""
    error = state.error or {}
    kind = str(error.get("type") or "Exception").rpartition(":")[2].rpartition(".")[2] or "Exception"
    message = str(error.get("message", ""))
    found = error.get("attrs")
    attrs: dict[str, Any] = found if isinstance(found, dict) else {}
    if isinstance(attrs.get("hint"), str) and isinstance(attrs.get("docs"), str):
        known = getattr(errors, kind, None)
        durable: Any = known if isinstance(known, type) and issubclass(known, DurablyError) else \
            type(kind, (DurablyError,), {"__module__": "builtins"})
        exc: DurablyError = durable.__new__(durable)  # past any __init__ of its own: the record carries message, hint, docs
        DurablyError.__init__(exc, message, hint=attrs["hint"], docs=attrs["docs"])
        return exc
    cls = type(kind, (WorkflowError,), {"__module__": "builtins"})
    return cls(kind, message, error.get("traceback"))


def _given(value: Any) -> Any:
    """A `--value` as the client takes it: the engine's "no value given" as the client's."""
    from .._engine.effects import MISSING

    return NO_VALUE if value is MISSING else value


def _tally(before: RunState, after: RunState) -> tuple[int, int, int]:
    """The steps an operation ran, replayed and saw fail, as the live view counts a local one: a step done before
    and not again (or whose effect an operator recorded a value for) replayed, any other step done now ran (no
    ctx calls)."""
    done = {s.path: s.finished_at for s in before.steps if s.status == "ok"} if before.run_id == after.run_id else {}
    ran = replayed = failed = 0
    for step in after.steps:
        if not is_step(step.label):
            continue
        if step.status == "failed":
            failed += 1
        elif step.status == "ok":
            decided = ((step.effect or {}).get("resolved") or {}).get("decision") == "value"
            if decided or (step.path in done and done[step.path] == step.finished_at):
                replayed += 1
            else:
                ran += 1
    return ran, replayed, failed


class RemoteTarget:
    """The runs of the console at `url`, with its `token`."""

    def __init__(self, settings: config.Settings, url: str, token: str | None) -> None:
        self.settings = settings
        self.client = Client(url, token)
        self.listed: tuple[list[str], list[str]] | None = None  # the last page's run ids and the console's notes
        self.kept = ""  # where the console keeps its runs, as the last listing said

    def local(self, command: str) -> LocalTarget:
        raise refused(command)

    def where(self) -> str:
        return self.kept or f"the console at {self.client.url}"

    def run(self, script: Path, args: list[str], *, workflow: str | None, input: str | None, key: str | None,
            fresh: bool, no_wait: bool, as_json: bool, jsonl: bool, debug: bool) -> int:
        raise refused("durably run", "a script runs where it is; `durably enqueue` then a worker run it elsewhere")

    def list_runs(self, *, status: list[str] | None, workflow: str | None, key_prefix: str | None,
                  since: datetime | None, until: datetime | None, without_patch: str | None, offset: int,
                  limit: int | None, counted: bool) -> tuple[list[RunState], int]:
        query: dict[str, Any] = {"status": status, "workflow": workflow, "key_prefix": key_prefix, "since": since,
                                 "until": until, "without_patch": without_patch}
        if limit is None or limit > 1000:
            found = self.client.list(**query, offset=offset, limit=limit)
            more = 0
            if counted and limit is not None and len(found) == limit:
                more = self.client.count(**query) - offset - len(found)
            self.listed = None
        else:
            listing = self.client.list_page(**query, offset=offset, limit=limit, count=counted)
            found, self.kept = listing.runs, listing.where
            more = 0
            if counted and listing.count is not None and len(found) == limit:
                more = listing.count - offset - len(found)
            self.listed = ([s.run_id for s in found], listing.notes)
        if not found and not self.kept:
            self.kept = self.client.list_page(limit=1).where
        return found, more

    def inspect(self, run: str) -> RunState:
        return self.client.inspect(run)

    def timeline(self, run_id: str) -> list[Any]:
        return self.client.timeline(run_id)

    def notes(self, states: list[RunState]) -> list[str]:
        ids = [s.run_id for s in states]
        if self.listed is not None and self.listed[0] == ids:
            return self.listed[1]  # the console's notes about the page it listed
        due = [s.run_id for s in states if s.status in DUE]  # only these can be due runs no worker serves
        return self.client.notes(due) if due else []

    def signal(self, run: str, name: str, payload: Any, *, strict: bool) -> tuple[str, SignalSent | None]:
        sent = self.client.signal(run, name, payload, strict=strict)
        return sent.run_id, sent

    def current(self, run: str, *, timeout: float) -> RunState:
        return self.client.inspect(run)

    def cancel(self, run: str, *, timeout: float, compensate: bool, cleanup: float | None) -> RunState:
        return self.client.cancel(run, timeout=min(timeout, 300.0), compensate=compensate, cleanup=cleanup)

    def resume(self, run: str) -> RunState:
        return self.client.resume(run)

    def effect_plan(self, run: str, path: tuple[int, ...], *, value: Any, rerun: bool,
                    fail: str | bool | None) -> EffectPlan:
        return EffectPlan(**self.client.plan_resolve(run, path, value=_given(value), rerun=rerun, fail=fail))

    def resolve_for_worker(self, run_id: str, path: tuple[int, ...], *, value: Any, rerun: bool,
                           fail: str | bool | None) -> RunState:
        answer = self.client.start_resolve(run_id, path, value=_given(value), rerun=rerun, fail=fail, here=False)
        return self.client.inspect(answer["run_id"])

    def continue_run(self, command: str, op: str, run: str, body: dict[str, Any], *, wait: bool, as_json: bool,
                     jsonl: bool, debug: bool, here: Callable[[LocalTarget], None]) -> int:
        """Start the retry or resolve in the console's process, follow the run until it ends (or, without
        `wait`, parks), then print its result and summary as `durably retry` does."""
        watcher = Watcher(None)
        run_id: str | None = None
        result: Any = None
        error: BaseException | None = None
        before: RunState | None = None
        try:
            before = self.client.inspect(run)
            if op == "resolve":
                run_id = self.client.operate(before.run_id, "resolve", body)["run_id"]
            else:
                run_id = self.client.start_retry(before.run_id, from_step=body.get("from_step"))
            tally = watcher.runs[run_id] = RunTally(run_id)
            state = self.client.settled(run_id, wait=wait, after=before.attempt)
            tally.status, tally.detail = state.status, parked_detail(state)
            tally.ran, tally.replayed, tally.failed = _tally(before, state)
            if state.status == "failed":
                error = workflow_error(state)
                code = EXIT_FAILED
                if isinstance(error, DurablyError):
                    report_durably_error(error, debug)
                else:
                    report_exception(error, debug, "the workflow")
            elif state.status in PARKED:
                raise RunParkedError(f"run {run_id} is {tally.detail or state.status}", run_id=run_id,
                                     status=state.status, hint=f"Send the signal with `durably signal {run_id} "
                                     "NAME`, or run again after the wake time.")
            else:
                result = outcome_of(state)
                code = EXIT_OK
        except DurablyError as exc:
            code, error = exit_code(exc, started=run_id is not None), exc
            report_durably_error(exc, debug)
        if as_json:
            if run_id is not None or code != 2:
                print_json(outcome(watcher, run_id, code, result, error), jsonl)
            return code
        if code == EXIT_OK:
            print_json(result, jsonl)
        if watcher.runs or code != 2:
            print_summary(watcher, code, as_json)
        return code


__all__ = ["RemoteTarget", "refused"]
