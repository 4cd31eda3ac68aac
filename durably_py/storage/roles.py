"""The storage protocol, as the roles a service names (`RunLogs`, `Identities`, `Catalog`, `Inbox`, `DueQueue`,
`Fleet`, `Limits`, `Blobs`, `Partials`) and `Storage`, their union, which every adapter implements. See `base` for
what a run is to storage."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .base import Check, Choose, Lease, Log, NewRun, QueueEntry, QueueStats, RunInfo

__all__ = ["AppTransaction", "Blobs", "Catalog", "DueQueue", "Fleet", "GroupCommits", "Identities", "Inbox",
           "LimitUpdate", "Limits", "Partials", "RunLogs", "Storage", "Transactions"]

LimitUpdate = Callable[[Any, float, Callable[[str, int], bool]], tuple[Any, Any]]
"""What `Limits.limit` runs in its atomic step: (the stored document or None, now in epoch seconds, live) ->
(the document to store, None to remove it; what `limit` returns)."""


@runtime_checkable
class RunLogs(Protocol):
    """A run's log and its lease: create, read, claim and append to a run, make it durable, compact it."""

    def create(self, run_id: str, header: bytes, *, at: float | None = None, priority: int = 0) -> None:
        """Create a run whose log starts with the `header` line, queued due at `at` (None: now) with
        `priority`; `ValidationError` if the id exists (a collision is never a silent re-bind)."""

    def read(self, run_id: str) -> Log | None:
        """All records of a run (None if unknown). A torn last line is dropped and named in `Log.torn`;
        damage before the last line raises `CorruptLogError` naming the line."""

    def claim(self, run_id: str, owner: str, ttl: float, *, check: Check | None = None,
              reopen: bool = False) -> Lease | None:
        """Take the run's lease (None while another live owner holds it). Appends a claim record
        ``{"t": "claim", "epoch": n, "owner": owner, "at": iso}`` and truncates a torn tail.
        `RunNotFoundError` for an unknown run; `CorruptLogError` (and nothing written) for a damaged log,
        or when `check(records, where)` raises; `Lease.records` are what `check` returned.

        A run whose log ends in an end record is claimed only with `reopen` (a retry of a failed run): else
        the claim is refused (None) in the same atomic step that would have claimed it, nothing is appended,
        and a queue entry it still has is removed as `unschedule` removes it (its process recorded the end
        and died before leaving the queue)."""

    def amend(self, run_id: str, choose: Choose, *, check: Check | None = None) -> bool:
        """Append the lines `choose(records, where)` returns (None: nothing) to a run no live owner holds,
        without claiming it: no claim record and no new epoch, so an operator's record (pause, resume,
        cancel, reset) is not a workflow attempt. Atomic against claims and durable once it returns; a torn
        tail is cut before the lines are added, and a lapsed lease can no longer append afterwards. False
        (nothing called, nothing written) while a live owner holds the run; `RunNotFoundError` for an
        unknown run; `CorruptLogError` (nothing written) for a damaged log, or when `check` raises."""

    def heartbeat(self, lease: Lease, ttl: float) -> bool:
        """Extend the lease; False when it was lost to another owner."""

    def release(self, lease: Lease) -> None:
        """Give the lease up (a stale lease leaves the stored one alone)."""

    def held(self, run_id: str) -> bool:
        """True while a live owner holds the run's lease."""

    def append(self, lease: Lease, data: bytes) -> None:
        """Append complete newline-terminated record lines; `LeaseLostError` if `lease` is no longer current."""

    def sync(self, lease: Lease) -> None:
        """Make every appended record durable against a machine crash (fsync or equivalent, counted in
        `fsyncs`); a no-op, not counted, when nothing changed since this lease's last sync."""

    def sync_all(self, leases: list[Lease]) -> None:
        """`sync` every lease in `leases` as one group commit (the file adapter: one `syncfs` where the OS has
        it, instead of an fsync per log); afterwards `sync` of any of them is a no-op until it appends again.
        `LeaseLostError` if any lease is no longer current (the others may be durable by then)."""

    def finish_all(self, leases: list[Lease]) -> list[BaseException | None]:
        """End the runs of `leases`, whose logs end in an end record, as one group commit: make every lease's
        appends durable (one fsync, `syncfs` or durable commit for all of them), take each run out of the queue
        (as `unschedule`, its parent's join included) and release each lease. A worker ends the runs it holds so,
        several at a time. The error of each lease, in order (None: done; `LeaseLostError` when it was no
        longer current, and then its run is left as it is); every lease is released either way."""

    def size(self, run_id: str) -> int:
        """Bytes the run's log takes (what compaction is measured against); `RunNotFoundError` if unknown."""

    def rewrite(self, lease: Lease, data: bytes) -> None:
        """Atomically and durably replace the whole log with `data` (compaction); all-or-nothing.
        `data` must be whole records starting with the header; the lease stays valid for appends."""


@runtime_checkable
class Identities(Protocol):
    """Identity bindings: a key (or workflow + canonical input) pointing at the run it started."""

    def bind(self, identity: str, run_id: str, expect: str | None = None) -> bool:
        """Point an identity (a key, or workflow + canonical input) at a run, atomically, only if it still
        points at `expect` (None: at nothing). False when another binding came first (compare-and-swap)."""

    def lookup(self, identity: str) -> str | None:
        """The run an identity points at, if any."""

    def lookup_many(self, identities: list[str]) -> list[str | None]:
        """The run each identity points at (None where none), in order: `lookup` of a batch in one query (a
        parent's children are looked up a batch at a time)."""

    def create_bound(self, runs: list[NewRun]) -> str | None:
        """Bind each run's identity (as `bind` with its `expect`) then create it (as `create`, due at its `at`), in
        order, as one batch made durable once at the end (a parent's children: one fsync or commit, not one
        per child). Stops at the first identity another binding got to first and returns it (the runs before
        it stay created); None when every run was created. A crash leaves a prefix of the batch, each
        created run's identity bound before its log exists."""


@runtime_checkable
class Catalog(Protocol):
    """The run catalog: what is known of runs without reading their logs, and their removal."""

    def info(self, run_id: str) -> RunInfo | None:
        """One run's header, last record and held flag, without reading its whole log (None if unknown)."""

    def list_runs(self, *, state: str | Iterable[str] | None = None, workflow: str | None = None,
                  key: str | None = None, key_prefix: str | None = None, search: str | None = None,
                  parent: str | None = None, since: float | None = None, until: float | None = None,
                  limit: int | None = None, offset: int = 0) -> list[RunInfo]:
        """Runs matching every given filter (`catalog.RunFilter`), most recently active first, answered from
        the adapter's index (never by reading every log): `state` is "open" (not ended) or an end status
        ("completed", "failed", "cancelled"), or several; `since`/`until` bound the last activity in epoch
        seconds; `offset` skips, `limit` keeps at most that many. Without arguments: every run. An adapter
        may learn that an ended run was opened again (a reopen or reset record) only when it is queued again
        (`schedule`), as the engine always does."""

    def count_runs(self, *, state: str | Iterable[str] | None = None, workflow: str | None = None,
                   key: str | None = None, key_prefix: str | None = None, search: str | None = None,
                   parent: str | None = None, since: float | None = None, until: float | None = None) -> int:
        """How many runs `list_runs` would give for the same filters, from the index."""

    def delete(self, run_id: str) -> int | None:
        """Remove a run for good: its log, index entry, queue entry, inbox and the identity bindings that name
        it. The bytes freed; None, with nothing removed, while a live owner holds the run; 0 if unknown.
        The caller decides whether a run may go (adapters do not judge its state)."""


@runtime_checkable
class Inbox(Protocol):
    """Each run's inbox of signals, beside its log: any process may send while another holds the lease."""

    def send(self, run_id: str, data: bytes) -> None:
        """Durably and atomically store one signal line for the run, whoever holds its lease (or none does)."""

    def inbox(self, run_id: str) -> list[dict[str, Any]]:
        """The run's signals not yet acknowledged, oldest first; `RunNotFoundError` if unknown."""

    def ack(self, run_id: str, signal_id: str) -> None:
        """Remove the stored signal(s) with `signal_id`; a no-op when none is stored (acks are idempotent)."""


@runtime_checkable
class DueQueue(Protocol):
    """The queue of runs that have not ended: when each is next due, and claiming the due ones."""

    def schedule(self, run_id: str, at: float | None, *, wait: tuple[str, ...] = (),
                 priority: int | None = None) -> None:
        """Put the run in the queue (or move it): due at `at` (None: only when woken), woken early by a signal
        named in `wait`; `priority` None keeps the entry's priority (0 for a new one). `RunNotFoundError` if
        the run is unknown."""

    def join_wait(self, run_id: str, children: tuple[str, ...]) -> bool:
        """Park a run until its child runs `children` end, in one atomic step: its entry becomes due only when
        woken (as `schedule(run_id, None)` does), and it waits for those of `children` still in the queue; a
        child out of the queue has ended. When none is left to wait for, the run is due now (True).
        `RunNotFoundError` if the run is unknown."""

    def unschedule(self, run_id: str) -> None:
        """Take the run out of the queue (it ended); a no-op when it is not queued. In the same atomic step the
        run stops counting for its parent's `join_wait` (its header's ``parent``): the parent is due at once
        when it was the last child it waited for. `schedule` of a run drops what it waited for in a join."""

    def wake(self, run_id: str, name: str | None = None) -> bool:
        """Make a queued run due now if it waits for signal `name` (None: whatever it waits for, or for
        nothing); True if the entry changed. `send` wakes with the signal's name."""

    def entry(self, run_id: str) -> QueueEntry | None:
        """The run's queue entry (None when it is not queued)."""

    def due(self, limit: int, now: float | None = None, *, skip: tuple[str, ...] = (),
            workflows: frozenset[str] | None = None, queues: frozenset[str] | None = None,
            full: frozenset[str] = frozenset()) -> list[str]:
        """Up to `limit` ids of queued runs due at `now` (default: the current time) that no live owner
        holds, except those in `skip`; only runs of `workflows` and in `queues` when given (an entry's queue,
        from its run's header: `QueueEntry.queue`), and never a run whose queue, or whose "QUEUE/PARTITION",
        is in `full` (at its limit).

        Order: highest priority first; within one priority the partitions of each queue take turns: rank each
        run among the runs kept of its (queue, partition, priority) by due time, then creation, and the first
        of each partition comes before the second of any; then earliest due, then oldest. A run without a
        partition ranks first, as if alone in a partition of its own, so without partitions this is highest
        priority, then earliest due, then oldest (`base.fair_order`)."""

    def claim_due(self, owner: str, ttl: float, limit: int, *, skip: tuple[str, ...] = (),
                  check: Check | None = None, workflows: frozenset[str] | None = None,
                  queues: frozenset[str] | None = None, full: frozenset[str] = frozenset()) -> list[Lease]:
        """Claim up to `limit` due runs (of `workflows` and `queues`, when given, none of `full`) in `due`
        order, as `claim` does each (with `check`, never reopening an ended run); runs another owner claims
        at the same moment are skipped, never waited for, and a damaged log is passed over."""

    def queue_stats(self, now: float | None = None) -> list[QueueStats]:
        """What each queue and partition holds at `now` (default: the current time), one `QueueStats` per
        (queue, partition) with any entry, by queue then partition (None first): runs due (not held), due
        later, running (held by a live owner), parked (due only when woken), and the oldest due time among
        the due ones. For operators: an adapter may read every entry to answer."""

    def next_due(self, now: float | None = None) -> float | None:
        """The earliest due time after `now` (default: the current time) of any queued run, None when no
        entry falls due later (an idle worker waits until then at most, so a sleep ends on time)."""

    def watch(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Call `callback` (from a thread of the adapter's) whenever another process may have made work due:
        a run created or woken, a parent made due, a run queued again. Returns the function that stops it, or
        None when the adapter cannot tell (workers then find new work at their next poll). Best effort: a
        missed call costs one poll, never a run."""


@runtime_checkable
class Fleet(Protocol):
    """Worker advertisements: which workers are live and what they serve."""

    def advertise(self, owner: str, info: dict[str, Any], ttl: float) -> None:
        """Record durably that worker `owner` is live and what it serves (`info`, a JSON object), for `ttl`
        seconds from now (database clock) or, on files, for as long as this process lives; each call renews
        it. Other processes read it with `workers`."""

    def retire(self, owner: str) -> None:
        """Remove worker `owner`'s advertisement (it stopped); a no-op when there is none."""

    def workers(self) -> list[dict[str, Any]]:
        """The advertisements of the live workers (each with its "owner"), in no particular order."""


@runtime_checkable
class Limits(Protocol):
    """Flow-control state every process sharing the store sees: one small JSON document per limit key
    (a rate limit's recent starts, a concurrency key's permits, a breaker's outcomes), changed atomically.
    The logic of each limit lives above storage, once; storage only reads, changes and writes a document in
    one atomic step, and tells inside that step whether a lease is still held."""

    def limit(self, key: str, update: LimitUpdate) -> Any:
        """Atomically, against every process sharing the store, read the document stored under `key` (None when
        none is), call `update(doc, now, live)` and store the document it returns first (None: remove it); return
        what it returns second. `now` is the store's clock in epoch seconds (PostgreSQL: the database's clock, so
        machines whose clocks differ agree; elsewhere time.time()). `live(run_id, epoch)` says, inside the same
        atomic step, whether the lease taken at `epoch` on `run_id` is still held by a live owner (a permit taken
        under a lease lapses with it: a SIGKILLed worker's permits come back within its lease; a released or
        re-claimed lease is not live; an unknown run is not live). `live(run_id, -1)` (any negative epoch) says
        whether the run exists and has not ended: a permit a run holds from its start to its end, parked or
        not (a named queue's). `update` may be called more than once (a
        retried transaction) and must have no side effects (nor call the storage: it runs under its lock). What
        it stored survives a kill of any process once `limit` returns.

        Documents are plain JSON (dicts with str keys, lists, str, int, finite float, bool, None; a tuple is
        stored as a list). A bad `key` (1-200 characters of text, no NUL), an `update` that is not callable,
        or a document that is not plain JSON is a `ValidationError`, and nothing is written; an exception
        `update` raises propagates, the stored document unchanged."""

    def limits(self, prefix: str = "") -> dict[str, Any]:
        """Every stored document whose key starts with `prefix`, by key (what `durably queues` and the console
        show)."""


@runtime_checkable
class Blobs(Protocol):
    """Bytes kept once under their sha256, whatever refers to them: the source files runs started with (a run's
    header names its own), so `durably diff` can show what changed since a run started and a run can be resumed
    on the code it began with."""

    def keep_blob(self, digest: str, data: bytes) -> None:
        """Keep `data` under `digest`, its sha256 in hex; nothing when it is kept already. Durable once it returns.
        A `digest` that is not the sha256 of `data` is a `ValidationError`, and nothing is written."""

    def blob(self, digest: str) -> bytes | None:
        """The data kept under `digest` (None: none is)."""


@runtime_checkable
class Partials(Protocol):
    """Stream partials: the chunks a streaming step emitted while it runs, beside its run's log (never in it), read
    live by followers and by the step's next attempt (`storage.partials` says where each adapter keeps them).
    Only the run's lease holder appends; anyone reads. Appends are batched by the caller and not fsynced: they
    survive a killed process, a machine crash may lose the last ones."""

    def append_partials(self, run_id: str, path: str, attempt: int, chunks: list[bytes]) -> None:
        """Add `chunks` (each one chunk's JSON bytes, no newline) after the stored chunks of the step at `path`,
        written by `attempt`, in order, without an fsync."""

    def read_partials(self, run_id: str, path: str, offset: int = 0) -> list[bytes]:
        """The step's stored chunks from index `offset` on, in append order ([] when none are stored)."""

    def drop_partials(self, run_id: str, path: str | None = None) -> None:
        """Remove the stored chunks of the step at `path` (of every step of the run when None); `delete` of a run
        removes them too."""

    def partial_paths(self, run_id: str) -> dict[str, int]:
        """The paths of the run's steps that have stored chunks, with how many each has."""


@runtime_checkable
class Storage(RunLogs, Identities, Catalog, Inbox, DueQueue, Fleet, Limits, Blobs, Partials, Protocol):
    """Where runs live: every role at once. Appends are atomic and ordered per run; only a lease holder appends."""


@runtime_checkable
class GroupCommits(Protocol):
    """An adapter that commits the writes under leases in groups (PostgreSQL): several runs' appends share one
    durable commit. Not part of `Storage`: `RunLog` uses it when an adapter has it (`groups_appends` true), and
    every other adapter keeps its synchronous `append`."""

    groups_appends: bool
    """True: `RunLog` hands records in with `append_soon` and awaits a step's record before its result goes back."""

    def append_soon(self, lease: Lease, data: bytes) -> Any:
        """`RunLogs.append` without waiting: the lines go into the next group commit, after the lease's earlier
        writes. Returns a future (the calling loop's, on a thread running an asyncio loop; else a
        `concurrent.futures.Future`) holding None once they are durable, or the error that kept them out; after a
        failed one, the lease's later writes fail too, so a run's log never has a gap."""


class AppTransaction(Protocol):
    """One open database transaction of the store's database that an application writes in (`connection`) and
    that a run's records then join (`commit`): both are committed together or neither is."""

    @property
    def connection(self) -> Any:
        """The DB-API connection the transaction is open on (`sqlite3.Connection`, psycopg `Connection`)."""

    def commit(self, lease: Lease, data: bytes) -> None:
        """Append the complete record lines `data` to the lease's run inside the transaction, fenced by the lease
        as `RunLogs.append` is, then commit the whole transaction. `LeaseLostError` (everything rolled back) if
        `lease` is no longer current; `ValidationError` (rolled back) if the application ended the transaction
        itself."""

    def rollback(self) -> None:
        """Undo everything written in the transaction (a no-op once it ended)."""

    def close(self) -> None:
        """Give the connection back (rolled back first if still open); the transaction is over."""


@runtime_checkable
class Transactions(Protocol):
    """Application writes and run records in one database transaction (`ctx.transaction`): the SQLite and
    PostgreSQL adapters, whose application tables may live in the same database. Not part of `Storage`: an
    adapter without it (files, memory) cannot make an application's write and a record atomic."""

    exclusive: bool
    """True when an open transaction holds the whole database's write lock (SQLite): every other writer, the
    adapter's own appends included, waits for its end. False when it locks only the rows it writes (PostgreSQL)."""

    def transaction(self) -> AppTransaction:
        """Open a transaction on a connection of its own to the store's database (not the one the adapter's other
        calls use), ready for the application's statements; the caller commits or rolls back and closes it."""
