"""The run catalog of every storage adapter: filtered, ordered, paged listing and counting from an index,
run deletion; and what only the file adapter's index promises (repair from the logs)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import storage_of
from test_storage import LONG, header, line

from durably_py import Engine, workflow
from durably_py._engine.runs import STATUSES
from durably_py.errors import RunNotFoundError, RunParkedError, ValidationError
from durably_py.storage import FileStorage, SqliteStorage


@pytest.fixture(params=["file", "memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    return storage_of(request.param, tmp_path, request)


def end(store: Any, run_id: str, status: str, *, after: bytes = b"") -> None:
    """Claim the run, append an end record with `status` (and `after`), release."""
    lease = store.claim(run_id, "me", LONG)
    store.append(lease, line(t="ok", p="0", v=1) + line(t="end", status=status) + after)
    store.release(lease)


def ids(infos: list[Any]) -> list[str]:
    return [i.run_id for i in infos]


def populate(store: Any) -> None:
    """Six runs, oldest first: a (wf x, key k-1), b (x, K-2), c (y, k-3, child of a), d (y), e (x), f (z)."""
    for run_id, extra in [("a", {"workflow": "x", "key": "k-1"}), ("b", {"workflow": "x", "key": "K-2"}),
                          ("c", {"workflow": "y", "key": "k-3", "parent": "a"}), ("d", {"workflow": "y"}),
                          ("e", {"workflow": "x"}), ("f", {"workflow": "z"})]:
        store.create(run_id, header(run_id, **extra))
        time.sleep(0.01)
    end(store, "a", "completed")
    time.sleep(0.01)
    end(store, "b", "failed")
    time.sleep(0.01)
    end(store, "d", "cancelled")
    time.sleep(0.01)
    end(store, "e", "failed", after=line(t="reopen"))  # retried: open again


def test_listing_filters_orders_and_pages_from_the_index(store: Any) -> None:
    populate(store)
    assert ids(store.list_runs()) == ["e", "d", "b", "a", "f", "c"]
    assert ids(store.list_runs(state="open")) == ["e", "f", "c"]
    assert ids(store.list_runs(state=["completed", "cancelled"])) == ["d", "a"]
    assert ids(store.list_runs(state="failed")) == ["b"]
    assert ids(store.list_runs(workflow="x")) == ["e", "b", "a"]
    assert ids(store.list_runs(workflow="x", state="failed")) == ["b"]
    assert ids(store.list_runs(key="k-1")) == ["a"]
    assert ids(store.list_runs(key_prefix="k-")) == ["a", "c"]  # case matters; runs without a key never match
    assert ids(store.list_runs(search="K-")) == ["b", "a", "c"]  # search ignores case
    assert ids(store.list_runs(search="%")) == []  # LIKE's wildcards are plain text
    assert ids(store.list_runs(parent="a")) == ["c"]
    assert ids(store.list_runs(limit=2)) == ["e", "d"]
    assert ids(store.list_runs(limit=2, offset=2)) == ["b", "a"]
    assert ids(store.list_runs(offset=5)) == ["c"]
    assert store.list_runs(limit=0) == []
    assert store.count_runs() == 6
    assert store.count_runs(state="open") == 3
    assert store.count_runs(workflow="y", state="open") == 1
    infos = {i.run_id: i for i in store.list_runs()}
    cut = (infos["b"].updated_at + infos["a"].updated_at) / 2
    assert ids(store.list_runs(since=cut)) == ["e", "d", "b"]
    assert ids(store.list_runs(until=cut)) == ["a", "f", "c"]
    assert store.count_runs(since=cut, workflow="x") == 2


def test_a_claim_after_the_end_keeps_the_run_ended(store: Any) -> None:
    store.create("r1", header("r1"))
    end(store, "r1", "completed")
    assert store.claim("r1", "again", LONG) is None  # an ended run is claimed only by what reopens it
    assert ids(store.list_runs(state="completed")) == ["r1"]
    lease = store.claim("r1", "retry", LONG, reopen=True)
    store.release(lease)
    assert ids(store.list_runs(state="completed")) == ["r1"]  # a claim record after the end keeps it ended
    lease = store.claim("r1", "retry", LONG)
    store.append(lease, line(t="reset", paths=["0"]))
    store.schedule("r1", None)  # the engine queues a run it opens again; the file index learns it then
    store.release(lease)
    assert ids(store.list_runs(state="open")) == ["r1"]


def test_listing_arguments_are_checked(store: Any) -> None:
    for bad in [{"state": "running"}, {"state": ["open", 3]}, {"limit": -1}, {"offset": -1}, {"limit": True},
                {"workflow": 3}, {"since": "yesterday"}]:
        with pytest.raises(ValidationError):
            store.list_runs(**bad)


def test_delete_removes_a_run_and_all_that_points_at_it(store: Any) -> None:
    store.create("r1", header("r1", identity="key:k1", key="k1"))
    assert store.bind("key:k1", "r1")
    store.create("r2", header("r2", identity="key:k2"))
    assert store.bind("key:k2", "r2")
    store.send("r1", line(id="s1", name="go"))
    lease = store.claim("r1", "me", LONG)
    assert store.delete("r1") is None  # held: nothing removed
    assert store.read("r1") is not None
    store.append(lease, line(t="end", status="completed"))
    store.release(lease)
    size = store.size("r1")
    assert store.delete("r1") >= size
    assert store.read("r1") is None and store.info("r1") is None
    assert store.lookup("key:k1") is None and store.lookup("key:k2") == "r2"
    assert store.entry("r1") is None and "r1" not in store.due(10)
    assert ids(store.list_runs()) == ["r2"] and store.count_runs() == 1
    with pytest.raises(RunNotFoundError):
        store.inbox("r1")
    assert store.delete("r1") == 0
    store.create("r1", header("r1"))  # the id is free again
    assert ids(store.list_runs()) == ["r1", "r2"]


def test_delete_leaves_a_binding_that_moved_on(store: Any) -> None:
    store.create("old", header("old", identity="key:k"))
    assert store.bind("key:k", "old")
    store.create("new", header("new", identity="key:k"))
    assert store.bind("key:k", "new", expect="old")
    store.delete("old")
    assert store.lookup("key:k") == "new"


# -- the file adapter's index --------------------------------------------------------------------------------


@pytest.fixture
def fs(tmp_path: Path) -> FileStorage:
    return FileStorage(tmp_path / "state")


def test_file_catalog_is_rebuilt_when_missing_or_damaged(fs: FileStorage) -> None:
    populate(fs)
    before = [(i.run_id, i.state) for i in fs.list_runs()]
    fs.close()
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (fs.dir / name).unlink(missing_ok=True)
    again = FileStorage(fs.dir)
    assert ids(again.list_runs()) == [run_id for run_id, _ in before]
    assert ids(again.list_runs(state="open")) == ["e", "f", "c"]
    again.close()
    (fs.dir / "catalog.db").write_bytes(b"this is not a database" * 100)
    third = FileStorage(fs.dir)
    assert sorted(ids(third.list_runs(state="open"))) == ["c", "e", "f"]
    assert third.count_runs() == 6


def test_file_catalog_follows_logs_changed_behind_its_back(fs: FileStorage, tmp_path: Path) -> None:
    populate(fs)
    assert fs.count_runs() == 6
    runs = fs.dir / "runs"
    shutil.copy(runs / "a.jsonl", runs / "copied.jsonl")  # a log copied in from elsewhere
    text = (runs / "copied.jsonl").read_text().replace('"run_id":"a"', '"run_id":"copied"')
    (runs / "copied.jsonl").write_text(text)
    (runs / "f.jsonl").unlink()  # a log deleted by hand
    with open(runs / "c.jsonl", "ab") as f:  # a process killed after writing the end, before saying so
        f.write(line(t="end", status="completed"))
    assert sorted(ids(fs.list_runs(state="completed"))) == ["a", "c", "copied"]
    assert fs.count_runs() == 6 and "f" not in ids(fs.list_runs())
    old = time.time() - 10  # the directory changed long ago: a reconcile must still have seen it
    os.utime(runs, (old, old))
    assert fs.count_runs() == 6


def test_file_catalog_queues_an_open_run_without_reading_its_log_and_still_lists_its_end(fs: FileStorage) -> None:
    fs.create("r1", header("r1"))
    lease = fs.claim("r1", "me", LONG)
    fs.append(lease, b"".join(line(t="ok", p=str(i), v=i) for i in range(100)))
    fs.append(lease, line(t="end", status="completed"))  # a process killed before it could say the run ended
    catalog = fs.catalog()
    size = catalog._db().execute("SELECT size FROM runs WHERE run_id = 'r1'").fetchone()[0]
    fs.schedule("r1", None)  # the row says open: only its time is refreshed, the log's tail is not read
    assert catalog._db().execute("SELECT size FROM runs WHERE run_id = 'r1'").fetchone()[0] == size
    assert ids(FileStorage(fs.dir).list_runs(state="completed")) == ["r1"]  # a listing's repair reads it
    assert ids(fs.list_runs(state="completed")) == ["r1"]


def test_file_catalog_is_never_written_per_step(fs: FileStorage) -> None:
    fs.create("r1", header("r1"))
    fs.list_runs()
    db = fs.dir / "catalog.db-wal"
    lease = fs.claim("r1", "me", LONG)
    before = db.stat().st_size, db.stat().st_mtime_ns
    for i in range(50):
        fs.append(lease, line(t="ok", p=str(i), v=i))
    assert (db.stat().st_size, db.stat().st_mtime_ns) == before
    fs.release(lease)
    assert fs.list_runs()[0].last == {"t": "ok", "p": "49", "v": 49}


# -- the engine's listing over the catalog -------------------------------------------------------------------

attempts: dict[str, int] = {}


def flaky(name: str) -> str:
    if name == "bad":
        raise ValueError("broken on purpose")
    return name.upper()


@workflow
async def catalog_job(ctx: Any, name: str) -> str:
    out = await ctx.step(flaky, name)
    if name == "gate":
        return str(await ctx.wait_for("go", timeout=3600))
    return out


def engine_of(kind: str, tmp_path: Path) -> Engine:
    return Engine(FileStorage(tmp_path / "state") if kind == "file"
                  else SqliteStorage(tmp_path / "state" / "durably.db"))


def a_mix_of_runs(engine: Engine) -> dict[str, str]:
    """Runs in many statuses; returns run id -> the status `inspect` gives."""
    asyncio.run(engine.run(catalog_job, "ok", key="done"))
    with pytest.raises(ValueError):
        asyncio.run(engine.run(catalog_job, "bad", key="failed"))
    with pytest.raises(ValueError):
        asyncio.run(engine.run(catalog_job, "bad", key="paused-failed"))
    asyncio.run(engine.pause("paused-failed"))
    for key in ("waiting", "cancelled"):
        with pytest.raises(RunParkedError):
            asyncio.run(engine.run(catalog_job, "gate", key=key, wait=False))
    asyncio.run(engine.cancel("cancelled"))
    asyncio.run(engine.enqueue(catalog_job, "ok", key="pending"))
    return {s.run_id: asyncio.run(engine.inspect(s.run_id)).status for s in asyncio.run(engine.list())}


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_list_and_count_agree_with_inspect_for_every_status(kind: str, tmp_path: Path) -> None:
    engine = engine_of(kind, tmp_path)
    truth = a_mix_of_runs(engine)
    assert sorted(truth.values()) == ["cancelled", "completed", "failed", "paused", "pending", "waiting"]
    for status in STATUSES:
        expected = {run_id for run_id, s in truth.items() if s == status}
        assert {s.run_id for s in asyncio.run(engine.list(status=status))} == expected, status
        assert asyncio.run(engine.count(status=status)) == len(expected), status
    listed = asyncio.run(engine.list(status=["waiting", "completed"], limit=1, offset=1))
    assert len(listed) == 1 and listed[0].status in ("waiting", "completed")
    assert asyncio.run(engine.count()) == len(truth)
    assert asyncio.run(engine.count(workflow="catalog_job", key_prefix="pa")) == 1


def test_a_damaged_log_is_listed_and_flagged_without_hiding_others(tmp_path: Path) -> None:
    engine = engine_of("file", tmp_path)
    truth = a_mix_of_runs(engine)
    victim = engine.resolve("done")
    path = tmp_path / "state" / "runs" / f"{victim}.jsonl"
    path.write_bytes(b'{"t":"run","v":1}\n' + path.read_bytes().split(b"\n", 1)[1])  # a header without its fields
    states = {s.run_id: s.status for s in asyncio.run(engine.list())}
    assert states[victim] == "corrupt" and len(states) == len(truth)
    assert [s.run_id for s in asyncio.run(engine.list(status="corrupt"))] == [victim]
    assert victim not in {s.run_id for s in asyncio.run(engine.list(status="completed"))}


def test_file_listing_without_a_usable_index_reads_the_logs(fs: FileStorage) -> None:
    populate(fs)
    fs.close()
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (fs.dir / name).unlink(missing_ok=True)
    (fs.dir / "catalog.db").mkdir()  # cannot be opened, as in a state dir this process may not write
    blocked = FileStorage(fs.dir)
    assert ids(blocked.list_runs()) == ["e", "d", "b", "a", "f", "c"]
    assert ids(blocked.list_runs(state="open", limit=2)) == ["e", "f"]
    assert blocked.count_runs(workflow="x") == 3
    blocked.create("g", header("g"))  # runs are still created; only the index is skipped
    assert blocked.count_runs() == 7


def test_an_sqlite_database_from_before_the_catalog_gets_it_on_first_use(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(  # the tables as they were before the catalog's columns
        "CREATE TABLE runs (run_id TEXT PRIMARY KEY, header BLOB NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,"
        " epoch INTEGER NOT NULL DEFAULT 0, owner TEXT, lease_expires REAL, last BLOB NOT NULL, size INTEGER NOT NULL,"
        " syncs INTEGER NOT NULL DEFAULT 0);"
        "CREATE TABLE records (seq INTEGER PRIMARY KEY, run_id TEXT NOT NULL, data BLOB NOT NULL);"
        "CREATE INDEX records_by_run ON records (run_id, seq);")
    db.execute("PRAGMA user_version=3")
    logs = {"done": header("done", workflow="x", key="k-done") + line(t="end", status="completed")
            + line(t="claim", epoch=2, owner="o", at="2024"),
            "open": header("open", workflow="y", parent="done") + line(t="ok", p="0", v=1)}
    for at, (run_id, data) in enumerate(logs.items()):
        db.execute("INSERT INTO runs (run_id, header, created, updated, last, size) VALUES (?, ?, ?, ?, ?, ?)",
                   (run_id, data.split(b"\n")[0] + b"\n", at, at, data.rstrip(b"\n").rsplit(b"\n", 1)[1] + b"\n",
                    len(data)))
        db.execute("INSERT INTO records (run_id, data) VALUES (?, ?)", (run_id, data))
    db.close()
    store = SqliteStorage(path)
    assert ids(store.list_runs(state="completed")) == ["done"]  # its claim after the end keeps it ended
    assert ids(store.list_runs(state="open", workflow="y", parent="done")) == ["open"]
    assert ids(store.list_runs(key_prefix="k-")) == ["done"] and store.count_runs() == 2
