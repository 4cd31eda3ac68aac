"""A run a worker serves parks instead of holding its process: in `ctx.join` / `ctx.join_all` until its
children end, and in a long retry backoff until it ends. Stores made before the queue get queue rows for
their unfinished runs when they are opened, so a worker takes those runs over."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from helpers import storage_of

from durably_py import FileStorage, MemoryStorage, Retry, SqliteStorage, create_engine, records, workflow
from durably_py._codec import digest, dump_value
from durably_py._replay import steps as park_rules

ran: list[str] = []


@workflow
async def pk_leaf(ctx, n):
    return await ctx.step(lambda: ran.append(f"leaf:{n}") or f"leaf:{n}", name="mark")


@workflow
async def pk_middle(ctx, n):
    results = await ctx.join_all(await ctx.spawn_all([(pk_leaf, f"{n}.{i}") for i in range(3)]))
    return [r.value for r in results]


@workflow
async def pk_top(ctx, width):
    single = await ctx.join(await ctx.spawn(pk_middle, "solo"))
    results = await ctx.join_all(await ctx.spawn_all([(pk_middle, i) for i in range(width)]))
    return [single, *[r.value for r in results]]


def parks(engine: Any, run_id: str) -> list[records.Park]:
    log = engine.storage.read(run_id)
    return [r for r in records.load(log.records, run_id) if isinstance(r, records.Park)]


@pytest.mark.parametrize("kind", ["memory", "sqlite", "file"])
def test_nested_fan_out_deeper_than_the_concurrency_completes_with_parents_parked(kind: str, tmp_path: Path) -> None:
    ran.clear()

    async def main() -> None:
        engine = create_engine(storage_of(kind, tmp_path), concurrency=1)
        await engine.start(poll=0.02)
        worker = engine.queue.worker
        handle = await engine.enqueue(pk_top, 3)
        seen_waiting = False
        most_active = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            most_active = max(most_active, len(worker.active))
            state = await engine.inspect(handle.run_id)
            if state.status == "waiting" and not engine.storage.held(handle.run_id):
                waits = [s for s in state.steps if s.label == "ctx.join" and s.status == "waiting"]
                assert waits and waits[0].output["count"] >= 1
                assert set(waits[0].output["children"]) <= set(state.children)
                seen_waiting = True
            if state.status == "completed":
                break
            await asyncio.sleep(0.005)
        await engine.stop()
        assert state.status == "completed", state.status
        assert state.result == [[f"leaf:solo.{i}" for i in range(3)],
                                *[[f"leaf:{n}.{i}" for i in range(3)] for n in range(3)]]
        assert seen_waiting  # the parent was parked, held by no process, while its children ran
        assert most_active <= 1  # one run at a time: every parent left its only slot while it waited
        assert sorted(ran) == sorted([f"leaf:solo.{i}" for i in range(3)]
                                     + [f"leaf:{n}.{i}" for n in range(3) for i in range(3)])
        assert [p.count for p in parks(engine, handle.run_id)] == [1, 3]
        for child in state.children:
            assert len(parks(engine, child)) == 1  # each middle parked once, and was due only when all ended
        assert engine.storage.due(10) == [] and engine.storage.entry(handle.run_id) is None

    asyncio.run(main())


def test_run_without_a_worker_still_completes_parent_and_children_in_its_own_process(tmp_path: Path) -> None:
    ran.clear()
    engine = create_engine(FileStorage(tmp_path / "state"), concurrency=1)
    run_id: list[str] = []
    value = asyncio.run(engine.run(pk_top, 2, on_run=run_id.append))
    assert value[0] == [f"leaf:solo.{i}" for i in range(3)] and len(value) == 3
    assert parks(engine, run_id[0]) == []  # nothing parked: the process waited for its children itself


@workflow
async def pk_lazy_parent(ctx, n):
    await ctx.spawn(pk_leaf, f"unjoined{n}")  # attached, never joined: the parent still ends after it
    return n


def test_a_served_parent_parks_at_its_end_until_its_attached_children_ended(tmp_path: Path) -> None:
    async def main() -> None:
        engine = create_engine(SqliteStorage(tmp_path / "durably.db"), concurrency=1)
        handle = await engine.enqueue(pk_lazy_parent, 5)
        await engine.drain()
        state = await engine.inspect(handle.run_id)
        assert state.status == "completed" and state.result == 5
        child = await engine.inspect(state.children[0])
        assert child.status == "completed"
        [park] = parks(engine, handle.run_id)
        assert park.children == state.children and park.path == ""
        assert child.updated_at <= state.updated_at

    asyncio.run(main())


def test_cancelling_a_parent_parked_in_a_join_by_a_worker_cancels_its_children(tmp_path: Path) -> None:
    async def main() -> None:
        engine = create_engine(FileStorage(tmp_path / "state"), concurrency=1)
        handle = await engine.enqueue(pk_middle, "c")
        await engine.start(poll=0.02)
        deadline = time.monotonic() + 20
        while (await engine.inspect(handle.run_id)).status != "waiting" and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        await engine.stop()  # the parent is parked; its children wait in the queue
        state = await engine.cancel(handle.run_id, timeout=10)
        assert state.status == "cancelled"
        children = [await engine.inspect(c) for c in state.children]
        assert len(children) == 3 and all(c.status in ("cancelled", "completed") for c in children)
        assert engine.storage.due(10) == []

    asyncio.run(main())


attempts: list[float] = []


def flaky() -> str:
    attempts.append(time.time())
    if len(attempts) == 1:
        raise ConnectionError("not yet")
    return "ok"


@workflow
async def pk_backoff(ctx, x):
    return await ctx.step(flaky, retry=Retry(2, backoff="linear", base=1.0))


def test_a_long_retry_backoff_parks_the_run_due_at_its_end(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(park_rules, "PARK_BACKOFF", 0.5)
    attempts.clear()

    async def main() -> None:
        engine = create_engine(FileStorage(tmp_path / "state"), concurrency=1)
        handle = await engine.enqueue(pk_backoff, 1)
        await engine.start(poll=0.02)
        worker = engine.queue.worker
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            state = await engine.inspect(handle.run_id)
            if state.status == "sleeping":
                break
            await asyncio.sleep(0.005)
        assert state.status == "sleeping"
        entry = engine.storage.entry(handle.run_id)
        [step] = state.steps
        assert step.status == "retrying" and step.output["retry_at"]
        assert abs(entry.at - (attempts[0] + 1.0)) < 0.3  # due at the backoff's end, not before
        await asyncio.sleep(0.1)
        assert not worker.active and not engine.storage.held(handle.run_id)  # no process holds it meanwhile
        while time.monotonic() < deadline and (await engine.inspect(handle.run_id)).status != "completed":
            await asyncio.sleep(0.02)
        await engine.stop()
        state = await engine.inspect(handle.run_id)
        assert state.status == "completed" and state.result == "ok"
        assert len(attempts) == 2 and attempts[1] - attempts[0] >= 0.99
        assert [(s.label, s.attempts) for s in state.steps] == [("flaky", 2)]

    asyncio.run(main())


def test_a_short_retry_backoff_is_waited_out_in_place(tmp_path: Path, monkeypatch: Any) -> None:
    attempts.clear()

    async def main() -> None:
        engine = create_engine(MemoryStorage(), concurrency=1)
        handle = await engine.enqueue(pk_backoff, 2)
        await engine.drain()
        state = await engine.inspect(handle.run_id)
        assert state.status == "completed" and parks(engine, handle.run_id) == []
        assert state.attempt == 1  # one claim: the 1 s backoff (under PARK_BACKOFF) kept its worker

    asyncio.run(main())


# ---- stores made before the queue -------------------------------------------------------------------------
@workflow
async def pk_old(ctx, x):
    first = await ctx.step(lambda: ran.append("old:first") or x, name="first")
    second = await ctx.step(lambda: ran.append("old:second") or x * 2, name="second")
    return first + second


def old_run_lines(run_id: str) -> list[bytes]:
    """A run interrupted after its first step, as an older durably-py left it."""
    wire = dump_value(3, "input")
    header = records.Header(v=records.LOG_VERSION, run_id=run_id, workflow="pk_old", fingerprint=pk_old.fingerprint,
                            key=None, input=wire, input_digest=digest(3), identity=f"wf:pk_old:{digest(3)}",
                            budget=None, created_at="2024-01-01T00:00:00+00:00", script=None,
                            module=__name__, ts=time.time() - 60)
    return [records.encode(header),
            records.encode(records.Claim(epoch=1, owner="gone:1", at="2024-01-01T00:00:01+00:00")),
            records.encode(records.Ok(path="0", label="first", value=3, attempt=1, ms=1.0, ts=time.time() - 59))]


OLD_SQLITE = """
CREATE TABLE runs (run_id TEXT PRIMARY KEY, header BLOB NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,
    epoch INTEGER NOT NULL DEFAULT 0, owner TEXT, lease_expires REAL, last BLOB NOT NULL, size INTEGER NOT NULL,
    syncs INTEGER NOT NULL DEFAULT 0);
CREATE TABLE records (seq INTEGER PRIMARY KEY, run_id TEXT NOT NULL, data BLOB NOT NULL);
CREATE INDEX records_by_run ON records (run_id, seq);
CREATE TABLE identities (identity TEXT PRIMARY KEY, run_id TEXT NOT NULL);
CREATE TABLE signals (seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, id TEXT NOT NULL,
    data BLOB NOT NULL);
CREATE INDEX signals_by_run ON signals (run_id, seq);
PRAGMA user_version=2;
"""

OLD_POSTGRES = """
CREATE SCHEMA {s};
CREATE TABLE {s}.runs (run_id TEXT PRIMARY KEY, header BYTEA NOT NULL,
    created TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), updated TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    epoch BIGINT NOT NULL DEFAULT 0, owner TEXT, lease_expires TIMESTAMPTZ, last BYTEA NOT NULL, size BIGINT NOT NULL);
CREATE TABLE {s}.records (run_id TEXT NOT NULL, seq BIGSERIAL, data BYTEA NOT NULL, PRIMARY KEY (run_id, seq));
CREATE TABLE {s}.identities (digest TEXT PRIMARY KEY, identity TEXT NOT NULL, run_id TEXT NOT NULL);
CREATE TABLE {s}.signals (seq BIGSERIAL PRIMARY KEY, run_id TEXT NOT NULL, id TEXT NOT NULL, data BYTEA NOT NULL);
CREATE INDEX signals_by_run ON {s}.signals (run_id, seq);
"""


def finish_old_run(storage: Any) -> None:
    ran.clear()

    async def main() -> None:
        engine = create_engine(storage)
        assert storage.due(10) == ["old-run"]  # the upgrade queued the unfinished run, not the ended one
        assert storage.entry("old-done") is None
        await engine.drain()
        state = await engine.inspect("old-run")
        assert state.status == "completed" and state.result == 9
        assert ran == ["old:second"]  # its recorded first step was not run again

    asyncio.run(main())


def test_a_sqlite_store_from_before_the_queue_has_its_unfinished_run_finished_by_a_worker(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SQLITE)
        for run_id, lines in (("old-run", old_run_lines("old-run")),
                              ("old-done", [*old_run_lines("old-done"),
                                            records.encode(records.End(status="completed", result=9, ts=1.0))])):
            now = time.time()
            db.execute("INSERT INTO runs (run_id, header, created, updated, epoch, last, size) VALUES (?, ?, ?, ?, 1,"
                       " ?, ?)", (run_id, lines[0], now, now, lines[-1], sum(map(len, lines))))
            db.executemany("INSERT INTO records (run_id, data) VALUES (?, ?)", [(run_id, line) for line in lines])
    finish_old_run(SqliteStorage(path))


def test_a_postgres_store_from_before_the_queue_has_its_unfinished_run_finished_by_a_worker(postgres_dsn: str) -> None:
    import uuid

    import psycopg

    from durably_py.storage import PostgresStorage

    schema = f"test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        for statement in OLD_POSTGRES.format(s=f'"{schema}"').split(";"):
            if statement.strip():
                conn.execute(statement)
        for run_id, lines in (("old-run", old_run_lines("old-run")),
                              ("old-done", [*old_run_lines("old-done"),
                                            records.encode(records.End(status="completed", result=9, ts=1.0))])):
            conn.execute(f'INSERT INTO "{schema}".runs (run_id, header, epoch, last, size) VALUES (%s, %s, 1, %s, %s)',
                         (run_id, lines[0], lines[-1], sum(map(len, lines))))
            for line in lines:
                conn.execute(f'INSERT INTO "{schema}".records (run_id, data) VALUES (%s, %s)', (run_id, line))
    storage = PostgresStorage(postgres_dsn, schema=schema)
    try:
        finish_old_run(storage)
    finally:
        storage.close()
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@workflow
async def pk_taken_over(ctx, x):
    return await ctx.step(flaky, retry=Retry(3, backoff="linear", base=2.0))


def test_a_run_taken_over_in_its_backoff_parks_for_what_is_left_and_never_retries_early(tmp_path: Path,
                                                                                         monkeypatch: Any) -> None:
    """Its process died between recording the failed attempt and parking: the worker that takes it over
    parks it again until the recorded time, then runs the next attempt once."""
    monkeypatch.setattr(park_rules, "PARK_BACKOFF", 0.5)
    attempts.clear()
    attempts.append(time.time())  # the first attempt, in the process that died
    storage = FileStorage(tmp_path / "state")
    wire = dump_value(1, "input")
    run_id = "pk-taken-over"
    retry_at = time.time() + 2.0
    from durably_py._codec import to_iso

    header = records.Header(v=records.LOG_VERSION, run_id=run_id, workflow="pk_taken_over",
                            fingerprint=pk_taken_over.fingerprint, key=None, input=wire, input_digest=digest(1),
                            identity=f"wf:pk_taken_over:{digest(1)}", budget=None,
                            created_at="2024-01-01T00:00:00+00:00", script=None, module=__name__, ts=time.time())
    storage.create(run_id, records.encode(header))
    lease = storage.claim(run_id, "gone:1", 30)
    storage.append(lease, records.encode(records.Fail(
        path="0", label="flaky", attempt=1, error={"type": "ConnectionError", "message": "not yet"}, ms=1.0,
        next=to_iso(datetime.fromtimestamp(retry_at, UTC)), ts=time.time())))
    storage.release(lease)  # the process died: the run is an orphan, due at once

    async def main() -> None:
        engine = create_engine(storage, concurrency=1)
        await engine.start(poll=0.02)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (await engine.inspect(run_id)).status != "sleeping":
            await asyncio.sleep(0.01)
        assert (await engine.inspect(run_id)).status == "sleeping"
        assert abs(engine.storage.entry(run_id).at - retry_at) < 0.01 and len(attempts) == 1
        while time.monotonic() < deadline and (await engine.inspect(run_id)).status != "completed":
            await asyncio.sleep(0.02)
        await engine.stop()
        state = await engine.inspect(run_id)
        assert state.status == "completed" and state.result == "ok"
        assert len(attempts) == 2 and attempts[1] >= retry_at - 0.01  # not before the recorded time
        log = records.load(engine.storage.read(run_id).records, run_id)
        assert [r.attempt for r in log if isinstance(r, records.Fail)] == [1]  # the failure recorded once

    asyncio.run(main())
