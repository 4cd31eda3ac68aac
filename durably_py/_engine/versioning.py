"""What changed code means for a run recorded by older code: adopting a renamed step of a stale run.

A run whose replay met a different step name at a recorded path (with code that changed since the run
started) stops as `stale` (`StaleRunError`, a `stale` record). `adopt` is the explicit assertion that the
step now called there is the recorded work under a new name: an `adopt` record makes replay answer it
from the log, and the run continues. `ctx.patched` (the kernel) is the other half: see docs/versioning.md.
"""

from __future__ import annotations

import builtins
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import records
from .._state.history import History, path_tuple, run_status
from ..errors import ValidationError

if TYPE_CHECKING:
    from .._events import StepEvent
    from .operations import Operations

DOCS = "docs/versioning.md#adopt"


def parse_path(path: Any) -> str:
    """A step path given as ``(2, 0, 1)``, ``[2, 0, 1]`` or ``"2.0.1"``, in the log's form ``"2.0.1"``."""
    if isinstance(path, str) and re.fullmatch(r"\d+(\.\d+)*", path.strip()):
        return path.strip()
    if isinstance(path, tuple | builtins.list) and path and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in path):
        return ".".join(map(str, path))
    raise ValidationError(f"path={path!r} is not a step path",
                          hint="Give a path like (2,) or (3, 1, 0) (the CLI: --path 2 or --path 3.1.0); "
                               "`durably inspect RUN` shows each step's path.", docs=DOCS)


def adoption(history: History, path: Any = None) -> records.Adopt:
    """The `adopt` record for a stale run: at the path its replay stopped at (or `path`, a recorded step)."""
    run_id = history.header.run_id
    status = run_status(history, False)
    if status != "stale":
        raise ValidationError(
            f"run {run_id} is {status}, not stale; there is nothing to adopt",
            hint="adopt answers a run whose replay stopped at a renamed step (`durably list --status stale`); "
                 f"`durably retry {run_id}` continues an interrupted or failed run.", docs=DOCS, run_id=run_id)
    detail = history.stale_detail() or {}
    if detail.get("patch") is not None:
        change = detail["patch"]
        raise ValidationError(
            f"run {run_id} is stale because it is on the old branch of patch {change!r}, which the code retired; "
            "adopt renames a step, it cannot bring back a deleted branch",
            hint=f"Deploy the code with `if ctx.patched({change!r}): ... else: <old branch>` again, then "
                 f"`durably retry {run_id}`; or start it over with `durably restart {run_id}`.",
            docs="docs/versioning.md#retiring-the-old-branch", run_id=run_id)
    stopped = ".".join(map(str, detail["path"])) if isinstance(detail.get("path"), list) else None
    where = parse_path(path) if path is not None else stopped
    if where is None or where not in history.done:
        steps = [f"{'.'.join(map(str, path_tuple(p)))} {history.done[p].label}"
                 for p in sorted(history.done, key=path_tuple)]
        listed = ", ".join(steps[:30]) + (f", … ({len(steps) - 30} more)" if len(steps) > 30 else "")
        what = f"path {where} has no recorded step" if where is not None else \
            "its replay did not stop at a renamed step (a task graph changed)"
        raise ValidationError(f"cannot adopt at run {run_id}: {what}; its steps: {listed or 'none'}",
                              hint="Pass the path of a recorded step (`durably inspect RUN` shows them), or start "
                                   f"over with `durably restart {run_id}`.", docs=DOCS, run_id=run_id)
    label = detail.get("called") if where == stopped else None
    return records.Adopt(path=where, recorded=history.done[where].label, label=label, ts=time.time())


async def adopt(operations: Operations, run: str, path: Any = None, *, on_step: Callable[[StepEvent], Any] | None = None,
                wait: bool = True, on_run: Callable[[str], Any] | None = None) -> Any:
    """Record that the step now called at `path` (default: where the stale run stopped) is the recorded one
    under a new name, then continue the run here as `retry` does; return its value or raise its error."""
    run_id = operations.runs.resolve(run)
    busy = ValidationError(f"run {run_id} is running in another process, not stale; there is nothing to adopt",
                           hint="Wait for it; `durably list --status stale` shows the runs adopt applies to.",
                           docs=DOCS, run_id=run_id)
    if operations.storage.held(run_id):
        raise busy
    chosen = adoption(operations.history(run_id), path)  # a clear error before the code is looked up
    workflow = operations.workflow_for(run_id)

    def record(current: History) -> records.Adopt:
        found = current.done.get(chosen.path)
        if found is None or found.label != chosen.recorded or current.end is not None:
            raise ValidationError(f"run {run_id} changed while it was being adopted", hint="Look at it again with "
                                  f"`durably inspect {run_id}`.", docs=DOCS, run_id=run_id)
        return chosen

    if not operations.amend(run_id, record):  # (the adopt record clears `stale`; it was checked above)
        raise busy
    operations.storage.schedule(run_id, time.time())  # due again: any worker may continue it too
    return await operations.run(workflow, run_id=run_id, on_step=on_step, wait=wait, on_run=on_run)
