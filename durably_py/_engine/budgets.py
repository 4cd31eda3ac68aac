"""Raising a run's budget from outside (`raise_budget`): what lets a run parked `over_budget` go on.

The budget lives in the log of the run that owns it (a child with none of its own spends its nearest budgeted
ancestor's, `_replay.budgets.owner_of`). A raise of a run no process holds appends a `budget` record (through
`amend`: no claim, no workflow attempt); a run a process holds gets a ``$budget`` control request in its inbox,
which that process records at its next boundary (while it waits over budget, at once). Then every over-budget
run spending that budget (the owner and its descendants) no process holds is due again, as a signal makes a
waiting run due: a worker continues it, or the next `run()` / `durably retry`.

Raise semantics: amounts are added to the current limits (a kind without a limit gets the amount); ``to=True``
sets the limits instead. See docs/policies.md#budgets.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import secrets
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .. import records as log_format
from .._codec import to_iso
from .._replay.budgets import REQUEST, apply_raise, owner_of
from .._state.history import BUDGET_KINDS, History, RunState, run_status
from ..errors import ValidationError

if TYPE_CHECKING:
    from ..storage.base import Storage
    from .operations import Operations

DOCS = "docs/policies.md#budgets"
POLL = 0.05
EXHAUSTED = ("park", "raise")
ON_EXHAUSTED: contextvars.ContextVar[str | None] = contextvars.ContextVar("durably_on_exhausted", default=None)
"""`run(..., on_exhausted=)` for the runs this call's task executes (its in-process child runs included)."""


def check_exhausted(value: Any) -> str:
    """`on_exhausted=`: what a run does when its budget runs out ("park", the default, or "raise")."""
    if value not in EXHAUSTED:
        raise ValidationError(f"on_exhausted= must be 'park' or 'raise', got {value!r}",
                              hint="'park' (the default) parks the run over_budget until its budget is raised; "
                                   "'raise' fails the step with BudgetExceededError.", docs=DOCS)
    return str(value)


def check_amounts(amounts: dict[str, Any]) -> dict[str, float]:
    """The amounts of a raise: at least one kind, each a finite number >= 0."""
    given = {k: v for k, v in amounts.items() if v is not None}
    if not given:
        raise ValidationError("a budget raise names no amount", hint="durably budget RUN --raise usd=5 (or "
                              "engine.raise_budget(run, usd=5)); kinds: " + ", ".join(BUDGET_KINDS), docs=DOCS)
    for kind, amount in given.items():
        if kind not in BUDGET_KINDS:
            raise ValidationError(f"unknown budget kind {kind!r}", hint=f"Use one of {', '.join(BUDGET_KINDS)}.",
                                  docs=DOCS)
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not math.isfinite(amount) \
                or amount < 0:
            raise ValidationError(f"budget {kind}={amount!r} must be a finite number >= 0",
                                  hint="durably budget RUN --raise usd=5", docs=DOCS)
    return {k: float(v) for k, v in given.items()}


def parked_hint(storage: Storage, run_id: str) -> str:
    """The next move for a run parked over its budget."""
    log = storage.read(run_id)
    owner = run_id
    kind = "usd"
    if log is not None:
        try:
            over = History(log.records, log.where).over_budget or {}
            owner = over.get("owner") or run_id
            kind = over.get("kind") or kind
        except Exception:  # noqa: BLE001 - the hint falls back to the run itself
            pass
    return (f"Raise its budget with `durably budget {owner} --raise {kind}=N` (or engine.raise_budget), then run "
            f"it again (a worker continues it by itself); or cancel it with `durably budget {owner} --cancel`. "
            "What it spent, and on what, is in `durably inspect`.")


def descendants(storage: Storage, run_id: str, limit: int = 10_000) -> list[str]:
    """The run and every descendant of it that has not ended, the run first."""
    out: list[str] = []
    queue, seen = [run_id], set[str]()
    while queue and len(seen) < limit:
        current = queue.pop(0)
        if current in seen:
            continue
        seen.add(current)
        out.append(current)
        queue.extend(info.run_id for info in storage.list_runs(parent=current, state="open"))
    return out


async def raise_budget(ops: Operations, run: str, amounts: dict[str, Any], *, to: bool = False,
                       timeout: float = 30.0) -> RunState:
    """Raise (or with `to`, set) the budget that run `run` spends; wake the runs over it. See the module."""
    given = check_amounts(amounts)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise ValidationError(f"timeout= must be seconds >= 0, got {timeout!r}", hint="timeout=30", docs=DOCS)
    run_id = ops.runs.resolve(run)
    history = ops.history(run_id)
    target = run_id
    if history.budget is None:
        target = owner_of(ops.storage, history.header.parent) or run_id
        if target != run_id:
            history = ops.history(target)
    status = run_status(history, ops.storage.held(target))
    if status in ("completed", "cancelled"):
        raise ValidationError(f"run {target} is {status}; its budget no longer matters",
                              hint=f"`durably restart {target}` runs it again (with budget=).", docs=DOCS,
                              run_id=target, status=status)
    payload = {"set" if to else "add": given}
    deadline = time.monotonic() + timeout
    asked: str | None = None
    while True:
        if not ops.storage.held(target):
            if asked is not None and not any(m.get("id") == asked for m in ops.storage.inbox(target)):
                break  # the holder recorded it before letting go
            if asked is not None:
                ops.storage.ack(target, asked)  # recorded here instead
            if ops.amend(target, lambda h: log_format.Budget(budget=apply_raise(h.budget, payload), ts=time.time())):
                break
            continue
        if asked is None:
            asked = secrets.token_hex(8)
            ops.storage.send(target, log_format.encode(log_format.Signal(
                id=asked, name=REQUEST, payload=payload, at=to_iso(datetime.now(UTC)))))
        elif not any(m.get("id") == asked for m in ops.storage.inbox(target)) or time.monotonic() >= deadline:
            break  # taken by the holder (or left for it to take at its next boundary)
        await asyncio.sleep(POLL)
    for current in descendants(ops.storage, target):
        if ops.storage.held(current):
            continue
        try:
            over = run_status(ops.history(current), False)
        except Exception:  # noqa: BLE001 - a damaged log is left alone; the others are woken
            continue
        if over in ("over_budget", "interrupted"):
            ops.storage.schedule(current, time.time())
    return await ops.runs.inspect(run_id)
