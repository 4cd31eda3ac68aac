"""`durably budget RUN`: show a run's budget and spend, raise it (`--raise usd=5`: by that much; `--set usd=20`: to
that), which lets a run parked `over_budget` go on, or cancel the run (`--cancel`)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.text import Text

from .._config import parse_duration
from .._state.history import RunState
from ..errors import ValidationError
from .options import OPTIONS, Options, RunArgument, shared
from .render import err_console

DOCS = "docs/cli.md#durably-budget"
AmountOption = Annotated[list[str] | None, typer.Option(
    "--raise", metavar="KIND=N", show_default=False,
    help="Raise the budget by N of KIND (usd, tokens, units); repeat for several kinds.")]
SetOption = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KIND=N", show_default=False, help="Set the budget of KIND to N; repeat for several kinds.")]


def parse_amounts(items: list[str], flag: str) -> dict[str, float]:
    """`usd=5` pairs as a dict; a malformed one is a ValidationError naming it."""
    out: dict[str, float] = {}
    for item in items:
        kind, eq, number = item.partition("=")
        try:
            amount = float(number.strip().lstrip("$")) if eq else None
        except ValueError:
            amount = None
        if amount is None or not kind.strip():
            raise ValidationError(f"{flag} {item!r} is not KIND=N", hint=f"{flag} usd=5 (kinds: usd, tokens, units)",
                                  docs=DOCS)
        out[kind.strip()] = amount
    return out


def _money(amounts: dict[str, float] | None) -> str:
    if not amounts:
        return "none"
    return ", ".join(f"${v:.2f}" if k == "usd" else f"{v:g} {k}" for k, v in amounts.items())


@shared("dir", "storage", "as_json", "output", "debug", "restate")
def budget(
    run: RunArgument,
    raise_by: AmountOption = None,
    set_to: SetOption = None,
    cancel: Annotated[bool, typer.Option("--cancel", help="Cancel the run instead of raising its budget.")] = False,
    timeout: Annotated[str, typer.Option("--timeout", metavar="DURATION",
                                         help="How long to wait for a process holding the run to record it.")] = "30s",
    opts: Options = OPTIONS,
) -> None:
    """Show a run's budget and what it spent (per step label); --raise usd=5 raises it by that much, --set usd=20
    sets it: a run parked over_budget then goes on (a worker continues it; else `durably retry RUN`). --cancel
    cancels the run. A child that spends its parent's budget raises that budget."""
    as_json = opts.json_output()
    target = opts.local("durably budget")
    with opts.guard():
        engine = target.engine
        seconds = parse_duration(timeout)
        if cancel and (raise_by or set_to):
            raise ValidationError("--cancel goes alone, not with --raise or --set",
                                  hint="durably budget RUN --cancel", docs=DOCS)
        if raise_by and set_to:
            raise ValidationError("give --raise or --set, not both", hint="durably budget RUN --raise usd=5",
                                  docs=DOCS)
        if cancel:
            state: RunState = asyncio.run(engine.cancel(run, timeout=seconds))
            action = "cancelled"
        elif raise_by or set_to:
            amounts = parse_amounts(raise_by or set_to or [], "--raise" if raise_by else "--set")
            unknown = [k for k in amounts if k not in ("usd", "tokens", "units")]
            if unknown:
                raise ValidationError(f"unknown budget kind {unknown[0]!r}", hint="Use usd, tokens or units.",
                                      docs=DOCS)
            state = asyncio.run(engine.raise_budget(run, to=bool(set_to), timeout=seconds, **amounts))
            action = "raised"
        else:
            state = asyncio.run(engine.inspect(run))
            action = "shown"
    if as_json:
        opts.print_json({"run_id": state.run_id, "status": state.status, "action": action, "budget": state.budget,
                         "spent": {k: v for k, v in state.spent.items() if v}, "spent_by": state.spent_by,
                         "over_budget": state.over_budget})
        return
    console = err_console()
    spent = {k: v for k, v in state.spent.items() if v}
    console.print(Text(f"{state.run_id}: {state.status}; budget {_money(state.budget)}, spent {_money(spent)}",
                       "green" if action == "raised" else "yellow" if state.status == "over_budget" else ""))
    for label, amounts in sorted(state.spent_by.items(), key=lambda kv: -kv[1].get("usd", kv[1].get("tokens", 0))):
        console.print(f"  {label}: {_money(amounts)}")
    if action == "raised" and state.status in ("over_budget", "interrupted"):
        console.print(Text(f"due for the next worker; `durably retry {state.run_id}` continues it here", "green"))
