"""The PostgreSQL adapter's flow-control documents (`Limits`): one row per limit key in the ``limits`` table,
changed under a transaction-scoped advisory lock on the key. A part of `PostgresStorage`, in a module of its own
as its due queue is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import StorageBusyError
from .base import LimitStep
from .catalog import OPEN
from .pgdriver import BUSY_DOCS, PostgresPart
from .pgdriver import psycopg_module as _psycopg

if TYPE_CHECKING:
    pass


class PostgresLimits(PostgresPart):
    """The limit methods of `PostgresStorage` (which provides the connection and the tables' names)."""

    schema: str
    lock_wait: float
    _runs: str
    _limits: str

    def _do_limit(self, key: str, step: LimitStep) -> Any:
        """Run `step` on the key's row in one transaction: a transaction-scoped advisory lock on (this schema, the
        key's hash) queues every session changing that key (waited for at most `lock_wait` seconds, then
        `StorageBusyError`); `now` and `live` (the ``runs`` lease columns) are read against the database clock
        once the lock is held; the row is then written or deleted and committed durably (``synchronous_commit =
        on``). Two keys whose hashes collide only take turns."""
        psycopg = _psycopg()
        try:
            with self._cursor(transaction=True) as cur:
                cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(self.lock_wait * 1000)}ms",))
                cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s), hashtext(%s))",
                            (f"durably-limits:{self.schema}", key))
                # a statement after the lock: its snapshot holds the last holder's commit
                cur.execute(f"SELECT extract(epoch FROM clock_timestamp())::float8,"
                            f" (SELECT doc FROM {self._limits} WHERE key = %s)", (key,))
                now, doc = cur.fetchone()  # type: ignore[misc]
                stored = None if doc is None else bytes(doc)

                def live(run_id: str, epoch: int) -> bool:
                    if epoch < 0:  # held while the run has not ended (`Limits.limit`)
                        cur.execute(f"SELECT 1 FROM {self._runs} WHERE run_id = %s AND state = %s", (run_id, OPEN))
                    else:
                        cur.execute(f"SELECT 1 FROM {self._runs} WHERE run_id = %s AND epoch = %s"
                                    " AND owner IS NOT NULL AND lease_expires >= clock_timestamp()", (run_id, epoch))
                    return cur.fetchone() is not None

                data, result = step(stored, float(now), live)
                if data is None:
                    if stored is not None:
                        cur.execute(f"DELETE FROM {self._limits} WHERE key = %s", (key,))
                elif data != stored:
                    cur.execute(f"INSERT INTO {self._limits} (key, doc) VALUES (%s, %s)"
                                " ON CONFLICT (key) DO UPDATE SET doc = excluded.doc", (key, data))
        except psycopg.errors.LockNotAvailable:
            raise StorageBusyError(
                f"limit {key!r} in PostgreSQL schema {self.schema} stayed locked for {self.lock_wait:g} s by another "
                "session's open transaction", docs=BUSY_DOCS,
                hint="Find it in pg_stat_activity (state 'idle in transaction') and end it, then run the same "
                     "command again; nothing was written.") from None
        return result

    def _do_limits(self, prefix: str) -> dict[str, bytes]:
        """The rows whose key starts with `prefix` (compared character by character, whatever the collation)."""
        rows = self._fetch(f"SELECT key, doc FROM {self._limits} WHERE left(key, %s) = %s", (len(prefix), prefix))
        return {key: bytes(doc) for key, doc in rows}
