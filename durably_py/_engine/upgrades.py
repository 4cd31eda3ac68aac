"""The code a run started with, against the code there is now: `durably diff`, and resuming on recorded source.

A new run's header names the sha256 of the source file defining its workflow (`Header.source`), and the store
keeps that file once per digest (`Storage.keep_blob`). So after an edit an operator can see what changed
since a run started (`source_diff`), and a run held `stale` by the change can be resumed on the code it began
with (`recorded_workflow`: its recorded source imported in place of the current one) where that file is
self-contained. See docs/versioning.md#upgrades.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import records
from .._authoring.workflow import REGISTRY, Workflow, load_script
from ..errors import ValidationError
from ..storage import Storage

DOCS = "docs/versioning.md#upgrades"


@dataclass(frozen=True)
class SourceDiff:
    """What changed in a run's source file since it started (`Engine.diff`).

    `started`: the digest of the file the run started with; `last`: of the file it last ran on (another after a
    resume on edited code); `current`: of the file at `script` now (None: no file there); `diff`: a unified diff
    from the started file to the current one ("" when they are the same)."""

    run_id: str
    workflow: str
    script: str | None
    started: str
    last: str | None
    current: str | None
    diff: str

    @property
    def changed(self) -> bool:
        """Whether the file now differs from the one the run started with."""
        return self.current != self.started


def recorded_source(storage: Storage, header: records.Header) -> bytes:
    """The source file the run of `header` started with, from the store; a `ValidationError` saying why when
    there is none."""
    run_id = header.run_id
    if header.source is None:
        raise ValidationError(
            f"run {run_id} recorded no source file (it started before sources were kept, or its workflow was not "
            "defined in a file)", hint=f"`durably inspect {run_id}` shows its script; compare it by hand.",
            docs=DOCS, run_id=run_id)
    text = storage.blob(header.source)
    if text is None:
        raise ValidationError(f"the source run {run_id} started with ({header.source[:12]}) is not in this store",
                              hint="It was removed from the store's sources; compare the run's script by hand.",
                              docs=DOCS, run_id=run_id)
    return text


def source_diff(storage: Storage, header: records.Header, last: str | None) -> SourceDiff:
    """The difference between the source file the run of `header` started with and the file at its script now."""
    before = recorded_source(storage, header)
    assert header.source is not None
    now: bytes | None = None
    if header.script is not None:
        try:
            now = Path(header.script).read_bytes()
        except OSError:
            now = None
    name = header.script or "<script>"
    diff = "" if now == before else "".join(difflib.unified_diff(
        before.decode("utf-8", "replace").splitlines(keepends=True),
        (now or b"").decode("utf-8", "replace").splitlines(keepends=True),
        fromfile=f"{name} (run started {header.source[:12]})",
        tofile=f"{name} (now)" if now is not None else f"{name} (missing)"))
    return SourceDiff(run_id=header.run_id, workflow=header.workflow, script=header.script, started=header.source,
                      last=last, current=hashlib.sha256(now).hexdigest() if now is not None else None, diff=diff)


def recorded_workflow(storage: Storage, header: records.Header) -> Workflow:
    """Import the source file the run of `header` started with, in place of the current one in this process's
    registry, and return its workflow: what runs the run on the code it began with. Its own imports resolve as
    usual (to the current files of other modules): the file must be self-contained for this to be that code."""
    text = recorded_source(storage, header)
    stem = re.sub(r"\W", "_", Path(header.script or "recorded").stem) or "recorded"
    folder = tempfile.mkdtemp(prefix="durably-source-")
    path = os.path.join(folder, f"{stem}.py")
    with open(path, "wb") as f:
        f.write(text)
    load_script(path)
    found = REGISTRY.get(header.workflow)
    if found is None or os.path.realpath(found.fn.__code__.co_filename) != os.path.realpath(path):
        raise ValidationError(
            f"the source run {header.run_id} started with does not declare workflow {header.workflow!r} itself",
            hint="Run it on the current code (`durably retry`), adopt the change (`durably adopt`) or start it "
                 f"over (`durably restart {header.run_id}`).", docs=DOCS, run_id=header.run_id)
    return found
