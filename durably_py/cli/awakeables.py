"""`durably resolve-awakeable`: resolve (or reject) an awakeable by id from the command line, also while no
process runs its run."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.text import Text

from .._run_command import parse_input
from ..errors import ValidationError
from .options import OPTIONS, Options, shared
from .render import err_console
from .target import RestateTarget


@shared("dir", "storage", "as_json", "output", "debug", "restate", "restate_admin")
def resolve_awakeable(
    awakeable: Annotated[str, typer.Argument(metavar="ID", show_default=False,
                                             help="The awakeable's id (`a.id` in the workflow; `durably inspect` "
                                                  "shows it).")],
    value: Annotated[str | None, typer.Argument(metavar="JSON", show_default=False,
                                                help="The value its await returns: JSON, or @file.json "
                                                     "(default: null).")] = None,
    reject: Annotated[str | None, typer.Option("--reject", metavar="MESSAGE", show_default=False,
                                               help="Reject it instead: its await raises AwakeableRejectedError "
                                                    "with MESSAGE.")] = None,
    opts: Options = OPTIONS,
) -> None:
    """Resolve awakeable ID with JSON (or reject it with --reject MESSAGE): the run waiting on it continues, at
    once in the process that waits, else with the next worker (or `durably retry`). Refused, with nothing
    changed (exit 2), when it is unknown, resolved already, past its deadline, or JSON does not match its schema."""
    as_json = opts.json_output()
    with opts.guard():
        if reject is not None and value is not None:
            raise ValidationError("give the value JSON or --reject MESSAGE, not both",
                                  hint="durably resolve-awakeable ID '{\"ok\": true}', or durably resolve-awakeable "
                                       "ID --reject 'declined'", docs="docs/cli.md#durably-resolve-awakeable")
        target = opts.target()
        if isinstance(target, RestateTarget):
            target.client.resolve_awakeable(awakeable, parse_input(value, "JSON") if reject is None else None,
                                            error=reject)
            if as_json:
                opts.print_json({"awakeable": awakeable, "rejected": reject is not None, "resolved": True})
            else:
                err_console().print(Text(f"{'rejected' if reject is not None else 'resolved'} {awakeable} on "
                                         f"{target.where()}", "green"))
            return
        engine = target.local("durably resolve-awakeable").engine
        if reject is not None:
            done = asyncio.run(engine.reject_awakeable(awakeable, reject))
        else:
            done = asyncio.run(engine.resolve_awakeable(awakeable, parse_input(value, "JSON")))
    if as_json:
        opts.print_json(done.to_dict())
        return
    how = "rejected" if done.rejected else "resolved"
    then = "the process waiting on it continues it" if done.held else \
        f"due for the next worker or re-run (`durably retry {done.run_id}` continues it now)"
    console = err_console()
    console.print(Text(f"{how} {done.awakeable}", "green"))
    console.print(Text(then, "bright_black"))
