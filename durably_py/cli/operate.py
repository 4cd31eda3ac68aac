"""The commands that act on runs: `signal`, `cancel`, `pause`, `resume`, `retry`, `fork`, `restart`, `adopt` and
`resolve`, on one run or (cancel, resume, retry) on every run a filter selects."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import typer
from rich.text import Text

from .._config import parse_duration
from .._engine.engine import Engine, set_run_hook
from .._run_command import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Watcher,
    exit_code,
    interrupted_exit,
    live_view,
    outcome,
    parse_input,
    print_summary,
    report_durably_error,
    report_exception,
    settle,
)
from .._state.history import RunState, path_tuple
from .._state.history import lineage as lineage_of
from ..errors import DurablyError, ValidationError
from .options import OPTIONS, Options, RunArgument, complete_run, complete_status, complete_workflow, shared
from .render import err_console, filters_text, json_text, path_text
from .target import LocalTarget

NoWaitOption = Annotated[bool, typer.Option("--no-wait", help="Exit with code 3 when the run parks on a sleep or a "
                                                               "signal (or is paused), instead of waiting.")]
TimeoutOption = Annotated[str, typer.Option("--timeout", metavar="DURATION",
                                            help="How long to wait for a running process to act on it: 30s, 2m.")]
RunOrFilterArgument = Annotated[str | None, typer.Argument(
    metavar="RUN", show_default=False, autocompletion=complete_run,
    help="A run id or a run key; or select runs with --status/--workflow.")]
BulkStatusOption = Annotated[list[str] | None, typer.Option(
    "--status", "-s", metavar="STATUS", show_default=False, autocompletion=complete_status,
    help="Act on every run with this status (repeat for several) instead of one RUN; asks first.")]
BulkWorkflowOption = Annotated[str | None, typer.Option(
    "--workflow", "-w", metavar="NAME", show_default=False, autocompletion=complete_workflow,
    help="Act on every run of this workflow (with --status: both must match) instead of one RUN; asks first.")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="With --status/--workflow: act without asking.")]

STEP_HINT = ("Pass a step path such as 2, 2.0.1 or (2, 0, 1), a step label such as fetch, or label#N for the Nth step "
             "with that label; `durably inspect RUN` shows paths and labels.")


def parse_step(text: str) -> tuple[int, ...] | str | tuple[str, int]:
    """A `--from-step` value: a path `2` or `3.1.0`, a label, or `label#nth` (the nth step with that label)."""
    spec = text.strip()
    if re.fullmatch(r"\d+(\.\d+)*", spec):
        return tuple(int(part) for part in spec.split("."))
    if re.fullmatch(r"\(\s*\d+\s*(,\s*\d+\s*)*,?\s*\)", spec):  # as `inspect` prints paths: (3,) or (3, 1, 0)
        return tuple(int(part) for part in spec.strip("() ").split(",") if part.strip())
    if not spec:
        raise ValidationError("--from-step is empty", hint=STEP_HINT, docs="docs/cli.md#durably-retry")
    label, hash_, nth = spec.rpartition("#")
    if hash_ and label and re.fullmatch(r"\d+", nth):
        if int(nth) < 1:
            raise ValidationError(f"--from-step {spec!r}: the N in label#N counts from 1", hint=STEP_HINT,
                                  docs="docs/cli.md#durably-retry")
        return (label, int(nth))
    return spec


def _step_spec(path: tuple[int, ...]) -> str:
    """A step path as `--from-step` takes it: 2 or 2.0.1."""
    return ".".join(map(str, path))


# ---- how an operation reports -----------------------------------------------------------------------------


def _operate(target: LocalTarget, opts: Options, as_json: bool,
             start: Callable[[Engine, Watcher, Callable[[str], Any]], Coroutine[Any, Any, Any]],
             extra: Callable[[str], dict[str, Any]] | None = None) -> None:
    """Run an operation that executes a run (retry, restart, fork) under the live view; print its result and
    summary (`extra(run_id)`: more fields for the JSON object, once the run was found)."""
    with opts.guard():
        engine = target.engine
    watcher = Watcher(engine)
    watcher.say = lambda line: err_console().print(Text(line, "cyan"))
    seen: list[str] = []

    def found(run_id: str) -> None:
        seen.append(run_id)
        watcher.found(run_id)

    code = EXIT_OK
    result: Any = None
    error: BaseException | None = None
    set_run_hook(watcher)
    try:
        with live_view(watcher, not as_json and sys.stderr.isatty()):
            result = asyncio.run(start(engine, watcher, found))
    except KeyboardInterrupt:
        code = interrupted_exit()
    except DurablyError as exc:
        code, error = exit_code(exc, started=bool(seen)), exc
        report_durably_error(exc, opts.debug)
    except Exception as exc:  # noqa: BLE001 - the workflow's own error, reported without a traceback
        code, error = EXIT_FAILED, exc
        report_exception(exc, opts.debug, "the workflow")
    finally:
        set_run_hook(None)
    settle(watcher, engine)
    if as_json:
        if seen or code != EXIT_USAGE:
            data = outcome(watcher, seen[0] if seen else None, code, result, error)
            if extra is not None and seen:
                data.update(extra(seen[0]))
            opts.print_json(data)
        raise typer.Exit(code)
    if code == EXIT_OK:
        opts.print_json(result)
    if watcher.runs or code != EXIT_USAGE:
        print_summary(watcher, code, as_json)
    raise typer.Exit(code)


def _settled(state: RunState, target: str, opts: Options, as_json: bool, done: str, pending: str) -> None:
    """Report whether an operation brought the run to `target`; exit 1 when it did not (yet)."""
    reached = state.status == target
    if as_json:
        opts.print_json({"run_id": state.run_id, "status": state.status, target: reached})
    else:
        err_console().print(Text(done, "green") if reached else Text(pending, "yellow"))
    if not reached:
        raise typer.Exit(EXIT_FAILED)


def _confirm(opts: Options, plan: str, question: str, refusal: dict[str, Any], as_json: bool) -> None:
    """Ask before acting on `plan`: without a terminal to ask on, say what would happen (with --json, also
    `refusal`) and exit 2; a no exits 1. Nothing is touched either way."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        if as_json:
            opts.print_json(refusal)
        err_console().print(Text(f"would {plan}; nothing was touched (no terminal to confirm on): pass --yes to go "
                                 "ahead", "yellow"))
        raise typer.Exit(EXIT_USAGE)
    err_console().print(plan)
    if not typer.confirm(question, default=False, err=True):
        err_console().print(Text("nothing was touched", "yellow"))
        raise typer.Exit(EXIT_FAILED)


# ---- by filter ------------------------------------------------------------------------------------------

_BULK_DONE = {"cancel": "cancelled", "resume": "resumed", "retry": "retried"}


def _one_or_many(verb: str, run: str | None, status: list[str] | None, workflow: str | None, opts: Options) -> bool:
    """Whether the command acts by filter; a usage error (exit 2) for both a RUN and a filter, or neither."""
    many = bool(status) or workflow is not None
    if many == (run is not None):
        with opts.guard():
            raise ValidationError(
                f"durably {verb} takes a RUN or --status/--workflow, not both" if many
                else f"durably {verb} needs a RUN, or --status/--workflow to select runs",
                hint=f"`durably {verb} RUN` acts on one run; `durably {verb} --status failed [--workflow NAME]` "
                     "on every matching run, after showing how many and asking.",
                docs="docs/cli.md#operations-by-filter")
    return many


def _bulk(verb: str, status: list[str] | None, workflow: str | None, yes: bool, target: LocalTarget, opts: Options,
          as_json: bool, **options: Any) -> None:
    """`durably cancel|resume|retry --status ... --workflow ...`: count the runs, ask (or need --yes), act on
    them, then report what was done and what was not, with why. Exit 0 when every run was acted on (and, for
    retry, none failed again), 1 otherwise, 2 when nothing was touched for want of a confirmation."""
    statuses = status or None
    filters = filters_text(status=" --status ".join(status) if status else None, workflow=workflow)
    with opts.guard():
        many = getattr(target.engine, f"{verb}_many")
        chosen = asyncio.run(many(status=statuses, workflow=workflow, dry_run=True, **options)).selected
    if not chosen:
        if as_json:
            opts.print_json({"operation": verb, "selected": 0, "acted": [], "skipped": []})
        else:
            err_console().print(Text(f"no run matches {filters}; nothing to {verb}", "yellow"))
        return
    shown = ", ".join(chosen[:5]) + (f", … ({len(chosen) - 5} more)" if len(chosen) > 5 else "")
    what = f"{verb} {len(chosen)} run{'s' if len(chosen) != 1 else ''} matching {filters}"
    if not yes:
        _confirm(opts, f"{what}: {shown}", f"{verb.capitalize()} {len(chosen)} runs?",
                 {"operation": verb, "selected": len(chosen), "confirmed": False, "runs": chosen}, as_json)
    with opts.guard():
        result = asyncio.run(many(status=statuses, workflow=workflow, **options))
    bad = [s for s in result.acted if s.status == "failed"] if verb == "retry" else []
    if as_json:
        opts.print_json({"operation": verb, "selected": len(result.selected),
                         "acted": [{"run_id": s.run_id, "status": s.status} for s in result.acted],
                         "skipped": [{"run_id": r, "reason": why} for r, why in result.skipped.items()]})
    else:
        console = err_console()
        counts: dict[str, int] = {}
        for state in result.acted:
            counts[state.status] = counts.get(state.status, 0) + 1
        tally = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        console.print(Text(f"{_BULK_DONE[verb]} {len(result.acted)} of {len(result.selected)} runs"
                           + (f": {tally}" if tally else ""), "green" if not (result.skipped or bad) else "yellow"))
        for run_id, why in list(result.skipped.items())[:20]:
            console.print(Text(f"  not {_BULK_DONE[verb]} {run_id}: {why}", "yellow"))
        if len(result.skipped) > 20:
            console.print(Text(f"  … {len(result.skipped) - 20} more not {_BULK_DONE[verb]}", "yellow"))
        for state in bad[:20]:
            console.print(Text(f"  failed again: {state.run_id} (`durably inspect {state.run_id}`)", "red"))
    if result.skipped or bad:
        raise typer.Exit(EXIT_FAILED)


# ---- the commands ---------------------------------------------------------------------------------------


@shared("dir", "storage", "as_json", "output", "debug", "restate", "restate_admin")
def signal(
    run: RunArgument,
    name: Annotated[str, typer.Argument(metavar="NAME", help="The signal the workflow waits for.",
                                        show_default=False)],
    payload: Annotated[str | None, typer.Argument(metavar="PAYLOAD", show_default=False,
                                                  help="JSON payload, or @file.json (default: null).")] = None,
    opts: Options = OPTIONS,
    strict: Annotated[bool, typer.Option("--strict", help="Refuse (exit 2, nothing sent) a signal that the run's "
                                                          "waits do not wait for.")] = False,
) -> None:
    """Send signal NAME to a run: its ctx.wait_for(NAME) returns PAYLOAD, now or whenever it next runs.
    An ended run is refused (exit 2); a run waiting for another name gets a warning (--strict: exit 2)."""
    as_json = opts.json_output()
    with opts.guard():
        target = opts.target()
        value = parse_input(payload, "PAYLOAD")
        run_id, sent = target.signal(run, name, value, strict=strict)
        warning = None
        if sent is not None and sent.mismatched:
            warning = (f"{run_id} waits for {' or '.join(map(repr, sent.awaited))}, not {name!r}: {name!r} stays in "
                       f"its inbox until a ctx.wait_for({name!r}) reads it (--strict refuses such a signal)")
        if as_json:
            opts.print_json({"run_id": run_id, "signal": name, "payload": value, "sent": True,
                             "status": sent.status if sent else None, "awaited": sent.awaited if sent else None,
                             "warning": warning})
            return
        console = err_console()
        console.print(Text(f"sent {name!r} to {run_id}", "green"))
        if warning:
            console.print(Text(f"warning: {warning}", "yellow"))
        elif sent is not None and sent.status == "waiting" and name in sent.awaited:
            console.print(Text("the process waiting on it continues it" if sent.held else
                               f"signal received; due for the next worker or re-run (`durably retry {run_id}` "
                               "continues it now)", "bright_black"))


@shared("dir", "storage", "as_json", "output", "debug", "restate", "restate_admin")
def cancel(
    run: RunOrFilterArgument = None,
    timeout: TimeoutOption = "30s",
    opts: Options = OPTIONS,
    status: BulkStatusOption = None,
    workflow: BulkWorkflowOption = None,
    yes: YesOption = False,
    compensate: Annotated[bool, typer.Option(
        "--compensate", help="Also run the compensations of the steps the run completed.")] = False,
    cleanup: Annotated[str | None, typer.Option(
        "--cleanup", metavar="DURATION",
        help="How long the workflow may clean up once cancelled (e.g. 30s; default: the engine's, 60s).")] = None,
) -> None:
    """Cancel a run: its workflow gets RunCancelledError where it waits, may clean up, and the run ends
    cancelled (one no process runs is cleaned up here). With --status/--workflow instead of RUN: every
    matching run, after showing how many and asking."""
    as_json = opts.json_output()
    if _one_or_many("cancel", run, status, workflow, opts):
        local = opts.local("durably cancel --status/--workflow")
        with opts.guard():
            seconds = parse_duration(timeout)
        _bulk("cancel", status, workflow, yes, local, opts, as_json, timeout=seconds)
        return
    assert run is not None
    with opts.guard():
        target = opts.target()
        seconds = parse_duration(timeout)
        window = parse_duration(cleanup) if cleanup is not None else None
        before = target.current(run, timeout=seconds)
        if before.status == "cancelled":
            if as_json:
                opts.print_json({"run_id": before.run_id, "status": "cancelled", "cancelled": True})
            else:
                err_console().print(Text(f"{before.run_id} was already cancelled", "yellow"))
            return
        state = target.cancel(run, timeout=seconds, compensate=compensate, cleanup=window)
        _settled(state, "cancelled", opts, as_json, f"cancelled {state.run_id}",
                 f"asked {state.run_id} to stop, but it is still {state.status} after {timeout}; "
                 "it stops at its next step boundary")


@shared("dir", "storage", "as_json", "output", "debug", "restate")
def pause(run: RunArgument, timeout: TimeoutOption = "30s", opts: Options = OPTIONS) -> None:
    """Pause a run: one no process runs is paused at once; a running one pauses at its next step boundary."""
    target = opts.local("durably pause")
    as_json = opts.json_output()
    with opts.guard():
        state = asyncio.run(target.engine.pause(run, timeout=parse_duration(timeout)))
        _settled(state, "paused", opts, as_json, f"paused {state.run_id}; `durably resume {state.run_id}` continues it",
                 f"asked {state.run_id} to pause, but it is still {state.status} after {timeout}; "
                 "it pauses at its next step boundary")


@shared("dir", "storage", "as_json", "output", "debug", "restate")
def resume(
    run: RunOrFilterArgument = None,
    opts: Options = OPTIONS,
    status: BulkStatusOption = None,
    workflow: BulkWorkflowOption = None,
    yes: YesOption = False,
) -> None:
    """Resume a paused run: the process waiting on it continues it, or the next run or retry does.
    With --status paused/--workflow instead of RUN: every matching paused run, after asking."""
    target = opts.local("durably resume")
    as_json = opts.json_output()
    if _one_or_many("resume", run, status, workflow, opts):
        _bulk("resume", status, workflow, yes, target, opts, as_json)
        return
    assert run is not None
    with opts.guard():
        state = asyncio.run(target.engine.resume(run))
        if as_json:
            opts.print_json({"run_id": state.run_id, "status": state.status, "resumed": state.status != "paused"})
        elif state.status in ("interrupted", "failed"):
            err_console().print(Text(f"resumed {state.run_id} ({state.status}); `durably retry {state.run_id}` "
                                     "continues it", "green"))
        else:
            err_console().print(Text(f"resumed {state.run_id} ({state.status})", "green"))
        if state.status == "paused":
            raise typer.Exit(EXIT_FAILED)


@shared("dir", "storage", "as_json", "output", "debug", "restate")
def retry(
    run: RunOrFilterArgument = None,
    from_step: Annotated[str | None, typer.Option("--from-step", metavar="PATH|LABEL[#N]",
                                                  help="Run this step (a path like 2, 2.0.1 or (2, 0, 1) "
                                                       "as inspect prints it, a label, or label#N) and every "
                                                       "step completed after it again.")] = None,
    recorded_source: Annotated[bool, typer.Option(
        "--recorded-source", help="Run it on the source file it started with, kept in the store (a run held "
                                  "stale by an edit; `durably diff RUN` shows the change).")] = False,
    no_wait: NoWaitOption = False,
    opts: Options = OPTIONS,
    status: BulkStatusOption = None,
    workflow: BulkWorkflowOption = None,
    yes: YesOption = False,
) -> None:
    """Resume a failed or interrupted run where it stopped, or from a chosen step; print its result as JSON.
    With --status/--workflow instead of RUN: every matching failed or interrupted run, after asking; a run
    that parks is left parked."""
    target = opts.local("durably retry")
    as_json = opts.json_output()
    if _one_or_many("retry", run, status, workflow, opts):
        if from_step is not None or no_wait or recorded_source:
            with opts.guard():
                raise ValidationError("--from-step, --no-wait and --recorded-source are for one RUN, not "
                                      "--status/--workflow",
                                      hint="By filter, each run resumes where it stopped, and one that parks is "
                                           "left parked.", docs="docs/cli.md#operations-by-filter")
        _bulk("retry", status, workflow, yes, target, opts, as_json)
        return
    assert run is not None
    try:
        selector = parse_step(from_step) if from_step is not None else None
    except ValidationError as exc:
        report_durably_error(exc, opts.debug)
        raise typer.Exit(EXIT_USAGE) from None

    async def start(engine: Engine, watcher: Watcher, found: Callable[[str], Any]) -> Any:
        if recorded_source:
            engine.use_recorded_source(run)
        try:
            return await engine.retry(run, from_step=selector, wait=not no_wait, on_run=found)
        except ValidationError as exc:
            if selector is None or not exc.message.startswith("from_step="):
                raise
            state = await engine.inspect(run)
            steps = [f"{_step_spec(s.path)} {s.label}" for s in state.steps if s.status in ("ok", "failed")]
            listed = ", ".join(steps[:30]) + (f", … ({len(steps) - 30} more)" if len(steps) > 30 else "")
            raise ValidationError(f"--from-step {from_step} matches no recorded step of run {state.run_id}; its "
                                  f"steps: {listed or 'none'}", hint=STEP_HINT, docs="docs/cli.md#durably-retry",
                                  run_id=state.run_id) from None

    _operate(target, opts, as_json, start)


@shared("dir", "storage", "as_json", "output", "debug", "restate")
def fork(
    run: RunArgument,
    from_step: Annotated[str, typer.Option("--from-step", metavar="PATH|LABEL[#N]", show_default=False,
                                           help="The completed step to fork from (a path like 2, 2.0.1 or "
                                                "(2, 0, 1) as inspect prints it, a label, or label#N).")],
    set_output: Annotated[str | None, typer.Option("--set-output", metavar="JSON|@FILE", show_default=False,
                                                   help="Record this output for that step in the fork instead "
                                                        "of the original's (JSON, or @file.json).")] = None,
    no_wait: NoWaitOption = False,
    opts: Options = OPTIONS,
) -> None:
    """Start a new run from a completed step of RUN: its history up to that step is copied (the step's output
    replaced with --set-output), then it runs on the current code; print the new run's id and its result.
    RUN is untouched; `durably inspect` of either shows the lineage."""
    target = opts.local("durably fork")
    as_json = opts.json_output()
    try:
        selector = parse_step(from_step)
        edit: dict[str, Any] = {} if set_output is None else {"set_output": parse_input(set_output, "--set-output")}
    except ValidationError as exc:
        report_durably_error(exc, opts.debug)
        raise typer.Exit(EXIT_USAGE) from None

    def lineage(fork_id: str) -> dict[str, Any]:
        forked = target.engine.runs.read(fork_id)[0].header.forked_from
        return {"forked_from": lineage_of(forked) if forked is not None else None}

    async def start(engine: Engine, watcher: Watcher, found: Callable[[str], Any]) -> Any:
        def forked(fork_id: str) -> None:
            origin = lineage(fork_id)["forked_from"] or {"run": run, "path": [], "label": "?", "edited": False}
            err_console().print(Text(f"forked {origin['run']} at step {_step_spec(tuple(origin['path']))} "
                                     f"({origin['label']}{', output set' if origin['edited'] else ''}) as "
                                     f"{fork_id}", "cyan"))
            found(fork_id)

        return await engine.fork(run, from_step=selector, wait=not no_wait, on_run=forked, **edit)

    _operate(target, opts, as_json, start, extra=lineage)


@shared("dir", "storage", "as_json", "output", "debug", "restate")
def restart(run: RunArgument, no_wait: NoWaitOption = False, opts: Options = OPTIONS) -> None:
    """Start a run over as a new run with the same workflow, input and key; print its result as JSON."""
    target = opts.local("durably restart")
    as_json = opts.json_output()
    _operate(target, opts, as_json, lambda engine, watcher, found: engine.restart(run, wait=not no_wait,
                                                                                   on_run=found))


@shared("dir", "storage", "as_json", "output", "debug", "restate")
def adopt(
    run: RunArgument,
    path: Annotated[str | None, typer.Option("--path", metavar="PATH",
                                             help="The recorded step to adopt (a path like 2 or 2.0.1); default: "
                                                  "where the stale run stopped.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Adopt without asking.")] = False,
    no_wait: NoWaitOption = False,
    opts: Options = OPTIONS,
) -> None:
    """Continue a stale run: the step now called at PATH is the recorded one under a new name; print the result.
    Says what it will map where and asks first (--yes: without asking)."""
    from .._engine.versioning import adoption

    target = opts.local("durably adopt")
    as_json = opts.json_output()
    with opts.guard():
        engine = target.engine
        run_id = engine.resolve(run)
        history = engine.operations.history(run_id)
        where_given = parse_step(path) if path is not None else None
        if where_given is not None and not (isinstance(where_given, tuple) and all(
                isinstance(i, int) for i in where_given)):
            raise ValidationError(f"--path {path!r} is not a step path",
                                  hint="Give a path like 2, 3.1.0 or (3, 1, 0); `durably inspect RUN` shows them.",
                                  docs="docs/versioning.md#adopt")
        chosen = adoption(history, where_given)
    recorded = history.done[chosen.path]
    where = path_text(path_tuple(chosen.path))
    now = f"the step now called {chosen.label!r}" if chosen.label else "whatever step the code now calls"
    result = f"its recorded result {json_text(getattr(recorded, 'value', None), 60)}"
    plan = f"adopt {run_id}: at {where}, {now} is the recorded {chosen.recorded!r} ({result}); then the run continues"
    if not yes:
        _confirm(opts, plan, "Adopt?", {"run_id": run_id, "path": list(path_tuple(chosen.path)),
                                        "recorded": chosen.recorded, "called": chosen.label, "confirmed": False},
                 as_json)
    _operate(target, opts, as_json, lambda engine, watcher, found: engine.adopt(
        run_id, where_given, wait=not no_wait, on_run=found))


@shared("dir", "storage", "as_json", "output", "debug", "restate")
def resolve(
    run: RunArgument,
    path: Annotated[str, typer.Option("--path", metavar="PATH", show_default=False,
                                      help="The cut-off step (a path like 2 or 2.0.1, as inspect shows it).")],
    value: Annotated[str | None, typer.Option("--value", metavar="JSON|@FILE", show_default=False,
                                              help="The effect happened: its verified result (JSON, or @file.json); "
                                                   "the workflow gets it as the step's result.")] = None,
    rerun: Annotated[bool, typer.Option("--rerun", help="Run the step again (a new attempt, the same operation "
                                                        "id).")] = False,
    fail: Annotated[bool, typer.Option("--fail", help="Fail the step with EffectFailedError: the workflow's except "
                                                      "runs, and its compensations if the run fails.")] = False,
    message: Annotated[str | None, typer.Option("--message", metavar="TEXT", show_default=False,
                                                help="With --fail: the error's message.")] = None,
    for_worker: Annotated[bool, typer.Option("--for-worker", help="Record the decision and leave the run due for a "
                                                                  "worker instead of continuing it here.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Resolve without asking.")] = False,
    no_wait: NoWaitOption = False,
    opts: Options = OPTIONS,
) -> None:
    """Decide about the cut-off unsafe step of a run that needs attention: --value JSON (it happened, with this
    result), --rerun (run it again) or --fail; then the run continues here (--for-worker: a worker continues it).
    Says what it will record and asks first (--yes: without asking)."""
    from .._engine.effects import MISSING, decision

    target = opts.local("durably resolve")
    as_json = opts.json_output()
    with opts.guard():
        engine = target.engine
        run_id = engine.resolve(run)
        history = engine.operations.history(run_id)
        where = parse_step(path)
        if not (isinstance(where, tuple) and all(isinstance(i, int) for i in where)):
            raise ValidationError(f"--path {path!r} is not a step path",
                                  hint="Give a path like 2, 3.1.0 or (3, 1, 0); `durably inspect RUN` shows them.",
                                  docs="docs/operations.md#effects-that-need-attention")
        if message is not None and not fail:
            raise ValidationError("--message goes with --fail", hint="--fail --message 'the provider has no record "
                                  "of it'", docs="docs/operations.md#effects-that-need-attention")
        given = parse_input(value, "--value") if value is not None else MISSING
        failure: str | bool | None = (message or True) if fail else None
        chosen = decision(history, where, value=given, rerun=rerun, fail=failure)
    start = history.attention()[chosen.path]
    what = {"value": f"record its result {json_text(given, 60)}", "rerun": "run it again",
            "fail": f"fail it ({(chosen.error or {}).get('message', '')})"}[chosen.decision]
    then = "a worker continues the run" if for_worker else "the run continues here"
    plan = (f"resolve {run_id}: step {path_text(path_tuple(chosen.path))} {chosen.label!r} (operation id "
            f"{run_id}/{chosen.path}, input {json_text(start.input, 60)}): {what}; then {then}")
    if not yes:
        _confirm(opts, plan, "Resolve?", {"run_id": run_id, "path": list(path_tuple(chosen.path)),
                                          "decision": chosen.decision, "confirmed": False}, as_json)
    if for_worker:
        with opts.guard():
            state = asyncio.run(engine.resolve_effect(run_id, where, value=given, rerun=rerun, fail=failure,
                                                      here=False))
        if as_json:
            opts.print_json({"run_id": run_id, "path": list(path_tuple(chosen.path)), "decision": chosen.decision,
                             "status": state.status, "resolved": True})
        else:
            err_console().print(Text(f"resolved {run_id} at {path_text(path_tuple(chosen.path))} "
                                     f"({chosen.decision}); due for the next worker (`durably retry {run_id}` "
                                     "continues it now)", "green"))
        return
    _operate(target, opts, as_json, lambda engine, watcher, found: engine.resolve_effect(
        run_id, where, value=given, rerun=rerun, fail=failure, wait=not no_wait, on_run=found))
