"""The commands that look at runs: `list`, `inspect`, `graph`, `logs` and `export`."""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer
from rich.text import Text

from .._config import parse_duration
from .._run_command import EXIT_FAILED
from ..errors import ValidationError
from .options import OPTIONS, STATUSES, Options, RunArgument, StatusOption, complete_workflow, shared
from .render import (
    err_console,
    filters_text,
    list_columns,
    out_console,
    path_text,
    record_line,
    run_header,
    stale_text,
    status_text,
    step_extras,
    step_tree,
    steps_title,
)

DEFAULT_PAGE = 20


def chunks_line(rec: dict[str, Any]) -> Text:
    """A batch of chunks a streamed step wrote (`Engine.follow(chunks=True)`): its text, or its chunks as JSON."""
    chunks = rec["chunks"]
    body = "".join(chunks) if all(isinstance(c, str) for c in chunks) else " ".join(map(repr, chunks))
    return Text.assemble(("  ▸ ", "dim"), (f"{path_text(tuple(rec['path']))} ", "cyan"), body)


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


@shared("dir", "storage", "as_json", "output", "debug", "restate", "restate_admin")
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
    opts: Options = OPTIONS,
) -> None:
    """List runs, newest first: `durably list -q --status failed | xargs -n1 durably retry`."""
    with opts.guard():
        target = opts.target()
        mode = opts.mode()
        for one in status or []:
            if one not in STATUSES:
                raise ValidationError(f"unknown status {one!r}", hint=f"Use one of: {', '.join(STATUSES)}.")
        after = parse_when(since, "--since") if since is not None else None
        before = parse_when(until, "--until") if until is not None else None
        page = limit
        if page is None and mode == "table" and not quiet and sys.stdout.isatty():
            page = DEFAULT_PAGE
        counted = mode == "table" and not quiet  # a table says how many more runs match past the page
        states, more = target.list_runs(status=status or None, workflow=workflow, key_prefix=key, since=after,
                                   until=before, without_patch=without_patch, offset=offset, limit=page,
                                   counted=counted)
        if quiet:
            sys.stdout.write("".join(f"{s.run_id}\n" for s in states))
            return
        if mode != "table":
            opts.emit([s.to_dict() for s in states], mode)
            return
        console = out_console()
        if not states:
            filters = filters_text(status=" --status ".join(status) if status else None, workflow=workflow,
                                   key=key, since=since, until=until, offset=offset or None,
                                   without_patch=without_patch)
            where = target.where()
            console.print(Text(f"no runs match {filters} in {where}" if filters else f"no runs in {where}",
                               "bright_black"))
            return
        from rich import box
        from rich.table import Table

        table = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold", pad_edge=False)
        columns = list_columns(console.width, states)
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
        for note in target.notes(states):
            console.print(Text(note, "yellow"))


@shared("dir", "storage", "as_json", "output", "debug", "restate", "restate_admin")
def inspect(run: RunArgument, opts: Options = OPTIONS) -> None:
    """Show a run: its header, advisories, result or error, and the tree of its steps."""
    as_json = opts.json_output()
    with opts.guard():
        target = opts.target()
        state = target.inspect(run)
        if as_json:
            opts.print_json(state.to_dict())
            return
        from rich.console import Group

        extras = step_extras(target.timeline(state.run_id))
        out_console().print(Group(run_header(state), Text(""), step_tree(state.steps, steps_title(state.steps),
                                                                         extras)))
        for note in target.notes([state]):
            out_console().print(Text(note, "yellow"))


@shared("dir", "storage", "as_json", "output", "debug")
def graph(run: RunArgument, opts: Options = OPTIONS) -> None:
    """Show the task graphs of a run: each node's child run, status, and why it waits."""
    as_json = opts.json_output()
    with opts.guard():
        states = asyncio.run(opts.engine().graph(run))
        if as_json:
            opts.print_json([s.to_dict() for s in states])
            return
        if not states:
            err_console().print(Text(f"{run} has no task graph (ctx.graph)", "yellow"))
            return
        from rich.table import Table

        for state in states:
            table = Table(title=Text.assemble(f"graph at {path_text(state.path)}  ", status_text(state.status)),
                          title_justify="left")
            for column in ("task", "workflow", "status", "waits for", "depends on", "run id"):
                table.add_column(column)
            for node in state.nodes:
                table.add_row(node.id, node.workflow, status_text(node.status), node.wait or "",
                              ", ".join(node.depends_on), node.run_id or "")
            out_console().print(table)


@shared("dir", "storage", "as_json", "output", "debug")
def diff(run: RunArgument, opts: Options = OPTIONS) -> None:
    """Show what changed in a run's source file since it started: the file kept in the store when it started
    against the file at its script now, as a unified diff. Exit 0 when they are the same, 1 when they differ."""
    as_json = opts.json_output()
    with opts.guard():
        found = asyncio.run(opts.engine().diff(run))
    if as_json:
        opts.print_json({"run_id": found.run_id, "workflow": found.workflow, "script": found.script,
                         "started": found.started, "last": found.last, "current": found.current,
                         "changed": found.changed, "diff": found.diff})
    elif not found.changed:
        err_console().print(Text(f"{found.run_id}: {found.script} is the file the run started with", "green"))
    else:
        out_console().print(Text(found.diff, no_wrap=True), end="", highlight=False)
        if found.current is None:
            err_console().print(Text(f"{found.script} is missing now", "yellow"))
    if found.changed:
        raise typer.Exit(EXIT_FAILED)


LogsJsonOption = Annotated[bool, typer.Option("--json", help="The records as one JSON list (-o jsonl: one record "
                                                             "per line, as they come).")]


@shared("dir", "storage", "as_json", "output", "debug", as_json=LogsJsonOption)
def logs(
    run: RunArgument,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing records as any process appends "
                                                                 "them, and the chunks streamed steps write, "
                                                                 "until the run ends or parks with no "
                                                                 "process waiting on it.")] = False,
    opts: Options = OPTIONS,
) -> None:
    """Print a run's log as a timeline (steps, attempts, waits, sleeps, the end), then the signals waiting unread
    in its inbox; --follow tails it live, with the chunks its streamed steps write as they come."""
    with opts.guard():
        mode = opts.mode()
        engine = opts.engine()
        console = out_console()
        kept: list[dict[str, Any]] = []

        def show(rec: dict[str, Any]) -> None:
            if mode == "table" and rec.get("t") == "chunks":  # a streamed step's output so far (--follow)
                console.print(chunks_line(rec), soft_wrap=True)
            elif mode == "table":
                console.print(record_line(rec), soft_wrap=True)
            elif mode == "jsonl":
                opts.emit(rec, mode)
            else:
                kept.append(rec)

        async def tail() -> None:
            if follow:
                async for rec in engine.follow(run, chunks=True):
                    show(rec)
            else:
                for rec in await engine.records(run):
                    show(rec)

        asyncio.run(tail())
        for message in engine.runs.unread(engine.resolve(run)):  # signals are not in the log: they wait beside it
            show({"t": "signal", **message})
        if mode == "json":
            opts.print_json(kept)


@shared("dir", "storage", "debug")
def export(run: RunArgument, opts: Options = OPTIONS) -> None:
    """Write a run's history (its header and every record, as JSONL) to stdout, for replaying it in tests."""
    with opts.guard():
        data = asyncio.run(opts.engine().export(run))
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
