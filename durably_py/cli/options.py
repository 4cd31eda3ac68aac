"""The options the commands share (`--dir`, `--storage`, `--json`, `-o`, `--debug`, `--restate`,
`--restate-admin`, `--remote`, `--token`), declared once: `@shared(...)` puts them where a command's `opts: Options` parameter
stands, and `Options` resolves them into settings, an output format and a `Target`. Also the error guard
every command runs under, and shell completion of statuses, runs and workflows."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import _config as config
from .._authoring.workflow import REGISTRY
from .._engine.engine import Engine
from .._run_command import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    Output,
    exit_code,
    import_script,
    print_json,
    report_durably_error,
    report_exception,
    settings_for,
)
from .._state.history import RunState
from ..errors import DurablyError, ValidationError
from .target import LocalTarget, Target, engine_at, target_for

STATUSES = ("pending", "running", "interrupted", "needs_attention", "over_budget", "stale", "completed", "failed", "cancelled", "waiting", "sleeping",
            "paused", "corrupt")
OUTPUTS = ("table", "json", "jsonl")


# ---- errors -----------------------------------------------------------------------------------------------


@contextmanager
def guard(debug: bool) -> Iterator[None]:
    """Turn errors of a command into their message, hint and exit code."""
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except DurablyError as exc:
        report_durably_error(exc, debug)
        raise typer.Exit(exit_code(exc, started=False)) from None
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_TERMINATED if Output.terminated else EXIT_INTERRUPTED) from None
    except Exception as exc:  # noqa: BLE001 - shown as one red line, the traceback only with --debug
        report_exception(exc, debug)
        raise typer.Exit(EXIT_FAILED) from None


def output_mode(as_json: bool, output: str | None) -> str:
    """The output format a command prints in: `-o` wins, `--json` means json, else table."""
    if output is not None and output not in OUTPUTS:
        raise ValidationError(f"unknown output format {output!r}", hint=f"Use one of: {', '.join(OUTPUTS)}.",
                              docs="docs/cli.md#output-formats")
    return output or ("json" if as_json else "table")


# ---- completion of values: statuses, run ids and keys, workflow names ----------------------------------------


def complete_status(incomplete: str) -> list[str]:
    """`--status` values for shell completion."""
    return [status for status in STATUSES if status.startswith(incomplete)]


def _completing_runs(ctx: typer.Context, limit: int) -> list[RunState]:
    """The most recently active runs of the store the command line names ([] on any error: a shell completes)."""
    try:
        settings = settings_for(ctx.params.get("dir"), ctx.params.get("storage"))
        return asyncio.run(engine_at(settings).list(limit=limit))
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
                import_script(Path(script).resolve())
        except Exception:  # noqa: BLE001 - a script that does not import completes nothing
            return []
        return sorted(name for name in REGISTRY if name.startswith(incomplete))
    return sorted({state.workflow for state in _completing_runs(ctx, 500) if state.workflow.startswith(incomplete)})


# ---- the shared options ---------------------------------------------------------------------------------------

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
RemoteOption = Annotated[str | None, typer.Option("--remote", metavar="URL", show_default=False,
                                                  help="Act on the runs of the console (`durably ui`) at this URL, "
                                                       "over its JSON API (or $DURABLY_REMOTE; docs/cli.md#remote-"
                                                       "control).")]
TokenOption = Annotated[str | None, typer.Option("--token", metavar="TOKEN", show_default=False,
                                                 help="The remote console's token (or $DURABLY_UI_TOKEN, or the "
                                                      "?token= of the --remote URL).")]
RunArgument = Annotated[str, typer.Argument(metavar="RUN", help="A run id or a run key.", show_default=False,
                                            autocompletion=complete_run)]
StatusOption = Annotated[list[str] | None, typer.Option(
    "--status", "-s", metavar="STATUS", show_default=False, autocompletion=complete_status,
    help=f"Only runs with this status; repeat for any of several ({', '.join(STATUSES)}).")]

SHARED: dict[str, tuple[Any, Any]] = {  # parameter name: (its declaration, its default)
    "dir": (DirOption, None), "storage": (StorageOption, None), "as_json": (JsonOption, False),
    "output": (OutputOption, None), "debug": (DebugOption, False), "restate": (RestateOption, None),
    "restate_admin": (RestateAdminOption, None), "remote": (RemoteOption, None), "token": (TokenOption, None)}


@dataclass
class Options:
    """The shared options one command was given, and what they resolve to."""

    names: frozenset[str] = frozenset()  # the shared options the command declares
    dir: str | None = None
    storage: str | None = None
    as_json: bool = False
    output: str | None = None
    debug: bool = False
    restate: str | None = None
    restate_admin: str | None = None
    remote: str | None = None
    token: str | None = None
    jsonl: bool = field(default=False, init=False)  # `-o jsonl`: each JSON value on one line

    def guard(self) -> contextlib.AbstractContextManager[None]:
        """The command's errors as their message, hint and exit code (tracebacks with --debug)."""
        return guard(self.debug)

    def mode(self) -> str:
        """The output format: table, json or jsonl (a usage error for any other)."""
        return output_mode(self.as_json, self.output)

    def json_output(self) -> bool:
        """Whether the command prints JSON (`--json`, `-o json`, `-o jsonl`); a bad `-o` exits 2 here."""
        with self.guard():
            mode = self.mode()
        self.jsonl = mode == "jsonl"
        return mode != "table"

    def print_json(self, value: Any) -> None:
        """Print a JSON result: indented, or on one line with `-o jsonl`."""
        print_json(value, self.jsonl)

    def emit(self, value: Any, mode: str) -> None:
        """Print a JSON result in `mode`: indented (`json`), or a list one item per line (`jsonl`)."""
        if mode == "jsonl":
            for item in value if isinstance(value, list) else [value]:
                print_json(item, jsonl=True)
        else:
            self.print_json(value)

    def settings(self) -> config.Settings:
        """The effective settings: these flags, then the environment, the config files and discovery."""
        return settings_for(self.dir, self.storage, self.restate, self.restate_admin)

    def target(self) -> Target:
        """Where the command acts: the console of `--remote` (or $DURABLY_REMOTE) when the command takes it;
        Restate when it takes `--restate` and one is set; else the local store."""
        url = (self.remote or os.environ.get("DURABLY_REMOTE") or None) if "remote" in self.names else None
        remote = None if url is None else (url, self.token or os.environ.get("DURABLY_UI_TOKEN") or None)
        if remote is not None and (self.dir or self.storage):
            raise ValidationError("--remote and --dir/--storage name two places to act on",
                                  hint="Give --remote URL to act on a console's runs, or --dir/--storage for a store "
                                       "this machine reaches (unset $DURABLY_REMOTE for the latter).",
                                  docs="docs/cli.md#remote-control")
        return target_for(self.settings(), "restate" in self.names, remote)

    def local(self, command: str) -> LocalTarget:
        """The local store, for `command`, which Restate mode cannot run (exit 2 there)."""
        with self.guard():
            return self.target().local(command)

    def engine(self) -> Engine:
        """The engine over the local store the settings name (never created here)."""
        return LocalTarget(self.settings()).engine


OPTIONS = Options()  # what a command's `opts` parameter defaults to in its source; `@shared` always passes one


def shared(*names: str, **variants: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the shared options `names`, in that order, where its `opts: Options` parameter stands
    (so its `--help` lists them there); `variants` gives one of them a declaration of its own. The command
    is called with `opts`, an `Options` of the values given."""
    def wrap(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        params: list[inspect.Parameter] = []
        for param in signature.parameters.values():
            if param.name != "opts":
                params.append(param)
                continue
            for name in names:
                declared, default = SHARED[name]
                params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                                annotation=variants.get(name, declared)))

        @functools.wraps(command)
        def with_options(**given: Any) -> None:
            opts = Options(frozenset(names), **{name: given.pop(name) for name in names})
            command(**given, opts=opts)

        with_options.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        with_options.__annotations__ = {param.name: param.annotation for param in params} | {"return": None}
        return with_options

    return wrap


__all__ = ["OPTIONS", "DebugOption", "Options", "RemoteOption", "RestateAdminOption", "RunArgument", "STATUSES", "StatusOption",
           "TokenOption", "complete_run", "complete_status", "complete_workflow", "guard", "output_mode", "shared"]
