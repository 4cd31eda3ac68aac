"""What a run records once and answers the same ever after (`Values`): `ctx.now()`, `ctx.random()`, `ctx.uuid()`,
the answers of `ctx.patched`, spend (`ctx.charge`) and notes (`ctx.annotate`)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid as uuidlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import records
from .._authoring.calls import check_budget_kind, current_attempt
from .._authoring.paths import Scope, current_scope
from .._clock import Clock
from .._codec import dump_value, load_error, load_value
from .._state.history import path_tuple
from ..errors import PurityError, StaleRunError, ValidationError
from .log import RunLog
from .turns import Turns

if TYPE_CHECKING:
    from .ports import Hooks


class Values:
    """The values one execution of a run records once, and reads back on replay."""

    def __init__(self, *, log: RunLog, turns: Turns, clock: Clock, owner: object, scope: Callable[[], Scope],
                 check_label: Callable[[str, Any, str], None],
                 replay_failed: Callable[[PurityError | StaleRunError], PurityError | StaleRunError],
                 record: Callable[[str, str | None, dict[str, float]], None]) -> None:
        self.log = log
        self.history = log.history
        self.done = log.history.done
        self.run_id = log.run_id
        self.turns = turns
        self.clock = clock
        self.owner = owner  # what an attempt of this run names as its kernel (`Attempt.kernel`)
        self.scope = scope
        self.check_label = check_label
        self.replay_failed = replay_failed
        self.record_charge = record  # `budgets.Meter.record`: writes the charge and counts it
        self.hooks: Hooks | None = None
        self.annotations: dict[str, int] = {}  # `ctx.annotate` calls made so far in this process, per strand

    def recorded(self, label: str, make: Callable[[], Any]) -> Any:
        """A value recorded once at the next path (ctx.now/random/uuid): live it is made, on replay read."""
        scope = self.scope()
        path = scope.alloc()
        rec = self.done.get(path)
        if rec is not None:
            self.check_label(path, rec, label)
            self.turns.take(path)
            if isinstance(rec, records.Err):
                raise load_error(rec.error)
            return load_value(rec.value)
        if self.hooks is not None:
            self.hooks.unrecorded(path, label, label)
        wire = dump_value(make(), label)
        self.log.write(records.Ok(attempt=1, path=path, label=label, value=wire, ms=0, ts=time.time()))
        self.log.step_done()
        return load_value(wire)

    def now(self) -> Any:
        return self.recorded("ctx.now", self.clock.now)

    def random(self) -> float:
        return self.recorded("ctx.random", random.random)

    def uuid(self) -> str:
        return self.recorded("ctx.uuid", lambda: str(uuidlib.uuid4()))

    def patched(self, change: str, deprecated: bool = False) -> bool:
        """`ctx.patched(change)`: True on the new code's branch, False in a run recorded before the change.

        The first answer is recorded and kept for the rest of the run. Without one, the run was recorded
        before the change exactly when it already holds work at or after the point the calling strand
        stands at (its next path, or a later position of an enclosing strand or loop); at its live frontier
        the answer is True. `deprecated` (`ctx.deprecate_patch`): the old branch is gone, so a run that
        answered (or would answer) False cannot go on and is stale."""
        if not isinstance(change, str) or not change or len(change) > 200:
            what = "ctx.deprecate_patch" if deprecated else "ctx.patched"
            raise ValidationError(f"{what} needs a change id of 1-200 characters, got {change!r}",
                                  hint="Name the change, e.g. ctx.patched('send-receipt-by-email').",
                                  docs="docs/versioning.md#ctxpatched")
        scope = self.scope()
        here = f"{scope.prefix}{scope.n}"
        rec = self.history.patches.get(change)
        if rec is None:
            value = not self.history.recorded_from(((scope.prefix, scope.n), *scope.outer))
            rec = records.Patch(change=change, path=here, value=value, ts=time.time())
            self.log.write(rec)
            self.history.patches.setdefault(change, rec)
        if deprecated and not rec.value:
            where = f"step path {path_tuple(rec.path)}"
            raise self.replay_failed(StaleRunError(
                f"run {self.run_id} is on the old branch of patch {change!r} (recorded before the change, at "
                f"{where}), but the code now calls ctx.deprecate_patch({change!r}): that branch was removed",
                hint=f"Deploy the code with `if ctx.patched({change!r}): ... else: <old branch>` again until "
                     f"`durably list --without-patch {change}` shows no unfinished run, then retry this run "
                     f"(`durably retry {self.run_id}`), or start it over with `durably restart {self.run_id}`.",
                docs="docs/versioning.md#retiring-the-old-branch", run_id=self.run_id, path=path_tuple(rec.path),
                recorded=f"patched({change!r}) = False", called=f"deprecate_patch({change!r})", patch=change))
        return rec.value

    def replaying(self) -> bool:
        """True while the calling strand is before the end of its recorded steps (or a wait or sleep it parked on)."""
        try:
            scope = current_scope.get()
        except LookupError:
            return False
        path = f"{scope.prefix}{scope.n}"
        return path in self.done or path in self.history.waits or path in self.history.wakes

    def charge(self, amounts: dict[str, float]) -> None:
        """Record spend; inside a step it is always new spend, in the workflow body it replays once."""
        for kind, amount in amounts.items():
            check_budget_kind(kind)
            if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount >= 0:
                raise ValidationError(f"charge {kind}={amount!r} must be a non-negative number",
                                      hint="Charge what was spent, e.g. ctx.charge(usd=0.02, tokens=1200).",
                                      docs="docs/policies.md#budgets")
        amounts = {k: float(v) for k, v in amounts.items() if v}
        att = current_attempt.get(None)
        if att is not None and att.kernel is self.owner:
            path = f"{att.path}@{uuidlib.uuid4().hex[:12]}"
            label: str | None = att.label
        else:
            path = "$" + self.scope().alloc()
            label = None  # `History.spent_by` names it ctx.charge by its path
            if path in self.history.charges:
                return
        self.record_charge(path, label, amounts)

    def annotate(self, values: dict[str, Any]) -> None:
        """Attach JSON values to the run (shown by inspect); the latest value of a name wins.

        A call the run already made (its strand is replaying, or the log has this call of its strand) writes
        nothing, so a resumed run never appends an older value again; a call inside a step is new each time
        the step runs."""
        wire = dump_value(values, "annotations")
        strand = index = None
        att = current_attempt.get(None)
        scope = current_scope.get(None) if att is None or att.kernel is not self.owner else None
        if scope is not None and (scope.owner is None or scope.owner is asyncio.current_task()):
            strand = scope.prefix
            index = self.annotations.get(strand, 0)
            self.annotations[strand] = index + 1
            if index <= self.history.noted.get(strand, -1) or self.replaying():
                return
        if any(self.history.notes.get(k, object()) != v for k, v in wire.items()):
            self.log.write(records.Note(notes=wire, strand=strand, index=index, ts=time.time()))
