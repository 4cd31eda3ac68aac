"""Workflows the console's form and resolve tests run for real (`durably run tests/form_flows.py --workflow NAME`):
waits with a schema (a Struct, a bool, none) and a `replay="unsafe"` charge to cut off."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from durably_py import workflow


class Expense(msgspec.Struct):
    """What an approver fills in."""

    amount: Annotated[int, msgspec.Meta(ge=1, le=10_000)]
    reason: str
    urgent: bool = False
    level: Literal["low", "high"] = "low"
    note: str | None = None


@workflow
async def expense_form(ctx: Any, who: str) -> str:
    """Wait for an `Expense` from a form, then report it."""
    got = await ctx.wait_for("expense", Expense, timeout=600)
    return f"{who}: {got.amount} for {got.reason} ({got.level}{', urgent' if got.urgent else ''})"


@workflow
async def expense_awakeable(ctx: Any, who: str) -> str:
    """An awakeable with the same schema: the console renders it as a form too."""
    got = await (await ctx.awakeable(timeout=600, schema=Expense, name="expense"))
    return f"{who}: {got.amount} for {got.reason}"


@workflow
async def go_no_go(ctx: Any, _: Any = None) -> str:
    """Wait for a plain yes or no."""
    return "approved" if await ctx.wait_for("go", bool, timeout=600) else "denied"


@workflow
async def free_form(ctx: Any, _: Any = None) -> Any:
    """Wait for any JSON value: no schema."""
    return await ctx.wait_for("data", timeout=600)


def note(folder: str, what: str) -> None:
    with open(Path(folder) / "effects.log", "a") as out:
        out.write(what + "\n")


def book(folder: str, order: str) -> str:
    note(folder, f"book {order}")
    return f"{folder}|{order}"  # what unbook gets


def unbook(order: str) -> None:
    folder, _, name = order.partition("|")
    note(folder, f"unbook {name}")


def charge(folder: str, order: str) -> dict[str, str]:
    """The unsafe effect: the first attempt of an order hangs (the test kills it there); a rerun returns."""
    note(folder, f"charge {order}")
    marker = Path(folder) / f"charging-{order}"
    if not marker.exists():
        marker.touch()
        time.sleep(600)
    return {"charged": order}


@workflow
async def unsafe_charge(ctx: Any, spec: dict[str, str]) -> Any:
    """Book (compensated by unbook), then an unsafe charge, then done."""
    folder, order = spec["dir"], spec["order"]
    await ctx.step(book, folder, order, compensate=unbook)
    return await ctx.step(charge, folder, order, replay="unsafe")
