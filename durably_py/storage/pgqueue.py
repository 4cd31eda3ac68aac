"""The PostgreSQL adapter's due queue (`DueQueue`): a `queue` row per run that has not ended (when it is due, its
priority, the signals that wake it, its named queue and partition), `joins` rows for the children a parked
parent waits for, the due query in the queue's fair order, claims with ``FOR UPDATE ... SKIP LOCKED``, and the
``LISTEN``/``NOTIFY`` wake-ups of idle workers. A part of `PostgresStorage`, kept in a module of its own as the
file adapter keeps its queue (`filequeue.py`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .base import Check, Lease, QueueEntry, QueueStats, decode_record, sorted_stats
from .catalog import queue_fields
from .pgdriver import MAX_TTL, PostgresPart
from .pgdriver import psycopg_module as _psycopg

if TYPE_CHECKING:
    import psycopg

    from .pgcommit import PostgresCommitter


class PostgresDueQueue(PostgresPart):
    """The queue methods of `PostgresStorage` (which provides the connection, the tables' names and the claim)."""

    dsn: str
    _conn: Any
    _committer: PostgresCommitter
    _queue: str
    _runs: str
    _joins: str
    _records: str
    _signals: str
    _channel: str

    if TYPE_CHECKING:
        def _claim_locked(self, cur: psycopg.Cursor[Any], run_id: str, epoch: int, owner: str, ttl: float,
                          check: Check | None, reopen: bool = False) -> Lease | None: ...
        def _claim_rows(self, cur: psycopg.Cursor[Any], rows: list[tuple[Any, ...]], owner: str, ttl: float,
                        check: Check | None) -> list[Lease]: ...

    def _do_schedule(self, run_id: str, at: float | None, wait: tuple[str, ...], priority: int | None) -> None:
        """Move the run's queue row in one statement; a run without one (queued again) gets a row in the queue
        and partition its header names, read in a second statement (the row's insert needs the run's row)."""
        names = list(wait)
        if self._write(
            f"WITH dropped AS (DELETE FROM {self._joins} WHERE parent = %s)"
            f" UPDATE {self._queue} SET due = %s, wait = %s, priority = coalesce(%s, priority) WHERE run_id = %s",
            (run_id, at, names, priority, run_id),
        ) == 0:
            rows = self._fetch(f"SELECT header FROM {self._runs} WHERE run_id = %s", (run_id,))
            if not rows or self._write(
                f"INSERT INTO {self._queue} (run_id, due, priority, created, wait, queue_name, partition_name)"
                f" SELECT run_id, %s, coalesce(%s, 0), %s, %s, %s, %s FROM {self._runs} WHERE run_id = %s"
                " ON CONFLICT (run_id) DO UPDATE SET due = excluded.due, wait = excluded.wait,"
                f" priority = coalesce(%s, {self._queue}.priority)",
                (at, priority, time.time(), names, *queue_fields(decode_record(bytes(rows[0][0]))), run_id,
                 priority),
            ) == 0:
                raise self._missing(run_id)
        self._notify()

    def _do_join_wait(self, run_id: str, children: tuple[str, ...]) -> bool:
        """In one transaction: the run's row due only when woken, and a `joins` row per child still queued."""
        now = time.time()
        with self._cursor(transaction=True) as cur:
            cur.execute(f"SELECT 1 FROM {self._runs} WHERE run_id = %s", (run_id,))
            if cur.fetchone() is None:
                raise self._missing(run_id)
            cur.execute(f"DELETE FROM {self._joins} WHERE parent = %s", (run_id,))
            # the children's rows are share-locked: a child ending now either ends first (its row is gone) or
            # waits for this transaction and then finds the joins rows it must drop
            cur.execute(f"SELECT run_id FROM {self._queue} WHERE run_id = ANY(%s) ORDER BY run_id FOR SHARE",
                        (sorted(set(children)),))
            queued = [row[0] for row in cur.fetchall()]
            if queued:
                cur.executemany(f"INSERT INTO {self._joins} (parent, child) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                                [(run_id, child) for child in queued])
            waiting = bool(queued)
            due = None if waiting else now
            cur.execute(f"UPDATE {self._queue} SET due = %s, wait = '{{}}' WHERE run_id = %s", (due, run_id))
            if cur.rowcount == 0:  # not queued (the run's row is share-locked by no one: read its header now)
                cur.execute(f"SELECT header FROM {self._runs} WHERE run_id = %s", (run_id,))
                place = queue_fields(decode_record(bytes(cur.fetchone()[0])))  # type: ignore[index]
                cur.execute(f"INSERT INTO {self._queue} (run_id, due, priority, created, wait, queue_name,"
                            " partition_name) VALUES (%s, %s, 0, %s, '{}', %s, %s)"
                            " ON CONFLICT (run_id) DO UPDATE SET due = excluded.due, wait = excluded.wait",
                            (run_id, due, now, *place))
            if not waiting:
                cur.execute("SELECT pg_notify(%s, '')", (self._channel,))
        return not waiting

    def _do_unschedule(self, run_id: str) -> None:
        """Delete the run's queue row and its `joins` rows; a parent left waiting for nothing is due now."""
        with self._cursor(transaction=True) as cur:
            self._unschedule(cur, run_id)

    def _unschedule(self, cur: psycopg.Cursor[Any], run_id: str) -> None:
        """Inside a transaction: `unschedule` (a parent made due is notified at the commit)."""
        self._unschedule_many(cur, [run_id])

    def _unschedule_many(self, cur: psycopg.Cursor[Any], run_ids: list[str]) -> None:
        """Inside a transaction: `unschedule` of each of `run_ids` (ended together), in three statements for all of
        them plus a few for each parent they were the last children of."""
        cur.execute(f"DELETE FROM {self._queue} WHERE run_id = ANY(%s)", (run_ids,))
        cur.execute(f"DELETE FROM {self._joins} WHERE parent = ANY(%s)", (run_ids,))
        cur.execute(f"DELETE FROM {self._joins} WHERE child = ANY(%s) RETURNING parent", (run_ids,))
        self._parents_due(cur, [row[0] for row in cur.fetchall()])

    def _parents_due(self, cur: psycopg.Cursor[Any], parents: list[str]) -> None:
        """Inside the transaction that deleted their children's `joins` rows: each of `parents` left waiting for
        no child is due now (notified at the commit)."""
        now = time.time()
        for parent in sorted(set(parents)):
            # children ending at once queue on the parent's row, so the last one sees the others' deletes
            cur.execute(f"SELECT 1 FROM {self._queue} WHERE run_id = %s FOR UPDATE", (parent,))
            cur.execute(f"SELECT 1 FROM {self._joins} WHERE parent = %s LIMIT 1", (parent,))
            if cur.fetchone() is None:
                cur.execute(f"UPDATE {self._queue} SET due = %s WHERE run_id = %s AND (due IS NULL OR due > %s)",
                            (now, parent, now))
                if cur.rowcount:
                    cur.execute("SELECT pg_notify(%s, '')", (self._channel,))

    def _do_wake(self, run_id: str, name: str | None) -> bool:
        """Make the run due now if its row waits for `name` (None: unconditionally)."""
        now = time.time()
        woke = self._write(
            f"UPDATE {self._queue} SET due = %s WHERE run_id = %s AND (due IS NULL OR due > %s)"
            " AND (%s::text IS NULL OR %s::text = ANY(wait))",
            (now, run_id, now, name, name),
        ) > 0
        if woke:
            self._notify()
        return woke

    def _notify(self) -> None:
        """Tell the workers listening on this schema (`watch`) that due work may have appeared."""
        self._write("SELECT pg_notify(%s, '')", (self._channel,))

    def next_due(self, now: float | None = None) -> float | None:
        """The earliest time after `now` at which a queued run falls due (None: none is to)."""
        rows = self._fetch(f"SELECT min(due) FROM {self._queue} WHERE due > %s", (time.time() if now is None else now,))
        return rows[0][0] if rows else None

    def watch(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """``LISTEN`` on this schema's channel on a connection of its own, in a thread that calls `callback`
        at every notification (and once after reconnecting, for what it may have missed meanwhile)."""
        psycopg = _psycopg()
        stopped = threading.Event()

        def connect() -> Any:
            conn = psycopg.connect(self.dsn, autocommit=True)
            conn.execute(f'LISTEN "{self._channel}"')
            return conn

        try:
            first = connect()
        except psycopg.Error:
            return None

        def listen() -> None:
            conn = first
            while not stopped.is_set():
                try:
                    if conn is None:
                        conn = connect()
                        callback()
                    for _ in conn.notifies(timeout=0.5):
                        if stopped.is_set():
                            break
                        callback()
                except psycopg.Error:
                    if conn is not None:
                        conn.close()
                    conn = None
                    stopped.wait(1.0)
            if conn is not None:
                conn.close()

        threading.Thread(target=listen, name="durably-listen", daemon=True).start()
        return stopped.set

    def _do_entry(self, run_id: str) -> QueueEntry | None:
        """The run's queue row."""
        rows = self._fetch(f"SELECT due, priority, wait, created, queue_name, partition_name FROM {self._queue}"
                           " WHERE run_id = %s", (run_id,))
        if not rows:
            return None
        due, priority, wait, created, queue, partition = rows[0]
        return QueueEntry(run_id, due, priority, tuple(wait), created, queue, partition)

    _KEPT = ("q.due IS NOT NULL AND q.due <= %s AND (r.owner IS NULL OR r.lease_expires < clock_timestamp())"
             " AND NOT (q.run_id = ANY(%s)) AND (%s OR r.workflow = ANY(%s)) AND (%s OR q.queue_name = ANY(%s))"
             " AND NOT (q.queue_name = ANY(%s))"
             " AND (q.partition_name IS NULL OR NOT (q.queue_name || '/' || q.partition_name = ANY(%s)))")
    """What a due row of ``queue q JOIN runs r`` meets (`_kept_params`)."""
    _PARTED = "SELECT 1 FROM {queue} WHERE partition_name IS NOT NULL LIMIT 1"
    """Whether any queued row has a partition (one probe of the partial index ``queue_parts``)."""
    _PLAIN = ("SELECT q.run_id, r.epoch, r.size, r.last FROM {queue} q JOIN {runs} r ON r.run_id = q.run_id WHERE " + _KEPT
              + " ORDER BY q.priority DESC, q.due, q.created, q.run_id LIMIT %s")
    """The due query while no row has a partition: the walk of ``queue_due_order`` in order, as before partitions."""
    _FAIR = ("SELECT c.run_id, r.epoch, r.size, r.last FROM ("
             "(SELECT q.run_id, q.priority, 1::bigint AS nth, q.due, q.created FROM {queue} q"
             " JOIN {runs} r ON r.run_id = q.run_id WHERE q.partition_name IS NULL AND " + _KEPT
             + " ORDER BY q.priority DESC, q.due, q.created, q.run_id LIMIT %s)"
             " UNION ALL (SELECT * FROM (SELECT q.run_id, q.priority, row_number() OVER (PARTITION BY q.queue_name,"
             " q.partition_name, q.priority ORDER BY q.due, q.created, q.run_id) AS nth, q.due, q.created"
             " FROM {queue} q JOIN {runs} r ON r.run_id = q.run_id WHERE q.partition_name IS NOT NULL AND " + _KEPT
             + ") ranked WHERE nth <= %s)"
             ") c JOIN {runs} r ON r.run_id = c.run_id WHERE (r.owner IS NULL OR r.lease_expires < clock_timestamp())"
             " ORDER BY c.priority DESC, c.nth, c.due, c.created, c.run_id LIMIT %s")
    """The due query in the queue's fair order (`base.fair_order`) once some row has a partition, in two parts:
    the rows without a partition walk ``queue_due_order`` in order up to a number of rows; the rows with one
    (through ``queue_parts``) are ranked in their (queue, partition, priority) by row_number(), a rank past that
    number left out. Outside, each run's row is joined once more, so ``FOR UPDATE OF r SKIP LOCKED`` locks it
    and re-checks its lease."""
    _CLAIMABLE = ("WITH picked AS ({due} FOR UPDATE OF r SKIP LOCKED) SELECT p.run_id, p.epoch, p.size, p.last,"
                  " (SELECT string_agg(d.data, ''::bytea ORDER BY d.seq) FROM {records} d WHERE d.run_id = p.run_id),"
                  " EXISTS (SELECT 1 FROM {signals} s WHERE s.run_id = p.run_id) FROM picked p")
    """The due rows locked for a claim, each with its log and whether its inbox holds anything, in one statement.
    The locked rows are their latest versions (a row changed since the statement began is read again once locked),
    the logs are as the statement's snapshot saw them: a log whose length or last line differs from its row's
    (a write committed in between) is read again (`_claim_rows`)."""

    @staticmethod
    def _kept_params(now: float, skip: tuple[str, ...], names: frozenset[str] | None,
                     queues: frozenset[str] | None, full: frozenset[str]) -> tuple[Any, ...]:
        """The parameters of `_KEPT`."""
        return (now, list(skip), names is None, sorted(names or ()), queues is None, sorted(queues or ()),
                sorted(full), sorted(full))

    def _due_rows(self, cur: psycopg.Cursor[Any], kept: tuple[Any, ...], take: int, limit: int) -> list[tuple[Any, ...]]:
        """(run id, epoch, size, last line) of up to `limit` due rows in the queue's fair order: `_PLAIN` while no
        queued row has a partition (one cheap probe first), else `_FAIR` looking at `take` rows (or ranks) of each
        part."""
        cur.execute(self._PARTED.format(queue=self._queue))
        if cur.fetchone() is None:
            cur.execute(self._PLAIN.format(queue=self._queue, runs=self._runs), (*kept, limit))
        else:
            cur.execute(self._FAIR.format(queue=self._queue, runs=self._runs), (*kept, take, *kept, take, limit))
        return cur.fetchall()

    def _claimable(self, due: str) -> str:
        """`_CLAIMABLE` around the due query `due`."""
        return self._CLAIMABLE.format(due=due, records=self._records, signals=self._signals)

    def _do_due(self, limit: int, now: float | None, skip: tuple[str, ...], names: frozenset[str] | None,
                queues: frozenset[str] | None, full: frozenset[str]) -> list[str]:
        """Due, unheld runs (of `names` and `queues`, when given, none of `full`) from the queue table's indexes."""
        kept = self._kept_params(time.time() if now is None else now, skip, names, queues, full)
        psycopg = _psycopg()
        for tries_left in (1, 0):  # as `_fetch`: once more on a new connection if the old one had broken
            try:
                with self._cursor(flush=False) as cur:
                    return [row[0] for row in self._due_rows(cur, kept, limit, limit)]
            except psycopg.OperationalError:
                if not tries_left or self._conn is not None:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _do_claim_due(self, owner: str, ttl: float, limit: int, skip: tuple[str, ...], check: Check | None,
                      names: frozenset[str] | None, queues: frozenset[str] | None,
                      full: frozenset[str]) -> list[Lease]:
        """Claim up to `limit` due runs in one transaction of a few statements whatever their number (`_claim_rows`):
        ``FOR UPDATE OF runs SKIP LOCKED`` lets machines claiming at once take different runs instead of queueing
        on the same rows (in the fair order, the due query looks at `4 * limit + 32` rows of each part, so the
        rows other machines are claiming meanwhile, locked and skipped, leave enough for this one).

        The transaction commits without waiting for its WAL flush (``synchronous_commit = off`` for it alone): a
        claim needs no flush of its own, since the claimed run's first durable write (its first step, at the
        latest its end) flushes the WAL up to it, and the server writes the WAL in order. A server crash before
        that forgets the claim and leaves the run due again, as if it had not been claimed; its owner's next
        write then finds the lease gone."""
        ttl = min(ttl, MAX_TTL)
        if limit == 0:
            return []
        kept = self._kept_params(time.time(), skip, names, queues, full)
        names_of = {"queue": self._queue, "runs": self._runs}
        with self._cursor(flush=False) as cur:  # no write of a lease this process holds comes before it
            conn = cur.connection
            try:  # two round trips: the start, the probe and the due rows pipelined; the claims and the commit
                with conn.pipeline():
                    cur.execute("BEGIN")
                    probe = conn.cursor()
                    probe.execute("SELECT set_config('synchronous_commit', 'off', true), EXISTS ("
                                  + self._PARTED.format(queue=self._queue) + ")")
                    cur.execute(self._claimable(self._PLAIN.format(**names_of)), (*kept, limit))  # most likely
                    if (probe.fetchone() or (None, False))[1]:  # partitions: the fair order instead
                        cur.execute(self._claimable(self._FAIR.format(**names_of)),
                                    (*kept, 4 * limit + 32, *kept, 4 * limit + 32, limit))
                    rows = cur.fetchall()
                    leases = self._claim_rows(cur, rows, owner, ttl, check) if rows else []
                    cur.execute("COMMIT")
            except BaseException:
                if not conn.broken and conn.info.transaction_status.name != "IDLE":
                    conn.execute("ROLLBACK")
                raise
        return leases

    def _do_queue_stats(self, now: float) -> list[QueueStats]:
        """One GROUP BY over the queue table (and each row's lease, on the database clock)."""
        rows = self._fetch(
            "SELECT queue_name, partition_name, count(*) FILTER (WHERE NOT held AND due <= %s),"
            " count(*) FILTER (WHERE NOT held AND due > %s), count(*) FILTER (WHERE held),"
            " count(*) FILTER (WHERE NOT held AND due IS NULL), min(due) FILTER (WHERE NOT held AND due <= %s)"
            " FROM (SELECT q.queue_name, q.partition_name, q.due,"
            " coalesce(r.owner IS NOT NULL AND r.lease_expires >= clock_timestamp(), false) AS held"
            f" FROM {self._queue} q LEFT JOIN {self._runs} r ON r.run_id = q.run_id) entries"
            " GROUP BY queue_name, partition_name", (now, now, now))
        return sorted_stats(QueueStats(*row) for row in rows)
