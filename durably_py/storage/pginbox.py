"""The PostgreSQL adapter's inbox (`Inbox`): signals as rows of the ``signals`` table, stored in one durable
statement by any process (no lease needed) after the writes still pending in the group commit, acknowledged by
deleting them. A part of `PostgresStorage`, in a module of its own as its due queue is."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .base import decode_signal
from .pgdriver import PostgresPart

if TYPE_CHECKING:

    from .pgcommit import PostgresCommitter


class PostgresInbox(PostgresPart):
    """The inbox methods of `PostgresStorage` (which provides the connection, the tables' names and `wake`)."""

    fsyncs: int
    _committer: PostgresCommitter
    _quiet: dict[str, float]
    _runs: str
    _signals: str

    if TYPE_CHECKING:
        def wake(self, run_id: str, name: str | None = None) -> bool: ...

    def _do_send(self, run_id: str, line: bytes, signal_id: str) -> None:
        """Store one signal line in one durable statement (no lease needed); `RunNotFoundError` if unknown."""
        self._quiet.pop(run_id, None)
        if self._write(
            f"INSERT INTO {self._signals} (run_id, id, data)"
            f" SELECT run_id, %s, %s FROM {self._runs} WHERE run_id = %s",
            (signal_id, line, run_id),
        ) == 0:
            raise self._missing(run_id)
        self.fsyncs += 1
        name = (decode_signal(line) or {}).get("name")
        if isinstance(name, str) and name:
            self.wake(run_id, name)

    def _do_inbox(self, run_id: str) -> list[dict[str, Any]]:
        """The run's unacknowledged signals, in send order; `RunNotFoundError` if unknown. The first look at a run
        this process just claimed with an empty inbox is answered from the claim (a signal sent since then is
        found at the next look, as if it had come just after this one)."""
        if self._quiet and self._quiet.pop(run_id, 0.0) > time.monotonic():
            return []
        rows = self._fetch(
            f"SELECT s.data FROM {self._runs} runs LEFT JOIN {self._signals} s ON s.run_id = runs.run_id"
            " WHERE runs.run_id = %s ORDER BY s.seq",
            (run_id,),
        )
        if not rows:
            raise self._missing(run_id)
        return [signal for row in rows if row[0] is not None and (signal := decode_signal(bytes(row[0])))]

    def _do_ack(self, run_id: str, signal_id: str) -> None:
        """Delete every stored copy of signal `signal_id` (none stored: nothing happens)."""
        with self._cursor() as cur:
            cur.execute(
                f"WITH acked AS (DELETE FROM {self._signals} WHERE run_id = %s AND id = %s)"
                f" SELECT 1 FROM {self._runs} WHERE run_id = %s",
                (run_id, signal_id, run_id),
            )
            if cur.fetchone() is None:
                raise self._missing(run_id)
