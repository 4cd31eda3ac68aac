"""A run's budget as one execution of it meters it (`Meter`): what it may spend, what it spent, what its running
steps hold, the charges its steps' results stand for, and what happens when the money runs out.

Spend lives in the log (`charge` records): a replay recounts it from there, never again from the calls, so a
run's spend is counted once across replays and crashes. Before a step starts, the budget must have room for
the step's reservation (`ctx.step(reserve=)`, held while it runs and replaced by its actual charge after); a
run without room **parks** as `over_budget` (a `park` record with its limit, what it spent and on what), holding
no process in a worker, or waiting in its own process for a raise, until `Engine.raise_budget` records a larger
budget (a `budget` record, or a ``$budget`` request to the process that holds it). With
``on_exhausted="raise"`` it raises `BudgetExceededError` instead, as before parking existed.

A child run with no budget of its own spends from the budget of its nearest ancestor created with one (its
*owner*): before each of its steps the owner's budget and the spend of the owner and all its descendants are
read through the store. See docs/policies.md#budgets.
"""

from __future__ import annotations

import sys
import time
import uuid as uuidlib
from typing import TYPE_CHECKING, Any

from .. import records
from .._authoring.calls import check_budget_kind
from .._authoring.usage import charges_of
from .._state.history import BUDGET_KINDS, History
from ..errors import BudgetExceededError, ValidationError
from .control import Control
from .log import RunLog
from .stops import Rest

if TYPE_CHECKING:
    from ..storage.base import Storage

REQUEST = "$budget"
"""The control request (and wake-up signal) of a budget raise for a run a process holds."""

DOCS = "docs/policies.md#budgets"
TREE_MAX = 10_000  # descendants read for a shared budget's spend at most


def apply_raise(budget: dict[str, float] | None, payload: Any) -> dict[str, float]:
    """The budget after a raise: ``{"add": {kind: n}}`` adds to each kind's limit (a kind without one gets
    `n`), ``{"set": {kind: n}}`` sets it; other kinds keep theirs."""
    out = dict(budget or {})
    if not isinstance(payload, dict):
        return out
    for how in ("add", "set"):
        amounts = payload.get(how)
        if not isinstance(amounts, dict):
            continue
        for kind, amount in amounts.items():
            if kind not in BUDGET_KINDS or isinstance(amount, bool) or not isinstance(amount, int | float):
                continue
            out[kind] = float(amount) + (out.get(kind, 0.0) if how == "add" else 0.0)
    return out


_OWNERS: dict[tuple[int, str], str | None] = {}  # (storage, run) -> its budget owner: headers never change


def owner_of(storage: Storage, parent: str | None) -> str | None:
    """The nearest of run `parent` and its ancestors created with a budget (whose budget a child of `parent`
    with none of its own spends), or None. Read from the runs' headers, which never change, once per process."""
    key = (id(storage), parent or "")
    if parent is None:
        return None
    if key in _OWNERS:
        return _OWNERS[key]
    found: str | None = None
    seen: set[str] = set()
    run: Any = parent
    while isinstance(run, str) and run not in seen:
        seen.add(run)
        try:
            info = storage.info(run)
        except Exception:  # noqa: BLE001 - a damaged ancestor never fails a run: it spends no shared budget
            info = None
        if info is None:
            break
        if info.header.get("budget"):
            found = run
            break
        run = info.header.get("parent")
    if len(_OWNERS) >= 4096:
        _OWNERS.clear()
    _OWNERS[key] = found
    return found


def tree_spent(storage: Storage, owner: str, mine: str, spent: dict[str, float]) -> tuple[
        dict[str, float] | None, dict[str, float], dict[str, dict[str, float]]]:
    """The budget of run `owner` and what it and all its descendants spent (in total, and per label), read
    through the store; run `mine` (this process's, mid-execution) counts with `spent`, its in-memory spend."""
    totals = dict.fromkeys(BUDGET_KINDS, 0.0)
    by: dict[str, dict[str, float]] = {}
    budget: dict[str, float] | None = None
    queue, seen = [owner], set[str]()
    while queue and len(seen) < TREE_MAX:
        run_id = queue.pop()
        if run_id in seen:
            continue
        seen.add(run_id)
        log = storage.read(run_id)
        if log is None:
            continue
        try:
            history = History(log.records, log.where)
        except Exception:  # noqa: BLE001 - a damaged log never fails a run: it counts as no spend
            continue
        if run_id == owner:
            budget = history.budget
        amounts = spent if run_id == mine else history.spent()
        for kind, amount in amounts.items():
            totals[kind] = totals.get(kind, 0.0) + amount
        for label, kinds in history.spent_by().items():
            mine_by = by.setdefault(label, {})
            for kind, amount in kinds.items():
                mine_by[kind] = mine_by.get(kind, 0.0) + amount
        queue.extend(info.run_id for info in storage.list_runs(parent=run_id))
    return budget, totals, by


class Meter:
    """The budget of one execution of a run, and the money its steps spend."""

    def __init__(self, *, log: RunLog, control: Control, storage: Storage, spent: dict[str, float],
                 budget: dict[str, float] | None) -> None:
        self.log = log
        self.history = log.history
        self.run_id = log.run_id
        self.control = control
        self.storage = storage
        self.spent = spent  # this run's own spend, from its log (shared with `Values`)
        self._budget = budget
        self._owner: str | None = None
        self.checks = budget is not None  # `active`, kept as a plain attribute: every step reads it
        self.reserved: dict[str, float] = {}  # what this process's running steps hold
        self.on_exhausted = "park"
        self.told = False
        self.children_seen = False
        self.next_look = 0.0
        control.requests[REQUEST] = self.requested

    @property
    def budget(self) -> dict[str, float] | None:
        """This run's own budget (None: none, or its owner's)."""
        return self._budget

    @budget.setter
    def budget(self, budget: dict[str, float] | None) -> None:
        self._budget = budget
        self.checks = budget is not None or self._owner is not None

    @property
    def owner(self) -> str | None:
        """The ancestor whose budget this run spends (None: its own)."""
        return self._owner

    @owner.setter
    def owner(self, owner: str | None) -> None:
        self._owner = owner
        self.checks = self._budget is not None or owner is not None

    @property
    def active(self) -> bool:
        """Whether steps are checked against a budget at all."""
        return self.checks

    # ---- the budget in force, and what it has left ---------------------------------------------
    def state(self) -> tuple[dict[str, float] | None, dict[str, float], str]:
        """(the budget in force, the spend counted against it, the run whose budget it is)."""
        if self.owner is not None:
            budget, spent, _ = tree_spent(self.storage, self.owner, self.run_id, self.spent)
            return budget, spent, self.owner
        if self.budget is None:
            return None, self.spent, self.run_id
        if not self.children_seen and time.monotonic() >= self.next_look:
            self.next_look = time.monotonic() + 0.5
            self.children_seen = bool(self.storage.list_runs(parent=self.run_id, limit=1))
        if self.children_seen:
            _, spent, _ = tree_spent(self.storage, self.run_id, self.run_id, self.spent)
            return self.budget, spent, self.run_id
        return self.budget, self.spent, self.run_id

    def short(self, reserve: dict[str, float] | None) -> tuple[str, float, float, dict[str, float]] | None:
        """The first kind the budget has no room for (with `reserve` held too): (kind, needed, limit, spent);
        None when it fits."""
        budget, spent, _ = self.state()
        if not budget:
            return None
        for kind, limit in budget.items():
            need = spent.get(kind, 0.0) + self.reserved.get(kind, 0.0) + (reserve or {}).get(kind, 0.0)
            if need > limit:
                return kind, need, limit, spent
        return None

    # ---- before and after a step ----------------------------------------------------------------
    async def admit(self, path: str, label: str, reserve: dict[str, float] | None) -> None:
        """Before the step at `path` starts: wait (or park) until the budget has room for it and its
        reservation, then hold the reservation (`release` gives it back)."""
        over = self.short(reserve)
        if over is not None:
            if self.on_exhausted == "raise":
                kind, need, limit, _ = over
                raise BudgetExceededError(
                    f"run {self.run_id} spent {need:g} {kind}, over its budget of {limit:g}",
                    hint=f"Raise it with `durably budget {self.run_id} --raise {kind}={limit:g}` and retry the run; "
                         "the spend so far is kept.", kind=kind, spent=need, limit=limit)
            await self.exhausted(path, label, reserve, over)
        if reserve:
            for kind, amount in reserve.items():
                self.reserved[kind] = self.reserved.get(kind, 0.0) + amount

    def release(self, reserve: dict[str, float] | None) -> None:
        """The step that held `reserve` ended: its actual charge (if any) replaces the reservation."""
        if reserve:
            for kind, amount in reserve.items():
                self.reserved[kind] = max(0.0, self.reserved.get(kind, 0.0) - amount)

    def charge_result(self, path: str, label: str, value: Any, charge: Any = None) -> None:
        """Charge what the step's result `value` says it cost (a model response's usage, or `charge=`)."""
        try:
            amounts = charges_of(value, charge)
        except ValidationError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken extractor is the user's error, named
            raise ValidationError(f"reading the usage of step {label!r}'s result failed: {type(exc).__name__}: "
                                  f"{exc}", hint="Fix the extractor, or pass charge=False to the step.",
                                  docs=DOCS) from exc
        if amounts:
            self.record(f"{path}@{uuidlib.uuid4().hex[:12]}", label, amounts)

    def record(self, path: str, label: str | None, amounts: dict[str, float]) -> None:
        """Write one charge and count it."""
        for kind, amount in amounts.items():
            check_budget_kind(kind)
            if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount >= 0:
                raise ValidationError(f"charge {kind}={amount!r} must be a non-negative number",
                                      hint="Charge what was spent, e.g. {'usd': 0.02, 'tokens': 1200}.", docs=DOCS)
        self.log.write(records.Charge(path=path, amounts=amounts, label=label, ts=time.time()))
        budget = self.budget
        for kind, amount in amounts.items():
            self.spent[kind] = self.spent.get(kind, 0.0) + amount
            if budget and budget.get(kind, 0) > 0:
                self.log.advise("BUDGET_NEAR", self.spent[kind] / budget[kind],
                                f"spent {self.spent[kind]:g} of the {budget[kind]:g} {kind} budget")

    # ---- over budget ---------------------------------------------------------------------------
    async def exhausted(self, path: str, label: str, reserve: dict[str, float] | None,
                        over: tuple[str, float, float, dict[str, float]]) -> None:
        """No room for the step at `path`: rest until a raise makes room. A run a worker serves (or run with
        `wait=False`) parks as `over_budget` meanwhile; a run waiting in its own process says so and waits."""
        control = self.control
        kind, need, limit, _ = over
        budget, spent, owner = self.state()
        _, _, by = tree_spent(self.storage, owner, self.run_id, self.spent) if owner != self.run_id or \
            self.children_seen else (None, None, self.history.spent_by())
        summary = {"limit": budget or {}, "spent": {k: v for k, v in spent.items() if v}, "by": by, "owner": owner,
                   "kind": kind, "needed": need, "reserve": reserve or {}}
        money = f"${need:.2f} of ${limit:.2f}" if kind == "usd" else f"{need:g} of {limit:g} {kind}"
        detail = f"over budget before step {label!r}: {money}"
        park = records.Park(path=path, budget=summary, ts=time.time())
        # held reservations of steps running now come back when they end: no park for those, only a wait
        rest = Rest("over_budget", detail, parkable=not control.wait and not any(self.reserved.values()),
                    signal=REQUEST, record=park, path=path, label=label)
        marked = False
        if control.wait:  # waits here: the log says so at once, for `list` and the console
            self.log.write(park)
            self.log.sync()
            marked = True
            if not self.told:
                self.told = True
                print(f"durably: run {self.run_id} is {detail}; raise it with `durably budget {owner} --raise "
                      f"{kind}=N` (or cancel it: `durably budget {owner} --cancel`); waiting", file=sys.stderr)
        with control.resting(rest):
            while True:
                await control.boundary(force=True)
                if self.short(reserve) is None:
                    break
                rest.parkable = not control.wait and not any(self.reserved.values())
                control.turns.wake()
                await control.clock.sleep(control.poll)
        if marked and self.history.over_budget is not None:
            self.log.write(records.Budget(budget=self.history.budget, ts=time.time()))  # ends the park

    def requested(self, message: dict[str, Any]) -> None:
        """A ``$budget`` request reached the process that holds the run: record the raised budget."""
        raised = apply_raise(self.budget, message.get("payload"))
        if raised == self.budget:
            return
        self.budget = raised
        self.log.write(records.Budget(budget=raised, ts=time.time()))
        self.log.sync()

