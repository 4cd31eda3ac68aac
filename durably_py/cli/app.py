"""The `durably` typer application: its help, `--version`, and the commands in the order `durably --help`
lists them; `main` is the entry point of `python -m durably_py.cli`."""

from __future__ import annotations

import contextlib
import signal as signals
import sys
from typing import Annotated

import typer

from .._run_command import EXIT_INTERRUPTED, EXIT_TERMINATED, Output, direct_run, on_sigterm
from . import admin, awakeables, budget, operate, queue, runs
from .run import RunCommand, run

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


app.command(cls=RunCommand)(run)
app.command("list")(runs.list_runs)
app.command()(runs.inspect)
app.command()(runs.graph)
app.command()(runs.diff)
app.command()(queue.schedules)
app.command()(operate.signal)
app.command()(operate.cancel)
app.command()(operate.pause)
app.command()(operate.resume)
app.command()(operate.retry)
app.command()(operate.fork)
app.command()(operate.restart)
app.command()(operate.adopt)
app.command()(operate.resolve)
app.command("resolve-awakeable")(awakeables.resolve_awakeable)
app.command()(budget.budget)
app.command()(admin.ui)
app.command()(runs.logs)
app.command()(runs.export)
app.command("replay-check")(admin.replay_check)
app.command("config")(admin.config_command)
app.command("init")(admin.init_command)
app.command("docs")(admin.docs_command)
app.command(cls=admin.ServeCommand)(admin.serve)
app.command()(queue.worker)
app.command()(queue.enqueue)
app.command()(queue.queues)
app.command()(admin.prune)


def main() -> None:
    """Entry point of the `durably` command line: SIGTERM is handled like Ctrl-C (exit 143); `durably run SCRIPT`
    without options runs without the parser."""
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signals.signal(signals.SIGTERM, on_sigterm)
    try:
        code = direct_run(sys.argv[1:])
        if code is not None:
            sys.exit(code)
        app(prog_name="durably")
    except KeyboardInterrupt:
        sys.exit(EXIT_TERMINATED if Output.terminated else EXIT_INTERRUPTED)
