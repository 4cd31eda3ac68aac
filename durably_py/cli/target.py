"""Where the commands act: the runs of a local store (through the `Engine`), of a Restate cluster (through
`durably_py.restate`'s client), or of a remote console (through `durably_py.client`, `remote.py`). Commands ask
a `Target`; what Restate mode or a remote console cannot do, its target refuses with a `NotSupportedError` that
says so."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .. import _config as config
from .._engine.code import unserved_notes
from .._engine.engine import Engine
from .._run_command import (
    EXIT_FAILED,
    EXIT_OK,
    exit_code,
    open_engine,
    parse_input,
    print_json,
    report_durably_error,
    report_exception,
    run_script,
)
from .._state.history import RunState
from ..errors import DurablyError, NotSupportedError, ValidationError

if TYPE_CHECKING:
    from .._state.history import SignalSent
    from ..restate.client import RestateClient

OPERATED_LOCALLY = "Restate workflows cannot be paused, retried from a step or restarted by durably"


def engine_at(settings: config.Settings) -> Engine:
    """The engine over the store the settings name, for the commands that read or operate runs. These never
    create a store: a SQLite file that is not there is a usage error naming the path."""
    if settings.storage is not None:
        from ..storage.url import parse_storage_url

        kind, target = parse_storage_url(settings.storage)
        if kind == "sqlite" and not Path(target).exists():
            source = settings.sources.get("storage", "--storage")
            raise ValidationError(f"no SQLite store at {os.path.abspath(target)} (from {source}); nothing was created",
                                  hint="Check the path; `durably run`, `durably enqueue` or `durably worker` create "
                                       "the store on first use.", docs="docs/storage.md#storage-urls")
    return open_engine(settings)


class Target(Protocol):
    """The runs a command acts on, and what it may do to them."""

    settings: config.Settings

    def local(self, command: str) -> LocalTarget:
        """This target when its runs are local; Restate and a remote console refuse `command` (an operation only
        durably's own engine over the store offers) with a `NotSupportedError`."""

    def where(self) -> str:
        """How messages name the place the runs are kept."""

    def run(self, script: Path, args: list[str], *, workflow: str | None, input: str | None, key: str | None,
            fresh: bool, no_wait: bool, as_json: bool, jsonl: bool, debug: bool) -> int:
        """`durably run`: run the script (or its workflow), print what happened, return the exit code."""

    def list_runs(self, *, status: list[str] | None, workflow: str | None, key_prefix: str | None,
             since: datetime | None, until: datetime | None, without_patch: str | None, offset: int,
             limit: int | None, counted: bool) -> tuple[list[RunState], int]:
        """The matching runs, newest first, at most `limit` of them; and (with `counted`) how many more match."""

    def inspect(self, run: str) -> RunState:
        """A run's state with its steps."""

    def timeline(self, run_id: str) -> list[Any]:
        """A run's spans (attempts, sleeps, waits) as `Engine.timeline` gives them."""

    def notes(self, states: list[RunState]) -> list[str]:
        """Warnings about runs no process will continue (their workflow unserved)."""

    def signal(self, run: str, name: str, payload: Any, *, strict: bool) -> tuple[str, SignalSent | None]:
        """Send a signal; the run id, and what the engine knows of the run's waits (None on Restate)."""

    def current(self, run: str, *, timeout: float) -> RunState:
        """A run's state as of now, without its steps where that is cheaper."""

    def cancel(self, run: str, *, timeout: float, compensate: bool, cleanup: float | None) -> RunState:
        """Cancel a run and return its state once it ended, or once `timeout` passed."""

    def resume(self, run: str) -> RunState:
        """Resume a paused run; its state then."""

    def effect_plan(self, run: str, path: tuple[int, ...], *, value: Any, rerun: bool,
                    fail: str | bool | None) -> EffectPlan:
        """What `durably resolve` would record about the cut-off step at `path` (checked: a refusal raises)."""

    def resolve_for_worker(self, run_id: str, path: tuple[int, ...], *, value: Any, rerun: bool,
                           fail: str | bool | None) -> RunState:
        """Record the decision about a cut-off step and leave the run due for a worker."""

    def continue_run(self, command: str, op: str, run: str, body: dict[str, Any], *, wait: bool, as_json: bool,
                     jsonl: bool, debug: bool, here: Callable[[LocalTarget], None]) -> int:
        """`retry` or `resolve` (`op`, with its API body `body`): continue the run and report it as `durably
        retry` does. Locally `here(self)` runs it in this process (and exits); a remote console runs it in its
        own process, and this waits for it, reports it the same way and returns the exit code."""


class EffectPlan:
    """A checked decision about a cut-off step, as `durably resolve` states it before asking."""

    def __init__(self, run_id: str, path: list[int], label: str, decision: str, input: Any,
                 error: dict[str, Any] | None) -> None:
        self.run_id = run_id
        self.path = path
        self.label = label
        self.decision = decision
        self.input = input
        self.error = error


class LocalTarget:
    """The runs of a state dir or storage URL, through the engine over it (opened when first needed)."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings

    @cached_property
    def engine(self) -> Engine:
        """The engine over the store (a store that is not there is a usage error)."""
        return engine_at(self.settings)

    def local(self, command: str) -> LocalTarget:
        return self

    def where(self) -> str:
        return self.engine.runs.where()

    def run(self, script: Path, args: list[str], *, workflow: str | None, input: str | None, key: str | None,
            fresh: bool, no_wait: bool, as_json: bool, jsonl: bool, debug: bool) -> int:
        return run_script(script, args, self.settings, workflow=workflow, input=input, key=key, fresh=fresh,
                          no_wait=no_wait, as_json=as_json, jsonl=jsonl, debug=debug)

    def list_runs(self, *, status: list[str] | None, workflow: str | None, key_prefix: str | None,
             since: datetime | None, until: datetime | None, without_patch: str | None, offset: int,
             limit: int | None, counted: bool) -> tuple[list[RunState], int]:
        query: dict[str, Any] = {"status": status, "workflow": workflow, "key_prefix": key_prefix, "since": since,
                                 "until": until, "without_patch": without_patch}
        found = asyncio.run(self.engine.list(**query, offset=offset, limit=limit))
        more = 0
        if counted and limit is not None and len(found) == limit:  # the catalog counts what lies past the page
            more = asyncio.run(self.engine.count(**query)) - offset - len(found)
        return found, more

    def inspect(self, run: str) -> RunState:
        return asyncio.run(self.engine.inspect(run))

    def timeline(self, run_id: str) -> list[Any]:
        return asyncio.run(self.engine.timeline(run_id))

    def notes(self, states: list[RunState]) -> list[str]:
        return unserved_notes(self.engine.storage, [(s.run_id, s.workflow, s.status) for s in states], time.time())

    def signal(self, run: str, name: str, payload: Any, *, strict: bool) -> tuple[str, SignalSent | None]:
        sent = asyncio.run(self.engine.signal(run, name, payload, strict=strict))
        return sent.run_id, sent

    def current(self, run: str, *, timeout: float) -> RunState:
        return self.inspect(run)

    def cancel(self, run: str, *, timeout: float, compensate: bool, cleanup: float | None) -> RunState:
        return asyncio.run(self.engine.cancel(run, timeout=timeout, compensate=compensate, cleanup=cleanup))

    def resume(self, run: str) -> RunState:
        return asyncio.run(self.engine.resume(run))

    def effect_plan(self, run: str, path: tuple[int, ...], *, value: Any, rerun: bool,
                    fail: str | bool | None) -> EffectPlan:
        from .._engine.effects import plan

        return EffectPlan(**plan(self.engine.operations, run, path, value=value, rerun=rerun, fail=fail))

    def resolve_for_worker(self, run_id: str, path: tuple[int, ...], *, value: Any, rerun: bool,
                           fail: str | bool | None) -> RunState:
        state: RunState = asyncio.run(self.engine.resolve_effect(run_id, path, value=value, rerun=rerun, fail=fail,
                                                                 here=False))
        return state

    def continue_run(self, command: str, op: str, run: str, body: dict[str, Any], *, wait: bool, as_json: bool,
                     jsonl: bool, debug: bool, here: Callable[[LocalTarget], None]) -> int:
        here(self)
        return EXIT_OK


class RestateTarget:
    """The runs of durably workflows on a Restate cluster, through its ingress and admin APIs."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.ingress: str = settings.restate or ""
        self.admin = settings.restate_admin

    @cached_property
    def client(self) -> RestateClient:
        """The cluster's client (imported when first needed)."""
        from ..restate.client import RestateClient

        return RestateClient(self.ingress, self.admin)

    @staticmethod
    def unsupported(command: str, why: str, hint: str | None = None) -> NotSupportedError:
        """The error for what Restate mode cannot do, naming the command."""
        from ..restate.unsupported import unsupported

        return unsupported(command, why, hint)

    def local(self, command: str) -> LocalTarget:
        raise self.unsupported(command, OPERATED_LOCALLY)

    def where(self) -> str:
        return f"Restate at {self.ingress}"

    def run(self, script: Path, args: list[str], *, workflow: str | None, input: str | None, key: str | None,
            fresh: bool, no_wait: bool, as_json: bool, jsonl: bool, debug: bool) -> int:
        """Start the workflow on Restate and print its result: the same output shapes and exit codes as on
        files."""
        started = time.monotonic()
        run_id: list[str] = []
        result: Any = None
        error: BaseException | None = None
        try:
            from ..restate.commands import run_workflow

            if workflow is None:
                raise ValidationError("--restate runs a workflow: pass --workflow NAME",
                                      hint="On Restate a script's __main__ block does not run; name the workflow.")
            if fresh:
                raise self.unsupported("durably run --fresh",
                                       "a Restate workflow key keeps its run until its retention ends",
                                       "Pass a new --key to start another run.")
            result = run_workflow(script, workflow, parse_input(input), key=key, wait=not no_wait,
                                  ingress=self.ingress, admin=self.admin, on_run=run_id.append)
            code = EXIT_OK
        except DurablyError as exc:
            code, error = exit_code(exc, started=bool(run_id)), exc
            report_durably_error(exc, debug)
        except Exception as exc:  # noqa: BLE001 - the workflow's own error, rebuilt with its class
            code, error = EXIT_FAILED, exc
            report_exception(exc, debug, f"workflow {workflow!r}")
        if as_json:
            status = {EXIT_OK: "completed", EXIT_FAILED: "failed"}.get(code, getattr(error, "status", None))
            failure = None if error is None else {"type": type(error).__name__,
                                                  "message": getattr(error, "message", None) or str(error)}
            print_json({"run_id": run_id[0] if run_id else None, "status": status if run_id else None,
                        "detail": None, "result": result if code == EXIT_OK else None, "error": failure,
                        "exit_code": code, "elapsed": round(time.monotonic() - started, 3), "runs": []}, jsonl)
        elif code == EXIT_OK:
            print_json(result, jsonl)
        return code

    def list_runs(self, *, status: list[str] | None, workflow: str | None, key_prefix: str | None,
             since: datetime | None, until: datetime | None, without_patch: str | None, offset: int,
             limit: int | None, counted: bool) -> tuple[list[RunState], int]:
        if without_patch is not None:
            raise self.unsupported("durably list --without-patch", "Restate mode has no ctx.patched")
        found = self.client.list(status=status, workflow=workflow, key_prefix=key_prefix, since=since, until=until,
                                 offset=offset, limit=None if counted else limit)
        page = found[:limit] if limit is not None else found
        return page, len(found) - len(page)

    def inspect(self, run: str) -> RunState:
        return self.client.inspect(run)

    def timeline(self, run_id: str) -> list[Any]:
        return []

    def notes(self, states: list[RunState]) -> list[str]:
        return []

    def signal(self, run: str, name: str, payload: Any, *, strict: bool) -> tuple[str, SignalSent | None]:
        if strict:
            raise self.unsupported("durably signal --strict", "Restate does not tell which signals a run waits for")
        self.client.signal(run, name, payload)
        return run, None

    def current(self, run: str, *, timeout: float) -> RunState:
        self.client.timeout = timeout
        return self.client.inspect(run, steps=False)

    def cancel(self, run: str, *, timeout: float, compensate: bool, cleanup: float | None) -> RunState:
        if compensate or cleanup is not None:
            raise self.unsupported("durably cancel --compensate/--cleanup", OPERATED_LOCALLY)
        self.client.timeout = timeout
        return self.client.cancel(run)

    def resume(self, run: str) -> RunState:
        raise self.unsupported("durably resume", OPERATED_LOCALLY)

    def effect_plan(self, run: str, path: tuple[int, ...], *, value: Any, rerun: bool,
                    fail: str | bool | None) -> EffectPlan:
        raise self.unsupported("durably resolve", OPERATED_LOCALLY)

    def resolve_for_worker(self, run_id: str, path: tuple[int, ...], *, value: Any, rerun: bool,
                           fail: str | bool | None) -> RunState:
        raise self.unsupported("durably resolve", OPERATED_LOCALLY)

    def continue_run(self, command: str, op: str, run: str, body: dict[str, Any], *, wait: bool, as_json: bool,
                     jsonl: bool, debug: bool, here: Callable[[LocalTarget], None]) -> int:
        raise self.unsupported(command, OPERATED_LOCALLY)


def target_for(settings: config.Settings, restate: bool, remote: tuple[str, str | None] | None = None) -> Target:
    """The target the settings name: a remote console when `remote` (its URL and token) is given; Restate when
    the command takes `--restate` (`restate`) and an ingress is set (by the flag, $DURABLY_RESTATE or the
    config); else the local store."""
    if remote is not None:
        from .remote import RemoteTarget

        target: RemoteTarget = RemoteTarget(settings, *remote)
        return target
    if restate and settings.restate:
        return RestateTarget(settings)
    return LocalTarget(settings)
