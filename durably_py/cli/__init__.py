"""The `durably` command line: run scripts under a live progress view, list runs and inspect them.

`durably run` itself lives in `run_command` (free of typer and rich, so the console script can answer a plain
`durably run SCRIPT` without importing this module); its helpers are shared with the commands here."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import re
import signal as signals
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperCommand

from .. import _config as config
from .. import _launcher as launcher
from .._authoring.workflow import REGISTRY
from .._docs import DOCS_DIR, docs_location
from .._engine.code import CodeSource, unserved_notes
from .._engine.engine import Engine, set_run_hook
from .._engine.runs import owner_text
from .._run_command import (
    COLOURS,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    Output,
    Watcher,
    _duration,
    _environment,
    _exit_code,
    _find_workflow,
    _import_script,
    _json_default,
    _live,
    _outcome,
    _parse_input,
    _report_durably_error,
    _report_exception,
    _settle,
    _summary,
    _when,
    check_input_given,
    interrupted_exit,
    on_sigterm,
    open_engine,
    parked_detail,
    print_json,
    run_script,
    settings_for,
    to_json,
    user_frame,
)
from .._state.history import RunState, StepState, path_tuple
from .._view.live import is_step, when_text
from .._view.logtext import money, record_segments, short_json
from .._worker.worker import Worker
from ..errors import DurablyError, ValidationError

if TYPE_CHECKING:  # imported where used: `durably run` without a terminal needs none of them
    from rich.tree import Tree

DEFAULT_PAGE = 20

STATUSES = ("pending", "running", "interrupted", "stale", "completed", "failed", "cancelled", "waiting", "sleeping",
            "paused", "corrupt")

HELP = """Local-first durable execution: run scripts so they resume where they stopped, and look at their runs.

\b
Exit codes:
  0    completed / ok
  1    the workflow (or the script) failed
  2    usage or validation error (bad arguments, unknown run)
  3    the run is parked (waiting, sleeping or paused)
  130  interrupted by Ctrl-C
  143  stopped by SIGTERM
"""

app = typer.Typer(name="durably", help=HELP, no_args_is_help=True, add_completion=True,
                  pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        sys.stdout.write(f"durably {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass

DirOption = Annotated[str | None, typer.Option("--dir", show_default=False, metavar="DIR",
                                               help="State dir (default: $DURABLY_DIR, the config, or the nearest "
                                                    ".durably/ here or in a parent folder).")]
StorageOption = Annotated[str | None, typer.Option("--storage", show_default=False, metavar="URL",
                                                   help="Storage URL instead of a dir: sqlite:PATH, postgresql://... "
                                                        "(or $DURABLY_STORAGE).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]
OutputOption = Annotated[str | None, typer.Option("--output", "-o", metavar="FORMAT", show_default=False,
                                                  help="table (default), json, or jsonl (one JSON value per "
                                                       "line); --json is -o json.")]
DebugOption = Annotated[bool, typer.Option("--debug", help="Show full tracebacks of errors.")]
RestateOption = Annotated[str | None, typer.Option("--restate", metavar="URL", show_default=False,
                                                   help="Operate runs on Restate at this ingress URL (or "
                                                        "$DURABLY_RESTATE, or restate in config.toml; "
                                                        "docs/restate.md).")]
RestateAdminOption = Annotated[str | None, typer.Option("--restate-admin", metavar="URL", show_default=False,
                                                        help="Restate admin URL (or $DURABLY_RESTATE_ADMIN, or "
                                                             "restate_admin in config.toml; default: the ingress "
                                                             "host, port 9070).")]


# ---- where the state is ---------------------------------------------------------------------------

_jsonl = False


def _restate_target(dir: str | None, storage: str | None, restate: str | None,
                    restate_admin: str | None) -> tuple[str | None, str | None]:
    """The Restate ingress and admin URLs a command uses (no ingress: it works on local runs)."""
    found = settings_for(dir, storage, restate, restate_admin)
    return found.restate, found.restate_admin


def engine_at(dir: str | None, storage: str | None) -> Engine:
    """`open_engine(settings_for(dir, storage))`: what every command that reads or operates runs calls. These
    commands never create a store: a SQLite file that is not there is a usage error naming the path."""
    settings = settings_for(dir, storage)
    if settings.storage is not None:
        from ..storage.url import parse_storage_url

        kind, target = parse_storage_url(settings.storage)
        if kind == "sqlite" and not Path(target).exists():
            source = settings.sources.get("storage", "--storage")
            raise ValidationError(f"no SQLite store at {os.path.abspath(target)} (from {source}); nothing was created",
                                  hint="Check the path; `durably run`, `durably enqueue` or `durably worker` create "
                                       "the store on first use.", docs="docs/storage.md#storage-urls")
    return open_engine(settings)


# ---- small helpers ------------------------------------------------------------------------------


parse_duration = config.parse_duration


def _print_json(value: Any) -> None:
    print_json(value, _jsonl)


def _err_console() -> Console:
    return Console(file=sys.stderr, highlight=False, soft_wrap=True, no_color=not Output.color or None)


def _out_console() -> Console:
    wide = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
    return Console(file=sys.stdout, highlight=False, width=wide, no_color=not Output.color or None)


def _preview(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _utc(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC") if value else ""


def _path(path: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, path)) + ("," if len(path) == 1 else "") + ")"


def _status(status: str) -> Text:
    return Text(status, style=COLOURS.get(status, ""))


def _anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def docs_text(topic: str) -> str:
    """A shipped docs page (`errors`), or one section of it (`errors#runnotfounderror`)."""
    name, _, anchor = topic.partition("#")
    pages = sorted(p.stem for p in DOCS_DIR.glob("*.md"))
    if name.removesuffix(".md") not in pages:
        raise ValidationError(f"no docs page {name!r}", hint=f"The pages are: {', '.join(pages)}.",
                              docs="docs/cli.md#durably-docs")
    text = (DOCS_DIR / f"{name.removesuffix('.md')}.md").read_text(encoding="utf-8")
    if not anchor:
        return text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        level = len(line) - len(line.lstrip("#"))
        if 0 < level <= 6 and _anchor(line[level:]) == anchor.lower():
            end = next((j for j in range(i + 1, len(lines))
                        if 0 < (depth := len(lines[j]) - len(lines[j].lstrip("#"))) <= level
                        and lines[j][depth:depth + 1] == " "), len(lines))
            return "\n".join(lines[i:end]).rstrip() + "\n"
    sections = [_anchor(line.lstrip("#")) for line in lines if line.startswith("#")]
    raise ValidationError(f"docs page {name!r} has no section {anchor!r}",
                          hint=f"Its sections: {', '.join(sections)}.", docs="docs/cli.md#durably-docs")


@contextmanager
def _guard(debug: bool) -> Iterator[None]:
    """Turn errors of the list/inspect commands into their message, hint and exit code."""
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except DurablyError as exc:
        _report_durably_error(exc, debug)
        raise typer.Exit(_exit_code(exc, started=False)) from None
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_TERMINATED if Output.terminated else EXIT_INTERRUPTED) from None
    except Exception as exc:  # noqa: BLE001 - shown as one red line, the traceback only with --debug
        _report_exception(exc, debug)
        raise typer.Exit(EXIT_FAILED) from None




class RunCommand(TyperCommand):
    """`durably run`: an unknown option most likely belongs to the script, so say how to pass it."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except Exception as exc:
            option = getattr(exc, "option_name", None)
            if type(exc).__name__ == "NoSuchOption" and option:
                exc.message = (f"No such option: {option}. Options for the script go after `--`: "  # type: ignore[attr-defined]
                               f"durably run SCRIPT -- {option}")
            raise


# ---- completion of values: statuses, run ids and keys, workflow names ----------------------------------------


def complete_status(incomplete: str) -> list[str]:
    """`--status` values for shell completion."""
    return [status for status in STATUSES if status.startswith(incomplete)]


def _completing_runs(ctx: typer.Context, limit: int) -> list[RunState]:
    """The most recently active runs of the store the command line names ([] on any error: a shell completes)."""
    try:
        return asyncio.run(engine_at(ctx.params.get("dir"), ctx.params.get("storage")).list(limit=limit))
    except Exception:  # noqa: BLE001 - no candidates, never an error, while a shell completes
        return []


def complete_run(ctx: typer.Context, incomplete: str) -> list[str]:
    """Run ids and keys of the store the command line names, most recently active first."""
    found = dict.fromkeys(value for state in _completing_runs(ctx, 200) for value in (state.run_id, state.key)
                          if value and value.startswith(incomplete))
    return list(found)[:100]


def complete_workflow(ctx: typer.Context, args: list[str], incomplete: str) -> list[str]:
    """Workflow names: those the command's SCRIPT defines (it is imported), else those of the store's runs."""
    script = ctx.params.get("script") or next((arg for arg in [*ctx.args, *args] if arg.endswith(".py")), None)
    if script is not None and Path(script).is_file():
        try:
            with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
                _import_script(Path(script).resolve())
        except Exception:  # noqa: BLE001 - a script that does not import completes nothing
            return []
        return sorted(name for name in REGISTRY if name.startswith(incomplete))
    return sorted({state.workflow for state in _completing_runs(ctx, 500) if state.workflow.startswith(incomplete)})


# ---- commands ------------------------------------------------------------------------------------


@app.command(cls=RunCommand)
def run(
    script: Annotated[Path, typer.Argument(metavar="SCRIPT", help="The Python script to run.", show_default=False)],
    args: Annotated[list[str] | None, typer.Argument(metavar="ARGS", show_default=False,
                                                     help="Arguments for the script, after `--`.")] = None,
    workflow: Annotated[str | None, typer.Option("--workflow", "-w", metavar="NAME", autocompletion=complete_workflow,
                                                 help="Run this workflow of the script (its __main__ block "
                                                      "does not run) and print its result as JSON.")] = None,
    input: Annotated[str | None, typer.Option("--input", "-i", metavar="JSON|@FILE",
                                              help="Workflow input: JSON text or @file.json.")] = None,
    key: Annotated[str | None, typer.Option("--key", metavar="KEY", help="Run key (with --workflow).")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start the run over (with --workflow).")] = False,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Exit with code 3 when the run parks on a sleep or "
                                                             "a signal, instead of waiting (with --workflow).")] = False,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
    restate_admin: RestateAdminOption = None,
) -> None:
    """Run SCRIPT as __main__ under durably, with a live progress view on stderr; or one of its workflows."""
    as_json = _json_output(as_json, output, debug)
    args = list(args or [])
    with _guard(debug):
        settings = settings_for(dir, storage, restate, restate_admin)
        if not script.is_file():
            raise ValidationError(f"no script file {str(script)!r}",
                                  hint="Pass the path of a Python file, e.g. durably run job.py.")
        if workflow is None and (input is not None or key is not None or fresh or no_wait):
            raise ValidationError("--input, --key, --fresh and --no-wait need --workflow NAME",
                                  hint="Without --workflow the script's own run(...) calls decide input and key; "
                                       "pass them as script arguments after `--`.")
    script = script.resolve()
    if settings.restate:
        raise typer.Exit(_run_on_restate(script, workflow, input, key, fresh, no_wait, settings.restate,
                                         settings.restate_admin, as_json, debug))
    code = run_script(script, args, settings, workflow=workflow, input=input, key=key, fresh=fresh,
                      no_wait=no_wait, as_json=as_json, jsonl=_jsonl, debug=debug)
    raise typer.Exit(code)


def _run_on_restate(script: Path, workflow: str | None, input: str | None, key: str | None, fresh: bool,
                    no_wait: bool, ingress: str, admin: str | None, as_json: bool, debug: bool) -> int:
    """`durably run --restate`: start the workflow on Restate and print its result; the same output shapes and
    exit codes as on files."""
    started = time.monotonic()
    run_id: list[str] = []
    result: Any = None
    error: BaseException | None = None
    try:
        from ..restate.commands import run_workflow
        from ..restate.unsupported import unsupported

        if workflow is None:
            raise ValidationError("--restate runs a workflow: pass --workflow NAME",
                                  hint="On Restate a script's __main__ block does not run; name the workflow.")
        if fresh:
            raise unsupported("durably run --fresh", "a Restate workflow key keeps its run until its retention ends",
                              "Pass a new --key to start another run.")
        result = run_workflow(script, workflow, _parse_input(input), key=key, wait=not no_wait, ingress=ingress,
                              admin=admin, on_run=run_id.append)
        code = EXIT_OK
    except DurablyError as exc:
        code, error = _exit_code(exc, started=bool(run_id)), exc
        _report_durably_error(exc, debug)
    except Exception as exc:  # noqa: BLE001 - the workflow's own error, rebuilt with its class
        code, error = EXIT_FAILED, exc
        _report_exception(exc, debug, f"workflow {workflow!r}")
    if as_json:
        status = {EXIT_OK: "completed", EXIT_FAILED: "failed"}.get(code, getattr(error, "status", None))
        failure = None if error is None else {"type": type(error).__name__,
                                              "message": getattr(error, "message", None) or str(error)}
        _print_json({"run_id": run_id[0] if run_id else None, "status": status if run_id else None, "detail": None,
                     "result": result if code == EXIT_OK else None, "error": failure, "exit_code": code,
                     "elapsed": round(time.monotonic() - started, 3), "runs": []})
    elif code == EXIT_OK:
        _print_json(result)
    return code


def _not_on_restate(dir: str | None, storage: str | None, restate: str | None, command: str, debug: bool) -> None:
    """Commands Restate mode cannot offer say so (exit 2) instead of acting on local files."""
    with _guard(debug):
        restate = _restate_target(dir, storage, restate, None)[0]
        if restate:
            from ..restate.unsupported import unsupported

            raise unsupported(command, "Restate workflows cannot be paused, retried from a step or restarted by "
                              "durably")


def _restate_client(ingress: str, admin: str | None) -> Any:
    from ..restate.client import RestateClient

    return RestateClient(ingress, admin)


ListColumn = tuple[str, Callable[[RunState], Text | str], dict[str, Any]]


def _status_cell(state: RunState) -> Text:
    """A run's status in `list`: `running (owner unresponsive since 10:02:13)` when the process holding it is gone."""
    if state.owner and state.owner.get("alive") is False:
        since = datetime.fromisoformat(state.owner["since"]) if state.owner.get("since") else None
        return Text(f"running (owner unresponsive since {since.astimezone():%H:%M:%S})" if since else
                    "running (owner unresponsive)", "yellow")
    return _status(state.status)


def _list_columns(width: int, states: list[RunState]) -> list[ListColumn]:
    """The columns of `durably list` that fit `width`: the run id always whole, then the most useful others."""
    id_width = max(len(s.run_id) for s in states)
    key_width = min(max((len(s.key or "") for s in states), default=0), 24)
    columns: dict[str, ListColumn] = {
        "run id": ("run id", lambda s: s.run_id, {"no_wrap": True, "min_width": id_width}),
        "workflow": ("workflow", lambda s: s.workflow, {"overflow": "fold"}),
        "key": ("key", lambda s: s.key or "", {"overflow": "fold"}),
        "status": ("status", _status_cell, {"no_wrap": True}),
        "attempt": ("attempt", lambda s: str(s.attempt or "-"), {"justify": "right", "no_wrap": True}),
        "created": ("created", lambda s: _when(s.created_at), {"no_wrap": True}),
        "updated": ("updated", lambda s: _when(s.updated_at or s.created_at), {"no_wrap": True}),
    }
    def widest(name: str, cells: list[str], cap: int = 24) -> int:
        return min(max([len(name), *map(len, cells)]), cap)

    widths = {"run id": id_width, "status": widest("status", [_status_cell(s).plain for s in states], 48), "updated": 19,
              "key": widest("key", [s.key or "" for s in states]),
              "workflow": widest("workflow", [s.workflow for s in states]), "attempt": 7, "created": 19}
    if not key_width:
        del widths["key"]
    chosen: set[str] = set()
    used = 0
    for name, need in widths.items():
        need += 2 if chosen else 0
        if not chosen or used + need <= width:
            chosen.add(name)
            used += need
    return [column for name, column in columns.items() if name in chosen]


def _filters_text(**filters: Any) -> str:
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in filters.items() if value is not None)


def parse_when(text: str, option: str) -> datetime:
    """A `--since`/`--until` value: a duration meaning that long ago (`2h`, `1d`), or an ISO 8601 time."""
    try:
        return datetime.now(UTC) - timedelta(seconds=parse_duration(text))
    except ValidationError:
        pass
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValidationError(f"{option} {text!r} is neither a duration nor an ISO time",
                              hint=f"Write {option} 2h (that long ago), {option} 1d12h, or "
                                   f"{option} 2026-11-30T09:00 (local time unless it names a zone).",
                              docs="docs/cli.md#durably-list") from None
    return when if when.tzinfo is not None else when.astimezone()


OUTPUTS = ("table", "json", "jsonl")


def output_mode(as_json: bool, output: str | None) -> str:
    """The output format a command prints in: `-o` wins, `--json` means json, else table."""
    if output is not None and output not in OUTPUTS:
        raise ValidationError(f"unknown output format {output!r}", hint=f"Use one of: {', '.join(OUTPUTS)}.",
                              docs="docs/cli.md#output-formats")
    return output or ("json" if as_json else "table")


def _json_output(as_json: bool, output: str | None, debug: bool) -> bool:
    """Whether a command prints JSON (`--json`, `-o json`, `-o jsonl`); jsonl prints each value on one line."""
    global _jsonl
    with _guard(debug):
        mode = output_mode(as_json, output)
    _jsonl = mode == "jsonl"
    return mode != "table"


def _emit(value: Any, mode: str) -> None:
    """Print a command's JSON result: indented (`json`) or on one line (`jsonl`; a list one item per line)."""
    if mode == "jsonl":
        items = value if isinstance(value, list) else [value]
        sys.stdout.write("".join(json.dumps(v, ensure_ascii=False, default=_json_default) + "\n" for v in items))
        sys.stdout.flush()
    else:
        _print_json(value)


StatusOption = Annotated[list[str] | None, typer.Option(
    "--status", "-s", metavar="STATUS", show_default=False, autocompletion=complete_status,
    help=f"Only runs with this status; repeat for any of several ({', '.join(STATUSES)}).")]


@app.command("list")
def list_runs(
    status: StatusOption = None,
    workflow: Annotated[str | None, typer.Option("--workflow", "-w", metavar="NAME", autocompletion=complete_workflow,
                                                 help="Only runs of this workflow.")] = None,
    key: Annotated[str | None, typer.Option("--key", metavar="PREFIX",
                                            help="Only runs whose key starts with PREFIX.")] = None,
    since: Annotated[str | None, typer.Option("--since", metavar="WHEN",
                                              help="Only runs active since WHEN: 2h (that long ago), 1d, or an "
                                                   "ISO time.")] = None,
    until: Annotated[str | None, typer.Option("--until", metavar="WHEN",
                                              help="Only runs last active before WHEN (a duration ago, or an ISO "
                                                   "time).")] = None,
    limit: Annotated[int | None, typer.Option("--limit", "-n", min=1, metavar="N",
                                              help="At most N runs (default 20 on a terminal, all when piped or "
                                                   "JSON).")] = None,
    offset: Annotated[int, typer.Option("--offset", min=0, metavar="N",
                                        help="Skip the first N matching runs.")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only run ids, one per line (for xargs).")] = False,
    without_patch: Annotated[str | None, typer.Option("--without-patch", metavar="CHANGE",
                                                      help="Only unfinished runs that may still take the old "
                                                           "branch of ctx.patched(CHANGE).")] = None,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
    restate_admin: RestateAdminOption = None,
) -> None:
    """List runs, newest first: `durably list -q --status failed | xargs -n1 durably retry`."""
    with _guard(debug):
        restate, restate_admin = _restate_target(dir, storage, restate, restate_admin)
        mode = output_mode(as_json, output)
        for one in status or []:
            if one not in STATUSES:
                raise ValidationError(f"unknown status {one!r}", hint=f"Use one of: {', '.join(STATUSES)}.")
        after = parse_when(since, "--since") if since is not None else None
        before = parse_when(until, "--until") if until is not None else None
        page = limit
        if page is None and mode == "table" and not quiet and sys.stdout.isatty():
            page = DEFAULT_PAGE
        counted = mode == "table" and not quiet  # a table says how many more runs match past the page
        if restate and without_patch is not None:
            from ..restate.unsupported import unsupported

            raise unsupported("durably list --without-patch", "Restate mode has no ctx.patched")
        past: int | None = None
        if restate:
            where = f"Restate at {restate}"
            found = _restate_client(restate, restate_admin).list(
                status=status or None, workflow=workflow, key_prefix=key, since=after, until=before, offset=offset,
                limit=None if counted else page)
        else:
            engine = engine_at(dir, storage)
            where = engine._where()
            query: dict[str, Any] = {"status": status or None, "workflow": workflow, "key_prefix": key,
                                     "since": after, "until": before, "without_patch": without_patch}
            found = asyncio.run(engine.list(**query, offset=offset, limit=page))
            if counted and page is not None and len(found) == page:  # the catalog counts what lies past the page
                past = asyncio.run(engine.count(**query)) - offset - len(found)
        states = found[:page] if page is not None else found
        more = past if past is not None else len(found) - len(states)
        if quiet:
            sys.stdout.write("".join(f"{s.run_id}\n" for s in states))
            return
        if mode != "table":
            _emit([s.to_dict() for s in states], mode)
            return
        console = _out_console()
        if not states:
            filters = _filters_text(status=" --status ".join(status) if status else None, workflow=workflow,
                                    key=key, since=since, until=until, offset=offset or None,
                                    without_patch=without_patch)
            console.print(Text(f"no runs match {filters} in {where}" if filters else f"no runs in {where}",
                               "bright_black"))
            return
        from rich import box
        from rich.table import Table

        table = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold", pad_edge=False)
        columns = _list_columns(console.width, states)
        for name, _, options in columns:
            table.add_column(name, **options)
        for s in states:
            table.add_row(*(cell(s) for _, cell, _ in columns))
        console.print(table)
        for s in states:
            if s.status == "corrupt":
                console.print(Text(f"{s.run_id}: {'; '.join(s.warnings)}", "red"))
            elif s.stale:
                console.print(Text(f"{s.run_id}: stale {stale_text(s.stale)}", "red"))
        if more:
            console.print(Text(f"{more} more (--offset {offset + len(states)} shows the next page, --limit N "
                               "more at once)", "bright_black"))
        if not restate:
            for note in unserved_notes(engine.storage, [(s.run_id, s.workflow, s.status) for s in states], time.time()):
                console.print(Text(note, "yellow"))


def json_text(value: Any, limit: int = 100) -> str:
    """A value as compact JSON (what `--input` and `signal` accept), cut to `limit` characters."""
    return short_json(value, limit, _json_default)


@dataclass
class StepExtras:
    """What the timeline adds to a step in `inspect`: each failed attempt, and a sleep's or wait's real length."""

    failures: list[str] = field(default_factory=list)
    seconds: float | None = None


def step_extras(spans: list[Any]) -> dict[tuple[int, ...], StepExtras]:
    """Failed attempts (with their errors) and sleep/wait durations per step path, from `Engine.timeline`."""
    out: dict[tuple[int, ...], StepExtras] = {}
    for span in spans:
        if span.kind == "attempt" and span.status == "failed":
            took = f" after {_duration(span.end - span.start)}" if span.end is not None else ""
            out.setdefault(span.path, StepExtras()).failures.append(
                f"attempt {span.attempt} failed{took}: {span.detail or 'error'}")
        elif span.kind in ("sleep", "wait"):  # the latest one (a retry from a step may have run it again)
            out.setdefault(span.path, StepExtras()).seconds = None if span.end is None else span.end - span.start
    return out


def _step_line(step: StepState, extras: StepExtras | None = None) -> Text:
    line = Text.assemble((_path(step.path), "bright_black"), " ", (step.label, "bold"), "  ", _status(step.status))
    if step.attempts != 1:
        line.append(f"  {step.attempts} attempts", "yellow" if step.attempts > 1 else "")
    if extras is not None and extras.seconds is not None:
        line.append(f"  {_duration(extras.seconds)}", "bright_black")
    elif step.ms is not None:
        line.append(f"  {_duration(step.ms / 1000)}", "bright_black")
    if step.status == "waiting" and isinstance(step.output, dict) and "children" in step.output:
        count = step.output.get("count") or len(step.output["children"])
        named = ", ".join(step.output["children"][:3]) + (", ..." if count > 3 else "")
        line.append(f"  → waiting for {count} child run{'s' if count != 1 else ''} to end ({named})", "blue")
    elif step.status == "waiting" and isinstance(step.output, dict):
        deadline = step.output.get("deadline")
        until = f" until {when_text(deadline)}" if deadline else " (no deadline)"
        line.append(f"  → waiting for signal {step.output.get('signal')!r}{until}", "blue")
    elif step.status == "running" and step.started_at is not None:
        line.append(f"  running for {_duration(max(time.time() - step.started_at.timestamp(), 0))}", "cyan")
    elif step.status == "sleeping" and isinstance(step.output, dict):
        line.append(f"  → sleeping until {when_text(step.output.get('until'))}", "blue")
    elif step.error:
        line.append(f"  → {step.preview()}", "red")
    elif step.status in ("ok", "compensated") and not (step.label == "ctx.sleep" and step.output is None):
        line.append(f"  → {json_text(step.output)}")
    if step.stashed is not None:
        line.append(f"  stashed: {json_text(step.stashed, 60)}", "yellow")
    if step.compensation == "failed":
        line.append("  compensation failed", "red")
    return line


def step_tree(steps: list[StepState], title: str = "steps",
              extras: dict[tuple[int, ...], StepExtras] | None = None) -> Tree:
    """The steps as a tree: branches of a fan-out nest under the position of their `ctx.parallel`."""
    from rich.tree import Tree

    root = Tree(Text(title, "bold"))
    nodes: dict[tuple[int, ...], Tree] = {(): root}
    loops = {step.path for step in steps if step.label == "ctx.loop"}
    per_branch: dict[tuple[int, ...], int] = {}
    for step in steps:
        for end in range(2, len(step.path), 2):
            per_branch[step.path[:end]] = per_branch.get(step.path[:end], 0) + 1

    def node(prefix: tuple[int, ...]) -> Tree:
        found = nodes.get(prefix)
        if found is not None:
            return found
        if len(prefix) % 2 == 0 and per_branch.get(prefix, 0) <= 1:
            return node(prefix[:-1])
        parent = node(prefix[:-1])
        if len(prefix) % 2:
            label = Text.assemble((_path(prefix), "bright_black"), " ", ("parallel", "bold"))
        else:
            label = Text(f"{'iteration' if prefix[:-1] in loops else 'branch'} {prefix[-1]}", "bright_black")
        made = nodes[prefix] = parent.add(label)
        return made

    for step in sorted(steps, key=lambda s: s.path):
        more = (extras or {}).get(step.path)
        existing = nodes.get(step.path)
        if existing is not None:
            existing.label = _step_line(step, more)
        else:
            existing = nodes[step.path] = node(step.path[:-1]).add(_step_line(step, more))
        for failure in more.failures if more is not None else ():
            existing.add(Text(failure, "red"))
    return root


def _next_move(state: RunState) -> str | None:
    """The command that moves a run on from where it stands (None for a finished or running run)."""
    run_id = state.run_id
    if state.ready:
        return f"durably retry {run_id} continues it now, or the next worker does ({state.ready})"
    if state.status == "pending":
        code = f" --import {state.script}" if state.script else ""
        return (f"a worker: nothing runs it until `durably worker{code}` (or `durably retry {run_id}`) claims it; "
                "none has yet")
    if state.status == "waiting":
        names = [s.output.get("signal") for s in state.steps if s.status == "waiting" and isinstance(s.output, dict)
                 and "signal" in s.output]
        if not names and any(s.label == "ctx.join" for s in state.steps if s.status == "waiting"):
            return "nothing: a worker continues it once its child runs end"
        return " or ".join(f"durably signal {run_id} {name} PAYLOAD" for name in names or ["NAME"])
    if state.status == "sleeping":
        return f"durably retry {run_id} continues it after its wake time (a waiting process does it by itself)"
    if state.status == "paused":
        return f"durably resume {run_id}"
    if state.status == "interrupted":
        done = [s for s in state.steps if s.status in ("ok", "failed")]
        inside = [s for s in state.steps if s.status == "interrupted"]
        after = f" (cut off in {', '.join(f'{_path(s.path)} {s.label}' for s in inside)})" if inside else \
            f" (cut off after {_path(done[-1].path)} {done[-1].label})" if done else " (cut off before its first step)"
        return f"durably retry {run_id} resumes it{after}"
    if state.status == "failed":
        return f"durably retry {run_id} resumes it at the failed step"
    if state.status == "stale" and state.stale and state.stale.get("patch") is None and state.stale.get("called"):
        return (f"durably adopt {run_id} if {state.stale['called']!r} is {state.stale['recorded']!r} renamed; "
                f"else restore the old code, or durably restart {run_id}")
    if state.status == "stale":
        return f"deploy code that matches the log again, then durably retry {run_id}; or durably restart {run_id}"
    return None


def owner_line(owner: dict[str, Any]) -> Text:
    """Who holds a running run: `pid 4242 on build-7`, and when that process no longer runs, since when and how
    long its lease still keeps the run from any other process."""
    text = Text(owner_text(owner.get("owner")))
    if owner.get("alive") is False:
        expires = owner.get("expires")
        left = f"; its lease lapses in {_duration(max(expires - time.time(), 0))}, then any process may continue " \
               "the run" if expires else ""
        text.append(f"  not responding since {when_text(owner.get('since'))}{left}", "yellow")
    return text


def stale_text(stale: dict[str, Any]) -> str:
    """Where a stale run's replay stopped, in one line."""
    path = _path(tuple(stale.get("path") or ()))
    if stale.get("patch") is not None:
        return f"at {path}: on the old branch of patch {stale['patch']!r}, which the code retired"
    if stale.get("called") is None:
        return f"at {path}: {stale.get('message')}"
    return f"at {path}: recorded as {stale.get('recorded')!r}, now called {stale.get('called')!r}"


def _header(state: RunState) -> Text:
    rows: list[tuple[str, Text | str]] = [("run", Text(state.run_id, "bold")), ("workflow", state.workflow),
                                          ("status", _status(state.status))]
    if state.key is not None:
        rows.append(("key", state.key))
    if state.input is not None:
        rows.append(("input", json_text(state.input, 200)))
    rows += [("created", _when(state.created_at)), ("updated", _when(state.updated_at)),
             ("attempt", str(state.attempt))]
    if state.script:
        rows.append(("script", state.script))
    if state.parent:
        rows.append(("parent", state.parent))
    if state.children:
        rows.append(("children", "\n".join(state.children)))
    spent = {k: v for k, v in state.spent.items() if v}
    if state.budget:
        rows.append(("budget", ", ".join(f"{money(k, state.spent.get(k, 0.0))} of {money(k, limit)}"
                                         for k, limit in state.budget.items())))
    elif spent:
        rows.append(("spent", ", ".join(money(k, v) for k, v in spent.items())))
    for name, value in state.annotations.items():
        rows.append((f"· {name}", _preview(value, 200)))
    if state.patches:
        rows.append(("patches", ", ".join(f"{change}: {'the new code' if new else 'the old code'}"
                                          for change, new in state.patches.items())))
    for adv in state.advisories:
        level = str(adv.get("level", "")).upper()
        text = Text.assemble((f"[{level}] {adv.get('code')}", "yellow" if level == "WARN" else "blue"),
                             f": {adv.get('msg', '')}")
        count = adv.get("count") or 1
        if count > 1:
            text.append(f" (×{count})", "bright_black")
        if adv.get("hint"):
            text.append(f"\nhint: {adv['hint']}", "bright_black")
        if adv.get("docs"):
            text.append(f"\ndocs: {docs_location(str(adv['docs']))}", "bright_black")
        rows.append(("advisory", text))
    if state.error:
        rows.append(("error", Text(f"{str(state.error.get('type', '')).rpartition(':')[2]}: "
                                   f"{state.error.get('message', '')}", "red")))
    elif state.status == "completed":
        rows.append(("result", json_text(state.result, 200)))
    detail = parked_detail(state)
    if detail is not None:
        rows.append(("parked", Text(detail, "blue")))
    if state.queued is not None:
        due = state.queued.get("due")
        rows.append(("queued", f"due {when_text(due) if due is not None else 'when woken'} · priority "
                               f"{state.queued.get('priority', 0)}"))
    if state.owner:
        rows.append(("owner", owner_line(state.owner)))
    for sig in state.signals:
        rows.append(("signal", Text(f"{sig['name']!r} unread since {when_text(sig.get('at'))}"
                                    + (f"  payload {json_text(sig.get('payload'), 60)}" if sig.get("payload")
                                       is not None else ""), "yellow")))
    if state.stale:
        rows.append(("stale", Text(stale_text(state.stale), "red")))
    next_move = _next_move(state)
    if next_move:
        rows.append(("next", Text(next_move, "bright_black")))
    for warning in state.warnings:
        rows.append(("warning", Text(warning, "yellow")))
    width = max(len(name) for name, _ in rows) + 2
    out = Text()
    for name, value in rows:
        value = value if isinstance(value, Text) else Text(value)
        for i, line in enumerate(value.split("\n")):
            out.append((name if i == 0 else "").ljust(width), "bold")
            out.append_text(line)
            out.append("\n")
    out.rstrip()
    return out


@app.command()
def inspect(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A run id or a run key.", show_default=False, autocompletion=complete_run)],
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
    restate_admin: RestateAdminOption = None,
) -> None:
    """Show a run: its header, advisories, result or error, and the tree of its steps."""
    as_json = _json_output(as_json, output, debug)
    with _guard(debug):
        restate, restate_admin = _restate_target(dir, storage, restate, restate_admin)
        engine: Engine | None = None
        if restate:
            state = _restate_client(restate, restate_admin).inspect(run)
        else:
            engine = engine_at(dir, storage)
            state = asyncio.run(engine.inspect(run))
        if as_json:
            _print_json(state.to_dict())
            return
        from rich.console import Group

        extras = step_extras(asyncio.run(engine.timeline(state.run_id))) if engine is not None else {}
        _out_console().print(Group(_header(state), Text(""), step_tree(state.steps, steps_title(state.steps),
                                                                       extras)))
        if engine is not None:
            for note in unserved_notes(engine.storage, [(state.run_id, state.workflow, state.status)], time.time()):
                _out_console().print(Text(note, "yellow"))


def steps_title(steps: list[StepState]) -> str:
    """`steps (3 · 1 running) · ctx calls (2 · 1 waiting)`: the steps that ended, counted as the end-of-run
    summary counts them (`ctx.step` calls), and apart from them the sleeps, waits, spawns, joins and loops."""
    def counted(chosen: list[StepState]) -> str:
        ended = sum(s.status in ("ok", "failed") for s in chosen)
        still = Counter(s.status for s in chosen if s.status not in ("ok", "failed"))
        return f"{ended}" + "".join(f" · {n} {status}" for status, n in still.items())

    own = [s for s in steps if is_step(s.label)]
    calls = [s for s in steps if not is_step(s.label)]
    return f"steps ({counted(own)})" + (f" · ctx calls ({counted(calls)})" if calls else "")


@app.command()
def graph(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A run id or a run key.", show_default=False, autocompletion=complete_run)],
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
) -> None:
    """Show the task graphs of a run: each node's child run, status, and why it waits."""
    as_json = _json_output(as_json, output, debug)
    with _guard(debug):
        states = asyncio.run(engine_at(dir, storage).graph(run))
        if as_json:
            _print_json([s.to_dict() for s in states])
            return
        if not states:
            _err_console().print(Text(f"{run} has no task graph (ctx.graph)", "yellow"))
            return
        from rich.table import Table

        for state in states:
            table = Table(title=Text.assemble(f"graph at {_path(state.path)}  ", _status(state.status)),
                          title_justify="left")
            for column in ("task", "workflow", "status", "waits for", "depends on", "run id"):
                table.add_column(column)
            for node in state.nodes:
                table.add_row(node.id, node.workflow, _status(node.status), node.wait or "",
                              ", ".join(node.depends_on), node.run_id or "")
            _out_console().print(table)


def import_code(targets: list[str]) -> None:
    """Load the scripts (paths ending in .py) or modules (dotted names) whose workflows and schedules a
    command serves; a target that cannot be imported is a usage error."""
    import importlib

    for target in targets:
        if target.endswith(".py") or os.sep in target:
            path = Path(target)
            if not path.is_file():
                raise ValidationError(f"--import {target}: no such script",
                                      hint="Pass a script path (app/jobs.py) or a module name (app.jobs).")
            _import_script(path)
            continue
        try:
            importlib.import_module(target)
        except ImportError as exc:
            raise ValidationError(f"--import {target}: {type(exc).__name__}: {exc}",
                                  hint="Pass a module importable from here (check PYTHONPATH) or a script path.") from None


@app.command()
def schedules(
    imports: Annotated[list[str] | None, typer.Option(
        "--import", metavar="PATH_OR_MODULE", show_default=False,
        help="A script or module declaring schedules (durably_py.schedule); repeatable.")] = None,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    debug: DebugOption = False,
) -> None:
    """List the schedules the imported code declares: cron, workflow, last fired tick and next tick (UTC)."""
    from .._worker.schedules import states

    with _guard(debug):
        import_code(imports or [])
        found = states(engine_at(dir, storage))
        if as_json:
            _print_json([{"name": s.name, "workflow": s.workflow, "cron": s.cron, "input": s.input,
                          "registered_at": s.registered_at, "last_tick": s.last_tick, "last_run": s.last_run,
                          "next_tick": s.next_tick} for s in found])
            return
        if not found:
            _err_console().print(Text("no schedules declared (pass --import with the script or module that calls "
                                      "durably_py.schedule)", "yellow"))
            return
        from rich.table import Table

        table = Table(title_justify="left")
        for column in ("name", "cron (UTC)", "workflow", "last tick", "last run", "next tick"):
            table.add_column(column)
        for s in found:
            table.add_row(s.name, s.cron, s.workflow, _utc(s.last_tick), s.last_run or "", _utc(s.next_tick))
        _out_console().print(table)


@app.command()
def signal(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A run id or a run key.", show_default=False, autocompletion=complete_run)],
    name: Annotated[str, typer.Argument(metavar="NAME", help="The signal the workflow waits for.",
                                        show_default=False)],
    payload: Annotated[str | None, typer.Argument(metavar="PAYLOAD", show_default=False,
                                                  help="JSON payload, or @file.json (default: null).")] = None,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
    restate_admin: RestateAdminOption = None,
    strict: Annotated[bool, typer.Option("--strict", help="Refuse (exit 2, nothing sent) a signal that the run's "
                                                          "waits do not wait for.")] = False,
) -> None:
    """Send signal NAME to a run: its ctx.wait_for(NAME) returns PAYLOAD, now or whenever it next runs.
    An ended run is refused (exit 2); a run waiting for another name gets a warning (--strict: exit 2)."""
    as_json = _json_output(as_json, output, debug)
    with _guard(debug):
        restate, restate_admin = _restate_target(dir, storage, restate, restate_admin)
        value = _parse_input(payload, "PAYLOAD")
        sent: Any = None
        if restate:
            if strict:
                from ..restate.unsupported import unsupported

                raise unsupported("durably signal --strict", "Restate does not tell which signals a run waits for")
            _restate_client(restate, restate_admin).signal(run, name, value)
            run_id = run
        else:
            engine = engine_at(dir, storage)
            sent = asyncio.run(engine.signal(run, name, value, strict=strict))
            run_id = sent.run_id
        warning = None
        if sent is not None and sent.mismatched:
            warning = (f"{run_id} waits for {' or '.join(map(repr, sent.awaited))}, not {name!r}: {name!r} stays in "
                       f"its inbox until a ctx.wait_for({name!r}) reads it (--strict refuses such a signal)")
        if as_json:
            _print_json({"run_id": run_id, "signal": name, "payload": value, "sent": True,
                         "status": sent.status if sent else None, "awaited": sent.awaited if sent else None,
                         "warning": warning})
            return
        console = _err_console()
        console.print(Text(f"sent {name!r} to {run_id}", "green"))
        if warning:
            console.print(Text(f"warning: {warning}", "yellow"))
        elif sent is not None and sent.status == "waiting" and name in sent.awaited:
            console.print(Text("the process waiting on it continues it" if sent.held else
                               f"signal received; due for the next worker or re-run (`durably retry {run_id}` "
                               "continues it now)", "bright_black"))


RunArgument = Annotated[str, typer.Argument(metavar="RUN", help="A run id or a run key.", show_default=False, autocompletion=complete_run)]
NoWaitOption = Annotated[bool, typer.Option("--no-wait", help="Exit with code 3 when the run parks on a sleep or a "
                                                               "signal (or is paused), instead of waiting.")]


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


def _operate(dir: str | None, storage: str | None, as_json: bool, debug: bool,
             start: Callable[[Engine, Watcher, Callable[[str], Any]], Coroutine[Any, Any, Any]]) -> None:
    """Run an operation that executes a run (retry, restart) under the live view; print its result and summary."""
    with _guard(debug):
        engine = engine_at(dir, storage)
    watcher = Watcher(engine)
    watcher.say = lambda line: _err_console().print(Text(line, "cyan"))
    seen: list[str] = []

    def found(run_id: str) -> None:
        seen.append(run_id)
        watcher.found(run_id)

    code = EXIT_OK
    result: Any = None
    error: BaseException | None = None
    set_run_hook(watcher)
    try:
        with _live(watcher, not as_json and sys.stderr.isatty()):
            result = asyncio.run(start(engine, watcher, found))
    except KeyboardInterrupt:
        code = interrupted_exit()
    except DurablyError as exc:
        code, error = _exit_code(exc, started=bool(seen)), exc
        _report_durably_error(exc, debug)
    except Exception as exc:  # noqa: BLE001 - the workflow's own error, reported without a traceback
        code, error = EXIT_FAILED, exc
        _report_exception(exc, debug, "the workflow")
    finally:
        set_run_hook(None)
    _settle(watcher, engine)
    if as_json:
        if seen or code != EXIT_USAGE:
            _print_json(_outcome(watcher, seen[0] if seen else None, code, result, error))
        raise typer.Exit(code)
    if code == EXIT_OK:
        _print_json(result)
    if watcher.runs or code != EXIT_USAGE:
        _summary(watcher, code, as_json)
    raise typer.Exit(code)


TimeoutOption = Annotated[str, typer.Option("--timeout", metavar="DURATION",
                                            help="How long to wait for a running process to act on it: 30s, 2m.")]


def _settled(state: RunState, target: str, as_json: bool, done: str, pending: str) -> None:
    """Report whether an operation brought the run to `target`; exit 1 when it did not (yet)."""
    reached = state.status == target
    if as_json:
        _print_json({"run_id": state.run_id, "status": state.status, target: reached})
    else:
        _err_console().print(Text(done, "green") if reached else Text(pending, "yellow"))
    if not reached:
        raise typer.Exit(EXIT_FAILED)


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
_BULK_DONE = {"cancel": "cancelled", "resume": "resumed", "retry": "retried"}


def _one_or_many(verb: str, run: str | None, status: list[str] | None, workflow: str | None, debug: bool) -> bool:
    """Whether the command acts by filter; a usage error (exit 2) for both a RUN and a filter, or neither."""
    many = bool(status) or workflow is not None
    if many == (run is not None):
        with _guard(debug):
            raise ValidationError(
                f"durably {verb} takes a RUN or --status/--workflow, not both" if many
                else f"durably {verb} needs a RUN, or --status/--workflow to select runs",
                hint=f"`durably {verb} RUN` acts on one run; `durably {verb} --status failed [--workflow NAME]` "
                     "on every matching run, after showing how many and asking.",
                docs="docs/cli.md#operations-by-filter")
    return many


def _bulk(verb: str, status: list[str] | None, workflow: str | None, yes: bool, dir: str | None,
          storage: str | None, as_json: bool, debug: bool, **options: Any) -> None:
    """`durably cancel|resume|retry --status ... --workflow ...`: count the runs, ask (or need --yes), act on
    them, then report what was done and what was not, with why. Exit 0 when every run was acted on (and, for
    retry, none failed again), 1 otherwise, 2 when nothing was touched for want of a confirmation."""
    statuses = status or None
    filters = _filters_text(status=" --status ".join(status) if status else None, workflow=workflow)
    with _guard(debug):
        engine = engine_at(dir, storage)
        many = getattr(engine, f"{verb}_many")
        chosen = asyncio.run(many(status=statuses, workflow=workflow, dry_run=True, **options)).selected
    if not chosen:
        if as_json:
            _print_json({"operation": verb, "selected": 0, "acted": [], "skipped": []})
        else:
            _err_console().print(Text(f"no run matches {filters}; nothing to {verb}", "yellow"))
        return
    shown = ", ".join(chosen[:5]) + (f", … ({len(chosen) - 5} more)" if len(chosen) > 5 else "")
    what = f"{verb} {len(chosen)} run{'s' if len(chosen) != 1 else ''} matching {filters}"
    if not yes:
        if not (sys.stdin.isatty() and sys.stderr.isatty()):
            if as_json:
                _print_json({"operation": verb, "selected": len(chosen), "confirmed": False, "runs": chosen})
            _err_console().print(Text(f"would {what}: {shown}; nothing was touched (no terminal to confirm on): "
                                      "pass --yes to go ahead", "yellow"))
            raise typer.Exit(EXIT_USAGE)
        _err_console().print(f"{what}: {shown}")
        if not typer.confirm(f"{verb.capitalize()} {len(chosen)} runs?", default=False, err=True):
            _err_console().print(Text("nothing was touched", "yellow"))
            raise typer.Exit(EXIT_FAILED)
    with _guard(debug):
        result = asyncio.run(many(status=statuses, workflow=workflow, **options))
    bad = [s for s in result.acted if s.status == "failed"] if verb == "retry" else []
    if as_json:
        _print_json({"operation": verb, "selected": len(result.selected),
                     "acted": [{"run_id": s.run_id, "status": s.status} for s in result.acted],
                     "skipped": [{"run_id": r, "reason": why} for r, why in result.skipped.items()]})
    else:
        console = _err_console()
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


@app.command()
def cancel(
    run: RunOrFilterArgument = None,
    timeout: TimeoutOption = "30s",
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
    restate_admin: RestateAdminOption = None,
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
    as_json = _json_output(as_json, output, debug)
    if _one_or_many("cancel", run, status, workflow, debug):
        _not_on_restate(dir, storage, restate, "durably cancel --status/--workflow", debug)
        with _guard(debug):
            seconds = parse_duration(timeout)
        _bulk("cancel", status, workflow, yes, dir, storage, as_json, debug, timeout=seconds)
        return
    assert run is not None
    with _guard(debug):
        restate, restate_admin = _restate_target(dir, storage, restate, restate_admin)
        seconds = parse_duration(timeout)
        window = parse_duration(cleanup) if cleanup is not None else None
        if restate:
            client = _restate_client(restate, restate_admin)
            client.timeout = seconds
            before = client.inspect(run, steps=False)
        else:
            engine = engine_at(dir, storage)
            before = asyncio.run(engine.inspect(run))
        if before.status == "cancelled":
            if as_json:
                _print_json({"run_id": before.run_id, "status": "cancelled", "cancelled": True})
            else:
                _err_console().print(Text(f"{before.run_id} was already cancelled", "yellow"))
            return
        if restate and (compensate or window is not None):
            _not_on_restate(dir, storage, restate, "durably cancel --compensate/--cleanup", debug)
        state = client.cancel(run) if restate else asyncio.run(engine.cancel(run, timeout=seconds,
                                                                            compensate=compensate, cleanup=window))
        _settled(state, "cancelled", as_json, f"cancelled {state.run_id}",
                 f"asked {state.run_id} to stop, but it is still {state.status} after {timeout}; "
                 "it stops at its next step boundary")


@app.command()
def pause(
    run: RunArgument,
    timeout: TimeoutOption = "30s",
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
) -> None:
    """Pause a run: one no process runs is paused at once; a running one pauses at its next step boundary."""
    _not_on_restate(dir, storage, restate, "durably pause", debug)
    as_json = _json_output(as_json, output, debug)
    with _guard(debug):
        state = asyncio.run(engine_at(dir, storage).pause(run, timeout=parse_duration(timeout)))
        _settled(state, "paused", as_json, f"paused {state.run_id}; `durably resume {state.run_id}` continues it",
                 f"asked {state.run_id} to pause, but it is still {state.status} after {timeout}; "
                 "it pauses at its next step boundary")


@app.command()
def resume(
    run: RunOrFilterArgument = None,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
    status: BulkStatusOption = None,
    workflow: BulkWorkflowOption = None,
    yes: YesOption = False,
) -> None:
    """Resume a paused run: the process waiting on it continues it, or the next run or retry does.
    With --status paused/--workflow instead of RUN: every matching paused run, after asking."""
    _not_on_restate(dir, storage, restate, "durably resume", debug)
    as_json = _json_output(as_json, output, debug)
    if _one_or_many("resume", run, status, workflow, debug):
        _bulk("resume", status, workflow, yes, dir, storage, as_json, debug)
        return
    assert run is not None
    with _guard(debug):
        state = asyncio.run(engine_at(dir, storage).resume(run))
        if as_json:
            _print_json({"run_id": state.run_id, "status": state.status, "resumed": state.status != "paused"})
        elif state.status in ("interrupted", "failed"):
            _err_console().print(Text(f"resumed {state.run_id} ({state.status}); `durably retry {state.run_id}` "
                                      "continues it", "green"))
        else:
            _err_console().print(Text(f"resumed {state.run_id} ({state.status})", "green"))
        if state.status == "paused":
            raise typer.Exit(EXIT_FAILED)


@app.command()
def retry(
    run: RunOrFilterArgument = None,
    from_step: Annotated[str | None, typer.Option("--from-step", metavar="PATH|LABEL[#N]",
                                                  help="Run this step (a path like 2, 2.0.1 or (2, 0, 1) "
                                                       "as inspect prints it, a label, or label#N) and every "
                                                       "step completed after it again.")] = None,
    no_wait: NoWaitOption = False,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
    status: BulkStatusOption = None,
    workflow: BulkWorkflowOption = None,
    yes: YesOption = False,
) -> None:
    """Resume a failed or interrupted run where it stopped, or from a chosen step; print its result as JSON.
    With --status/--workflow instead of RUN: every matching failed or interrupted run, after asking; a run
    that parks is left parked."""
    _not_on_restate(dir, storage, restate, "durably retry", debug)
    as_json = _json_output(as_json, output, debug)
    if _one_or_many("retry", run, status, workflow, debug):
        if from_step is not None or no_wait:
            with _guard(debug):
                raise ValidationError("--from-step and --no-wait are for one RUN, not --status/--workflow",
                                      hint="By filter, each run resumes where it stopped, and one that parks is "
                                           "left parked.", docs="docs/cli.md#operations-by-filter")
        _bulk("retry", status, workflow, yes, dir, storage, as_json, debug)
        return
    assert run is not None
    try:
        selector = parse_step(from_step) if from_step is not None else None
    except ValidationError as exc:
        _report_durably_error(exc, debug)
        raise typer.Exit(EXIT_USAGE) from None

    async def start(engine: Engine, watcher: Watcher, found: Callable[[str], Any]) -> Any:
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

    _operate(dir, storage, as_json, debug, start)


@app.command()
def restart(
    run: RunArgument,
    no_wait: NoWaitOption = False,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
) -> None:
    """Start a run over as a new run with the same workflow, input and key; print its result as JSON."""
    _not_on_restate(dir, storage, restate, "durably restart", debug)
    as_json = _json_output(as_json, output, debug)
    _operate(dir, storage, as_json, debug, lambda engine, watcher, found: engine.restart(
        run, wait=not no_wait, on_run=found))


@app.command()
def adopt(
    run: RunArgument,
    path: Annotated[str | None, typer.Option("--path", metavar="PATH",
                                             help="The recorded step to adopt (a path like 2 or 2.0.1); default: "
                                                  "where the stale run stopped.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Adopt without asking.")] = False,
    no_wait: NoWaitOption = False,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
    restate: RestateOption = None,
) -> None:
    """Continue a stale run: the step now called at PATH is the recorded one under a new name; print the result.
    Says what it will map where and asks first (--yes: without asking)."""
    from .._engine.versioning import adoption

    _not_on_restate(dir, storage, restate, "durably adopt", debug)
    as_json = _json_output(as_json, output, debug)
    with _guard(debug):
        engine = engine_at(dir, storage)
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
    where = _path(path_tuple(chosen.path))
    now = f"the step now called {chosen.label!r}" if chosen.label else "whatever step the code now calls"
    result = f"its recorded result {json_text(getattr(recorded, 'value', None), 60)}"
    plan = f"adopt {run_id}: at {where}, {now} is the recorded {chosen.recorded!r} ({result}); then the run continues"
    if not yes:
        if not (sys.stdin.isatty() and sys.stderr.isatty()):
            if as_json:
                _print_json({"run_id": run_id, "path": list(path_tuple(chosen.path)), "recorded": chosen.recorded,
                             "called": chosen.label, "confirmed": False})
            _err_console().print(Text(f"would {plan}; nothing was touched (no terminal to confirm on): pass --yes "
                                      "to go ahead", "yellow"))
            raise typer.Exit(EXIT_USAGE)
        _err_console().print(plan)
        if not typer.confirm("Adopt?", default=False, err=True):
            _err_console().print(Text("nothing was touched", "yellow"))
            raise typer.Exit(EXIT_FAILED)
    _operate(dir, storage, as_json, debug, lambda engine, watcher, found: engine.adopt(
        run_id, where_given, wait=not no_wait, on_run=found))


@app.command()
def ui(
    host: Annotated[str, typer.Option("--host", help="Address to listen on; any non-loopback address requires "
                                                     "a token ($DURABLY_UI_TOKEN, or one made and printed).")]
        = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on (0: any free port).")]
        = 8765,
    open_browser: Annotated[bool, typer.Option("--open", help="Open the console in the default browser.")] = False,
    dir: DirOption = None,
    storage: Annotated[str | None, typer.Option("--storage", metavar="URL", show_default=False,
                                                help="Storage URL instead of --dir: a directory, file:PATH, "
                                                     "sqlite:PATH or postgresql://...")] = None,
    debug: DebugOption = False,
) -> None:
    """Serve the web console and its JSON API over the runs in DIR or URL (needs `pip install 'durably-py\\[ui]'`)."""
    from .. import ui as console

    with _guard(debug):
        engine = engine_at(dir, storage)
        token = os.environ.get("DURABLY_UI_TOKEN") or None
        console.serve(engine, host=host, port=port, open_browser=open_browser, token=token,
                      announce=lambda line: _err_console().print(Text(line, "green"), soft_wrap=True))


def record_line(rec: dict[str, Any]) -> Text:
    """One log record as a line of `durably logs`: its time, the step it is about, and what happened."""
    return Text.assemble(*record_segments(rec))


@app.command()
def logs(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A run id or a run key.", show_default=False, autocompletion=complete_run)],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing records as any process appends "
                                                                 "them, until the run ends or parks with no "
                                                                 "process waiting on it.")] = False,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="The records as one JSON list (-o jsonl: one record per "
                                                         "line, as they come).")] = False,
    output: OutputOption = None,
    debug: DebugOption = False,
) -> None:
    """Print a run's log as a timeline (steps, attempts, waits, sleeps, the end), then the signals waiting unread
    in its inbox; --follow tails it live."""
    with _guard(debug):
        mode = output_mode(as_json, output)
        engine = engine_at(dir, storage)
        console = _out_console()
        kept: list[dict[str, Any]] = []

        def show(rec: dict[str, Any]) -> None:
            if mode == "table":
                console.print(record_line(rec), soft_wrap=True)
            elif mode == "jsonl":
                sys.stdout.write(json.dumps(rec, ensure_ascii=False, default=_json_default) + "\n")
                sys.stdout.flush()
            else:
                kept.append(rec)

        async def tail() -> None:
            if follow:
                async for rec in engine.follow(run):
                    show(rec)
            else:
                for rec in await engine.records(run):
                    show(rec)

        asyncio.run(tail())
        for message in engine.runs.unread(engine.resolve(run)):  # signals are not in the log: they wait beside it
            show({"t": "signal", **message})
        if mode == "json":
            _print_json(kept)


@app.command()
def export(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A run id or a run key.", show_default=False, autocompletion=complete_run)],
    dir: DirOption = None,
    storage: StorageOption = None,
    debug: DebugOption = False,
) -> None:
    """Write a run's history (its header and every record, as JSONL) to stdout, for replaying it in tests."""
    with _guard(debug):
        data = asyncio.run(engine_at(dir, storage).export(run))
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


@app.command("replay-check")
def replay_check(
    script: Annotated[Path, typer.Argument(metavar="SCRIPT", help="The script with the new workflow code.",
                                           show_default=False)],
    workflow: Annotated[str, typer.Option("--workflow", "-w", metavar="NAME", help="The workflow to check.",
                                               autocompletion=complete_workflow)],
    status: StatusOption = None,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    debug: DebugOption = False,
) -> None:
    """Replay every unfinished run of a workflow (or those with --status) against SCRIPT's code, running no
    step; one line per run, exit 1 if any diverged."""
    from ..testing import replay_check as check

    with _guard(debug):
        settings = settings_for(dir, storage)
        if not script.is_file():
            raise ValidationError(f"no script file {str(script)!r}",
                                  hint="Pass the path of a Python file, e.g. durably replay-check jobs.py -w nightly.")
        script = script.resolve()
        with _environment(script, settings, []):
            _import_script(script)
            wf = _find_workflow(workflow, script)
            reports = asyncio.run(check(open_engine(settings), wf, status=status or None))
        damaged = sum(r.damaged for r in reports)
        diverged = sum(not r.ok for r in reports) - damaged
        if as_json:
            _print_json({"workflow": workflow, "checked": len(reports), "diverged": diverged, "damaged": damaged,
                         "runs": [r.to_dict() for r in reports]})
        else:
            for report in reports:
                sys.stdout.write(report.line() + "\n")
            sys.stdout.write(f"{len(reports)} run(s) of {workflow!r} checked, {diverged} diverged"
                             + (f", {damaged} damaged\n" if damaged else "\n"))
        if diverged or damaged:
            raise typer.Exit(EXIT_FAILED)


@app.command("config")
def config_command(
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
) -> None:
    """Print the effective settings (state dir or storage, colour) and where each one came from."""
    as_json = _json_output(as_json, output, debug)
    with _guard(debug):
        settings = settings_for(dir, storage)
        if as_json:
            _print_json(settings.to_dict())
            return
        rows = [("storage", settings.storage, settings.sources.get("storage")) if settings.storage is not None
                else ("dir", settings.dir, settings.sources.get("dir")),
                ("color", "true" if settings.color else "false", settings.sources.get("color"))]
        rows += [(name.replace("_", "-"), value, settings.sources.get(name))
                 for name, value in (("restate", settings.restate), ("restate_admin", settings.restate_admin))
                 if value is not None]
        rows += [(name.replace("_", "-"), f"{getattr(settings, name)}".lower() if name == "import_recorded"
                  else f"{getattr(settings, name):g}" if isinstance(getattr(settings, name), float)
                  else getattr(settings, name), settings.sources[name])
                 for name in config.ENGINE_KEYS if name in settings.sources]
        out = Text()
        for name, value, source in rows:
            out.append(f"{name:<7} ", "bold")
            out.append(f"{value}")
            out.append(f"  ({source})\n", "bright_black")
        project = settings.project / config.CONFIG_FILE if settings.project else None
        for name, path in (("project", project), ("user", settings.user_file)):
            out.append(f"{name:<8}", "bold")
            if path is None:
                out.append("no .durably/ here or in a parent folder (`durably init` makes one)\n", "bright_black")
            else:
                out.append(f"{path}")
                out.append("\n" if path.is_file() else "  (not there)\n", "bright_black")
        out.rstrip()
        _out_console().print(out, soft_wrap=True)


@app.command("init")
def init_command(
    folder: Annotated[Path, typer.Argument(metavar="FOLDER", show_default=False,
                                           help="The project folder (default: the current one).")] = Path("."),
    debug: DebugOption = False,
) -> None:
    """Create .durably/ in a project: an example config.toml and a .gitignore that keeps run state out of git."""
    with _guard(debug):
        if not folder.is_dir():
            raise ValidationError(f"{str(folder)!r} is not a folder", hint="Pass the project folder, or run it there.",
                                  docs="docs/cli.md#durably-init")
        made = config.init_project(folder)
        console = _err_console()
        for path in made:
            console.print(Text(f"created {path}", "green"))
        if not made:
            console.print(Text(f"{folder / config.STATE_DIR} already has config.toml and .gitignore; nothing to do",
                               "yellow"))


@app.command("docs")
def docs_command(
    topic: Annotated[str | None, typer.Argument(metavar="PAGE[#SECTION]", show_default=False,
                                                help="A page such as errors, or a section: errors#runparkederror.")]
    = None,
    debug: DebugOption = False,
) -> None:
    """Print a page of the documentation shipped with durably (the pages error messages point to)."""
    with _guard(debug):
        if topic is None:
            pages = sorted(p.stem for p in DOCS_DIR.glob("*.md"))
            sys.stdout.write(f"docs in {DOCS_DIR}:\n" + "".join(f"  durably docs {p}\n" for p in pages))
            return
        sys.stdout.write(docs_text(topic))


class ServeCommand(TyperCommand):
    """`durably serve`: `--restate URL` names the cluster by its ingress as on every other command; a bare
    `--restate` means the cluster the settings name ($DURABLY_RESTATE, the config), or the default admin URL."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        args = list(args)
        for i, arg in enumerate(args):
            if arg == "--":
                break
            if arg == "--restate" and (i + 1 == len(args) or args[i + 1].startswith("-")):
                args[i] = "--restate="
        return super().parse_args(ctx, args)


@app.command(cls=ServeCommand)
def serve(
    restate: Annotated[str | None, typer.Option("--restate", metavar="[URL]", show_default=False,
                                                help="Serve the workflows to the Restate cluster at this ingress "
                                                     "URL (alone: the one $DURABLY_RESTATE or the config names; "
                                                     "the only mode of serve today).")] = None,
    imports: Annotated[list[str] | None, typer.Option("--import", metavar="SCRIPT_OR_MODULE",
                                                      help="A script or module defining @workflow functions "
                                                           "(repeatable).")] = None,
    host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (HTTP/2).")] = 9080,
    restate_admin: RestateAdminOption = None,
    no_register: Annotated[bool, typer.Option("--no-register", help="Do not register the deployment with "
                                                                      "the Restate admin API.")] = False,
    debug: DebugOption = False,
) -> None:
    """Serve workflows as Restate workflows named durably.<workflow> and register them with Restate."""
    with _guard(debug):
        if restate is None:
            raise ValidationError("durably serve needs --restate",
                                  hint="durably serve --restate --import flows.py (or --restate URL, the ingress); "
                                       "see docs/restate.md.", docs="docs/restate.md#serving")
        admin = _restate_target(None, None, restate or None, restate_admin)[1]
        from ..restate.commands import serve as serve_restate

        serve_restate(list(imports or []), host=host, port=port, admin=admin, register=not no_register,
                      announce=lambda uri, services: _err_console().print(
                          Text(f"serving {', '.join(services)} at {uri}", "green")))


def _direct_run(argv: list[str]) -> bool:
    """Run `durably run SCRIPT [ARGS...]` written without options without typer's parser (see `launcher`);
    False when the line is not of that shape."""
    code = launcher.direct_run(argv)
    if code is None:
        return False
    sys.exit(code)


# ---- the durable queue: worker and enqueue ---------------------------------------------------------------

def _import_code(target: str) -> None:
    """Load a script (a path to a .py file) or import a module (dotted name) so its @workflows register."""
    path = Path(target)
    if target.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ValidationError(f"--import {target}: no such script file",
                                  hint="Pass a path to a .py file or a dotted module name, e.g. --import jobs.py "
                                       "or --import myapp.workflows.", docs="docs/deploying.md")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        _import_script(path.resolve())
        return
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        importlib.import_module(target)
    except ImportError as exc:
        raise ValidationError(f"--import {target}: {type(exc).__name__}: {exc}",
                              hint="Pass a path to a .py file or a module importable from here (or on "
                                   "PYTHONPATH).", docs="docs/deploying.md") from None


@app.command()
def worker(
    concurrency: Annotated[int | None, typer.Option("--concurrency", "-c", metavar="N", show_default=False,
                                                    help="Runs (and child runs) at once in this worker "
                                                         "[default: 4, or $DURABLY_CONCURRENCY / config].")] = None,
    imports: Annotated[list[str] | None, typer.Option("--import", metavar="PATH_OR_MODULE",
                                                      help="A script or module whose @workflows this worker "
                                                           "serves (repeatable); runs of other workflows are left "
                                                           "for workers that serve them.")] = None,
    import_recorded: Annotated[bool | None, typer.Option(
        "--import-recorded/--no-import-recorded", show_default=False,
        help="Also run other workflows' runs by importing the module or script each recorded, if it lies "
             "under --code-root [default: off, or $DURABLY_IMPORT_RECORDED / config].")] = None,
    code_root: Annotated[str | None, typer.Option("--code-root", metavar="DIR", show_default=False,
                                                  help="Where --import-recorded may import from [default: the "
                                                       "folder holding .durably/, else the current one].")] = None,
    lease: Annotated[float | None, typer.Option("--lease", metavar="SECONDS", show_default=False,
                                                help="Lease of each run on SQLite and PostgreSQL (at least 2): "
                                                     "after a kill, another worker takes a run over within this "
                                                     "plus one poll [default: 30].")] = None,
    heartbeat: Annotated[float | None, typer.Option("--heartbeat", metavar="SECONDS", show_default=False,
                                                    help="How often held leases are renewed (at most half the "
                                                         "lease) [default: a third of the lease].")] = None,
    poll: Annotated[float | None, typer.Option("--poll", metavar="SECONDS", show_default=False,
                                               help="How often to look for due runs when idle [default: 0.2].")]
        = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing per run (only the start, the "
                                                              "stop and warnings).")] = False,
    retention: Annotated[str | None, typer.Option("--retention", metavar="DURATION",
                                                  help="Delete runs this long after they ended (30d, 12h), "
                                                       "checked every tenth of it, at most hourly.")] = None,
    dir: DirOption = None,
    storage: StorageOption = None,
    debug: DebugOption = False,
) -> None:
    """Run due runs of the imported workflows until stopped: claim, run, park, release, repeat. SIGTERM or
    Ctrl-C stops gracefully (no new claims or steps; running steps finish and are recorded; leases released;
    exit 0)."""
    with _guard(debug):
        settings = settings_for(dir, storage)
        for name, value, flag in (("concurrency", concurrency, "--concurrency"), ("lease", lease, "--lease"),
                                  ("heartbeat", heartbeat, "--heartbeat"), ("poll", poll, "--poll"),
                                  ("retention", None if retention is None else parse_duration(retention),
                                   "--retention"),
                                  ("import_recorded", import_recorded, "--import-recorded"),
                                  ("code_root", None if code_root is None else os.path.abspath(code_root),
                                   "--code-root")):
            config.override(settings, name, value, flag)
        config.check_engine(settings)
        if not imports and not settings.import_recorded:
            raise ValidationError("durably worker was given no code to serve",
                                  hint="Pass --import with the script or module that declares the workflows "
                                       "(repeatable), or --import-recorded to import the code each run recorded.",
                                  docs="docs/deploying.md#what-a-worker-serves")
        before = set(REGISTRY)
        for target in imports or []:
            _import_code(target)
        engine = open_engine(settings)
        engine.code = CodeSource(serves=frozenset(set(REGISTRY) - before) if imports else frozenset(),
                                 recorded=settings.import_recorded, root=settings.code_root or config.project_root(
                                     settings))

        def tell(message: str) -> None:
            sys.stderr.write(f"{time.strftime('%H:%M:%S')} {message}\n")
            sys.stderr.flush()

        def say(message: str) -> None:  # what happens to each run; --quiet keeps only the start, stop and warnings
            if not quiet:
                tell(message)

        engine.heartbeat.report = tell
        loop_worker = Worker(engine, concurrency=engine.concurrency,
                             poll=settings.poll if settings.poll is not None else 0.2, log=say)
        where = settings.storage or os.path.abspath(settings.dir or ".durably")
        served = ", ".join(sorted(engine.code.serves or ())) or "no imported workflow"
        recorded = f"; recorded code under {engine.code.root}" if engine.code.recorded else ""
        tell(f"durably worker {engine.owner} on {where}: concurrency {loop_worker.concurrency}, lease "
            f"{engine.lease_ttl:g}s renewed every {engine.heartbeat_every:g}s, poll {loop_worker.poll:g}s, "
            f"serving {served}{recorded}")
        asyncio.run(_serve(loop_worker, tell))
        tell(f"durably worker stopped after {loop_worker.ran} run turns"
            + (f"; pruned {loop_worker.pruned} ended runs" if loop_worker.pruned else "")
            + (f"; {len(loop_worker.stopped)} stopped part-way and due again" if loop_worker.stopped else ""))
    raise typer.Exit(0)


async def _serve(loop_worker: Worker, say: Any) -> None:
    """Run the worker until SIGTERM/SIGINT; a second signal exits at once."""
    loop = asyncio.get_running_loop()
    asked = {"n": 0}

    def on_signal(name: str) -> None:
        asked["n"] += 1
        if asked["n"] > 1:
            say(f"{name} again: exiting now")
            os._exit(EXIT_INTERRUPTED)
        say(f"{name}: stopping (no new claims or steps; running steps finish)")
        loop_worker.request_stop()

    for sig in (signals.SIGTERM, signals.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - Windows
            signals.signal(sig, lambda *_: loop.call_soon_threadsafe(on_signal, "signal"))
    await loop_worker.run()


@app.command()
def enqueue(
    script: Annotated[Path, typer.Argument(metavar="SCRIPT", help="The script defining the workflow.",
                                           show_default=False)],
    workflow: Annotated[str, typer.Option("--workflow", "-w", metavar="NAME", help="The workflow to enqueue.",
                                               autocompletion=complete_workflow)],
    input: Annotated[str | None, typer.Option("--input", "-i", metavar="JSON|@FILE",
                                              help="Workflow input: JSON text or @file.json.")] = None,
    key: Annotated[str | None, typer.Option("--key", metavar="KEY", help="Run key.")] = None,
    priority: Annotated[int, typer.Option("--priority", "-p", metavar="P",
                                          help="Higher runs first among due runs.")] = 0,
    delay: Annotated[str | None, typer.Option("--delay", metavar="SECONDS",
                                              help="Not due before this long from now: 30, 30s, 5m, 2h.")] = None,
    lines: Annotated[str | None, typer.Option("--from", metavar="FILE|-",
                                              help="Enqueue one run per line of a JSON-lines file (- reads "
                                                   "stdin): each line {\"input\": ..., \"key\": ...}, both "
                                                   "optional; written a batch at a time.")] = None,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    debug: DebugOption = False,
) -> None:
    """Record a pending run of one of SCRIPT's workflows and print its id; a worker runs it when due. With
    --from, one run per line of a JSON-lines file or stdin, in batches of one durable write each, printing
    their ids in order."""
    with _guard(debug):
        settings = settings_for(dir, storage)
        if not script.is_file():
            raise ValidationError(f"no script file {str(script)!r}",
                                  hint="Pass the path of a Python file, e.g. durably enqueue jobs.py -w nightly.")
        if lines is not None and (input is not None or key is not None):
            raise ValidationError("--from gives each run its input and key: it takes no --input or --key",
                                  hint='Put them in each line: {"input": {"n": 1}, "key": "job-1"}.',
                                  docs="docs/cli.md#durably-enqueue")
        seconds = parse_duration(delay) if delay is not None else 0.0
        items = _enqueue_lines(lines) if lines is not None else None
        value = _parse_input(input) if items is None else None
        script = script.resolve()
        with _environment(script, settings, []):
            _import_script(script)
            wf = _find_workflow(workflow, script)
            engine = open_engine(settings)
            if items is None:
                check_input_given(wf, input is not None, script, "enqueue")
                handles = [asyncio.run(engine.enqueue(wf, value, key=key, priority=priority, delay=seconds))]
            else:
                handles = asyncio.run(engine.enqueue_many([(wf, item_input, item_key) for item_input, item_key
                                                           in items], priority=priority, delay=seconds))
        if as_json:
            _print_json({"run_id": handles[0].run_id} if items is None else
                        {"run_ids": [handle.run_id for handle in handles]})
        else:
            sys.stdout.write("".join(handle.run_id + "\n" for handle in handles))
            if sys.stderr.isatty():
                when = "now" if not seconds else f"in {_duration(seconds)}"
                what = handles[0].run_id + " is" if len(handles) == 1 else f"{len(handles):,} runs are"
                _err_console().print(Text(f"{what} pending (due {when}, priority {priority}): nothing runs "
                                          f"{'it' if len(handles) == 1 else 'them'} until a worker does: "
                                          f"`durably worker --import {script.name}`", "bright_black"))


def _enqueue_lines(source: str) -> list[tuple[Any, str | None]]:
    """(input, key) of each non-blank line of `source` (a path, or - for stdin), every line checked before
    anything is enqueued."""
    where = "stdin" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"cannot read {where}: {exc}", hint="Pass a readable JSON-lines file, or - for stdin.",
                              docs="docs/cli.md#durably-enqueue") from None
    items: list[tuple[Any, str | None]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            item = exc
        if not isinstance(item, dict) or set(item) - {"input", "key"} or \
                not isinstance(item.get("key"), str | type(None)):
            raise ValidationError(f"line {number} of {where} is not {{\"input\": ..., \"key\": \"...\"}}: {line[:80]!r}",
                                  hint='Each line is a JSON object with an optional "input" and an optional '
                                       'string "key", e.g. {"input": {"n": 1}, "key": "job-1"}; nothing was '
                                       "enqueued.", docs="docs/cli.md#durably-enqueue")
        items.append((item.get("input"), item.get("key")))
    return items


@app.command()
def prune(
    older_than: Annotated[str, typer.Option("--older-than", metavar="DURATION",
                                            help="Only runs that ended at least this long ago: 30d, 12h, 90m.")],
    status: Annotated[list[str] | None, typer.Option(
        "--status", "-s", metavar="STATUS", show_default=False,
        help="Only runs that ended so (completed, failed, cancelled; repeatable). Default: all three.")] = None,
    workflow: Annotated[str | None, typer.Option("--workflow", "-w", metavar="NAME", autocompletion=complete_workflow,
                                                 help="Only runs of this workflow.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be deleted; delete nothing.")] = False,
    dir: DirOption = None,
    storage: StorageOption = None,
    as_json: JsonOption = False,
    output: OutputOption = None,
    debug: DebugOption = False,
) -> None:
    """Delete ended runs (log, index entry, inbox, key binding) and say what that freed. Unfinished runs,
    runs a process holds and children of unfinished parents are never touched."""
    as_json = _json_output(as_json, output, debug)
    with _guard(debug):
        for one in status or []:
            if one not in ("completed", "failed", "cancelled"):
                raise ValidationError(f"prune deletes ended runs only; {one!r} is not an end status",
                                      hint="Use --status completed, failed or cancelled.",
                                      docs="docs/storage.md#retention")
        engine = engine_at(dir, storage)
        report = asyncio.run(engine.prune(older_than=parse_duration(older_than), status=status or None,
                                          workflow=workflow, dry_run=dry_run))
        if as_json:
            _print_json(report.to_dict())
            return
        verb = "would delete" if dry_run else "deleted"
        size = f"{report.bytes / 1e6:,.1f} MB" if report.bytes >= 100_000 else f"{report.bytes:,} bytes"
        console = _out_console()
        console.print(Text(f"{verb} {len(report.runs)} ended runs ({size}) from {engine._where()}",
                           "green" if report.runs else "bright_black"))
        if report.kept:
            console.print(Text(f"kept {len(report.kept)} that matched: "
                               + "; ".join(f"{run_id} ({why})" for run_id, why in list(report.kept.items())[:5])
                               + (" ..." if len(report.kept) > 5 else ""), "bright_black"))


def main() -> None:
    """Entry point of the `durably` console script: SIGTERM is handled like Ctrl-C (exit 143)."""
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signals.signal(signals.SIGTERM, on_sigterm)
    try:
        if not _direct_run(sys.argv[1:]):
            app(prog_name="durably")
    except KeyboardInterrupt:
        sys.exit(EXIT_TERMINATED if Output.terminated else EXIT_INTERRUPTED)


__all__ = ["app", "main", "parse_duration", "parse_step", "step_tree", "to_json", "user_frame"]
