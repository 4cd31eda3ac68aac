"""A run's log read back: what replay answers from, and what `inspect` shows.

The records themselves (kinds, fields, version, validation) are defined in `records.py` and
docs/log-format.md; `History` folds a validated log into tables keyed by step path, one
handler per record kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .. import records as r
from .._codec import load_error, load_value
from ..errors import DurablyError, RunCancelledError, WorkflowFailedError
from ..records import Header, Record

BUDGET_KINDS = ("usd", "tokens", "units")


class History:
    """Everything replay needs from a run's records, with superseded records already dropped.

    `records` are validated first (`records.load`): a damaged log raises `CorruptLogError` naming
    `where`, line and field, before anything reads it."""

    def __init__(self, records: list[Any], where: str = "run log") -> None:
        typed = r.load(records, where)
        self.header: Header = typed[0]  # type: ignore[assignment]
        self.done: dict[str, r.Ok | r.Err] = {}
        self.errs: set[str] = set()  # paths recorded failed (`reopen` runs them again), with stale ones
        self.fails: dict[str, r.Fail] = {}
        self.starts: dict[str, r.Start] = {}
        self.resolved: dict[str, r.Resolve] = {}  # operators' decisions about cut-off unsafe steps, by path
        self.stashes: dict[str, r.Stash] = {}
        self.comps: dict[str, r.Comp] = {}
        self.snaps: dict[str, r.Snap] = {}
        self.graphs: dict[str, r.Graph] = {}
        self.wakes: dict[str, r.Wake] = {}
        self.waits: dict[str, r.Wait] = {}
        self.awakeables: dict[str, r.Awake] = {}  # awakeables created, by path (resolved once `done` has the path)
        self.signals: set[str] = set()
        self.charges: dict[str, r.Charge] = {}
        self.patches: dict[str, r.Patch] = {}
        self.adopted: dict[str, r.Adopt] = {}
        self.stale_error: dict[str, Any] | None = None
        self.advisories: dict[str, dict[str, Any]] = {}
        self.notes: dict[str, Any] = {}
        self.noted: dict[str, int] = {}  # per workflow strand, the index of its last `ctx.annotate` call recorded
        self.end: r.End | None = None
        self.claim: r.Claim | None = None
        self.park: r.Park | None = None  # a join or a retry backoff the run parked in since its last claim
        self.cancel: r.Cancel | None = None  # the cancel delivered to the workflow, while it cleans up
        self.cancel_after: str | None = None  # the path of the last outcome before it (None: the first)
        self.paused = False
        self.stale = False
        self.budget: dict[str, float] | None = self.header.budget
        self.fingerprint: str | None = self.header.fingerprint
        self.source: str | None = self.header.source  # the source file's digest of the code it last ran on
        self.updated: float | None = None
        self.elided = False  # records were written to the log but not kept here (`forget`)
        self.forgotten: dict[str, None] = {}  # one path per batch of forgotten records, for `recorded_from`
        fold = _FOLD
        done = self.done
        ok = r.Ok
        for rec in typed[1:]:
            if type(rec) is ok and rec.signal is None:  # most of a log: `_done` inlined
                done[rec.path] = rec
            else:
                fold[type(rec)](self, rec)
        for rec in reversed(typed):
            ts = getattr(rec, "ts", None)
            if ts is not None:
                self.updated = ts
                break

    def add(self, rec: Record) -> None:
        """Fold one record into the history (records must come in log order)."""
        _FOLD[type(rec)](self, rec)
        ts = getattr(rec, "ts", None)
        if ts is not None:
            self.updated = ts

    def add_ok(self, rec: r.Ok) -> None:
        """`add` of an `Ok` without a signal and with a `ts` (a live step's), written out: once per fresh step."""
        self.done[rec.path] = rec
        self.updated = rec.ts

    def forget(self, path: str, batch: str) -> None:
        """Drop the record at `path` from memory; the log keeps it. A run forgets the spawn and join records
        of a `spawn_all` / `join_all` once replayed, and never folds those it writes (`kept_out`): nothing asks
        for them again in this process,
        so a parent of 100,000 children does not hold 200,000 records. `batch`, one path of the batch the
        record belongs to, stands for all of them in `recorded_from`; `elided` tells a loop compaction, which
        rewrites the log from a history, to read the whole log back first."""
        if self.done.pop(path, None) is not None:
            self.errs.discard(path)
            self.elided = True
            self.forgotten[batch] = None

    def kept_out(self, batch: str, ts: float | None) -> None:
        """Records of the batch at `batch` were written to the log without being folded here (see `forget`)."""
        self.elided = True
        self.forgotten[batch] = None
        if ts is not None:
            self.updated = ts

    def _done(self, rec: r.Ok | r.Err) -> None:
        self.done[rec.path] = rec
        if isinstance(rec, r.Ok):
            if rec.signal is not None:
                self.signals.add(rec.signal)
        else:
            self.errs.add(rec.path)

    def _start(self, rec: r.Start) -> None:
        """A step began. An unsafe step's own start (with its `effect` and `input`) is kept over a later start
        of the same attempt that lacks them (the heartbeat's), so what the attempt needs on a resume survives."""
        known = self.starts.get(rec.path)
        if known is not None and known.effect is not None and rec.effect is None and known.attempt == rec.attempt:
            return
        self.starts[rec.path] = rec

    def _resolve(self, rec: r.Resolve) -> None:
        """An operator's decision about a cut-off unsafe step, folded as the outcome it stands for: a value is
        the step's result (an `ok`), a failure its error (an `err`), a rerun a failed attempt due at once (a
        `fail`, so the next attempt runs with the next number). `resolved` keeps the decision for `inspect`."""
        self.resolved[rec.path] = rec
        if rec.decision == "value":
            self.done[rec.path] = r.Ok(path=rec.path, label=rec.label, value=rec.value, attempt=rec.attempt,
                                       ts=rec.ts)
        elif rec.decision == "fail":
            self.done[rec.path] = r.Err(path=rec.path, label=rec.label, error=rec.error or {}, attempt=rec.attempt,
                                        ts=rec.ts)
            self.errs.add(rec.path)
        else:
            when = datetime.fromtimestamp(rec.ts or 0, UTC).isoformat()
            self.fails[rec.path] = r.Fail(path=rec.path, label=rec.label, attempt=rec.attempt,
                                          error=rec.error or {}, next=when, ts=rec.ts)

    def attention(self) -> dict[str, r.Start]:
        """The unsafe steps with the "manual" policy whose last attempt started and never finished, by path: a
        run no process holds with any of them `needs_attention` until an operator resolves each
        (`Engine.resolve_effect`)."""
        out: dict[str, r.Start] = {}
        for path, start in self.starts.items():
            if start.effect != "manual" or path in self.done:
                continue
            fail = self.fails.get(path)
            if fail is None or fail.attempt < start.attempt:
                out[path] = start
        return out

    def _note(self, rec: r.Note) -> None:
        self.notes.update(rec.notes)
        if rec.strand is not None and rec.index is not None and rec.index > self.noted.get(rec.strand, -1):
            self.noted[rec.strand] = rec.index

    def _advice(self, rec: r.Advice) -> None:
        self.advisories[rec.advisory["code"]] = rec.advisory

    def _pause(self, rec: r.Pause | r.Resume) -> None:
        self.paused = isinstance(rec, r.Pause)

    def _code(self, rec: r.Code) -> None:
        self.fingerprint = rec.fingerprint
        self.source = rec.source

    def _budget(self, rec: r.Budget) -> None:
        self.budget = rec.budget
        if self.park is not None and self.park.budget is not None:
            self.park = None  # raised: the run is no longer over budget (its next claim checks again)

    def _end(self, rec: r.End) -> None:
        self.end = rec

    def _cancel(self, rec: r.Cancel) -> None:
        if self.cancel is None:
            self.cancel = rec
            self.cancel_after = next(reversed(self.done), None)

    def order(self) -> list[str]:
        """The paths of the recorded outcomes in the order they reached the workflow (the log's): what a
        replay delivers them in (`turns.Turns`), a delivered cancel request in its place as ``"$cancel"``."""
        order = list(self.done)
        if self.cancel is not None and self.end is None:
            at = order.index(self.cancel_after) + 1 if self.cancel_after in self.done else 0
            order.insert(at, "$cancel")
        return order

    def _patch(self, rec: r.Patch) -> None:
        self.patches.setdefault(rec.change, rec)  # the first answer is the run's for good

    def _claim(self, rec: r.Claim) -> None:
        self.claim = rec
        self.stale = False
        self.park = None

    def _park(self, rec: r.Park) -> None:
        self.park = rec

    def _stale(self, rec: r.Stale) -> None:
        self.stale = True
        self.stale_error = rec.error

    def _adopt(self, rec: r.Adopt) -> None:
        self.adopted[rec.path] = rec
        self.stale = False

    def accepts(self, path: str, label: str) -> bool:
        """True when an adoption says the step now called `label` at `path` is the recorded one there."""
        adopted = self.adopted.get(path)
        return adopted is not None and adopted.label in (None, label)

    def stale_detail(self) -> dict[str, Any] | None:
        """Where the replay of a stale run stopped: ``path`` (a list), the ``recorded`` step name and the one
        the code now ``called`` there, the error ``message``, and ``patch`` when a retired patch stopped it."""
        if not self.stale or not self.stale_error:
            return None
        attrs = self.stale_error.get("attrs") or {}
        detail = {"path": attrs.get("path"), "recorded": attrs.get("recorded"), "called": attrs.get("called"),
                  "message": self.stale_error.get("message")}
        if attrs.get("patch") is not None:
            detail["patch"] = attrs["patch"]
        return detail

    @property
    def failing(self) -> bool:
        """True while the run is failing: compensations ran (since it was last reopened) and it has not ended,
        so a process was killed between its failure and its end."""
        return bool(self.comps) and self.end is None

    def reopen(self, rec: r.Reopen | None = None) -> None:
        """A failed (or failing) run resumes: its failed steps run again with fresh attempts, and so does every
        step a compensation undid (the loop around one runs again too, from before it: its recorded result and
        a snapshot taken after it are dropped). A step whose compensation failed was not undone: it keeps its
        result, and its compensation runs again should the run fail again."""
        rerun = [p for p in self.errs if isinstance(self.done.get(p), r.Err)]
        undone = [p for p, comp in self.comps.items() if comp.ok]
        rerun.extend(p for p in undone if p in self.done)
        for parts in (p.split(".") for p in undone):  # a loop's recorded result holds its undone steps' results
            rerun.extend(q for q in (".".join(parts[:k]) for k in range(1, len(parts))) if q in self.done)
        self.errs.clear()
        for path in dict.fromkeys(rerun):
            del self.done[path]
            self.fails.pop(path, None)
            self.starts.pop(path, None)
            self.waits.pop(path, None)
            self.awakeables.pop(path, None)
        for loop in [loop for loop in self.snaps if any(self.snapshotted(p, loop) for p in undone)]:
            del self.snaps[loop]
        self.comps.clear()
        self.end = None

    def reset(self, paths: list[str] | r.Reset) -> None:
        """`retry --from-step`: the steps at `paths` run again (loops rewind past them); the run is open again."""
        if isinstance(paths, r.Reset):
            paths = paths.paths
        if self.end is not None and self.end.status == "failed" or self.failing:
            self.reopen()
        drop = set(paths)
        for table in (self.done, self.fails, self.starts, self.stashes, self.waits, self.wakes, self.comps,
                      self.awakeables):
            for path in [p for p in table if p in drop]:
                del table[path]
        for loop, snap in list(self.snaps.items()):
            inner = [q[len(loop) + 1:].partition(".")[0] for q in paths if q.startswith(f"{loop}.")]
            if loop in drop or any(i.isdigit() and int(i) <= snap.iteration for i in inner):
                del self.snaps[loop]
        self.end = None

    @property
    def attempt(self) -> int:
        """The workflow attempt: how many times a process has claimed the run."""
        return self.claim.epoch if self.claim else 0

    def parked(self) -> str | None:
        """"waiting" while a wait has no result yet or the run parked in a join or for a limit, "sleeping" while a sleep has
        no result yet or the run parked in a retry backoff, else None."""
        park = self.park
        if park is not None and park.budget is not None:
            park = None  # over budget: `run_status` tells it
        if any(p not in self.done for p in self.waits) or any(p not in self.done for p in self.awakeables) or (park is not None and (park.until is None or park.limit)):
            return "waiting"
        if any(p not in self.done for p in self.wakes) or park is not None:
            return "sleeping"
        return None

    def spent(self) -> dict[str, float]:
        """Total charges per budget kind."""
        totals = dict.fromkeys(BUDGET_KINDS, 0.0)
        for rec in self.charges.values():
            for kind, amount in rec.amounts.items():
                totals[kind] = totals.get(kind, 0.0) + amount
        return totals

    def spent_by(self) -> dict[str, dict[str, float]]:
        """The charges per label (what they were spent on: a step's label, ``ctx.charge``), each per kind; a
        charge recorded without a label counts under the label of the step at its path, else ``"?"``."""
        out: dict[str, dict[str, float]] = {}
        for path, rec in self.charges.items():
            label = rec.label
            if label is None:
                step = self.done.get(path.lstrip("$").partition("@")[0])
                label = step.label if step is not None else "ctx.charge" if path.startswith("$") else "?"
            totals = out.setdefault(label, {})
            for kind, amount in rec.amounts.items():
                totals[kind] = totals.get(kind, 0.0) + amount
        return out

    @property
    def over_budget(self) -> dict[str, Any] | None:
        """What the run spent and on what when it parked over its budget (the park record's `budget`), while
        no raise has ended that park; else None."""
        park = self.park
        return park.budget if park is not None and park.budget is not None else None

    def recorded_from(self, bounds: tuple[tuple[str, int], ...]) -> bool:
        """True when any step, sleep, wait, retry, stash, graph, snapshot or charge is recorded at a path
        that one of `bounds` covers: ``(prefix, first)`` covers ``prefix + i`` (and everything under it) for
        every ``i >= first``. `ctx.patched` asks this to tell a run recorded before a change (it has work
        recorded at or after the point it asks from) from one at its live frontier. Patch answers do not count."""
        tables: tuple[dict[str, Any], ...] = (self.done, self.fails, self.starts, self.stashes, self.waits,
                                              self.wakes, self.graphs, self.snaps, self.charges, self.forgotten,
                                              self.awakeables)
        for table in tables:
            for path in table:
                path = path.lstrip("$").partition("@")[0]
                for prefix, first in bounds:
                    if path.startswith(prefix):
                        head = path[len(prefix):].partition(".")[0]
                        if head.isdigit() and int(head) >= first:
                            return True
        return False

    def snapshotted(self, path: str, only: str | None = None) -> bool:
        """True for a step inside a loop iteration that a later snapshot already covers (of the loop at `only`)."""
        for loop, snap in self.snaps.items():
            if (only is None or loop == only) and path.startswith(loop + "."):
                iteration = path[len(loop) + 1:].partition(".")[0]
                if iteration.isdigit() and int(iteration) <= snap.iteration:
                    return True
        return False

    def outcome(self, schema: Any = None) -> Any:
        """The result of an ended run (converted by the workflow's output `schema`, if any), or raise its error:
        how a run another process finished, or one that had finished already, is answered."""
        end = self.end
        assert end is not None
        run_id = self.header.run_id
        if end.status == "completed":
            value = load_value(end.result)
            return schema.convert(value, "result") if schema is not None else value
        if not end.error:
            raise RunCancelledError(f"run {run_id} was cancelled", run_id=run_id)
        error = load_error(end.error)
        if isinstance(error, DurablyError) or not isinstance(error, Exception):
            raise error
        raise error from WorkflowFailedError(f"run {run_id} failed in another process", run_id=run_id)

    def compacted(self) -> list[Record]:
        """The fewest records that rebuild this same history (for log compaction)."""
        out: list[Record] = [self.header]
        if self.fingerprint != self.header.fingerprint or self.source != self.header.source:
            out.append(r.Code(fingerprint=self.fingerprint, source=self.source))
        if self.budget != self.header.budget:
            out.append(r.Budget(budget=self.budget))
        if self.claim:
            out.append(self.claim)
        if self.cancel is not None and self.cancel_after is None:
            out.append(self.cancel)
        for p, d in self.done.items():
            if not self.snaps or not self.snapshotted(p):
                out.append(d)
            if self.cancel is not None and p == self.cancel_after:
                out.append(self.cancel)
        out.extend(s for p, s in self.snaps.items() if p not in self.done)
        for table in (self.fails, self.starts, self.stashes, self.waits, self.wakes):
            out.extend(d for p, d in table.items() if p not in self.done)
        out.extend(self.graphs.values())
        out.extend(self.charges.values())
        out.extend(self.comps.values())
        out.extend(self.patches.values())
        out.extend(self.adopted.values())
        out.extend(r.Advice(advisory=a) for a in self.advisories.values())
        out.extend(r.Note(notes={}, strand=strand, index=i) for strand, i in self.noted.items()
                   if not self.snapshotted(strand + "0"))  # a strand a snapshot covers never runs again
        if self.notes:
            out.append(r.Note(notes=self.notes))
        if self.end:
            out.append(self.end)
        if self.paused:
            out.append(r.Pause())
        return out


def _keep(table: str) -> Callable[[History, Any], None]:
    def fold(history: History, rec: Any) -> None:
        getattr(history, table)[rec.path] = rec
    return fold


def _ignore(history: History, rec: Any) -> None:
    """Records replay does not fold (a second header is rejected by `records.load`)."""


_FOLD: dict[type, Callable[[History, Any], None]] = {
    r.Ok: History._done,
    r.Err: History._done,
    r.Fail: _keep("fails"),
    r.Start: History._start,
    r.Resolve: History._resolve,
    r.Stash: _keep("stashes"),
    r.Charge: _keep("charges"),
    r.Comp: _keep("comps"),
    r.Wait: _keep("waits"),
    r.Awake: _keep("awakeables"),
    r.Wake: _keep("wakes"),
    r.Graph: _keep("graphs"),
    r.Snap: _keep("snaps"),
    r.Claim: History._claim,
    r.Stale: History._stale,
    r.Advice: History._advice,
    r.Note: History._note,
    r.Patch: History._patch,
    r.Adopt: History._adopt,
    r.End: History._end,
    r.Reopen: History.reopen,
    r.Reset: History.reset,
    r.Code: History._code,
    r.Budget: History._budget,
    r.Pause: History._pause,
    r.Resume: History._pause,
    r.Park: History._park,
    r.Cancel: History._cancel,
    r.Header: _ignore,
}
"""How each record kind folds into a `History` (one entry per kind of `records.Record`)."""


def path_tuple(path: str) -> tuple[int, ...]:
    """'0.3.1' -> (0, 3, 1)."""
    return tuple(int(p) for p in path.split(".")) if path else ()


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class StepState:
    """One step as `inspect` shows it. `status` is ok, failed, retrying, running, interrupted, needs_attention
    (an unsafe "manual" step cut off: an operator decides), waiting, sleeping, or compensated (it completed
    and a compensation then undid it: a retry runs it again). `effect` describes an unsafe step's last recorded
    start: its ``policy``, ``operation_id``, ``input``, ``attempt``, ``started_at`` and, once an operator
    decided about it, ``resolved`` (``decision`` and ``at``)."""

    path: tuple[int, ...]
    label: str
    status: str
    attempts: int
    ms: float | None = None
    output: Any = None
    error: dict[str, Any] | None = None
    stashed: Any = None
    finished_at: datetime | None = None
    compensation: str | None = None
    started_at: datetime | None = None  # when a step still running (or cut off) began, as its start record says
    effect: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form (for `--json`), values shared with the step."""
        data = dict(vars(self))
        data["path"] = list(self.path)
        for key in ("finished_at", "started_at"):
            data[key] = data[key].isoformat() if data[key] else None
        return data

    def preview(self) -> str:
        """A one-line preview of the output or the error."""
        if self.error:
            return f"{self.error['type'].rpartition(':')[2]}: {self.error['message']}"
        return _preview(self.output) if self.status in ("ok", "compensated") else ""


@dataclass
class SignalSent:
    """What `Engine.signal` delivered: to which run, the run's status then, the names its open waits wait for,
    and whether a process held it (and so reads the signal by itself)."""

    run_id: str
    name: str
    status: str
    awaited: list[str]
    held: bool

    @property
    def mismatched(self) -> bool:
        """The run waits for signals, none of them this one: it stays in the inbox until a wait for it."""
        return self.status == "waiting" and bool(self.awaited) and self.name not in self.awaited


@dataclass
class RunState:
    """A run as `inspect` and `list` describe it."""

    run_id: str
    status: str
    workflow: str
    key: str | None
    input: Any
    created_at: datetime
    updated_at: datetime | None
    attempt: int
    steps: list[StepState] = field(default_factory=list)
    advisories: list[dict[str, Any]] = field(default_factory=list)
    annotations: dict[str, Any] = field(default_factory=dict)
    result: Any = None
    error: dict[str, Any] | None = None
    script: str | None = None
    parent: str | None = None
    children: list[str] = field(default_factory=list)
    budget: dict[str, float] | None = None
    spent: dict[str, float] = field(default_factory=dict)
    spent_by: dict[str, dict[str, float]] = field(default_factory=dict)  # the spend per step label, per kind
    over_budget: dict[str, Any] | None = None  # an over-budget run's park: limit, spent, by label, budget owner
    warnings: list[str] = field(default_factory=list)
    patches: dict[str, bool] = field(default_factory=dict)
    stale: dict[str, Any] | None = None
    signals: list[dict[str, Any]] = field(default_factory=list)  # unread signals in the inbox (name, at, payload)
    ready: str | None = None  # what a parked run no process holds received: it continues on its next claim
    queued: dict[str, Any] | None = None  # a pending run's place in the queue: due (epoch seconds), priority, queue, partition
    owner: dict[str, Any] | None = None  # who holds a running run's lease (see `Runs.holder`)
    attention: list[dict[str, Any]] = field(default_factory=list)  # the cut-off steps an operator must resolve
    forked_from: dict[str, Any] | None = None  # a fork's lineage: {"run", "path" (a list), "label", "edited"}
    forks: list[str] = field(default_factory=list)  # the runs forked from this one (`inspect` only), oldest first
    awakeables: list[dict[str, Any]] = field(default_factory=list)  # open awakeables: id, name, path, deadline

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form (for `--json`). Values are shared, not copied: a 10,000-step run converts
        in milliseconds (a deep copy took most of a second)."""
        data = dict(vars(self))
        for key in ("created_at", "updated_at"):
            data[key] = data[key].isoformat() if data[key] else None
        data["steps"] = [step.to_dict() for step in self.steps]
        return data


def _created(header: Header) -> datetime:
    """When the run was created (from the header's ``created_at``, else its ``ts``)."""
    if header.created_at:
        try:
            return datetime.fromisoformat(header.created_at)
        except ValueError:
            pass
    return datetime.fromtimestamp(header.ts or 0, UTC)


def _ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


def lineage(forked_from: dict[str, Any]) -> dict[str, Any]:
    """A fork's header field `forked_from` as `RunState.forked_from` gives it: the step path as a list, like
    `StepState.path` in JSON."""
    path = forked_from.get("path")
    return {"run": forked_from.get("run"), "path": list(path_tuple(path)) if isinstance(path, str) else path,
            "label": forked_from.get("label"), "edited": bool(forked_from.get("edited"))}


def run_status(history: History, held: bool) -> str:
    """completed / failed / cancelled from the end record; paused; stale (its replay no longer matches the code);
    needs_attention (an unsafe "manual" step was cut off: an operator decides, `Engine.resolve_effect`);
    over_budget (it parked over its budget: `Engine.raise_budget` lets it go on); waiting, sleeping; running while
    held; pending until first claimed; else interrupted."""
    if history.paused and (not history.end or history.end.status == "failed"):
        return "paused"
    if history.end:
        return history.end.status
    if history.park is not None and history.park.budget is not None:
        return "over_budget"
    if history.stale and not held:
        return "stale"
    if not held and history.starts and history.attention():
        return "needs_attention"
    parked = history.parked()
    if parked:
        return parked
    if held:
        return "running"
    return "pending" if history.claim is None else "interrupted"


def _iso(ts: float | None) -> str | None:
    """Epoch seconds as an ISO 8601 UTC time (None stays None)."""
    return datetime.fromtimestamp(ts, UTC).isoformat() if ts is not None else None


def effect_of(history: History, start: r.Start) -> dict[str, Any]:
    """What `inspect` says about an unsafe step from its start record: its policy, operation id, input, attempt
    and start time, and the operator's decision once there is one for that attempt."""
    run_id = history.header.run_id
    effect: dict[str, Any] = {"policy": start.effect, "operation_id": f"{run_id}/{start.path}",
                              "input": load_value(start.input) if start.input is not None else None,
                              "attempt": start.attempt,
                              "started_at": _iso(start.ts)}
    decided = history.resolved.get(start.path)
    if decided is not None and decided.attempt == start.attempt:
        effect["resolved"] = {"decision": decided.decision,
                              "at": _iso(decided.ts)}
    return effect


def status_needs(step: StepState, attention: dict[str, r.Start], path: str) -> bool:
    """Whether `step` (at `path`) is one of the cut-off steps an operator must resolve."""
    return step.status == "needs_attention" and path in attention


def describe(history: History, *, held: bool, warnings: list[str] | None = None, steps: bool = True) -> RunState:
    """Build the `RunState` of a run from its history."""
    header = history.header
    state = RunState(
        run_id=header.run_id, status=run_status(history, held), workflow=header.workflow,
        key=header.key, input=load_value(header.input),
        created_at=_created(header), updated_at=_ts(history.updated),
        attempt=history.attempt, advisories=list(history.advisories.values()), annotations=dict(history.notes),
        script=header.script, parent=header.parent, budget=history.budget, spent=history.spent(),
        spent_by=history.spent_by() if history.charges else {}, over_budget=history.over_budget,
        warnings=warnings or [], patches={change: rec.value for change, rec in history.patches.items()},
    )
    if header.forked_from is not None:
        state.forked_from = lineage(header.forked_from)
    if history.end:
        state.result = load_value(history.end.result)
        state.error = history.end.error
    if state.status == "stale":
        state.stale = history.stale_detail()
    state.children = [d.value["run_id"] for d in history.done.values()
                      if d.label == "ctx.spawn" and isinstance(d, r.Ok) and isinstance(d.value, dict)]
    state.awakeables = [{"id": a.id, "name": a.name, "path": list(path_tuple(p)), "deadline": a.deadline}
                        for p, a in history.awakeables.items() if p not in history.done and history.end is None]
    if not steps:
        return state
    paths = list(history.done) + [p for p in (*history.fails, *history.starts, *history.waits, *history.wakes,
                                              *history.awakeables) if p not in history.done]
    attention = history.attention() if history.starts and history.end is None else {}
    for path in dict.fromkeys(paths):
        rec = history.done.get(path)
        fail = history.fails.get(path)
        if isinstance(rec, r.Ok):
            step = StepState(path_tuple(path), rec.label, "ok", rec.attempt, rec.ms, load_value(rec.value),
                             finished_at=_ts(rec.ts))
        elif rec is not None:
            step = StepState(path_tuple(path), rec.label, "failed", rec.attempt, rec.ms, None, rec.error,
                             finished_at=_ts(rec.ts))
        elif path in history.waits:
            wait = history.waits[path]
            step = StepState(path_tuple(path), "ctx.wait_for", "waiting", 1,
                             output={"signal": wait.name, "deadline": wait.deadline,
                                     **({"schema": wait.schema} if isinstance(wait.schema, dict) else {})})
        elif path in history.awakeables:
            awake = history.awakeables[path]
            step = StepState(path_tuple(path), "ctx.awakeable", "waiting", 1,
                             output={"awakeable": awake.id, "name": awake.name, "deadline": awake.deadline,
                                     **({"schema": awake.schema} if awake.schema is not None else {})})
        elif path in history.wakes:
            step = StepState(path_tuple(path), "ctx.sleep", "sleeping", 1, output={"until": history.wakes[path].at})
        elif fail is not None and (path not in history.starts or history.starts[path].attempt <= fail.attempt):
            step = StepState(path_tuple(path), fail.label, "retrying", fail.attempt, fail.ms, error=fail.error,
                             finished_at=_ts(fail.ts))
        else:
            start = history.starts[path]
            status = "running" if held else "needs_attention" if path in attention else "interrupted"
            step = StepState(path_tuple(path), start.label, status, start.attempt,
                             error=fail.error if fail is not None else None, started_at=_ts(start.ts))
        began = history.starts.get(path)
        if began is not None and began.effect is not None:
            step.effect = effect_of(history, began)
            if status_needs(step, attention, path):
                state.attention.append({"path": list(step.path), "label": step.label, **step.effect})
        park = history.park
        if park is not None and park.path == path and park.until is not None and step.status == "retrying":
            step.output = {"retry_at": park.until}
        if path in history.stashes and step.status != "ok":
            step.stashed = load_value(history.stashes[path].value)
        comp = history.comps.get(path)
        if comp is not None:
            step.compensation = "ok" if comp.ok else "failed"
            if comp.ok and step.status == "ok":
                step.status = "compensated"  # undone: a retry runs it again
        state.steps.append(step)
    park = history.park
    if park is not None and park.limit and park.path not in history.done:
        waiting = {"limit": park.limit, "until": park.until}
        known = next((s for s in state.steps if s.path == path_tuple(park.path)), None)
        if known is None:
            state.steps.append(StepState(path_tuple(park.path), "limit", "waiting", 1, output=waiting))
        else:  # a retried step whose next attempt waits for the limit
            known.status, known.output = "waiting", waiting
    elif park is not None and park.until is None and park.budget is None and park.path not in history.done:
        state.steps.append(StepState(path_tuple(park.path), "ctx.join", "waiting", 1,
                                     output={"children": list(park.children or ()), "count": park.count}))
    state.steps.sort(key=lambda s: s.path)
    return state
