"""Group commit of the PostgreSQL adapter's lease-fenced writes (`PostgresCommitter`): every append, sync, release
and end (`finish_all`) the runs of one process make goes to one committer thread with a connection of its own,
which writes whatever is pending in one transaction, so one WAL flush serves all of them.

Each write is fenced by its own lease (the run's row must still carry the lease's epoch and owner), so a lost
lease fails only that lease's writes; the writes of one run keep the order they were submitted in; and a write's
outcome is handed back only once the commit carrying it returned (``synchronous_commit = on``): nothing is
acknowledged before it is durable. Consecutive appends of many runs become one statement (arrays, ``unnest``),
consecutive releases and ends another handful, so a group costs a few round trips and one flush however many
runs it serves. Callers either wait (`call`: the storage's synchronous methods) or take the future
(`submit`: `RunLog`, which awaits it only where a step's result is handed back)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..errors import LeaseLostError
from .base import Lease, last_line
from .catalog import header_fields, state_after
from .pgdriver import psycopg_module as _psycopg

if TYPE_CHECKING:
    import psycopg

_KEEP = "\x00"  # `state_after` of this: the appended lines left the run's catalog state as it was
_Statement = tuple[str, tuple[Any, ...], Callable[[Any], None]]  # a query, its parameters, what reads its result


class Write:
    """One fenced write waiting for the next group commit: an append of `data` (with the run's new stored values
    `blobs`), a `sync` (the lease checked), or an end of the lease (`release`, and `unschedule` the run too)."""

    __slots__ = ("kind", "lease", "data", "blobs", "unschedule", "future", "waited", "waiter")

    def __init__(self, kind: str, lease: Lease, data: bytes = b"", blobs: dict[str, bytes] | None = None,
                 unschedule: bool = False) -> None:
        self.kind = kind  # "append", "sync" or "end"
        self.lease = lease
        self.data = data
        self.blobs = blobs
        self.unschedule = unschedule
        self.future: Future[Any] | None = None  # the outcome for a thread (`submit`)
        self.waiter: asyncio.Future[Any] | None = None  # or for a loop: one wake-up of it per group (`submit`)
        self.waited = False  # its caller waits for it (`call`), so hears of its failure


class PostgresCommitter:
    """The committer thread of one `PostgresStorage` (started on first use): writes submitted meanwhile go into
    one transaction together. `tables` names the tables ("runs", "records", "run_blobs", "queue", "joins");
    `lost` makes a lease's `LeaseLostError`; `parents_due(cur, parents)` makes the parents whose last child
    ended due (`pgqueue`); `full(exc)` maps an out-of-space error."""

    def __init__(self, dsn: str, tables: dict[str, str], *, lost: Callable[[Lease], LeaseLostError],
                 parents_due: Callable[[Any, list[str]], None],
                 full: Callable[[BaseException], BaseException | None]) -> None:
        self.dsn = dsn
        self._runs, self._records, self._run_blobs = tables["runs"], tables["records"], tables["run_blobs"]
        self._queue, self._joins = tables["queue"], tables["joins"]
        self._lost = lost
        self._parents_due = parents_due
        self._full = full
        self._pending: list[Write] = []
        self._staged: list[Write] = []  # handed in during a loop's pass that has not ended yet (`submit`)
        self._kicking = False  # a `_kick` is scheduled
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._stopping = False
        self._submitted = 0  # writes handed in so far
        self._done = 0  # of them, the ones whose commit finished (durable or failed)
        self._failed: dict[tuple[str, int], BaseException] = {}  # leases a write of which failed: so do later ones
        self.commits = 0  # group commits made (one WAL flush each)
        self.sizes: dict[tuple[str, int], int] = {}  # the log's size each `sync` found, by (run, epoch)

    # ---- handing writes in ----------------------------------------------------------------------------
    def submit(self, write: Write, *, soon: bool = False) -> Future[Any] | asyncio.Future[Any]:
        """Queue `write` for the next group commit; its future holds the outcome once that commit returned.

        With `soon` (a run's record handed in without waiting for it, `RunLog.write`) from a thread running an
        asyncio loop, it waits for the loop's current pass to end before the committer may take it, so the
        records every run of the loop writes in one pass (the steps a group commit let go on) share the next
        commit rather than the first of them going alone. Without, it may go at once (its caller may block on
        it, even on the loop's thread)."""
        loop = None
        if soon:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        outcome: Future[Any] | asyncio.Future[Any]
        if loop is not None:
            outcome = write.waiter = loop.create_future()
        else:
            outcome = write.future = Future()
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._serve, name="durably-pg-commit", daemon=True)
                self._thread.start()
            self._submitted += 1
            if loop is not None:
                self._staged.append(write)
                if not self._kicking:
                    self._kicking = True
                    loop.call_soon(self._kick)
                return outcome
            if self._staged:  # after the writes handed in before it
                self._pending += self._staged
                self._staged = []
            self._pending.append(write)
            self._cond.notify()
        return outcome

    def _kick(self) -> None:
        """The loop's pass that handed writes in is over: let the committer take them."""
        with self._cond:
            self._kicking = False
            if self._staged:
                self._pending += self._staged
                self._staged = []
                self._cond.notify()

    def call(self, write: Write) -> Any:
        """Queue `write` and wait for its outcome (raised when it failed)."""
        write.waited = True
        self.submit(write)
        assert write.future is not None
        return write.future.result()

    def flush(self) -> None:
        """Wait until every write handed in before this call has been committed (or failed): a statement the
        adapter makes on its other connection after this sees them, in order."""
        with self._cond:
            target = self._submitted
            if self._staged:  # the loop that handed them in may be the one waiting here
                self._pending += self._staged
                self._staged = []
                self._cond.notify()
            while self._done < target and self._thread is not None and self._thread.is_alive():
                self._cond.wait(1.0)

    def close(self) -> None:
        """Commit what is pending, then stop the thread and close the connection (a later write starts it again)."""
        with self._cond:
            thread = self._thread
            self._stopping = True
            self._pending += self._staged
            self._staged = []
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    # ---- the committer thread ----------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if not self._pending:  # stopping, nothing left
                    self._thread = None
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None
                    return
                group, self._pending = self._pending, []
            outcomes = self._commit(group)
            with self._cond:
                self._done += len(group)
                self._cond.notify_all()
            woken: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
            for write, outcome in zip(group, outcomes, strict=True):
                failed = isinstance(outcome, BaseException)
                if failed and not write.waited:  # handed in and gone on: what its lease writes later is refused
                    self._failed.setdefault((write.lease.run_id, write.lease.epoch), outcome)
                if write.waiter is not None:
                    woken.setdefault(write.waiter.get_loop(), []).append((write.waiter, outcome))
                elif write.future is not None:
                    _settle(write.future, outcome)
            for loop, waiters in woken.items():
                try:
                    loop.call_soon_threadsafe(_wake, waiters)
                except RuntimeError:  # the loop closed meanwhile: nothing waits any more
                    pass

    def _db(self) -> psycopg.Connection[Any]:
        if self._conn is not None and (self._conn.closed or self._conn.broken):
            self._conn = None
        if self._conn is None:
            conn = _psycopg().connect(self.dsn, autocommit=True)
            conn.execute("SET synchronous_commit = on")  # every group commit is durable before anyone hears of it
            self._conn = conn
        return self._conn

    def _commit(self, group: list[Write]) -> list[Any]:
        """Write `group` in one transaction: each write's outcome (an exception for one that failed). A deadlock
        with another session retries the whole group (nothing of it was kept); any other error fails every
        write of the group (a broken connection is reopened at the next group)."""
        psycopg = _psycopg()
        failed = self._failed
        outcomes: list[Any] = [None] * len(group)
        live = []
        for i, write in enumerate(group):
            releases = write.kind == "end" and not write.unschedule
            prior = None if releases else failed.get((write.lease.run_id, write.lease.epoch))
            if prior is not None:  # an earlier write of the lease failed: nothing after it is kept but a release
                outcomes[i] = prior
            else:
                live.append(i)
        for tries_left in (3, 2, 1, 0):
            conn = None
            try:
                conn = self._db()
                kept = self._transaction(conn, [group[i] for i in live])
                self.commits += 1
                for i, ok in zip(live, kept, strict=True):
                    outcomes[i] = ok
                return outcomes
            except Exception as exc:  # noqa: BLE001 - every write of the group fails with it
                if conn is not None and not conn.broken and conn.info.transaction_status.name != "IDLE":
                    try:
                        conn.execute("ROLLBACK")
                    except Exception:  # noqa: BLE001 - a broken connection rolls back on the server
                        pass
                if isinstance(exc, psycopg.errors.DeadlockDetected) and tries_left:
                    continue
                if self._conn is not None and self._conn.broken:
                    self._conn.close()
                    self._conn = None
                error = self._full(exc) or exc
                if error is not exc:
                    error.__cause__ = exc  # the server's own error, as `raise ... from` keeps it
                for i in live:
                    outcomes[i] = error
                return outcomes
        raise AssertionError("unreachable")  # pragma: no cover

    def _transaction(self, conn: psycopg.Connection[Any], group: list[Write]) -> list[Any]:
        """One transaction for `group`; each write's outcome (a `LeaseLostError` for one whose lease is not current).

        Most groups are one statement (`_writes`: appends and ends of many runs together): it is sent alone and
        commits on its own (the connection is in autocommit mode), one round trip with no BEGIN and COMMIT. A group
        of several statements sends them with its BEGIN and COMMIT in one pipeline (one round trip); two when a run
        ending in it is a child run (its parent may be waiting for it: whether it was the last child is asked once
        the run's `joins` rows are gone, inside the transaction)."""
        outcomes: list[Any] = [None] * len(group)
        parents: list[str] = []
        children = any(write.kind == "end" and write.unschedule and header_fields(write.lease.records[:1] and
                                                                                  write.lease.records[0])[2]
                       for write in group)
        statements = self._statements(group, outcomes, parents)
        if len(statements) == 1 and not children:
            query, params, read = statements[0]
            with conn.cursor() as cur:
                cur.execute(query, params)
                read(cur)
        else:
            with conn.pipeline() as pipe:
                conn.execute("BEGIN")
                cursors = []
                for query, params, read in statements:
                    cur = conn.cursor()
                    cur.execute(query, params)
                    cursors.append((cur, read))
                if not children:
                    conn.execute("COMMIT")
                pipe.sync()
                for cur, read in cursors:
                    read(cur)
                if children:
                    if parents:
                        with conn.cursor() as cur:
                            self._parents_due(cur, parents)
                    conn.execute("COMMIT")
        if parents and not children:  # a run that was waited for though its header names no parent (none should)
            with conn.transaction(), conn.cursor() as cur:
                self._parents_due(cur, parents)
        return outcomes

    def _statements(self, group: list[Write], outcomes: list[Any], parents: list[str]) -> list[_Statement]:
        """The statements of one group, in order: each stretch of appends and ends becomes one statement (`_writes`;
        a lease's appends joined, its end after them), a sync or an append with stored values one of its own. A
        stretch ends where a lease would write after its end, or a run comes again under another lease. Each
        comes with what reads its result (filling `outcomes`, and `parents` with the runs some ended child was the
        last one of)."""
        statements = []
        i = 0
        while i < len(group):
            write = group[i]
            j = i + 1
            if write.kind == "end" or (write.kind == "append" and not write.blobs):
                leases: dict[str, tuple[Lease, list[int]]] = {}
                ended: set[str] = set()
                j = i
                while j < len(group) and (group[j].kind == "end" or (group[j].kind == "append" and not group[j].blobs)):
                    run_id = group[j].lease.run_id
                    same = leases.get(run_id)
                    if same is not None and (same[0] is not group[j].lease or run_id in ended):
                        break  # the run again under another lease, or after its end: in a statement of its own
                    if same is None:
                        leases[run_id] = (group[j].lease, [j])
                    else:
                        same[1].append(j)
                    if group[j].kind == "end":
                        ended.add(run_id)
                    j += 1
                statements.append(self._writes(group, leases, outcomes, parents))
            elif write.kind == "append":
                statements.append(self._writes(group, {write.lease.run_id: (write.lease, [i])}, outcomes, parents,
                                               write.blobs))
            else:  # "sync": the lease checked, the log's size read
                statements.append(self._sync(write, i, outcomes))
            i = j
        return statements

    def _writes(self, group: list[Write], leases: dict[str, tuple[Lease, list[int]]], outcomes: list[Any],
                parents: list[str], blobs: dict[str, bytes] | None = None) -> _Statement:
        """One statement for the appends and ends of several leases, each run's row updated once: if its lease is
        current, its lines (its appends' data joined, in order) inserted as one chunk and its row's last line,
        size and state moved on; the lease released when it ends; and the runs whose end asks it taken out of the
        queue (their queue rows and joins deleted; the parents whose last child one was come back). `blobs`: the
        stored values an append of one run refers to, kept with it.

        The catalog's ``updated`` (indexed) moves when the lease is released (a park, an end) or the lines change
        the run's catalog state, as at a claim; a step's lines leave it alone, so their row update touches no index
        and stays on its page (a HOT update)."""
        run_ids, epochs, owners, datas, lasts, sizes, states, releases, unschedules = [], [], [], [], [], [], [], [], []
        for run_id, (lease, indexes) in leases.items():
            chunks = [group[k].data for k in indexes if group[k].kind == "append"]
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            end = group[indexes[-1]] if group[indexes[-1]].kind == "end" else None
            run_ids.append(run_id)
            epochs.append(lease.epoch)
            owners.append(lease.owner)
            datas.append(data)
            lasts.append(bytes(last_line(data)) if data else None)
            sizes.append(len(data))
            states.append(_state(data) if data else None)
            releases.append(end is not None)
            unschedules.append(end is not None and end.unschedule)
        params: tuple[Any, ...] = (run_ids, epochs, owners, datas, lasts, sizes, states, releases, unschedules)
        kept_values = ""
        if blobs:
            kept_values = (f" kept AS (INSERT INTO {self._run_blobs} (run_id, digest, data) SELECT fenced.run_id,"
                           " b.digest, b.data FROM fenced, unnest(%b::text[], %b::bytea[]) AS b(digest, data)"
                           " ON CONFLICT DO NOTHING),")
            params += (list(blobs), list(blobs.values()))
        query = (
            "WITH u AS (SELECT * FROM unnest(%b::text[], %b::bigint[], %b::text[], %b::bytea[], %b::bytea[],"
            " %b::bigint[], %b::text[], %b::bool[], %b::bool[])"
            " AS u(run_id, epoch, owner, data, last, size, state, release, unschedule)),"
            f" fenced AS (UPDATE {self._runs} r SET"
            " updated = CASE WHEN u.release OR u.state IS NOT NULL THEN clock_timestamp() ELSE r.updated END,"
            " last = coalesce(u.last, r.last), size = r.size + u.size, state = coalesce(u.state, r.state),"
            " owner = CASE WHEN u.release THEN NULL ELSE r.owner END,"
            " lease_expires = CASE WHEN u.release THEN NULL ELSE r.lease_expires END FROM u"
            " WHERE r.run_id = u.run_id AND r.epoch = u.epoch AND r.owner = u.owner RETURNING r.run_id, u.unschedule),"
            + kept_values +
            f" logged AS (INSERT INTO {self._records} (run_id, data) SELECT u.run_id, u.data FROM u JOIN fenced"
            " ON fenced.run_id = u.run_id WHERE u.size > 0),"
            " gone AS (SELECT run_id FROM fenced WHERE unschedule),"
            f" dequeued AS (DELETE FROM {self._queue} WHERE run_id IN (SELECT run_id FROM gone)),"
            f" waited AS (DELETE FROM {self._joins} WHERE parent IN (SELECT run_id FROM gone)),"
            f" joined AS (DELETE FROM {self._joins} WHERE child IN (SELECT run_id FROM gone) RETURNING parent)"
            " SELECT run_id, NULL FROM fenced UNION ALL SELECT NULL, parent FROM joined")

        def read(cur: Any) -> None:
            kept = set()
            for run_id, parent in cur.fetchall():
                if parent is not None:
                    parents.append(parent)
                else:
                    kept.add(run_id)
            for run_id, (lease, indexes) in leases.items():
                if run_id not in kept:
                    for k in indexes:
                        outcomes[k] = self._lost(lease)
        return query, params, read

    def _sync(self, write: Write, k: int, outcomes: list[Any]) -> _Statement:
        """The lease checked and the log's size read, in the group's transaction."""
        lease = write.lease

        def read(cur: Any) -> None:
            row = cur.fetchone()
            outcomes[k] = self._lost(lease) if row is None else int(row[0])
        return (f"SELECT size FROM {self._runs} WHERE run_id = %s AND epoch = %s AND owner = %s",
                (lease.run_id, lease.epoch, lease.owner), read)


def _wake(waiters: list[tuple[asyncio.Future[Any], Any]]) -> None:
    """On a loop's thread: hand each of its writes of a group its outcome (one wake-up of the loop per group)."""
    for waiter, outcome in waiters:
        _settle(waiter, outcome)


def _settle(future: Future[Any] | asyncio.Future[Any], outcome: Any) -> None:
    """Give a write's future its outcome (an exception for a write that failed), unless it has one already."""
    if not future.done():
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _state(data: bytes) -> str | None:
    """The run's catalog state once `data` is appended, None when it stays as it was (no end, reopen or reset)."""
    state = state_after(_KEEP, data)
    return None if state == _KEEP else state
