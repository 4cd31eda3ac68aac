"""Effects that need attention: an operator's decision about a cut-off unsafe step.

A step with `replay="manual"` (or its older name "unsafe") records its start, fsynced, before it runs. When the
process dies inside it, the run is left `needs_attention`: a resume stops before running anything at that step,
no compensation runs, and a worker parks the run out of its queue's due set. Only an operator knows whether the
external effect happened; `resolve_effect` records what they found (a `resolve` record, through `amend`, so it is
no workflow attempt) and continues the run:

- `value`: the effect happened and this is its result; the workflow gets it as the step's result (converted by
  the step's `schema=` when the run continues: a value it refuses fails the step with `ValidationError`);
- `rerun`: run the step again, as a new attempt (with the same `attempt().operation_id`);
- `fail`: the step fails with `EffectFailedError` (the operator's message): the workflow's `except` runs, and a
  run that then fails runs its compensations as for any failed step.

See docs/operations.md#effects-that-need-attention.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import records
from .._codec import dump_error, dump_value
from .._state.history import History, path_tuple, run_status
from ..errors import EffectFailedError, ValidationError
from .versioning import parse_path

if TYPE_CHECKING:
    from .._events import StepEvent
    from .operations import Operations

DOCS = "docs/operations.md#effects-that-need-attention"


class _Missing:
    """The default of `value=`: no value given (None is a value an operator may record)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def _steps_text(history: History) -> str:
    """The cut-off steps of a run, as a hint lists them: `1 charge, 2.0 send`."""
    waiting = [f"{'.'.join(map(str, path_tuple(p)))} {s.label}" for p, s in history.attention().items()]
    return ", ".join(waiting) or "none"


def decision(history: History, path: Any, *, value: Any = MISSING, rerun: bool = False,
             fail: str | bool | None = None) -> records.Resolve:
    """The `resolve` record for the cut-off step at `path` of a run that needs attention, checked: exactly one
    decision, a run that needs attention, a path that is one of its cut-off steps, a value that is JSON. Each
    refusal is a `ValidationError` (a value that is not JSON: `SerializationError`); nothing is written."""
    run_id = history.header.run_id
    given = [name for name, on in (("value", value is not MISSING), ("rerun", rerun is True),
                                   ("fail", fail is not None and fail is not False)) if on]
    if rerun not in (True, False) or len(given) != 1:
        raise ValidationError(
            f"resolve takes one decision about the step: a value, rerun or fail; got {', '.join(given) or 'none'}",
            hint="--value JSON (the effect happened: its result), --rerun (run the step again) or --fail "
                 "[--message TEXT]; in Python value=..., rerun=True or fail='why'.", docs=DOCS, run_id=run_id)
    if fail is not None and fail is not False and fail is not True and not isinstance(fail, str):
        raise ValidationError(f"fail= must be True or a message, got {fail!r}",
                              hint="fail='the payment provider has no record of it'", docs=DOCS, run_id=run_id)
    status = run_status(history, False)
    if status != "needs_attention":
        raise ValidationError(
            f"run {run_id} is {status}, not needs_attention; there is nothing to resolve",
            hint="resolve answers a run whose unsafe step was cut off (`durably list --status needs_attention`); "
                 f"`durably retry {run_id}` continues an interrupted or failed run.", docs=DOCS, run_id=run_id,
            status=status)
    where = parse_path(path)
    start = history.attention().get(where)
    if start is None:
        raise ValidationError(
            f"step {where} of run {run_id} is not a cut-off step that needs attention; those are: "
            f"{_steps_text(history)}",
            hint=f"Pass the path of the step `durably inspect {run_id}` shows as needs_attention, e.g. "
                 f"--path {next(iter(history.attention()), '1')}.", docs=DOCS, run_id=run_id)
    now = time.time()
    if value is not MISSING:
        return records.Resolve(path=where, label=start.label, attempt=start.attempt, decision="value",
                               value=dump_value(value, "value"), ts=now)
    if rerun:
        note = EffectFailedError(f"step {start.label!r} at path {path_tuple(where)} was cut off; an operator asked "
                                 "to run it again", path=list(path_tuple(where)), label=start.label,
                                 operation_id=f"{run_id}/{where}")
        return records.Resolve(path=where, label=start.label, attempt=start.attempt, decision="rerun",
                               error=dump_error(note), ts=now)
    message = fail if isinstance(fail, str) and fail.strip() else \
        f"an operator failed step {start.label!r} at path {path_tuple(where)}, which was cut off"
    error = EffectFailedError(message, path=list(path_tuple(where)), label=start.label,
                              operation_id=f"{run_id}/{where}")
    return records.Resolve(path=where, label=start.label, attempt=start.attempt, decision="fail",
                           error=dump_error(error), ts=now)


async def resolve_effect(operations: Operations, run: str, path: Any, *, value: Any = MISSING, rerun: bool = False,
                         fail: str | bool | None = None, here: bool = True,
                         on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                         on_run: Callable[[str], Any] | None = None) -> Any:
    """Record an operator's decision about the cut-off step at `path` of a run that needs attention, then
    continue the run here as `retry` does and return its value (or raise its error); with `here=False`, leave
    it due for a worker instead and return its `RunState`. Every refusal happens before anything is written."""
    run_id = operations.runs.resolve(run)
    busy = ValidationError(f"run {run_id} is running in another process, not needs_attention; there is nothing to "
                           "resolve", hint="Wait for it; `durably list --status needs_attention` shows the runs "
                                           "resolve applies to.", docs=DOCS, run_id=run_id)
    if operations.storage.held(run_id):
        raise busy
    chosen = decision(operations.history(run_id), path, value=value, rerun=rerun, fail=fail)
    workflow = operations.workflow_for(run_id) if here else None  # a clear error before anything is written

    def record(current: History) -> records.Resolve:
        start = current.attention().get(chosen.path)
        if start is None or start.attempt != chosen.attempt or current.end is not None:
            raise ValidationError(f"run {run_id} changed while its step {chosen.path} was being resolved (resolved "
                                  "already?)", hint=f"Look at it again with `durably inspect {run_id}`.", docs=DOCS,
                                  run_id=run_id)
        return chosen

    if not operations.amend(run_id, record):
        raise busy
    operations.storage.schedule(run_id, time.time())  # due again: a worker may continue it
    if workflow is None:
        return await operations.runs.inspect(run_id)
    return await operations.run(workflow, run_id=run_id, on_step=on_step, wait=wait, on_run=on_run)


def plan(operations: Operations, run: str, path: Any, *, value: Any = MISSING, rerun: bool = False,
         fail: str | bool | None = None) -> dict[str, Any]:
    """What `resolve_effect` would record, checked as it checks it (a refusal raises) and nothing written: the
    run's id, the step's path (a list), label and recorded input, the decision and the error it records. `durably
    resolve` states it before asking; the console answers it to a remote `durably resolve`."""
    run_id = operations.runs.resolve(run)
    history = operations.history(run_id)
    chosen = decision(history, path, value=value, rerun=rerun, fail=fail)
    return {"run_id": run_id, "path": list(path_tuple(chosen.path)), "label": chosen.label,
            "decision": chosen.decision, "input": history.attention()[chosen.path].input, "error": chosen.error}
