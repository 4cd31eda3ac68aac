"""A claim never waits without limit for a run another connection holds locked: PostgreSQL waits
`lock_wait` seconds for the run's row and then names the session that holds it, SQLite waits its `timeout`
for the database's write lock; either way a `StorageBusyError` with a hint, and nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from durably_py import SqliteStorage, StorageBusyError

FAILS_ONCE = '''
import os
from durably_py import workflow


def flaky():
    if not os.path.exists(os.environ["FLAG"]):
        raise RuntimeError("not yet")
    return "ok"


@workflow
async def locked_flow(ctx):
    return await ctx.step(flaky)
'''


@pytest.fixture
def pg(postgres_dsn: str) -> Any:
    import psycopg

    parts = dict(p.split("=", 1) for p in postgres_dsn.split())
    schema = f"test_{uuid.uuid4().hex[:16]}"
    yield postgres_dsn, schema, f"postgresql://{parts['user']}@/{parts['dbname']}?host={parts['host']}&schema={schema}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_durably_retry_on_a_postgres_row_an_open_transaction_holds_stops_and_names_it(pg: Any,
                                                                                         tmp_path: Path) -> None:
    import psycopg

    dsn, schema, url = pg
    script = tmp_path / "flow.py"
    script.write_text(FAILS_ONCE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    env["FLAG"] = str(tmp_path / "flag")

    def durably(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "durably_py.cli", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    failed = durably("run", str(script), "--workflow", "locked_flow", "--storage", url)
    assert failed.returncode == 1, failed.stderr
    with psycopg.connect(dsn) as conn:
        [(run_id,)] = conn.execute(f'SELECT run_id FROM "{schema}".runs').fetchall()
        conn.commit()
        (tmp_path / "flag").touch()
        holder = psycopg.connect(dsn, application_name="reporting-job")
        try:
            holder.execute(f'SELECT 1 FROM "{schema}".runs WHERE run_id = %s FOR UPDATE', (run_id,))  # left open
            began = time.monotonic()
            stuck = durably("retry", run_id, "--storage", url + "&lock_wait=1")
            took = time.monotonic() - began
            pid = holder.info.backend_pid
        finally:
            holder.rollback()
            holder.close()
        print(f"\n  retry on a locked row answered after {took:.1f} s: {stuck.stderr.strip().splitlines()[0]}")
        assert stuck.returncode != 0 and took < 15
        assert "StorageBusyError" in stuck.stderr and "stayed locked for 1 s by session" in stuck.stderr
        assert f"session {pid}" in stuck.stderr and "'reporting-job'" in stuck.stderr
        assert "idle in transaction" in stuck.stderr and f"pg_terminate_backend({pid})" in stuck.stderr
        count = conn.execute(f'SELECT count(*) FROM "{schema}".records WHERE run_id = %s', (run_id,)).fetchone()
        conn.commit()
    done = durably("retry", run_id, "--storage", url, "--json")
    assert done.returncode == 0, done.stderr
    with psycopg.connect(dsn) as conn:  # the refused retry wrote nothing: the one that ran added its records
        assert conn.execute(f'SELECT count(*) FROM "{schema}".records WHERE run_id = %s',
                            (run_id,)).fetchone()[0] > count[0]


def test_amend_and_delete_on_postgres_wait_the_same_bounded_time(postgres_storage: Any) -> None:
    store, holder = postgres_storage(lock_wait=0.3), postgres_storage()
    store.create("r", b'{"t":"run","v":1,"run_id":"r","workflow":"w"}\n')
    conn = holder._db()
    with conn.transaction():
        conn.execute(f'SELECT 1 FROM "{holder.schema}".runs WHERE run_id = %s FOR UPDATE', ("r",))
        for call in (lambda: store.claim("r", "me", 30), lambda: store.amend("r", lambda records, where: None),
                     lambda: store.delete("r")):
            began = time.monotonic()
            with pytest.raises(StorageBusyError) as info:
                call()
            assert time.monotonic() - began < 3 and info.value.hint and info.value.run_id == "r"


def test_sqlite_says_who_it_waited_for_instead_of_database_is_locked(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "runs.db"
    store = SqliteStorage(db, timeout=0.3)
    store.create("r", b'{"t":"run","v":1,"run_id":"r","workflow":"w"}\n')
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # a shell left inside a write transaction
    try:
        began = time.monotonic()
        with pytest.raises(StorageBusyError) as info:
            store.claim("r", "me", 30)
        assert time.monotonic() - began < 3
        assert "stayed locked by another connection for 0.3 s" in info.value.message and info.value.hint
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.claim("r", "me", 30) is not None
