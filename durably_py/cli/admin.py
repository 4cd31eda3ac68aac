"""The commands about durably itself and its stores: `config`, `init`, `docs`, `prune`, `replay-check`, `ui`
and `serve`."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text
from typer.core import TyperCommand

from .. import _config as config
from .._config import parse_duration
from .._docs import DOCS_DIR
from .._run_command import EXIT_FAILED, find_workflow, import_script, open_engine, script_environment, settings_for
from ..errors import ValidationError
from .options import OPTIONS, DebugOption, Options, RestateAdminOption, StatusOption, complete_workflow, guard, shared
from .render import err_console, out_console


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


@shared("dir", "storage", "as_json", "output", "debug")
def config_command(
    opts: Options = OPTIONS,
) -> None:
    """Print the effective settings (state dir or storage, colour) and where each one came from."""
    as_json = opts.json_output()
    with opts.guard():
        settings = opts.settings()
        if as_json:
            opts.print_json(settings.to_dict())
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
        out_console().print(out, soft_wrap=True)


@shared("debug")
def init_command(
    folder: Annotated[Path, typer.Argument(metavar="FOLDER", show_default=False,
                                           help="The project folder (default: the current one).")] = Path("."),
    opts: Options = OPTIONS,
) -> None:
    """Create .durably/ in a project: an example config.toml and a .gitignore that keeps run state out of git."""
    with opts.guard():
        if not folder.is_dir():
            raise ValidationError(f"{str(folder)!r} is not a folder", hint="Pass the project folder, or run it there.",
                                  docs="docs/cli.md#durably-init")
        made = config.init_project(folder)
        console = err_console()
        for path in made:
            console.print(Text(f"created {path}", "green"))
        if not made:
            console.print(Text(f"{folder / config.STATE_DIR} already has config.toml and .gitignore; nothing to do",
                               "yellow"))


@shared("debug")
def docs_command(
    topic: Annotated[str | None, typer.Argument(metavar="PAGE[#SECTION]", show_default=False,
                                                help="A page such as errors, or a section: errors#runparkederror.")]
    = None,
    opts: Options = OPTIONS,
) -> None:
    """Print a page of the documentation shipped with durably (the pages error messages point to)."""
    with opts.guard():
        if topic is None:
            pages = sorted(p.stem for p in DOCS_DIR.glob("*.md"))
            sys.stdout.write(f"docs in {DOCS_DIR}:\n" + "".join(f"  durably docs {p}\n" for p in pages))
            return
        sys.stdout.write(docs_text(topic))


@shared("dir", "storage", "as_json", "output", "debug")
def prune(
    older_than: Annotated[str, typer.Option("--older-than", metavar="DURATION",
                                            help="Only runs that ended at least this long ago: 30d, 12h, 90m.")],
    status: Annotated[list[str] | None, typer.Option(
        "--status", "-s", metavar="STATUS", show_default=False,
        help="Only runs that ended so (completed, failed, cancelled; repeatable). Default: all three.")] = None,
    workflow: Annotated[str | None, typer.Option("--workflow", "-w", metavar="NAME", autocompletion=complete_workflow,
                                                 help="Only runs of this workflow.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be deleted; delete nothing.")] = False,
    opts: Options = OPTIONS,
) -> None:
    """Delete ended runs (log, index entry, inbox, key binding) and say what that freed. Unfinished runs,
    runs a process holds and children of unfinished parents are never touched."""
    as_json = opts.json_output()
    with opts.guard():
        for one in status or []:
            if one not in ("completed", "failed", "cancelled"):
                raise ValidationError(f"prune deletes ended runs only; {one!r} is not an end status",
                                      hint="Use --status completed, failed or cancelled.",
                                      docs="docs/storage.md#retention")
        engine = opts.engine()
        report = asyncio.run(engine.prune(older_than=parse_duration(older_than), status=status or None,
                                          workflow=workflow, dry_run=dry_run))
        if as_json:
            opts.print_json(report.to_dict())
            return
        verb = "would delete" if dry_run else "deleted"
        size = f"{report.bytes / 1e6:,.1f} MB" if report.bytes >= 100_000 else f"{report.bytes:,} bytes"
        console = out_console()
        console.print(Text(f"{verb} {len(report.runs)} ended runs ({size}) from {engine.runs.where()}",
                           "green" if report.runs else "bright_black"))
        if report.kept:
            console.print(Text(f"kept {len(report.kept)} that matched: "
                               + "; ".join(f"{run_id} ({why})" for run_id, why in list(report.kept.items())[:5])
                               + (" ..." if len(report.kept) > 5 else ""), "bright_black"))


@shared("dir", "storage", "as_json", "debug")
def replay_check(
    script: Annotated[Path, typer.Argument(metavar="SCRIPT", help="The script with the new workflow code.",
                                           show_default=False)],
    workflow: Annotated[str, typer.Option("--workflow", "-w", metavar="NAME", help="The workflow to check.",
                                               autocompletion=complete_workflow)],
    status: StatusOption = None,
    opts: Options = OPTIONS,
) -> None:
    """Replay every unfinished run of a workflow (or those with --status) against SCRIPT's code, running no
    step; one line per run, exit 1 if any diverged."""
    from ..testing import replay_check as check

    with opts.guard():
        settings = opts.settings()
        if not script.is_file():
            raise ValidationError(f"no script file {str(script)!r}",
                                  hint="Pass the path of a Python file, e.g. durably replay-check jobs.py -w nightly.")
        script = script.resolve()
        with script_environment(script, settings, []):
            import_script(script)
            wf = find_workflow(workflow, script)
            reports = asyncio.run(check(open_engine(settings), wf, status=status or None))
        damaged = sum(r.damaged for r in reports)
        diverged = sum(not r.ok for r in reports) - damaged
        if opts.as_json:
            opts.print_json({"workflow": workflow, "checked": len(reports), "diverged": diverged, "damaged": damaged,
                         "runs": [r.to_dict() for r in reports]})
        else:
            for report in reports:
                sys.stdout.write(report.line() + "\n")
            sys.stdout.write(f"{len(reports)} run(s) of {workflow!r} checked, {diverged} diverged"
                             + (f", {damaged} damaged\n" if damaged else "\n"))
        if diverged or damaged:
            raise typer.Exit(EXIT_FAILED)


UiStorageOption = Annotated[str | None, typer.Option("--storage", metavar="URL", show_default=False,
                                                  help="Storage URL instead of --dir: a directory, file:PATH, "
                                                       "sqlite:PATH or postgresql://...")]


@shared("dir", "storage", "debug", storage=UiStorageOption)
def ui(
    host: Annotated[str, typer.Option("--host", help="Address to listen on; any non-loopback address requires "
                                                     "a token ($DURABLY_UI_TOKEN, or one made and printed).")]
        = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on (0: any free port).")]
        = 8765,
    open_browser: Annotated[bool, typer.Option("--open", help="Open the console in the default browser.")] = False,
    opts: Options = OPTIONS,
) -> None:
    """Serve the web console and its JSON API over the runs in DIR or URL (needs `pip install 'durably-py\\[ui]'`)."""
    from .. import ui as console

    with opts.guard():
        engine = opts.engine()
        token = os.environ.get("DURABLY_UI_TOKEN") or None
        console.serve(engine, host=host, port=port, open_browser=open_browser, token=token,
                      announce=lambda line: err_console().print(Text(line, "green"), soft_wrap=True))


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
    with guard(debug):
        if restate is None:
            raise ValidationError("durably serve needs --restate",
                                  hint="durably serve --restate --import flows.py (or --restate URL, the ingress); "
                                       "see docs/restate.md.", docs="docs/restate.md#serving")
        admin = settings_for(None, None, restate or None, restate_admin).restate_admin
        from ..restate.commands import serve as serve_restate

        serve_restate(list(imports or []), host=host, port=port, admin=admin, register=not no_register,
                      announce=lambda uri, services: err_console().print(
                          Text(f"serving {', '.join(services)} at {uri}", "green")))
