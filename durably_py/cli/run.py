"""`durably run`: run a script as __main__ under durably, or one of its workflows, here or on Restate. The
work itself is `durably_py._run_command`'s (free of typer, for the console script's fast path)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from ..errors import ValidationError
from .options import OPTIONS, Options, complete_workflow, shared


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


@shared("dir", "storage", "as_json", "output", "debug", "restate", "restate_admin")
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
    opts: Options = OPTIONS,
) -> None:
    """Run SCRIPT as __main__ under durably, with a live progress view on stderr; or one of its workflows."""
    as_json = opts.json_output()
    with opts.guard():
        target = opts.target()
        if not script.is_file():
            raise ValidationError(f"no script file {str(script)!r}",
                                  hint="Pass the path of a Python file, e.g. durably run job.py.")
        if workflow is None and (input is not None or key is not None or fresh or no_wait):
            raise ValidationError("--input, --key, --fresh and --no-wait need --workflow NAME",
                                  hint="Without --workflow the script's own run(...) calls decide input and key; "
                                       "pass them as script arguments after `--`.")
    code = target.run(script.resolve(), list(args or []), workflow=workflow, input=input, key=key, fresh=fresh,
                      no_wait=no_wait, as_json=as_json, jsonl=opts.jsonl, debug=opts.debug)
    raise typer.Exit(code)
