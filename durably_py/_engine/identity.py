"""Which run a call names, and creating it: the identity rules, run headers, and finding or binding a run.

`workflow(input)` names one run: the run bound to its key (`key=`), else to its workflow and input digest.
Processes starting the same run at once agree on one run (`Storage.bind`); a run id is never re-bound
silently, and an identity pointing at a run created for another (two runs given one id) is refused.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .. import _ids
from .. import records as log_format
from .._authoring.workflow import Workflow
from .._codec import digest, dump_value, load_value, to_iso
from ..errors import KeyConflictError, ValidationError
from ..storage import RunInfo, Storage

JOIN_POLL = 0.05
RESERVED_WAIT = 2.0
"""Seconds a bound identity may point at a run whose header is not written yet before it is bound afresh."""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def script_of(workflow: Workflow) -> str | None:
    """The script a run's header records: $DURABLY_SCRIPT, else the file defining the workflow function."""
    return os.environ.get("DURABLY_SCRIPT") or workflow.source_file


_kept: set[tuple[int, str]] = set()  # (id of a storage, digest) this process kept already


def keep_source(storage: Storage, workflow: Workflow) -> str | None:
    """Keep the source file defining `workflow` in `storage` (once per storage and digest in this process) and
    return its digest for the new run's header (None: the workflow has no source file)."""
    found = workflow.source
    if found is None:
        return None
    digest_, text = found
    kept = (id(storage), digest_)
    if kept not in _kept:
        storage.keep_blob(digest_, text)
        if len(_kept) < 4096:
            _kept.add(kept)
    return digest_


def new_header(run_id: str, workflow: Workflow, wire_input: Any, input_digest: str, key: str | None,
               identity: str, budget: dict[str, float] | None, storage: Storage | None = None,
               **extra: Any) -> bytes:
    """The header line of a new run (`storage`: where its workflow's source is kept, `keep_source`)."""
    if storage is not None:
        extra["source"] = keep_source(storage, workflow)
    return log_format.encode(log_format.Header(
        v=log_format.LOG_VERSION, run_id=run_id, workflow=workflow.name, fingerprint=workflow.fingerprint,
        key=key, input=wire_input, input_digest=input_digest, identity=identity, budget=budget,
        created_at=to_iso(datetime.now(UTC)), script=script_of(workflow), module=workflow.fn.__module__,
        ts=time.time(), **extra))


def identity_of(workflow: Workflow, input: Any, key: str | None) -> tuple[Any, str, str]:
    """The input as recorded (checked against the workflow's schema), its digest and the identity naming
    the run: the key, else the workflow and the digest."""
    schema = workflow.input_schema
    wire_input = dump_value(schema.to_builtins(input) if schema else input, "input")
    if schema is not None:
        wire_input = dump_value(schema.to_builtins(schema.convert(load_value(wire_input), "input")), "input")
    if input is not None and not workflow.takes_input:
        raise ValidationError(f"workflow {workflow.name!r} takes no input, got {_short(input)}",
                              hint=f"Run it without input, or give it one: `async def {workflow.name}(ctx, "
                                   "input)`.", docs="docs/running.md")
    input_digest = digest(load_value(wire_input))
    return wire_input, input_digest, f"key:{key}" if key is not None else f"wf:{workflow.name}:{input_digest}"


def check_bound(identity: str, info: RunInfo, parent: str | None = None) -> None:
    """Refuse a run that `identity` points at but that was created for another identity (two runs given one id:
    a collision of its random bits, or ids forced by hand), so one run is never taken for two. A header
    without an identity (an older log) is taken at its word."""
    recorded = info.identity
    if recorded is None or recorded == identity:
        return
    whose = f"run {parent}" if parent is not None else "this run"
    raise ValidationError(
        f"{identity} points at run {info.run_id}, which was created as {recorded}: two runs were given one id, "
        f"and {whose} cannot tell them apart",
        hint=f"Start {whose} over with `durably restart {parent or 'RUN'}`; nothing of run {info.run_id} is "
             "changed." if parent is not None else "Start it over with fresh=True (`durably restart RUN`).",
        docs="docs/running.md#run-ids", run_id=info.run_id, identity=identity, recorded=recorded)


class Identities:
    """Finds the run a call names in one storage, or creates and queues it (`Engine.identities`).

    `valid` raises the `CorruptLogError` of a damaged run it finds (`Runs.valid`)."""

    def __init__(self, storage: Storage, valid: Callable[[RunInfo], None]) -> None:
        self.storage = storage
        self.valid = valid

    async def identify(self, workflow: Workflow, input: Any, key: str | None, fresh: bool,
                       budget: dict[str, float] | None, at: float | None = None, priority: int = 0,
                       **extra: Any) -> str:
        """The id of the run that `workflow(input)` (or `key`) names under the identity rules, created if needed
        (`extra`: header fields of a new run, such as its queue)."""
        run_id, _ = await self.identify_run(workflow, input, key, fresh, budget, at, priority, **extra)
        return run_id

    async def identify_run(self, workflow: Workflow, input: Any, key: str | None, fresh: bool,
                           budget: dict[str, float] | None, at: float | None = None, priority: int = 0,
                           **extra: Any) -> tuple[str, bool]:
        """`identify`, and whether the run it found had ended failed (then `Engine.run` claims it reopened at
        once, instead of being refused as an ended run first)."""
        wire_input, input_digest, identity = identity_of(workflow, input, key)
        return await self.find_or_create(workflow, input, wire_input, input_digest, key, identity, budget, fresh,
                                         at, priority, **extra)

    async def find_or_create(self, workflow: Workflow, input: Any, wire_input: Any, input_digest: str,
                             key: str | None, identity: str, budget: dict[str, float] | None, fresh: bool,
                             at: float | None = None, priority: int = 0, **extra: Any) -> tuple[str, bool]:
        """The run `identity` names, or a new run bound to it, and whether the run found had ended failed;
        processes starting it at once agree on one run."""
        storage = self.storage
        waited = 0.0
        while True:
            previous = storage.lookup(identity)
            info = storage.info(previous) if previous is not None else None
            if previous is not None and info is None and waited < RESERVED_WAIT:
                await asyncio.sleep(JOIN_POLL / 5)  # another process bound it and is writing its header now
                waited += JOIN_POLL / 5
                continue
            if info is not None and not fresh:
                self.valid(info)
                check_bound(identity, info)
                if key is not None and info.input_digest != input_digest:
                    bound = load_value(info.header.get("input"))
                    raise KeyConflictError(
                        f"key {key!r} is bound to run {info.run_id} with input {bound!r}, not {input!r}",
                        hint="Pass the same input to resume that run, another key for a new run, or fresh=True "
                             "to rebind the key.",
                        run_id=info.run_id, key=key, bound_input=bound, input=input)
                if info.end_status not in ("completed", "cancelled"):
                    return info.run_id, info.end_status == "failed"
            run_id = _ids.new_run_id(workflow.name)
            if storage.bind(identity, run_id, expect=previous):
                self.create(run_id, workflow, wire_input, input_digest, key, identity, budget, at=at,
                            priority=priority, **extra)
                return run_id, False

    def create(self, run_id: str, workflow: Workflow, wire_input: Any, input_digest: str, key: str | None,
               identity: str, budget: dict[str, float] | None, *, at: float | None = None, priority: int = 0,
               **extra: Any) -> None:
        """Write the header of a run whose identity is already bound to `run_id`, and queue it (due at `at`,
        None: now). An id that exists already is a loud `ValidationError`, never a silent re-bind."""
        header = new_header(run_id, workflow, wire_input, input_digest, key, identity, budget, self.storage,
                            **extra)
        self.storage.create(run_id, header, at=at, priority=priority)
