"""Every error durably raises: a `DurablyError` carrying `hint` (the next move) and `docs`."""

from __future__ import annotations

from typing import Any

DOCS = "docs/errors.md"


class DurablyError(Exception):
    """Base of every operational error; `hint` says what to do next, `docs` where to read more."""

    message: str
    hint: str
    docs: str
    details: dict[str, Any]
    run_id: str | None

    default_hint = "See the docs for this error."
    anchor = "durablyerror"

    def __init__(self, message: str, *, hint: str | None = None, docs: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint or self.default_hint
        self.docs = docs or f"{DOCS}#{self.anchor}"
        self.details = details
        for name, value in details.items():
            setattr(self, name, value)

    def __str__(self) -> str:
        return self.message

    def describe(self) -> str:
        """The message, the hint and the docs on three lines, as the CLI prints them."""
        return f"{type(self).__name__}: {self.message}\n  hint: {self.hint}\n  docs: {self.docs}"


class ValidationError(DurablyError, ValueError):
    """An argument or a value does not have the shape it must have."""

    default_hint = "Fix the value named in the message; nothing was run or recorded."
    anchor = "validationerror"


class ArgumentError(ValidationError, TypeError):
    """A call got an argument it does not take (also a `TypeError`, as Python raises for unknown keywords)."""


class SerializationError(DurablyError, TypeError):
    """A value crossing the durable boundary is not JSON plus datetime; `path` names where."""

    path: str

    default_hint = (
        "Convert the value at the step boundary to JSON types (dict with str keys, list, str, int, "
        "float, bool, None) or a timezone-aware datetime."
    )
    anchor = "serializationerror"


class StepTimeoutError(DurablyError, TimeoutError):
    """A step attempt ran longer than its `timeout=`; retryable."""

    path: list[int]
    label: str
    timeout: float

    default_hint = "Raise `timeout=`, add `retry=`, or `attempt().stash()` progress so a retry resumes it."
    anchor = "steptimeouterror"


class WaitTimeoutError(DurablyError, TimeoutError):
    """No signal arrived before a `ctx.wait_for(..., timeout=)` deadline."""

    name: str
    path: list[int]

    default_hint = "Catch it in the workflow to take the no-answer path, or wait again with a longer timeout."
    anchor = "waittimeouterror"


class StepFailedError(DurablyError):
    """A recorded step failure whose exception class could not be rebuilt on replay."""

    type_name: str
    traceback: str
    original_message: str
    remote_traceback: str

    default_hint = "The step failed in an earlier process; `type_name`, `message` and `traceback` describe it."
    anchor = "stepfailederror"


class NonRetryableError(DurablyError):
    """Raised by a step to fail it at once: no retry policy runs it again (subclass it for your own errors).

    The step fails with this error as every failed step does (compensations run if the workflow fails)."""

    default_hint = "The step gave up on purpose; fix the cause, then retry the run (`durably retry RUN`)."
    anchor = "nonretryableerror"


class StepInterruptedError(DurablyError):
    """A `replay="unsafe"` step started and never finished: its process died inside it."""

    path: list[int]
    label: str
    operation_id: str

    default_hint = (
        "Check whether the external effect happened (use `operation_id` as its idempotency key), "
        "then continue from the workflow; the step is not run again on its own."
    )
    anchor = "stepinterruptederror"


class EffectFailedError(DurablyError):
    """An operator failed a cut-off unsafe step (`durably resolve RUN --path P --fail`): the workflow sees it
    where the step is awaited, as any failed step's error (its `except` runs; a run that then fails runs its
    compensations). `path`, `label` and `operation_id` name the step; the message is the operator's."""

    path: list[int]
    label: str
    operation_id: str

    default_hint = ("An operator decided that this step's external effect did not happen (or must count as "
                    "failed); handle it like any failed step, or `durably retry` the failed run to run it again.")
    anchor = "effectfailederror"


class PurityError(DurablyError):
    """The workflow did something replay cannot reproduce (its recorded step topology changed)."""

    path: tuple[int, ...]
    recorded: str
    called: str

    default_hint = (
        "Keep the order of recorded steps stable; add new steps after the recorded ones, "
        "or start over with `fresh=True`."
    )
    anchor = "purityerror"


class StaleRunError(DurablyError):
    """The run was recorded by other workflow code than the code now asked to resume it."""

    path: tuple[int, ...]
    recorded: str
    called: str

    default_hint = ("If the step now called at `path` is the recorded one under a new name, `durably adopt RUN` "
                    "(`engine.adopt(run)`) continues with its recorded result; else restore the old code, or start "
                    "over with `durably restart RUN` (`fresh=True`).")
    anchor = "stalerunerror"


class ReplayDivergenceError(DurablyError, AssertionError):
    """A recorded history replayed against new code: at `path` the code calls another step than the recorded one."""

    path: tuple[int, ...] | None
    recorded: str | None
    called: str | None
    report: Any

    default_hint = (
        "The new code would not resume this run: keep the recorded steps in their order (add new ones after "
        "them), or branch on ctx.patched() so recorded runs keep the old path."
    )
    anchor = "replaydivergenceerror"


class BudgetExceededError(DurablyError):
    """Charges passed the run's budget; raised before the next step starts."""

    kind: str
    spent: float
    limit: float

    default_hint = "Raise the budget (`budget=`) and resume the run, or spend less per step."
    anchor = "budgetexceedederror"


class CircuitOpenError(DurablyError):
    """A resource's circuit breaker is open; retryable."""

    resource: str

    default_hint = "Wait for the breaker's cooldown; steps with `retry=` back off and try again."
    anchor = "circuitopenerror"


class KeyConflictError(DurablyError):
    """A run key is already bound to a run with another input."""

    key: str
    bound_input: Any
    input: Any

    default_hint = "Use another `key=`, pass the same input, or `fresh=True` to rebind the key."
    anchor = "keyconflicterror"


class RunCancelledError(DurablyError):
    """The run was cancelled."""

    default_hint = "Start it again with `fresh=True` or `durably restart RUN`."
    anchor = "runcancellederror"


class LeaseLostError(DurablyError):
    """Another process claimed this run; this process stops writing to it."""

    default_hint = "The run continues in the other process; `durably inspect RUN` shows its progress."
    anchor = "leaselosterror"


class RunNotFoundError(DurablyError, LookupError):
    """No run has that id or key."""

    default_hint = "`durably list` shows the runs in this state dir; check `--dir`."
    anchor = "runnotfounderror"


class AwakeableTimeoutError(WaitTimeoutError):
    """No resolution reached a `ctx.awakeable(timeout=)` before its deadline; `awakeable` is its id. Also a
    `WaitTimeoutError`, so code that handles a wait's timeout handles this one."""

    awakeable: str
    deadline: str

    default_hint = "Catch it in the workflow to take the no-answer path, or create the awakeable with a longer timeout."
    anchor = "awakeabletimeouterror"


class AwakeableRejectedError(DurablyError):
    """An awakeable was rejected (`engine.reject_awakeable`, `durably resolve-awakeable ID --reject MESSAGE`, or a
    rejecting callback): the workflow gets it where it awaits the awakeable; the message is the rejecter's."""

    awakeable: str

    default_hint = "Handle it in the workflow like a failed step: the outside system said no."
    anchor = "awakeablerejectederror"


class AwakeableNotFoundError(RunNotFoundError):
    """No awakeable has that id (or callback token): its run is unknown, or the run never created it."""

    default_hint = "Use the id `a.id` (or the URL `a.url`) the workflow handed out; `durably inspect RUN` shows it."
    anchor = "awakeablenotfounderror"


class AwakeableResolvedError(DurablyError):
    """An awakeable can no longer be resolved: it was resolved (or rejected) already, its deadline passed, or its
    run ended. Nothing was changed; the first resolution stays."""

    awakeable: str

    default_hint = "An awakeable takes one resolution; the first one stands. Create a new one to ask again."
    anchor = "awakeableresolvederror"


class AwakeableTokenError(DurablyError, PermissionError):
    """A callback named an awakeable with a token that is not its own (forged, or from another awakeable)."""

    default_hint = "Call the exact callback URL `a.url` the workflow handed out."
    anchor = "awakeabletokenerror"


class CorruptLogError(DurablyError):
    """A run's log has a damaged line before its last; nothing was overwritten."""

    path: str
    line: int | None
    field: str | None

    default_hint = (
        "Restore the file from a backup or move it aside; durably never rewrites a damaged log. "
        "A torn last line alone is repaired automatically."
    )
    anchor = "corruptlogerror"


class StorageFullError(DurablyError, OSError):
    """The disk (or quota, or file size limit) is full: a record could not be written.

    Nothing partial is left behind: a cut line is undone, so the run resumes once there is space."""

    path: str

    default_hint = ("Free disk space (or raise the quota or file size limit), then run the same command again: "
                    "the run resumes from its last complete record.")
    anchor = "storagefullerror"


class StorageBusyError(DurablyError):
    """A claim (or an operator's record) waited its storage's bounded time for a run another connection holds
    locked, and gave up: nothing was written. The message says who holds it, as far as the storage can tell."""

    run_id: str

    default_hint = ("End the transaction that holds the run (commit or roll it back, or stop its process), then "
                    "run the same command again; nothing was written.")
    anchor = "storagebusyerror"


class LogVersionError(CorruptLogError):
    """A run's log was written by a newer durably-py than this one (its header's version is higher)."""

    version: int

    default_hint = "Upgrade durably-py to the version that wrote the run; the log is left untouched."
    anchor = "logversionerror"


class WorkflowFailedError(DurablyError):
    """A workflow failed in another process; raised when its recorded error cannot be rebuilt."""

    default_hint = "`durably inspect RUN` shows the failed step; run again to resume at it."
    anchor = "workflowfailederror"


class DependencyFailedError(DurablyError):
    """A graph task did not run because one of its prerequisites failed, was cancelled or was blocked."""

    task: str
    dependency: str

    default_hint = "Fix the failed prerequisite; resuming the run re-runs it and then the tasks that wait for it."
    anchor = "dependencyfailederror"


class LoopLimitError(DurablyError):
    """A `ctx.loop` ran `max_iterations` times without its reducer returning `it.done(value)`."""

    path: list[int]
    iterations: int

    default_hint = "Return it.done(value) when the work is finished, or raise max_iterations=."
    anchor = "looplimiterror"


class RunParkedError(DurablyError):
    """The run parked (waiting for a signal or a wake time) and `run(..., wait=False)` asked not to wait."""

    status: str

    default_hint = "Send the signal with `durably signal`, or run again after the wake time."
    anchor = "runparkederror"


class NotDurableError(DurablyError):
    """A workflow used an asyncio form whose effect would not survive a park, a crash or a replay (a plain
    asyncio deadline around a durable wait); the error names the durable form to use instead."""

    default_hint = "Use the durable form: ctx.wait_for(name, timeout=...) or ctx.first(...) with ctx.sleep(...)."
    anchor = "notdurableerror"


class NotSupportedError(DurablyError):
    """A feature the current execution mode cannot provide (e.g. `stash` on Restate); `feature` and `mode` name it."""

    default_hint = "Run this workflow on FileStorage, SQLite or PostgreSQL, or avoid the feature in this mode."
    anchor = "notsupportederror"


class RemoteError(DurablyError):
    """A remote console (`durably ui`, reached by `durably_py.client` or `--remote URL`) could not be reached, or
    answered with something that is not its JSON API; `url` names it."""

    url: str

    default_hint = ("Check the URL (`durably ui` prints it) and that the console runs and is reachable from here; "
                    "nothing was changed.")
    anchor = "remoteerror"


class RemoteAuthError(RemoteError, ValidationError):
    """A remote console refused the request: its token is missing or wrong, or the request was not allowed."""

    default_hint = ("Pass the console's token with --token (or $DURABLY_UI_TOKEN): the one `durably ui` printed in "
                    "its URL (?token=...) or was started with; nothing was changed.")
    anchor = "remoteautherror"
