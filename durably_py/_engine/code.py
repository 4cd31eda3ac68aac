"""Which code runs a recorded run: the workflows this process registered, and only where asked for, the one
module or script the run's header recorded.

A run's header records its workflow's name, module and script. A log never decides on its own what code a
process imports: `durably worker --import X` serves the workflows X declares and nothing else (`serves`);
the module or script a header names is imported only where recorded code is allowed (`recorded`: an operator
retrying one run, or a worker started with `--import-recorded`), and then only from under `root` when one is
set (a worker's project root, `code_root`). Even then one import is tried, never two: the recorded module
when it is the recorded script's own module (or no script was recorded), else the script.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._authoring.workflow import REGISTRY, Workflow, load_script
from ..errors import ValidationError

if TYPE_CHECKING:
    from .. import records as log_format

CODE_DOCS = "docs/operations.md#which-code-runs-an-old-run"


class CodeSource:
    """The code an engine runs recorded runs with (`Engine.code`).

    `serves`: the workflow names a worker claims runs of (None: any). `recorded`: whether a header's module or
    script may be imported for a workflow not registered here. `root`: the folder that imported code must
    lie under (None: anywhere)."""

    def __init__(self, *, serves: frozenset[str] | None = None, recorded: bool = True,
                 root: str | None = None) -> None:
        self.serves = serves
        self.recorded = recorded
        self.root = os.path.realpath(root) if root is not None else None

    def claims(self) -> frozenset[str] | None:
        """The workflows a worker with this code claims runs of: `serves`, or any when recorded code may be
        imported (None)."""
        return None if self.recorded else self.serves

    def describe(self) -> dict[str, object]:
        """What a worker advertises: the workflows it serves and where recorded code may come from."""
        return {"serves": sorted(self.serves) if self.serves is not None else None,
                "recorded": (self.root or "anywhere") if self.recorded else None}

    def workflow(self, header: log_format.Header) -> Workflow:
        """The workflow code for a run header: registered by name, else (where allowed) the one recorded
        module or script imported; a `ValidationError` saying why when there is none."""
        name = header.workflow
        found = REGISTRY.get(name)
        if found is not None and (self.serves is None or name in self.serves or self.recorded):
            return found
        if found is None and self.recorded:
            self._import_recorded(header)
            found = REGISTRY.get(name)
            if found is not None:
                return found
        raise self._missing(header, registered=found is not None)

    def _import_recorded(self, header: log_format.Header) -> None:
        """Import the header's module or its script (one of them), when it lies under `root`."""
        module, script = header.module, header.script
        if module and module not in ("__main__",) and module not in sys.modules:
            origin = _origin(module, self._allowed)
            if origin is not None and (not script or _same(origin, script)):
                importlib.import_module(module)
                return
        if script and os.path.isfile(script) and self._allowed(script):
            folder = os.path.dirname(os.path.abspath(script))
            sys.path.insert(0, folder)
            try:
                load_script(script)
            finally:
                if folder in sys.path:
                    sys.path.remove(folder)

    def _allowed(self, path: str) -> bool:
        if self.root is None:
            return True
        real = os.path.realpath(path)
        return real == self.root or real.startswith(self.root.rstrip(os.sep) + os.sep)

    def _missing(self, header: log_format.Header, *, registered: bool) -> ValidationError:
        name, run_id, script = header.workflow, header.run_id, header.script
        if registered or not self.recorded:
            served = ", ".join(sorted(self.serves or ())) or "none"
            return ValidationError(
                f"workflow {name!r} of run {run_id} is not served here (this worker serves: {served})",
                hint="Start a worker with --import naming the module or script that declares it (or "
                     "--import-recorded to import the code a run recorded, from under the project root).",
                docs="docs/deploying.md#what-a-worker-serves", run_id=run_id, workflow=name)
        if script and os.path.isfile(script) and not self._allowed(script):
            where = f"its script {script} lies outside {self.root}"
        elif script and os.path.isfile(script):
            where = f"its script {script} defines no workflow of that name"
        else:
            where = f"its script {script} does not exist" if script else "no script was recorded for it"
        return ValidationError(
            f"cannot find the code of workflow {name!r} for run {run_id}: it is not registered and {where}",
            hint="Import the module that defines the workflow first (its @workflow registers it by name), or "
                 "restore the script at the recorded path.",
            docs=CODE_DOCS, run_id=run_id, workflow=name, script=script)


def _origin(module: str, allowed: Callable[[str], bool]) -> str | None:
    """The file a module would be imported from when it and its top-level package are `allowed` (None: not
    importable from here, or not allowed). Nothing outside `allowed` is imported to find out: a dotted name's
    parent packages are looked up only once the top-level one is known to be allowed."""
    try:
        spec = importlib.util.find_spec(module.partition(".")[0])
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        where = spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else \
            (locations[0] if locations else None)
        if where is None or not allowed(where):
            return None
        if "." in module:
            spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return origin if origin and os.path.isfile(origin) and allowed(origin) else None


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def serving(workers: list[dict[str, Any]], workflow: str) -> list[dict[str, Any]]:
    """The live workers (`Storage.workers`) that would claim a run of `workflow`: those that serve it, any
    workflow, or import recorded code."""
    return [w for w in workers if w.get("serves") is None or w.get("recorded") or workflow in (w.get("serves") or ())]


def unserved_notes(storage: Any, runs: Iterable[tuple[str, str, str]], now: float) -> list[str]:
    """What `durably list` and `inspect` say of queued runs no live worker would claim: one line per workflow.

    `runs` are (run id, workflow, status) of runs that have not ended; a run counts when its queue entry is
    due by `now`, no process holds it, and it is pending (enqueued for a worker) or, while any worker is live
    on the storage, interrupted."""
    workers = storage.workers()
    counted: dict[str, int] = {}
    for run_id, workflow, status in runs:
        if status != "pending" and not (workers and status == "interrupted"):
            continue
        entry = storage.entry(run_id)
        if entry is None or entry.at is None or entry.at > now or serving(workers, workflow):
            continue
        counted[workflow] = counted.get(workflow, 0) + 1
    served = sorted({name for w in workers for name in (w.get("serves") or ())})
    live = (f"{len(workers)} live worker{'s serve' if len(workers) != 1 else ' serves'} "
            f"{', '.join(served) or 'nothing'}" if workers else "no worker is live on this storage")
    return [f"{n} due run{'s' if n != 1 else ''} of workflow {name!r}: no live worker serves it ({live}); start "
            f"one with `durably worker --import` naming the code that declares it" for name, n in counted.items()]
