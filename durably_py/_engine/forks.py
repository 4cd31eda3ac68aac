"""Forks: a new run that starts from a recorded step of another run, on the current code.

`fork(run, from_step=P)` copies the original's history up to the record that completed step P (the log's order
is the cut, so with parallel branches exactly what had completed when P completed is kept), optionally with
P's recorded output replaced, into a new run; the new run then replays that history and continues live after
P. The original run is only read. What if the model had answered "deny"? Fork from the model's step with that
answer and watch the other branch run.

What is copied is what replay needs: step outcomes (with their failed attempts), sleeps and waits that
finished, `ctx.now`/`random`/`uuid` values, patches, adoptions, loop snapshots, task graphs, charges, notes,
advisories, code and budget changes, and the reopen and reset records that say which outcomes still stand (a reset of a run that had failed reopened it
because of its end record, which is not copied: the fork gets a reopen record in its place).
Claims, parks, pauses, resumes, stale marks and ends are not: they are about the original's processes, not
its history. Nor are the records of work still unfinished when P completed (a step running in a parallel
branch, a sleep or wait not over): the fork runs it again.

A fork is bound to a key of its own, ``fork:ORIGINAL:N`` (its Nth fork), never to the original's key or input
identity, so `run()` of the original's workflow and input (or key) still finds the original; its header's
`forked_from` records the lineage, and the catalog finds a run's forks by the key prefix (`Runs.forks`).
"""

from __future__ import annotations

import builtins
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec

from .. import _ids
from .. import records as log_format
from .._codec import dump_value, to_iso
from .._events import StepEvent
from .._replay.kernel import selects
from .._state.history import History, path_tuple
from ..errors import DurablyError, RunNotFoundError, ValidationError
from .runs import fork_key

if TYPE_CHECKING:
    from .operations import Operations

DOCS = "docs/operations.md#forks"
PENDING_UNTIL = 9e11
"""Where a fork's queue entry is due while its history is copied in (never, in practice): no worker takes a fork
before its history is complete; it is made due once it is."""
FORK_KEYS_TRIED = 1000

_NOT_COPIED = (log_format.Claim, log_format.Park, log_format.Pause, log_format.Resume, log_format.Stale,
               log_format.End, log_format.Header)
_IN_FLIGHT = (log_format.Start, log_format.Fail, log_format.Stash, log_format.Wake, log_format.Wait)


class _Unset:
    """The default of `set_output`: keep the recorded output (None is an output like any other)."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


@dataclass
class ForkPlan:
    """What a fork will be, decided (and checked) before anything is written."""

    original: History
    path: str
    label: str
    records: builtins.list[log_format.Record]
    edited: bool
    budget: dict[str, float] | None  # the budget the run had when P completed


def step_selector(from_step: Any) -> Any:
    """`from_step` as a selector `selects` reads: a path written "3.1.0" or "(3, 1, 0)" (as `inspect` prints
    it) becomes a tuple, a list a tuple; a label, `(label, nth)` and a path tuple stay as they are."""
    if isinstance(from_step, list):
        return tuple(from_step)
    if isinstance(from_step, str):
        spec = from_step.strip()
        if re.fullmatch(r"\d+(\.\d+)*", spec):
            return tuple(int(part) for part in spec.split("."))
        if re.fullmatch(r"\(\s*\d+\s*(,\s*\d+\s*)*,?\s*\)", spec):
            return tuple(int(part) for part in spec.strip("() ").split(",") if part.strip())
    return from_step


def _shape_ok(selector: Any) -> bool:
    return isinstance(selector, str) and bool(selector) or (
        isinstance(selector, tuple) and bool(selector) and (
            all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in selector)
            or (len(selector) == 2 and isinstance(selector[0], str) and isinstance(selector[1], int)
                and not isinstance(selector[1], bool) and selector[1] >= 1)))


def _listed(history: History) -> str:
    steps = [f"{'.'.join(map(str, path_tuple(p)))} {history.done[p].label}" for p in
             sorted(history.done, key=path_tuple)]
    return ", ".join(steps[:30]) + (f", … ({len(steps) - 30} more)" if len(steps) > 30 else "") or "none"


def choose_step(history: History, from_step: Any) -> str:
    """The path of the completed step `from_step` picks (counted in the order steps completed, as
    `retry --from-step` counts), or the `ValidationError` that says why none: not a selector, a step the run
    started but has not completed, or one it never reached."""
    run_id = history.header.run_id
    selector = step_selector(from_step)
    hint = ("Select a completed step by its path (2,), (3, 1, 0) or '3.1.0', by its label 'model', or by "
            "(label, nth) for the nth step with that label; `durably inspect RUN` shows paths and labels.")
    if not _shape_ok(selector):
        raise ValidationError(f"from_step={from_step!r} is not a step selector", hint=hint, docs=DOCS,
                              run_id=run_id)
    seen: dict[str, int] = {}
    for path, rec in history.done.items():
        nth = seen[rec.label] = seen.get(rec.label, 0) + 1
        if selects(selector, path, rec.label, nth):
            return path
    unfinished: dict[str, str] = {}
    for table in (history.starts, history.fails):
        for path, began in table.items():
            unfinished.setdefault(path, began.label)
    for path in history.waits:
        unfinished.setdefault(path, "ctx.wait_for")
    for path in history.wakes:
        unfinished.setdefault(path, "ctx.sleep")
    for path, label in unfinished.items():
        if path not in history.done and (selects(selector, path, label, 1) or selector == label):
            raise ValidationError(
                f"run {run_id} has not completed step {'.'.join(map(str, path_tuple(path)))} ({label}) yet: it "
                "started and has no outcome, so there is no output to fork from",
                hint=f"Fork from a step it completed ({_listed(history)}), or let it finish first "
                     f"(`durably retry {run_id}`).", docs=DOCS, run_id=run_id)
    raise ValidationError(f"from_step={from_step!r} matches no step run {run_id} completed; its steps: "
                          f"{_listed(history)}", hint=hint, docs=DOCS, run_id=run_id)


def plan(typed: builtins.list[log_format.Record], where: str, from_step: Any, set_output: Any,
         ended: Callable[[str], bool]) -> ForkPlan:
    """Decide a fork of the run whose validated log is `typed` from `from_step` (`set_output`: P's new output,
    or `UNSET`): the records it starts with, all checked. `ended(run_id)` says whether a child run has ended.
    Writes nothing; every refusal is a `ValidationError` with a hint."""
    history = History(typed, where)  # folds these very records, so P's record is found among them by identity
    run_id = history.header.run_id
    path = choose_step(history, from_step)
    chosen = history.done[path]
    cut = next((i for i in range(len(typed) - 1, 0, -1) if typed[i] is chosen), None)
    if cut is None:  # the history was folded from other objects: the last outcome recorded at the path
        cut = max(i for i, rec in enumerate(typed) if isinstance(rec, log_format.Ok | log_format.Err)
                  and rec.path == path)
    prefix = typed[: cut + 1]
    settled = History(prefix, f"run {run_id}")
    step = ".".join(map(str, path_tuple(path)))
    if set_output is not UNSET and chosen.label == "ctx.spawn":
        raise ValidationError(f"step {step} of run {run_id} spawned a child run; its output names that run and "
                              "cannot be set", hint="Fork from it without set_output, or set the output of its join "
                              "(ctx.join).", docs=DOCS, run_id=run_id)
    if settled.cancel is not None:
        raise ValidationError(
            f"step {step} of run {run_id} completed after the run was cancelled, during its clean-up; a fork does "
            "not carry the cancel", hint="Fork from a step that completed before the cancel (`durably inspect "
                                         f"{run_id}` shows them).", docs=DOCS, run_id=run_id)
    running = [rec.value["run_id"] for rec in settled.done.values()
               if isinstance(rec, log_format.Ok) and rec.label == "ctx.spawn" and isinstance(rec.value, dict)
               and isinstance(rec.value.get("run_id"), str) and not ended(rec.value["run_id"])]
    if running:
        raise ValidationError(
            f"run {run_id} had spawned child runs by step {step} that have not ended ({', '.join(running[:3])}"
            f"{', …' if len(running) > 3 else ''}); a fork would share them with the original",
            hint="Fork once they have ended, or from a step before they were spawned.", docs=DOCS, run_id=run_id)
    edited = set_output is not UNSET
    last = chosen
    if edited:
        try:
            wire = dump_value(set_output, "set_output")
        except DurablyError as exc:
            raise ValidationError(f"set_output= cannot be recorded: {exc.message}", hint=exc.hint or
                                  "Give a JSON value: str, int, float, bool, None, lists and dicts of them.",
                                  docs=DOCS, run_id=run_id) from None
        last = log_format.Ok(path=path, label=chosen.label, value=wire, attempt=chosen.attempt, ms=chosen.ms,
                             ts=time.time())
    kept: builtins.list[log_format.Record] = []
    failed = False  # an end record left out said the run had failed, and nothing reopened it since
    for rec in prefix[1:-1]:
        if isinstance(rec, log_format.End):
            failed = rec.status == "failed"
        elif isinstance(rec, log_format.Reopen):
            failed = False
        elif isinstance(rec, log_format.Reset) and failed:
            kept.append(log_format.Reopen(ts=rec.ts))  # a reset of a failed run reopened it: said outright here
            failed = False
        if isinstance(rec, _NOT_COPIED):
            continue
        if isinstance(rec, _IN_FLIGHT) and rec.path not in settled.done:
            continue  # work unfinished when P completed: the fork runs it again
        kept.append(rec)
    kept.append(last)
    return ForkPlan(history, path, chosen.label, kept, edited, settled.budget)


class Forks:
    """Forks of an engine's runs (`Engine.fork` delegates here), over the operations' reading and running."""

    def __init__(self, operations: Operations) -> None:
        self.operations = operations
        self.storage = operations.storage

    def ended(self, run_id: str) -> bool:
        """Whether a (child) run has ended: an unknown one has, for a fork's purpose (nothing can run it)."""
        info = self.storage.info(run_id)
        return info is None or info.ended

    def create(self, chosen: ForkPlan) -> str:
        """Write the fork: bind its key, create it not yet due, copy its history in (one durable amend), then
        make it due. A failure on the way removes what was written."""
        header = chosen.original.header
        original = header.run_id
        fork_id = _ids.new_run_id(header.workflow)
        key = None
        start = len(self.operations.runs.forks(original)) + 1
        for n in range(start, start + FORK_KEYS_TRIED):
            if self.storage.bind(f"key:{fork_key(original, n)}", fork_id, expect=None):
                key = fork_key(original, n)
                break
        if key is None:
            raise ValidationError(f"no free fork key for run {original} after {FORK_KEYS_TRIED} tries", docs=DOCS,
                                  run_id=original)
        now = time.time()
        lineage = {"run": original, "path": chosen.path, "label": chosen.label, "edited": chosen.edited}
        head = msgspec.structs.replace(header, run_id=fork_id, key=key, identity=f"key:{key}",
                                       created_at=to_iso(datetime.now(UTC)), ts=now, parent=None, detached=False,
                                       forked_from=lineage)
        body = b"".join(log_format.encode(rec) for rec in chosen.records)
        self.storage.create(fork_id, log_format.encode(head), at=PENDING_UNTIL)
        try:
            if not self.storage.amend(fork_id, lambda records, where: body, check=log_format.load):
                raise ValidationError(f"fork {fork_id} was claimed before its history was written", run_id=fork_id)
            self.storage.schedule(fork_id, time.time())
        except BaseException:
            self.storage.delete(fork_id)
            raise
        return fork_id

    async def fork(self, run: str, *, from_step: Any, set_output: Any = UNSET,
                   on_step: Callable[[StepEvent], Any] | None = None, wait: bool = True,
                   on_run: Callable[[str], Any] | None = None) -> Any:
        """Fork run `run` (by id or key) from the completed step `from_step` (its output replaced by `set_output`
        when given) into a new run, and run that here on the current code; return its value or raise its error
        (`on_run` gets the fork's id first). Bad input writes nothing."""
        ops = self.operations
        run_id = ops.runs.resolve(run)
        log = self.storage.read(run_id)
        if log is None:
            raise RunNotFoundError(f"no run {run_id!r} in {ops.runs.where()}", run_id=run_id)
        where = log.where or f"run {run_id}"
        chosen = plan(log_format.load(log.records, where), where, from_step, set_output, self.ended)
        workflow = ops.code_for(chosen.original.header)  # the code is found before anything is written
        fork_id = self.create(chosen)
        return await ops.run(workflow, run_id=fork_id, on_step=on_step, wait=wait, on_run=on_run,
                             budget=chosen.budget)
