"""A SQLite database written by the adapter of schema 9 (records keyed by a global sequence, with an index on their
run) is moved in place to schema 10 (records keyed by their run's number) on first open: every reader answers as
it did before, nothing is lost, and its runs go on. The database is `tests/data/sqlite_schema9.sql`, made by the
schema-9 adapter (`tests/data/sqlite_schema9_make.py`), with what its readers answered then
(`tests/data/sqlite_schema9.json`)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import sqlite3
from pathlib import Path
from typing import Any

from durably_py import SqliteStorage, create_engine
from durably_py.storage.sqlite import SCHEMA_VERSION

DATA = Path(__file__).parent / "data"
_spec = importlib.util.spec_from_file_location("sqlite_schema9_make", DATA / "sqlite_schema9_make.py")
assert _spec is not None and _spec.loader is not None
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)  # its workflows (registered by name) and its readers


def _old_database(tmp_path: Path) -> Path:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript((DATA / "sqlite_schema9.sql").read_text())
    db.close()
    return path


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def test_a_schema_9_database_upgrades_in_place_and_every_reader_answers_as_before(tmp_path: Path) -> None:
    before = json.loads((DATA / "sqlite_schema9.json").read_text())
    path = _old_database(tmp_path)
    old = sqlite3.connect(path)
    tables = [row[0] for row in old.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    counts = {table: old.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in tables}
    old.close()
    store = SqliteStorage(path)
    assert _plain(made.readers(store)) == before["storage"]  # info, list_runs, read, size, inbox, entry
    db = store._db()
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 10
    assert [row[1] for row in db.execute("PRAGMA table_info(records)")] == ["seq", "data"]
    assert db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'records_by_run'").fetchone()[0] == 0
    assert counts["runs"] == len(before["storage"]) and counts["records"] > counts["runs"]
    assert {table: db.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in tables} == counts
    store.close()
    assert _plain(asyncio.run(made.engine_readers(path))) == before["engine"]  # Engine.list, Engine.inspect
    assert made.cli_list(path) == before["cli"]  # `durably list --json`, a real process
    again = SqliteStorage(path)  # a second open changes nothing
    assert _plain(made.readers(again)) == before["storage"]
    again.close()


def test_an_upgraded_database_goes_on_running_its_runs(tmp_path: Path) -> None:
    before = json.loads((DATA / "sqlite_schema9.json").read_text())
    path = _old_database(tmp_path)
    by_key = {state["inspect"][2]: run_id for run_id, state in before["engine"].items()}

    async def go() -> None:
        engine = create_engine(f"sqlite:{path}")
        await engine.signal(by_key["waits-8"], "go", "went")
        await engine.drain()
        new = await engine.run(made.three, 100, key="after-upgrade")
        assert new == 106
        states = {state.run_id: state.status for state in await engine.list()}
        for key in ("pending-5", "pending-6", "waits-8", "done-1", "done-2", "big-4"):
            assert states[by_key[key]] == "completed", key
        assert states[by_key["held-11"]] == "running"  # its owner's lease is still live
        assert states[by_key["later-7"]] == "pending" and states[by_key["sleeps-9"]] == "sleeping"
        assert (await engine.inspect(by_key["pending-5"])).result == 11
        assert (await engine.inspect(by_key["waits-8"])).result == "went"
        assert len(states) == len(before["engine"]) + 1

    asyncio.run(go())
    store = SqliteStorage(path)
    for run_id, old in before["storage"].items():  # what each log held before is still its beginning
        log = store.read(run_id)
        assert log is not None
        now = [r if isinstance(r, dict) else json.loads(made.records.encode(r)) for r in log.records]
        assert now[: len(old["records"])] == old["records"], run_id
    store.close()


def test_a_stale_sequence_number_never_puts_an_append_out_of_order(tmp_path: Path) -> None:
    store = SqliteStorage(tmp_path / "runs.db")
    store.create("r", b'{"t":"run","v":1,"run_id":"r","workflow":"w","input":null,"ts":1735689600.0}\n')
    lease = store.claim("r", "me", ttl=60)
    assert lease is not None
    other = dataclasses.replace(lease, state=dict(lease.state))  # the same lease, its own idea of the next number
    line = b'{"t":"ok","p":"%d","l":"add","v":%d,"a":1,"ms":0.01,"ts":1735689601.0}\n'
    store.append(other, line % (0, 0))
    store.append(lease, line % (1, 1))  # its number is taken: it goes after the latest append
    tx = store.transaction()
    try:
        tx.commit(other, line % (2, 2))  # stale too, on a connection of its own
    finally:
        tx.close()
    store.append(lease, line % (3, 3))
    log = store.read("r")
    assert log is not None
    plain = [r if isinstance(r, dict) else json.loads(made.records.encode(r)) for r in log.records]
    assert [r.get("p") for r in plain][2:] == ["0", "1", "2", "3"]
    store.close()
