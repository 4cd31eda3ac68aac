"""Operations on runs by id: cancel, pause and resume through one request-and-wait path; retry, restart, signal.

Cancel, pause and resume differ only in their policy (`Cancel`, `Pause`, `Resume`): which status is the goal,
which statuses refuse the operation, the record that does it to a run no process holds, and which attached
children follow. The path they share (`Operations.operate`) reads the run; appends the record itself when no
process holds the run; otherwise puts a control request (``$cancel``, ``$pause``, ``$resume``) in the run's inbox
for the holding process to act on at its next boundary, and waits for that until `timeout`; then applies the
same operation to the attached children.
"""

from __future__ import annotations

import asyncio
import builtins
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from .. import records as log_format
from .._codec import dump_error, dump_value, load_value, to_iso
from .._events import StepEvent
from .._replay.kernel import Selector, selects
from .._state.history import History, RunState, SignalSent, path_tuple, run_status
from ..errors import CorruptLogError, DurablyError, RunCancelledError, RunNotFoundError, ValidationError
from ..storage.base import validate_name

if TYPE_CHECKING:
    from .._authoring.workflow import Workflow
    from .._clock import Clock
    from ..storage.base import Storage
    from .runs import Runs

JOIN_POLL = 0.05
ALL_REQUESTS = ("$cancel", "$pause", "$resume")


def _cancelled_end(history: History) -> log_format.End | None:
    """The end record that cancels a run no process holds (None when it already ended otherwise)."""
    if history.end is not None and history.end.status != "failed":
        return None
    run_id = history.header.run_id
    error = RunCancelledError(f"run {run_id} was cancelled", run_id=run_id)
    return log_format.End(status="cancelled", error=dump_error(error), ts=time.time())


class Operation:
    """What one of cancel, pause and resume does at each turn of the shared request-and-wait path."""

    name = ""
    request = ""
    docs = ""
    wait_hint = ""
    cascade_on_timeout = False  # whether the attached children follow when the holder did not act in time

    def settled(self, ops: Operations, run_id: str, history: History, held: bool, asked: bool, acted: bool) -> bool:
        """True once the run is where the operation leads; raises when the operation cannot apply."""
        raise NotImplementedError

    def record(self, history: History) -> log_format.Record | None:
        """The record that does the operation to a run no process holds (None: nothing left to do)."""
        raise NotImplementedError

    def after_amend(self) -> tuple[str, ...]:
        """The control requests that an appended record supersedes."""
        return ("$pause", "$resume")

    def after_done(self) -> tuple[str, ...]:
        """The control requests left over once the operation has taken effect."""
        return ()

    def payload(self) -> Any:
        """What the control request carries to the process that holds the run."""
        return None

    def follows(self, child_status: str) -> bool:
        """Whether an attached child in `child_status` gets the same operation."""
        return True


class Cancel(Operation):
    """End the run as cancelled, after the clean-up its workflow does when it is cancelled (`compensate`: the
    compensations of its completed steps run too; `cleanup`: seconds the clean-up may take, None: the engine's)."""

    name, request, docs = "cancel", "$cancel", "docs/operations.md#cancel"
    wait_hint = "cancel(run, timeout=30) waits up to 30 s for the running process to stop."

    def __init__(self, compensate: bool = False, cleanup: float | None = None, default: float = 60.0,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.compensate = compensate
        self.cleanup = cleanup
        self.default, self.now = default, now  # the cancelling engine's window and clock, for a run it cleans up

    def payload(self) -> Any:
        return {"compensate": self.compensate, "cleanup": self.cleanup}

    def settled(self, ops: Operations, run_id: str, history: History, held: bool, asked: bool, acted: bool) -> bool:
        status = history.end.status if history.end is not None else None
        if status == "completed":
            late = " before the cancel request took effect" if asked else ""
            ops.drop_requests(run_id)
            raise ValidationError(f"run {run_id} already completed{late}; there is nothing to cancel",
                                  hint=f"`durably restart {run_id}` runs it again from the start.",
                                  docs=self.docs, run_id=run_id)
        return status == "cancelled" and not (held and asked)  # once asked, until the holder lets go

    def record(self, history: History) -> log_format.Record | None:
        """A run that did work and has not ended is cancelled by a `cancel` record (its workflow then runs its
        clean-up, `Operations.clean_up`); one that did nothing, or failed, ends cancelled at once."""
        if history.end is None and history.cancel is None and (history.done or history.waits or history.wakes):
            window = self.default if self.cleanup is None else self.cleanup
            until = to_iso(self.now() + timedelta(seconds=window))
            return log_format.Cancel(compensate=self.compensate, until=until, ts=time.time())
        if history.cancel is not None and history.end is None:
            return None  # cancelled already: its clean-up is under way
        return _cancelled_end(history)

    def after_amend(self) -> tuple[str, ...]:
        return ()

    def after_done(self) -> tuple[str, ...]:
        return ALL_REQUESTS


class Pause(Operation):
    """Park the run as paused until it is resumed."""

    name, request, docs = "pause", "$pause", "docs/operations.md#pause-and-resume"
    wait_hint = "pause(run, timeout=30) waits up to 30 s for the running process."

    def settled(self, ops: Operations, run_id: str, history: History, held: bool, asked: bool, acted: bool) -> bool:
        status = run_status(history, held)
        if status in ("completed", "cancelled"):
            late = " before the pause request took effect" if asked else ""
            if asked:
                ops.drop_requests(run_id, ("$pause",))
            raise ValidationError(f"run {run_id} already {status}{late}; there is nothing to pause",
                                  hint=f"`durably restart {run_id}` runs it again from the start.",
                                  docs=self.docs, run_id=run_id)
        return status == "paused"

    def record(self, history: History) -> log_format.Record | None:
        if run_status(history, False) in ("paused", "completed", "cancelled"):
            return None
        return log_format.Pause(ts=time.time())

    def follows(self, child_status: str) -> bool:
        return child_status != "paused"


class Resume(Operation):
    """Let a paused run continue."""

    name, request, docs = "resume", "$resume", "docs/operations.md#pause-and-resume"
    wait_hint = "resume(run, timeout=30) waits up to 30 s for the running process."
    cascade_on_timeout = True

    def settled(self, ops: Operations, run_id: str, history: History, held: bool, asked: bool, acted: bool) -> bool:
        status = run_status(history, held)
        if status == "paused":
            return False
        if asked or acted:
            return True
        raise ValidationError(f"run {run_id} is {status}, not paused; there is nothing to resume",
                              hint=f"`durably pause {run_id}` pauses it; `durably retry {run_id}` continues an "
                                   "interrupted or failed run.", docs=self.docs, run_id=run_id)

    def record(self, history: History) -> log_format.Record | None:
        return log_format.Resume(ts=time.time()) if history.paused else None

    def follows(self, child_status: str) -> bool:
        return child_status == "paused"


CANCEL, PAUSE, RESUME = Cancel(), Pause(), Resume()

BULK_STATUSES = {
    "cancel": ("pending", "running", "interrupted", "stale", "failed", "waiting", "sleeping", "paused",
               "needs_attention"),
    "resume": ("paused",),
    "retry": ("failed", "interrupted"),
}
"""The statuses each operation by filter can act on; with no `status=` it selects runs in any of them."""


@dataclass
class BulkResult:
    """What an operation by filter did: the runs it selected, those it acted on (their state afterwards) and,
    for each run it could not act on, why (a run that changed status meanwhile, a damaged log, ...). With
    `dry_run=True` only `selected` is filled and nothing is touched."""

    operation: str
    selected: list[str] = field(default_factory=list)  # run ids, newest first
    acted: list[RunState] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # run id -> why it was not acted on


def bulk_filter(operation: str, status: str | Iterable[str] | None,
                workflow: str | None) -> tuple[builtins.list[str], str | None]:
    """The statuses and workflow an operation by filter selects, checked: only statuses it can act on."""
    allowed = BULK_STATUSES[operation]
    if workflow is not None and (not isinstance(workflow, str) or not workflow):
        raise ValidationError(f"workflow= must be a workflow name, got {workflow!r}",
                              hint=f"{operation}_many(workflow='nightly') selects the runs of one workflow.",
                              docs="docs/operations.md#operations-by-filter")
    statuses = builtins.list(allowed) if status is None else [status] if isinstance(status, str) else \
        builtins.list(status)
    wrong = [s for s in statuses if s not in allowed]
    if wrong or not statuses:
        raise ValidationError(
            f"{operation} by filter acts on runs that are {', '.join(allowed)}; not {', '.join(map(repr, wrong))}"
            if wrong else f"status= names no status for {operation} by filter",
            hint=f"Select one or several of {', '.join(allowed)} (status= in Python, --status on the command "
                 "line), or leave the status out for all of them.",
            docs="docs/operations.md#operations-by-filter")
    return statuses, workflow


def check_timeout(timeout: Any, operation: Operation) -> None:
    """Validate the `timeout=` of an operation that waits for the process running a run."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise ValidationError(f"timeout= must be a number of seconds >= 0, got {timeout!r}",
                              hint=operation.wait_hint, docs=operation.docs)


class Operations:
    """Operations on an engine's runs by id or key; `Engine.cancel` and its siblings delegate here."""

    def __init__(self, storage: Storage, runs: Runs, clock: Clock, *, run: Callable[..., Awaitable[Any]],
                 code_for: Callable[[log_format.Header], Workflow], retries: set[str],
                 concurrency: Callable[[], int], cleanup: Callable[[], float]) -> None:
        self.storage = storage
        self.runs = runs
        self.clock = clock
        self.run = run
        self.code_for = code_for
        self.retries = retries
        self.concurrency = concurrency
        self.cleanup = cleanup

    def workflow_for(self, run_id: str) -> Workflow:
        """The workflow code that runs an existing run: registered by name, else imported (`CodeSource`)."""
        return self.code_for(self.runs.read(run_id)[0].header)

    # ---- reading --------------------------------------------------------------------------------
    def history(self, run_id: str) -> History:
        """The validated history of a run."""
        log = self.storage.read(run_id)
        if log is None:
            raise RunNotFoundError(f"no run {run_id!r} in {self.runs.where()}", run_id=run_id)
        return History(log.records, log.where or f"run {run_id}")

    def status(self, run_id: str) -> str:
        """A run's status as `list` tells it ("corrupt" for a damaged log)."""
        if self.storage.info(run_id) is None:
            return "pending"
        try:
            return run_status(self.history(run_id), self.storage.held(run_id))
        except CorruptLogError:
            return "corrupt"

    def attached(self, state: RunState) -> builtins.list[str]:
        """The run's attached (not detached) child runs that have not ended."""
        out = []
        for child in state.children:
            info = self.storage.info(child)
            if info is not None and not info.detached and not info.ended:
                out.append(child)
        return out

    # ---- cancel, pause, resume ------------------------------------------------------------------
    async def operate(self, operation: Operation, run: str, timeout: float, *, cascaded: bool = False) -> RunState:
        """Do `operation` to a run (by id or key), then to its attached children: the one request-and-wait path.
        A `cascaded` child run that ended by itself since its parent looked has nothing left to do: it is no error."""
        check_timeout(timeout, operation)
        run_id = self.runs.resolve(run)
        deadline = time.monotonic() + timeout
        asked = acted = False
        while True:
            history = self.history(run_id)
            held = self.storage.held(run_id)
            if cascaded and history.end is not None and not held:
                break
            if operation.settled(self, run_id, history, held, asked, acted):
                break
            if held:
                if not asked:
                    self.request(run_id, operation.request, operation.payload())
                    asked = True
                if time.monotonic() >= deadline:
                    if operation.cascade_on_timeout:
                        break
                    return await self.runs.inspect(run_id)
                await asyncio.sleep(JOIN_POLL)
                continue
            if self.amend(run_id, operation.record):
                acted = True
                if operation.after_amend():
                    self.drop_requests(run_id, operation.after_amend())
                if isinstance(operation, Cancel):
                    cancelled = self.history(run_id)
                    if cancelled.cancel is not None and cancelled.end is None:
                        await self.clean_up(run_id)
        if operation.after_done():
            self.drop_requests(run_id, operation.after_done())
        state = await self.runs.inspect(run_id)
        for child in self.attached(state):
            if operation.follows(self.status(child)):
                await self.operate(operation, child, max(deadline - time.monotonic(), 0), cascaded=True)
        return state

    async def cancel(self, run: str, *, timeout: float = 30.0, compensate: bool = False,
                     cleanup: float | None = None) -> RunState:
        """Cancel a run (by id or key): its workflow gets `RunCancelledError` where it waits and may clean up,
        then it ends as cancelled. A run some process holds is asked to (waiting up to `timeout`); one nobody
        holds is cancelled here, its clean-up run in this process."""
        if not isinstance(compensate, bool):
            raise ValidationError(f"compensate= must be True or False, got {compensate!r}",
                                  hint="cancel(run, compensate=True) runs the compensations of completed steps.",
                                  docs=CANCEL.docs)
        if cleanup is not None and (isinstance(cleanup, bool) or not isinstance(cleanup, int | float)
                                    or not 0 <= cleanup < 1e9):
            raise ValidationError(f"cleanup= must be seconds >= 0, got {cleanup!r}",
                                  hint="cancel(run, cleanup=30) gives the workflow 30 s to clean up.",
                                  docs=CANCEL.docs)
        return await self.operate(Cancel(compensate, cleanup, self.cleanup(), self.clock.now), run, timeout)

    async def clean_up(self, run_id: str) -> None:
        """A run nobody held was cancelled with a `cancel` record: run it here until it ends, its workflow
        getting `RunCancelledError` where it stood and cleaning up. Without its code it ends cancelled."""
        history = self.history(run_id)
        try:
            workflow = self.code_for(history.header)
        except ValidationError as exc:
            return self.end_cancelled(run_id, f"its code was not found: {exc.message}")
        try:
            await self.run(workflow, run_id=run_id)
        except RunCancelledError:
            return
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except BaseException as exc:  # noqa: BLE001 - the clean-up broke off: the run is cancelled all the same
            self.end_cancelled(run_id, f"it stopped with {type(exc).__name__}: {exc}")

    def end_cancelled(self, run_id: str, why: str) -> None:
        """End a cancelled run whose clean-up could not run here (saying why in its error)."""
        error = RunCancelledError(f"run {run_id} was cancelled; its clean-up did not finish: {why}", run_id=run_id)
        self.amend(run_id, lambda h: log_format.End(status="cancelled", error=dump_error(error), ts=time.time())
                   if h.end is None else None)

    async def pause(self, run: str, *, timeout: float = 30.0) -> RunState:
        """Pause a run (by id or key): at once when no process runs it, else at the running process's next boundary."""
        return await self.operate(PAUSE, run, timeout)

    async def resume(self, run: str, *, timeout: float = 30.0) -> RunState:
        """Resume a paused run (by id or key): its waiting process continues it, or the next run()/retry does."""
        return await self.operate(RESUME, run, timeout)

    # ---- by filter ------------------------------------------------------------------------------
    async def _many(self, operation: str, status: str | Iterable[str] | None, workflow: str | None,
                    act: Callable[[str], Awaitable[RunState | None]], width: int, dry_run: bool) -> BulkResult:
        """Select runs with `Engine.list` and apply `act` to each, at most `width` at once; a run `act`
        refuses (a `DurablyError`, or None) is skipped with why, and never stops the others."""
        statuses, workflow = bulk_filter(operation, status, workflow)
        selected = [s.run_id for s in await self.runs.list(status=statuses, workflow=workflow)]
        result = BulkResult(operation, selected)
        if dry_run:
            return result
        acted: dict[str, RunState] = {}
        gate = asyncio.Semaphore(max(width, 1))

        async def one(run_id: str) -> None:
            async with gate:
                try:
                    state = await act(run_id)
                except DurablyError as exc:
                    result.skipped[run_id] = exc.message
                    return
                if state is None:
                    result.skipped[run_id] = f"run {run_id} was not {operation}d"
                else:
                    acted[run_id] = state

        await asyncio.gather(*(one(run_id) for run_id in selected))
        result.acted = [acted[r] for r in selected if r in acted]
        return result

    async def cancel_many(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                          timeout: float = 30.0, dry_run: bool = False) -> BulkResult:
        """Cancel every run `Engine.list(status=, workflow=)` selects (by default every run that has not
        ended); a running one is asked to stop and waited for up to `timeout` seconds, all at once."""
        check_timeout(timeout, CANCEL)

        async def act(run_id: str) -> RunState | None:
            state = await self.cancel(run_id, timeout=timeout)
            if state.status != "cancelled":
                raise ValidationError(f"run {run_id} is still {state.status} after {timeout:g} s; it stops at its "
                                      "next step boundary", run_id=run_id)
            return state

        return await self._many("cancel", status, workflow, act, 16, dry_run)

    async def resume_many(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                          timeout: float = 30.0, dry_run: bool = False) -> BulkResult:
        """Resume every paused run of `workflow` (all workflows when None)."""
        check_timeout(timeout, RESUME)
        return await self._many("resume", status, workflow, lambda run_id: self.resume(run_id, timeout=timeout), 16,
                                dry_run)

    async def retry_many(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                         dry_run: bool = False) -> BulkResult:
        """Retry every failed or interrupted run `Engine.list(status=, workflow=)` selects, here and now, at most
        the engine's `concurrency` at once; a run that parks is left parked (as `wait=False` does) and one
        that fails again is acted on all the same: `acted` holds each run's state afterwards."""

        async def act(run_id: str) -> RunState | None:
            started: builtins.list[str] = []
            try:
                await self.retry(run_id, wait=False, on_run=started.append)
            except Exception as exc:
                if not started:  # refused before it ran (changed status meanwhile, code not found, ...)
                    if isinstance(exc, DurablyError):
                        raise
                    raise ValidationError(f"run {run_id} could not be retried: {type(exc).__name__}: {exc}",
                                          run_id=run_id) from exc
            return await self.runs.inspect(run_id)

        return await self._many("retry", status, workflow, act, self.concurrency(), dry_run)

    # ---- records and requests -------------------------------------------------------------------
    def amend(self, run_id: str, record: Callable[[History], log_format.Record | None]) -> bool:
        """Append the record `record(history)` chooses (None: nothing) to a run no process holds; False if held.

        The run is not claimed (`Storage.amend`), so an operator's record is not a workflow attempt."""
        chosen: builtins.list[log_format.Record] = []

        def choose(records: builtins.list[Any], where: str) -> bytes | None:
            picked = record(History(records, where))
            if picked is None:
                return None
            chosen.append(picked)
            return log_format.encode(picked)

        if not self.storage.amend(run_id, choose, check=log_format.load):
            return False
        if chosen:
            self.requeue(run_id, chosen[0])
        return True

    def requeue(self, run_id: str, record: log_format.Record) -> None:
        """Keep the queue true to an operation's record: an ended run leaves it, a paused one is due only once
        resumed, a resumed or reset one is due at once (a worker re-parks it if it still sleeps or waits)."""
        if isinstance(record, log_format.End):
            self.storage.unschedule(run_id)
        elif isinstance(record, log_format.Pause):
            self.storage.schedule(run_id, None)
        elif isinstance(record, log_format.Resume | log_format.Reset):
            self.storage.schedule(run_id, time.time())

    def drop_requests(self, run_id: str, names: tuple[str, ...] = ALL_REQUESTS) -> None:
        """Acknowledge control requests left in a run's inbox (by an ended run, or ones an operation superseded)."""
        for message in self.storage.inbox(run_id):
            if message.get("name") in names:
                self.storage.ack(run_id, message["id"])

    def request(self, run_id: str, name: str, payload: Any = None) -> None:
        """Put control request `name` ($cancel, $pause, $resume) in the run's inbox."""
        self.storage.send(run_id, log_format.encode(log_format.Signal(id=secrets.token_hex(8), name=name,
                                                                      payload=payload,
                                                                      at=to_iso(datetime.now(UTC)))))

    # ---- signal ---------------------------------------------------------------------------------
    async def signal(self, run: str, name: str, payload: Any = None, *, strict: bool = False) -> SignalSent:
        """Deliver signal `name` to a run (by id or key); its next `ctx.wait_for(name)` returns `payload`.

        The run need not be live: the signal waits in the run's inbox until the run reads it. A run that ended
        (completed, failed, cancelled) reads no signal: `ValidationError` naming its status, nothing sent. A
        waiting run whose waits are all for other names gets it all the same (a later `ctx.wait_for(name)`
        may read it; `SignalSent.mismatched` says so), unless `strict`: then `ValidationError`, nothing sent."""
        if not isinstance(name, str) or not name or len(name) > 200 or name.startswith("$"):
            raise ValidationError(f"a signal name is 1-200 characters not starting with '$', got {name!r}",
                                  hint="Use the name the workflow waits for: ctx.wait_for('approval').",
                                  docs="docs/authoring.md#parking")
        validate_name(name)
        run_id = self.runs.resolve(run)
        wire = dump_value(payload, "payload")
        history = self.history(run_id)
        held = self.storage.held(run_id)
        status = run_status(history, held)
        if status in ("completed", "failed", "cancelled"):
            again = f"`durably retry {run_id}` resumes it; signal it once it waits again" if status == "failed" \
                else f"`durably restart {run_id}` runs it again; signal the new run once it waits"
            raise ValidationError(f"run {run_id} is {status}; no step will read signal {name!r}, so nothing was sent",
                                  hint=f"Signal a run that has not ended (`durably list --status waiting`); {again}.",
                                  docs="docs/authoring.md#parking", run_id=run_id, status=status)
        awaited = list(dict.fromkeys(w.name for p, w in history.waits.items() if p not in history.done))
        sent = SignalSent(run_id, name, status, awaited, held)
        if strict and sent.mismatched:
            raise ValidationError(f"run {run_id} waits for {' or '.join(map(repr, awaited))}, not {name!r}; nothing "
                                  "was sent", hint=f"Send {awaited[0]!r}, or leave out strict (--strict) to leave "
                                  f"{name!r} in its inbox for a later ctx.wait_for({name!r}).",
                                  docs="docs/authoring.md#parking", run_id=run_id, awaited=awaited)
        try:
            line = log_format.encode(log_format.Signal(id=secrets.token_hex(8), name=name, payload=wire,
                                                       at=to_iso(self.clock.now())))
        except UnicodeEncodeError:
            raise ValidationError(f"the payload of signal {name!r} holds text that is not UTF-8 (a lone surrogate)",
                                  hint="Send text that encodes as UTF-8.", docs="docs/authoring.md#parking",
                                  run_id=run_id) from None
        self.storage.send(run_id, line)
        return sent

    # ---- retry and restart ----------------------------------------------------------------------
    async def retry(self, run: str, *, from_step: Selector | None = None,
                    on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                    on_run: Callable[[str], Any] | None = None) -> Any:
        """Resume a failed or interrupted run (by id or key); `from_step=` also runs that step and all later ones again."""
        run_id = self.runs.resolve(run)
        history = self.history(run_id)
        status = run_status(history, self.storage.held(run_id))
        if status == "running":
            raise ValidationError(f"run {run_id} is running in another process",
                                  hint=f"Wait for it, or stop it first with `durably cancel {run_id}`.",
                                  docs="docs/operations.md#retry", run_id=run_id)
        if status == "paused":
            raise ValidationError(f"run {run_id} is paused; a paused run does not continue until it is resumed",
                                  hint=f"Resume it first with `durably resume {run_id}`, then retry it.",
                                  docs="docs/operations.md#pause-and-resume", run_id=run_id)
        if status == "cancelled":
            raise ValidationError(f"run {run_id} was cancelled; a cancelled run is not resumed",
                                  hint=f"Start it over with `durably restart {run_id}`.",
                                  docs="docs/operations.md#retry", run_id=run_id)
        if status == "completed" and from_step is None:
            raise ValidationError(f"run {run_id} already completed; there is nothing to retry",
                                  hint=f"Run steps again with `durably retry {run_id} --from-step PATH|LABEL`, or "
                                       f"start over with `durably restart {run_id}`.",
                                  docs="docs/operations.md#retry", run_id=run_id)
        if from_step is not None:
            self.reset_paths(history, from_step)
        workflow = self.workflow_for(run_id)
        if from_step is not None:
            if status == "completed":
                self.drop_requests(run_id)
            if not self.amend(run_id, lambda h: log_format.Reset(paths=self.reset_paths(h, from_step),
                                                                 ts=time.time())):
                raise ValidationError(f"run {run_id} is running in another process", run_id=run_id,
                                      hint=f"Wait for it, or stop it first with `durably cancel {run_id}`.",
                                      docs="docs/operations.md#retry")
            for path in self.reset_paths(history, from_step):  # a step run again streams anew (keep_partials)
                self.storage.drop_partials(run_id, path)
        # Unlike running it again, a retry reopens a run killed while it was failing (its compensations had
        # begun) as it does a failed one, and resumes each failed (or failing) child it joins once.
        self.retries.add(run_id)
        try:
            return await self.run(workflow, run_id=run_id, on_step=on_step, wait=wait, on_run=on_run)
        finally:
            self.retries.discard(run_id)

    def reset_paths(self, history: History, selector: Any) -> builtins.list[str]:
        """The recorded step `selector` picks, every step completed after it, and the steps nested under it."""
        if isinstance(selector, list):
            selector = tuple(selector)
        shape_ok = isinstance(selector, str) or (
            isinstance(selector, tuple) and bool(selector) and (
                all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in selector)
                or (len(selector) == 2 and isinstance(selector[0], str) and isinstance(selector[1], int)
                    and not isinstance(selector[1], bool) and selector[1] >= 1)))
        order = list(history.done)
        seen: dict[str, int] = {}
        for index, path in enumerate(order if shape_ok else ()):
            label = history.done[path].label
            nth = seen[label] = seen.get(label, 0) + 1
            if selects(selector, path, label, nth):
                return order[index:] + [p for p in order[:index] if p.startswith(f"{path}.")]
        steps = [f"{path_tuple(p)} {history.done[p].label}" for p in sorted(order, key=path_tuple)]
        listed = ", ".join(steps[:30]) + (f", … ({len(steps) - 30} more)" if len(steps) > 30 else "")
        what = "matches no recorded step" if shape_ok else "is not a step selector"
        raise ValidationError(
            f"from_step={selector!r} {what} of run {history.header.run_id}; its steps: {listed or 'none'}",
            hint="Select a step by its path (2,) or (3, 1, 0), by its label 'fetch', or by (label, nth) for the "
                 "nth step with that label; `durably inspect RUN` shows paths and labels.",
            docs="docs/operations.md#retry-from-a-step", run_id=history.header.run_id)

    async def restart(self, run: str, *, on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                      on_run: Callable[[str], Any] | None = None) -> Any:
        """Start a run (by id or key) over as a new run with the same workflow, input and key; return its value."""
        run_id = self.runs.resolve(run)
        if self.storage.held(run_id):
            raise ValidationError(f"run {run_id} is running in another process",
                                  hint=f"Stop it first with `durably cancel {run_id}`, then restart it.",
                                  docs="docs/operations.md#restart", run_id=run_id)
        history = self.history(run_id)
        workflow = self.workflow_for(run_id)
        value = load_value(history.header.input)
        if workflow.input_schema is not None:
            value = workflow.input_schema.convert(value, "input")
        return await self.run(workflow, value, key=history.header.key, fresh=True, budget=history.budget,
                                on_step=on_step, wait=wait, on_run=on_run)
