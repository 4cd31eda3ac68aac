"""Finding and describing runs: by id or key, one at a time (`inspect`, `records`, `follow`, `timeline`,
`graph`) or many at once (`list`, `count`) from the storage's run catalog; and pruning the ended ones.

`Engine` keeps its public methods for all of these as thin delegates; nothing here runs a workflow, takes a
lease for long, or writes a log record.

A listing asks the storage's catalog (`storage.catalog`) for a page of runs, newest activity first, and
describes only that page. The catalog knows whether a run ended and how (completed, failed, cancelled); the
statuses of an open run (pending, running, sleeping, waiting, paused, stale, interrupted) come from its log,
exactly as `inspect` derives them, so a listing filtered by one of those reads the open runs' logs, never
the ended ones'.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import socket
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec

from .. import records as log_format
from .._authoring import graphs
from .._authoring.awakeables import SIGNAL as AWAKEABLE_SIGNAL
from .._authoring.graphs import GraphState
from .._codec import dump_error, load_value
from .._state.history import History, RunState, describe, path_tuple, run_status
from .._state.timeline import Span, epoch, spans
from ..errors import CorruptLogError, DurablyError, RunNotFoundError, ValidationError
from ..storage import RunInfo, Storage, validate_run_id
from ..storage.catalog import ENDED, OPEN

CORRUPT = "corrupt"  # the status `list` gives a run whose log does not validate
FOLLOW_STOPS = ("completed", "failed", "cancelled", "waiting", "sleeping", "paused", "over_budget", CORRUPT)
ENDS = ("completed", "failed", "cancelled", CORRUPT)  # `follow` stops at these; at a park only when no process waits
STATUSES = ("pending", "running", "sleeping", "waiting", "paused", "stale", "needs_attention", "over_budget", "interrupted", "completed", "failed",
            "cancelled", CORRUPT)
_PAGE = 500  # catalog rows read at a time when statuses must be checked against the logs
EXACT = frozenset({"completed", "cancelled"})  # statuses the catalog's state alone decides (a failed run may be
                                               # paused since: its state stays "failed", its status is "paused")


FORK_KEYS = "fork:{run}:"
"""How the key of a run forked from run `run` starts (`fork:RUN:N`, its Nth fork): a fork is bound to a key of
its own, never to its original's, and the catalog finds a run's forks by this prefix (`Runs.forks`)."""


def fork_key(run_id: str, n: int) -> str:
    """The key of the `n`th fork of run `run_id` (from 1)."""
    return f"{FORK_KEYS.format(run=run_id)}{n}"


def owner_text(owner: str | None) -> str:
    """A lease owner (`host:pid:token`) as people read it: `pid 4242 on build-7`."""
    host, _, rest = (owner or "").partition(":")
    pid = rest.partition(":")[0]
    return f"pid {pid} on {host}" if pid.isdigit() else (owner or "another process")


def owner_alive(owner: str | None) -> bool | None:
    """Whether the process owning a lease (`host:pid:token`) still runs: known on its own machine only."""
    host, _, rest = (owner or "").partition(":")
    pid = rest.partition(":")[0]
    if not pid.isdigit() or host != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True


def _fork_number(key: Any) -> int:
    """N of a fork key `fork:RUN:N` (0 when it is not a number), to order forks oldest first."""
    tail = (key if isinstance(key, str) else "").rpartition(":")[2]
    return int(tail) if tail.isdigit() else 0


def check_page(limit: Any, offset: Any, since: Any = None, until: Any = None) -> None:
    """`limit` (None or >= 1), `offset` (>= 0) and the time bounds (aware datetimes) of `Engine.list`."""
    for name, value in (("since", since), ("until", until)):
        if value is not None and (not isinstance(value, datetime) or value.tzinfo is None):
            raise ValidationError(f"{name}= must be a timezone-aware datetime, got {value!r}",
                                  hint="Pass e.g. datetime.now(UTC) - timedelta(hours=1).",
                                  docs="docs/operations.md#listing-runs")
    for name, value, low in (("limit", limit, 1), ("offset", offset, 0)):
        if value is None and name == "limit":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValidationError(f"{name}= must be an integer >= {low}, got {value!r}",
                                  hint="list(limit=50, offset=100) gives the third page of 50 runs.",
                                  docs="docs/operations.md#listing-runs")


def check_retention(seconds: Any) -> float | None:
    """Validate `retention=` (seconds after their end that ended runs are kept, or None to keep them)."""
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int | float)
                                or not 0 < seconds < float("inf")):
        raise ValidationError(f"retention= must be a number of seconds > 0 or None, got {seconds!r}",
                              hint="retention=30 * 86400 deletes runs 30 days after they end.",
                              docs="docs/storage.md#retention")
    return None if seconds is None else float(seconds)


def _plain(record: Any) -> dict[str, Any]:
    """A log record as the JSON object it is on disk."""
    return msgspec.to_builtins(record) if isinstance(record, msgspec.Struct) else dict(record)


def _statuses(status: str | Iterable[str] | None) -> set[str] | None:
    if status is None:
        return None
    found = {status} if isinstance(status, str) else set(status)
    for one in found:
        if not isinstance(one, str):
            raise ValidationError(f"status= takes status names, got {one!r}", hint=f"Use {', '.join(STATUSES)}.",
                                  docs="docs/operations.md#listing-runs")
    return found


def catalog_states(statuses: set[str]) -> tuple[str, ...] | None:
    """The catalog states a run with one of `statuses` can have (None: any): an ended status is its own
    state; paused is an open run or a failed one paused afterwards; a damaged log can be anywhere; every
    other status is an open run's."""
    if CORRUPT in statuses:
        return None
    states = {s for s in statuses if s in ENDED}
    if "paused" in statuses:
        states |= {OPEN, "failed"}
    if statuses - set(ENDED) - {"paused"}:
        states.add(OPEN)
    return tuple(sorted(states))


def ready(state: RunState, history: History, arrived: set[Any], status: Any) -> str | None:
    """What a parked run got already that it waited for (None: nothing yet): a signal it waits for is in its
    inbox, a wait's deadline or a sleep's wake time passed, or the children of the join it parked in ended.
    `status(run_id)` tells a child's status."""
    now = time.time()
    for step in state.steps:
        out = step.output if isinstance(step.output, dict) else {}
        if step.status == "waiting" and "awakeable" in out:
            if AWAKEABLE_SIGNAL + ".".join(map(str, step.path)) in arrived:
                return f"awakeable {out['awakeable']} resolved"
            deadline = epoch(out.get("deadline"))
            if deadline is not None and deadline <= now:
                return f"awakeable {out['awakeable']} passed its deadline"
        elif step.status == "waiting" and "signal" in out:
            if out["signal"] in arrived:
                return f"signal {out['signal']!r} received"
            deadline = epoch(out.get("deadline"))
            if deadline is not None and deadline <= now:
                return f"the wait for {out['signal']!r} timed out"
        elif step.status == "waiting" and "children" in out:
            children = out["children"]
            if (out.get("count") or len(children)) == len(children) and children \
                    and all(status(child) in ENDED for child in children):
                return f"its {len(children)} child run{'s' if len(children) != 1 else ''} ended"
        elif step.status == "sleeping":
            until = epoch(out.get("until"))
            if until is not None and until <= now:
                return "its wake time passed"
        elif step.status == "retrying":
            at = epoch(out.get("retry_at"))
            if at is not None and at <= now:
                return f"the retry time of {step.label!r} came"
    return None


@dataclass
class PruneReport:
    """What `Engine.prune` removed (or, with `dry_run`, would remove)."""

    runs: list[str] = field(default_factory=list)  # ids of the runs deleted
    bytes: int = 0  # storage freed (log, inbox), as the adapter counts it
    kept: dict[str, str] = field(default_factory=dict)  # run id -> why a candidate was left alone
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"runs": list(self.runs), "count": len(self.runs), "bytes": self.bytes, "kept": dict(self.kept),
                "dry_run": self.dry_run}


class Runs:
    """Finds and describes the runs of one storage."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def where(self) -> str:
        """How messages name the store."""
        return str(getattr(self.storage, "dir", type(self.storage).__name__))

    def read(self, run_id: str) -> tuple[History, str | None]:
        """A run's validated history and its torn-tail message; `RunNotFoundError` if unknown."""
        log = self.storage.read(run_id)
        if log is None:
            raise RunNotFoundError(f"no run {run_id!r} in {self.where()}", run_id=run_id)
        return History(log.records, log.where or f"run {run_id}"), log.torn

    def resolve(self, run: str) -> str:
        """A run id from a run id or a run key."""
        if not isinstance(run, str):
            raise ValidationError(f"a run is named by its id or key, got {run!r}", hint="Pass the id as a string.")
        run_id = self.storage.lookup(f"key:{run}")
        if run_id is not None:
            return run_id
        validate_run_id(run)
        if self.storage.info(run) is None:
            raise RunNotFoundError(f"no run with id or key {run!r} in {self.where()}", run_id=run)
        return run

    async def inspect(self, run: str) -> RunState:
        """The state of a run (by id or key): status, steps, advisories, result or error, unread signals, who
        holds it, its place in the queue, and whether a parked run got what it waits for."""
        run_id = self.resolve(run)
        history, torn = self.read(run_id)
        held = self.storage.held(run_id)
        state = describe(history, held=held, warnings=[torn] if torn else [])
        self.situate(state, history, held)
        state.forks = self.forks(run_id)
        return state

    def forks(self, run_id: str) -> builtins.list[str]:
        """The runs forked from `run_id`, oldest first: found in the catalog by their key prefix (`FORK_KEYS`,
        an indexed filter on every adapter, no log read), each confirmed by its header's `forked_from`."""
        found = self.storage.list_runs(key_prefix=FORK_KEYS.format(run=run_id))
        out: builtins.list[tuple[str, int, str]] = []
        for info in found:
            header = info.header if isinstance(info.header, dict) else {}
            lineage = header.get("forked_from")
            if isinstance(lineage, dict) and lineage.get("run") == run_id:
                out.append((str(header.get("created_at") or ""), _fork_number(header.get("key")), info.run_id))
        return [fork for *_, fork in sorted(out)]

    def holder(self, run_id: str, history: History | None = None) -> dict[str, Any]:
        """Who holds a run's lease: `owner` (`host:pid:token`), `expires` (epoch seconds the lease lapses unless
        renewed; None where the lease is a lock that ends with its process), `alive` (whether that process runs:
        known on its own machine only, else None); {} while no process holds the run."""
        lease_of = getattr(self.storage, "lease_of", None)  # storages whose leases expire say who and until when
        found = lease_of(run_id) if lease_of is not None else None
        if found is not None:
            owner, expires = found
        elif self.storage.held(run_id):
            history = history or self.read(run_id)[0]
            owner, expires = (history.claim.owner if history.claim else None), None
        else:
            return {}
        return {"owner": owner, "expires": expires, "alive": owner_alive(owner)}

    def unread(self, run_id: str) -> builtins.list[dict[str, Any]]:
        """The signals waiting in a run's inbox that no step has read yet, oldest first, as stored (`t`, `id`,
        `name`, `payload` in wire form, `at`); control requests ($cancel ...) are not signals."""
        return [m for m in self.storage.inbox(run_id) if not str(m.get("name", "")).startswith("$")]

    def situate(self, state: RunState, history: History, held: bool) -> None:
        """Add to a described run what its log alone does not tell: unread signals, who holds it (and whether
        that process still runs), a pending run's due time and priority, and what a parked run no process
        holds received already (`ready`)."""
        run_id = state.run_id
        unread = self.unread(run_id)
        state.signals = [{"name": m["name"], "at": m.get("at"), "payload": load_value(m.get("payload"))}
                         for m in unread]
        if held:
            owner = self.holder(run_id, history)
            if owner:
                state.owner = {**owner, "since": state.updated_at.isoformat() if state.updated_at else None}
        if state.status == "pending":
            entry = self.storage.entry(run_id)
            if entry is not None:
                state.queued = {"due": entry.at, "priority": entry.priority, "queue": entry.queue,
                                "partition": entry.partition}
        if not held and state.status in ("waiting", "sleeping"):
            arrived = {m.get("name") for m in unread}
            if history.awakeables:
                arrived.update(m.get("name") for m in self.storage.inbox(run_id)
                               if str(m.get("name", "")).startswith(AWAKEABLE_SIGNAL))
            state.ready = ready(state, history, arrived, self.status)

    # ---- many runs ----------------------------------------------------------------------------
    def _where(self, workflow: str | None, key: str | None, key_prefix: str | None, search: str | None,
               since: datetime | None, until: datetime | None, parent: str | None = None) -> dict[str, Any]:
        return {"workflow": workflow, "key": key, "key_prefix": key_prefix, "search": search or None,
                "parent": parent, "since": since.timestamp() if since is not None else None,
                "until": until.timestamp() if until is not None else None}

    def _matching(self, statuses: set[str] | None, where: dict[str, Any], offset: int,
                  limit: int | None, without_patch: str | None = None) -> builtins.list[RunState]:
        """`limit` runs after `offset` whose status is one of `statuses` (None: any), newest first; with
        `without_patch`, only runs that may still take the old branch of that patch."""
        if without_patch is None and (statuses is None or statuses <= EXACT):  # the catalog alone decides
            infos = self.storage.list_runs(state=None if statuses is None else tuple(sorted(statuses)),
                                           limit=limit, offset=offset, **where)
            states = [self.state(info) for info in infos]
            return states if statuses is None else [s for s in states if s.status in statuses]
        out: list[RunState] = []
        skipped = 0
        at = 0
        candidates = catalog_states(statuses) if statuses is not None else None
        if without_patch is not None:  # completed and cancelled runs never take a branch again
            candidates = tuple(s for s in (candidates or (OPEN, *ENDED)) if s in (OPEN, "failed"))
        chunk = _PAGE if limit is None else min(_PAGE, max(32, offset + limit))
        while limit is None or len(out) < limit:
            infos = self.storage.list_runs(state=candidates, limit=chunk, offset=at, **where)
            at += len(infos)
            for info in infos:
                described = self.state(info)
                if statuses is not None and described.status not in statuses:
                    continue
                if without_patch is not None and not self._on_old_branch(info, without_patch):
                    continue
                if skipped < offset:
                    skipped += 1
                    continue
                out.append(described)
                if limit is not None and len(out) >= limit:
                    break
            if len(infos) < chunk:
                break
            chunk = min(_PAGE, chunk * 2)
        return out

    async def list(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                   key: str | None = None, key_prefix: str | None = None,
                   since: datetime | None = None, until: datetime | None = None, search: str | None = None,
                   limit: int | None = None, offset: int = 0, parent: str | None = None,
                   without_patch: str | None = None) -> builtins.list[RunState]:
        """Runs newest activity first, filtered by status, workflow name, key, parent run, last activity time,
        a search text and a patch still on its old branch; one page read from the storage's run catalog (see
        `Engine.list`)."""
        check_page(limit, offset, since, until)
        return self._matching(_statuses(status), self._where(workflow, key, key_prefix, search, since, until,
                                                             parent), offset, limit, without_patch)

    async def count(self, *, status: str | Iterable[str] | None = None, workflow: str | None = None,
                    key: str | None = None, key_prefix: str | None = None,
                    since: datetime | None = None, until: datetime | None = None, search: str | None = None,
                    parent: str | None = None, without_patch: str | None = None) -> int:
        """How many runs `list` gives for the same filters (from the catalog alone when no status of an open
        run is asked for)."""
        check_page(None, 0, since, until)
        statuses = _statuses(status)
        where = self._where(workflow, key, key_prefix, search, since, until, parent)
        if without_patch is None and (statuses is None or statuses <= EXACT):
            return self.storage.count_runs(state=None if statuses is None else tuple(sorted(statuses)), **where)
        return len(self._matching(statuses, where, 0, None, without_patch))

    def _on_old_branch(self, info: RunInfo, change: str) -> bool:
        """Whether a run may still take the old branch of patch `change`: it is not completed or cancelled
        and has not answered True there. A damaged log is left out."""
        try:
            history = self.read(info.run_id)[0]
        except (CorruptLogError, RunNotFoundError):
            return False
        if history.end is not None and history.end.status in ("completed", "cancelled"):
            return False
        answer = history.patches.get(change)
        return not (answer is not None and answer.value)

    def state(self, info: RunInfo) -> RunState:
        """How `list` describes one run (without its steps): from its header and last record when it ended,
        else from its log; a damaged log is status "corrupt" with its error, never an exception."""
        try:
            brief = self.brief(info)
        except CorruptLogError as exc:
            state = self.damaged(info, exc)
        else:
            state = describe(brief, held=info.held, steps=False)
            state.updated_at = datetime.fromtimestamp(info.updated_at, UTC)
            state.attempt = info.epoch
            if state.status == "running":  # whether the process holding it still runs, as inspect tells it
                owner = self.holder(info.run_id, brief)
                if owner.get("alive") is False:
                    state.owner = {**owner, "since": state.updated_at.isoformat()}
        return state

    def status(self, run_id: str) -> str:
        """A run's status as `list` tells it ("corrupt" for a damaged log, "pending" for an unknown run)."""
        info = self.storage.info(run_id)
        if info is None:
            return "pending"
        try:
            return run_status(self.brief(info), info.held)
        except CorruptLogError:
            return CORRUPT

    def valid(self, info: RunInfo) -> None:
        """Raise the `CorruptLogError` naming file, line and field if the run's header or last record is damaged."""
        try:
            self.brief(info)
        except CorruptLogError:
            self.read(info.run_id)
            raise

    def damaged(self, info: RunInfo, error: CorruptLogError) -> RunState:
        """How `list` shows a run whose log does not validate: status "corrupt", the error and its hint.

        The error of a full read is preferred (it names the file); the run's other runs are unaffected."""
        try:
            self.read(info.run_id)
        except CorruptLogError as exc:
            error = exc
        except DurablyError:
            pass
        header = info.header if isinstance(info.header, dict) else {}
        workflow, key = header.get("workflow"), header.get("key")
        return RunState(
            run_id=info.run_id, status=CORRUPT, workflow=workflow if isinstance(workflow, str) else "?",
            key=key if isinstance(key, str) else None, input=None,
            created_at=datetime.fromtimestamp(info.updated_at, UTC), updated_at=None, attempt=info.epoch,
            error=dump_error(error), warnings=[f"{error.message} (hint: {error.hint})"])

    def brief(self, info: RunInfo) -> History:
        """Enough history for a run's status, so `list` and `inspect` agree whatever the last record is: the
        header and last record of a run that ended or never started, else the whole log."""
        last = info.kind
        if last not in ("end", "run", "pause"):
            try:
                return self.read(info.run_id)[0]
            except (CorruptLogError, RunNotFoundError):
                pass  # a damaged log never hides the run: its ends still tell a status
        history = History([info.header], f"run {info.run_id}")
        if last in ("end", "pause"):
            history.add(log_format.load_one(info.last, f"run {info.run_id}"))
        return history

    # ---- one run's log ------------------------------------------------------------------------
    async def timeline(self, run: str) -> builtins.list[Span]:
        """Where the time of a run (by id or key) went: every step attempt, backoff, sleep and wait as a span."""
        run_id = self.resolve(run)
        log = self.storage.read(run_id)
        if log is None:
            raise RunNotFoundError(f"no run {run_id!r} in {self.where()}", run_id=run_id)
        return spans(log.records)

    async def records(self, run: str) -> builtins.list[dict[str, Any]]:
        """A run's log (by id or key) as plain JSON objects, header first, exactly as recorded."""
        run_id = self.resolve(run)
        log = self.storage.read(run_id)
        if log is None:
            raise RunNotFoundError(f"no run {run_id!r} in {self.where()}", run_id=run_id)
        return [_plain(rec) for rec in log.records]

    async def export(self, run: str) -> bytes:
        """A run's whole log (by id or key) as validated JSONL, header first: a self-contained history."""
        run_id = self.resolve(run)
        log = self.storage.read(run_id)
        if log is None:
            raise RunNotFoundError(f"no run {run_id!r} in {self.where()}", run_id=run_id)
        return b"".join(log_format.encode(r) for r in log_format.load(log.records, log.where or f"run {run_id}"))

    async def follow(self, run: str, *, poll: float = 0.2) -> AsyncIterator[dict[str, Any]]:
        """A run's records (by id or key) as plain JSON objects, then each record appended later by any
        process, until the run ends (completed, failed, cancelled) or parks (waiting, sleeping, paused) with no
        process holding it (a process waiting in the park goes on, and so does the following)."""
        run_id = self.resolve(run)
        seen = 0
        last = False
        while True:
            log = self.storage.read(run_id)
            found = log.records if log is not None else []
            if len(found) < seen:  # compacted meanwhile: what it kept was already shown
                seen = len(found)
            for rec in found[seen:]:
                yield _plain(rec)
            seen = len(found)
            if last:
                return
            status = self.status(run_id)
            if status in FOLLOW_STOPS and (status in ENDS or not self.storage.held(run_id)):
                last = True  # one more read: the end may have been appended after the one above
                continue
            await asyncio.sleep(poll)

    async def graph(self, run: str) -> builtins.list[GraphState]:
        """The task graphs of a run (by id or key): each node's child run, status, and why it waits."""
        run_id = self.resolve(run)
        history, _ = self.read(run_id)
        live = self.storage.held(run_id)
        states = []
        for prefix, record in history.graphs.items():
            children: dict[str, str | None] = {}
            for i, task_id in enumerate(record.tasks):
                spawn = history.done.get(f"{prefix}.{i}.0")
                child = spawn.value.get("run_id") if isinstance(spawn, log_format.Ok) and isinstance(spawn.value, dict) \
                    else None
                children[task_id] = child if isinstance(child, str) else None
            ended = history.end.status if history.end is not None and not live else None
            states.append(graphs.describe(run_id, path_tuple(prefix), {"tasks": record.tasks}, children, self.status,
                                          live, ended))
        return states

    # ---- retention ----------------------------------------------------------------------------
    async def prune(self, *, older_than: float, status: str | Iterable[str] | None = None,
                    workflow: str | None = None, dry_run: bool = False) -> PruneReport:
        """`prune_now` on a worker thread, so a long prune never holds the event loop."""
        return await asyncio.to_thread(self.prune_now, older_than=older_than, status=status, workflow=workflow,
                                       dry_run=dry_run)

    def prune_now(self, *, older_than: float, status: str | Iterable[str] | None = None,
                  workflow: str | None = None, dry_run: bool = False, now: float | None = None) -> PruneReport:
        """Delete runs that ended (completed, failed or cancelled; `status` narrows) and were last active more
        than `older_than` seconds ago, of `workflow` if given. A run that has not ended, one whose parent has
        not ended, and one a process holds are never touched."""
        if isinstance(older_than, bool) or not isinstance(older_than, int | float) or not older_than >= 0:
            raise ValidationError(f"older_than= must be a number of seconds >= 0, got {older_than!r}",
                                  hint="prune(older_than=30 * 86400) deletes runs that ended over 30 days ago.",
                                  docs="docs/storage.md#retention")
        if not isinstance(dry_run, bool):
            raise ValidationError(f"dry_run= must be True or False, got {dry_run!r}")
        wanted = set(ENDED) if status is None else _statuses(status)
        assert wanted is not None
        unended = sorted(wanted - set(ENDED))
        if unended:
            raise ValidationError(f"prune deletes ended runs only; {unended[0]!r} is not an end status",
                                  hint="Use --status completed, failed or cancelled.", docs="docs/storage.md#retention")
        cutoff = (time.time() if now is None else now) - older_than
        report = PruneReport(dry_run=dry_run)
        candidates: list[RunInfo] = []
        while True:  # every candidate first: deleting while paging would shift the pages
            page = self.storage.list_runs(state=tuple(sorted(wanted)), workflow=workflow, until=cutoff,
                                          limit=_PAGE, offset=len(candidates))
            candidates.extend(page)
            if len(page) < _PAGE:
                break
        parents: dict[str, bool] = {}
        for info in candidates:
            why = self._keep(info, wanted, parents)
            if why is not None:
                report.kept[info.run_id] = why
                continue
            if dry_run:
                try:
                    report.bytes += self.storage.size(info.run_id)
                except RunNotFoundError:
                    continue
                report.runs.append(info.run_id)
                continue
            freed = self.storage.delete(info.run_id)
            if freed is None:
                report.kept[info.run_id] = "held by a process"
                continue
            report.runs.append(info.run_id)
            report.bytes += freed
        return report

    def _keep(self, info: RunInfo, wanted: set[str], parents: dict[str, bool]) -> str | None:
        """Why a prune candidate must stay (None: it may go): not ended as the log tells it, held, or a child
        whose parent has not ended."""
        if info.held:
            return "held by a process"
        try:
            status = run_status(self.brief(info), held=False)
        except CorruptLogError:
            return "its log is damaged"
        if status not in wanted:
            return f"it is {status}"
        parent = info.parent
        if isinstance(parent, str):
            ended = parents.get(parent)
            if ended is None:
                found = self.storage.info(parent)
                ended = parents[parent] = found is None or self.status(parent) in ENDED
            if not ended:
                return f"its parent {parent} has not ended"
        return None
