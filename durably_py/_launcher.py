"""The `durably` console script's entry: `durably run SCRIPT [ARGS...]` without options runs straight away;
every other command line goes to the typer application in `cli`.

Importing typer and building its parser (which imports click and builds a validator per parameter) costs
more than the rest of a one-step run, and a command line without options needs none of it: the script path
and its arguments are all there is to read. Anything with an option (`-x`, `--x`, before a `--`), and a run
on Restate (an ingress from `$DURABLY_RESTATE` or the config), goes through typer.
"""

from __future__ import annotations

import contextlib
import signal
import sys


def main() -> None:
    """Entry point of the `durably` console script: SIGTERM is handled like Ctrl-C (exit 143)."""
    from ._run_command import EXIT_INTERRUPTED, EXIT_TERMINATED, Output, direct_run, on_sigterm

    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code = direct_run(sys.argv[1:])
    except KeyboardInterrupt:
        sys.exit(EXIT_TERMINATED if Output.terminated else EXIT_INTERRUPTED)
    if code is not None:
        sys.exit(code)
    from .cli import main as cli_main

    cli_main()
