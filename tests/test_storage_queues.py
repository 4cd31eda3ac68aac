"""Named queues and partitions in the due queue, on every adapter: each entry's queue and partition come from
its run's header; `due` and `claim_due` keep the queues asked for and leave out full queues and partitions;
partitions take turns within a priority; `queue_stats` counts what each queue and partition holds."""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import storage_of

from durably_py.errors import ValidationError
from durably_py.storage import LOG_VERSION, FileStorage, MemoryStorage, SqliteStorage
from durably_py.storage.base import NewRun, QueueEntry, QueueStats

LONG = 3600.0
KINDS = ["file", "memory", "sqlite", "postgres"]
DOCS = "docs/deploying.md#flow-control"


def header(run_id: str, **extra: Any) -> bytes:
    """A run header line as the kernel writes it, with `extra` fields (queue=, partition=)."""
    record = {"t": "run", "v": LOG_VERSION, "run_id": run_id, "workflow": "wf", "key": None, "created_at": "2024"}
    return msgspec.json.encode(record | extra) + b"\n"


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    adapter = storage_of(request.param, tmp_path, request)
    yield adapter
    adapter.close()


def add(store: Any, run_id: str, at: float, *, priority: int = 0, **place: Any) -> None:
    """Create run `run_id` due at `at`, in the queue and partition `place` names (header fields)."""
    store.create(run_id, header(run_id, **place), at=at, priority=priority)


def ids(leases: list[Any]) -> list[str]:
    return [lease.run_id for lease in leases]


# ---- entries know their queue and partition ----------------------------------------------------------------

def test_an_entry_takes_its_queue_and_partition_from_the_header_and_keeps_them(store: Any) -> None:
    now = time.time()
    add(store, "plain", now)
    add(store, "nulls", now, queue=None, partition=None)
    add(store, "mail", now, queue="emails")
    add(store, "tenant", now, queue="emails", partition="t-1")
    store.create_bound([NewRun("bound", header("bound", queue="reports", partition="t-2"), "id-bound")])
    place = {run_id: (e.queue, e.partition) for run_id in ("plain", "nulls", "mail", "tenant", "bound")
             if (e := store.entry(run_id)) is not None}
    assert place == {"plain": ("default", None), "nulls": ("default", None), "mail": ("emails", None),
                     "tenant": ("emails", "t-1"), "bound": ("reports", "t-2")}

    store.schedule("tenant", now + 60, wait=("go",), priority=4)  # moved: its place stays
    assert store.entry("tenant") == QueueEntry("tenant", pytest.approx(now + 60), 4, ("go",),
                                               store.entry("tenant").created, "emails", "t-1")
    assert store.wake("tenant", "go") and store.entry("tenant").partition == "t-1"
    add(store, "child", now, parent="bound", partition="t-9")
    assert store.join_wait("bound", ("child",)) is False  # parked in a join, then due once its child ends
    assert (store.entry("bound").queue, store.entry("bound").partition) == ("reports", "t-2")
    store.unschedule("child")
    assert store.entry("bound").at is not None and store.entry("bound").partition == "t-2"

    store.unschedule("tenant")
    store.schedule("tenant", None)  # queued again (a reopened run): its header says where
    assert (store.entry("tenant").queue, store.entry("tenant").partition) == ("emails", "t-1")
    store.unschedule("bound")
    assert store.join_wait("bound", ()) is True  # a join_wait of a run out of the queue queues it where it was
    assert (store.entry("bound").queue, store.entry("bound").partition) == ("reports", "t-2")


def test_a_file_entry_stores_a_queue_and_partition_only_when_it_has_them(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path / "state")
    now = time.time()
    add(fs, "plain", now)
    add(fs, "tenant", now, queue="emails", partition="t-1")
    plain, tenant = (msgspec.json.decode(os.readlink(path) if path.is_symlink() else path.read_bytes())
                     for path in (fs.dir / "queue" / "plain.json", fs.dir / "queue" / "tenant.json"))
    assert "q" not in plain and "pt" not in plain  # as entries from before named queues, read as "default"
    assert (tenant["q"], tenant["pt"]) == ("emails", "t-1")
    fs.close()


@pytest.mark.parametrize("place", [{"queue": ""}, {"queue": 5}, {"queue": "a\x00b"}, {"partition": ""},
                                   {"partition": ["t"]}], ids=repr)
def test_a_header_naming_a_queue_or_partition_no_adapter_can_store_is_refused(store: Any, place: Any) -> None:
    with pytest.raises(ValidationError):
        store.create("r1", header("r1", **place))
    with pytest.raises(ValidationError):
        store.create_bound([NewRun("r2", header("r2", **place), "id-r2")])
    assert store.read("r1") is None and store.read("r2") is None and store.due(10) == []


# ---- queues= and full= -----------------------------------------------------------------------------------

def test_due_and_claim_due_keep_the_queues_asked_for(store: Any) -> None:
    now = time.time()
    add(store, "d1", now - 30)
    add(store, "e1", now - 20, queue="emails")
    add(store, "e2", now - 10, queue="emails", partition="t-1")
    add(store, "r1", now - 5, queue="reports")
    assert store.due(10) == ["d1", "e1", "e2", "r1"]
    assert store.due(10, queues=frozenset({"emails"})) == ["e1", "e2"]
    assert store.due(10, queues=frozenset({"default", "reports"})) == ["d1", "r1"]
    assert store.due(10, queues=["reports"]) == ["r1"]  # any iterable of names
    assert store.due(10, queues=frozenset()) == []
    assert store.due(10, queues=frozenset({"emails"}), workflows=frozenset({"other"})) == []
    assert store.due(10, queues=frozenset({"emails"}), workflows=frozenset({"wf"}), skip=("e1",)) == ["e2"]
    assert store.due(10, workflows=frozenset()) == []
    assert ids(store.claim_due("w", LONG, 10, queues=frozenset({"emails"}))) == ["e1", "e2"]
    assert store.due(10) == ["d1", "r1"]
    assert ids(store.claim_due("w", LONG, 10, queues=frozenset({"nothing"}))) == []


def test_full_leaves_out_a_whole_queue_or_one_partition_of_it(store: Any) -> None:
    now = time.time()
    add(store, "d1", now - 50)
    add(store, "a1", now - 40, queue="emails", partition="a")
    add(store, "b1", now - 30, queue="emails", partition="b")
    add(store, "e1", now - 20, queue="emails")
    add(store, "r1", now - 10, queue="reports", partition="a")
    assert store.due(10, full=frozenset({"emails"})) == ["d1", "r1"]
    assert store.due(10, full=frozenset({"emails/a"})) == ["d1", "b1", "e1", "r1"]
    assert store.due(10, full=frozenset({"emails/a", "reports/a", "default"})) == ["b1", "e1"]
    assert store.due(10, full=frozenset({"emails/c", "a"})) == ["d1", "a1", "b1", "e1", "r1"]  # none of theirs
    assert store.due(10, queues=frozenset({"emails"}), full=frozenset({"emails/b"})) == ["a1", "e1"]
    assert ids(store.claim_due("w", LONG, 10, full=frozenset({"emails/a", "default"}))) == ["b1", "e1", "r1"]
    assert store.due(10) == ["d1", "a1"]


@pytest.mark.parametrize("bad", [
    {"queues": "emails"}, {"queues": frozenset({""})}, {"queues": frozenset({"a\x00"})},
    {"queues": frozenset({"\ud800"})}, {"queues": [3]}, {"queues": 7}, {"full": None}, {"full": "emails"},
    {"full": frozenset({""})}, {"full": [b"emails"]},
], ids=repr)
def test_bad_queue_filters_are_refused_and_claim_nothing(store: Any, bad: dict[str, Any]) -> None:
    add(store, "r1", time.time(), queue="emails")
    for call in (lambda: store.due(10, **bad), lambda: store.claim_due("w", LONG, 10, **bad)):
        with pytest.raises(ValidationError) as caught:
            call()
        assert caught.value.docs == DOCS and caught.value.hint
    assert not store.held("r1") and store.due(10) == ["r1"]


# ---- fair order across partitions --------------------------------------------------------------------------

def test_a_partition_behind_a_long_backlog_of_another_is_due_among_the_first(store: Any) -> None:
    """100 due runs of partition "a" enqueued before one of "b", same priority: "b"'s run is among the first
    few (second), not after the 100."""
    base = time.time() - 1000
    store.create_bound([NewRun(f"a{i:03d}", header(f"a{i:03d}", partition="a"), f"id-a{i}", at=base + i)
                        for i in range(100)])
    add(store, "b", base + 500, partition="b")
    assert store.due(4) == ["a000", "b", "a001", "a002"]
    assert "b" in ids(store.claim_due("w", LONG, 4))


def test_partitions_take_turns_each_turn_in_due_order(store: Any) -> None:
    base = time.time() - 1000
    for run_id, at in (("a1", 1), ("a2", 2), ("a3", 3), ("b1", 4), ("b2", 5), ("c1", 6)):
        add(store, run_id, base + at, queue="q", partition=run_id[0])
    add(store, "other", base + 7, queue="r", partition="a")  # another queue's "a" is another partition
    assert store.due(10) == ["a1", "b1", "c1", "other", "a2", "b2", "a3"]
    # a rank counts the runs kept only: a held run, or one skipped, gives its partition's turn to the next
    lease = store.claim("a1", "w", LONG)
    assert store.due(10, skip=("b1",)) == ["a2", "b2", "c1", "other", "a3"]
    store.release(lease)


def test_without_partitions_the_order_is_priority_then_due_then_age(store: Any) -> None:
    now = time.time()
    add(store, "low", now - 50, priority=-1)
    add(store, "old", now - 40, queue="emails")
    add(store, "mid", now - 30, queue="reports")
    add(store, "new", now - 20)
    add(store, "high", now - 10, priority=5, queue="emails")
    assert store.due(10) == ["high", "old", "mid", "new", "low"]  # one queue's backlog is not interleaved


def test_runs_without_a_partition_take_their_turn_first(store: Any) -> None:
    base = time.time() - 1000
    for i in range(3):
        add(store, f"a{i}", base + i, partition="a")
    add(store, "plain1", base + 10)
    add(store, "plain2", base + 11)
    assert store.due(10) == ["a0", "plain1", "plain2", "a1", "a2"]


def test_priority_wins_over_a_partitions_turn(store: Any) -> None:
    base = time.time() - 1000
    for i in range(3):
        add(store, f"a{i}", base + i, priority=5, partition="a")
    add(store, "b0", base - 10, partition="b")
    add(store, "b1", base + 20, priority=5, partition="b")
    add(store, "c0", base + 30, priority=9)
    assert store.due(10) == ["c0", "a0", "b1", "a1", "a2", "b0"]


def fair(entries: list[QueueEntry], limit: int, skip: tuple[str, ...], queues: frozenset[str] | None,
         full: frozenset[str], held: set[str]) -> list[str]:
    """The order `due` promises, computed from its definition: the runs kept, each ranked among the kept runs of
    its (queue, partition, priority) by due time, creation and id (a run without a partition ranks first), then
    by priority (highest first), rank, due time, creation and id."""
    kept = [e for e in entries if e.run_id not in skip and e.run_id not in held and e.at is not None
            and (queues is None or e.queue in queues) and e.queue not in full
            and (e.partition is None or f"{e.queue}/{e.partition}" not in full)]
    rank: dict[str, int] = {}
    seen: dict[tuple[str, str, int], int] = {}
    for e in sorted(kept, key=lambda e: (e.at, e.created, e.run_id)):
        group = (e.queue, e.partition, e.priority) if e.partition is not None else None
        rank[e.run_id] = 1 if group is None else seen.setdefault(group, 0) + 1
        if group is not None:
            seen[group] += 1
    kept.sort(key=lambda e: (-e.priority, rank[e.run_id], e.at, e.created, e.run_id))
    return [e.run_id for e in kept[:limit]]


@pytest.mark.parametrize("seed", range(4))
def test_due_follows_the_fair_order_of_random_queues(store: Any, seed: int) -> None:
    """Random runs (queues, partitions, priorities, due times, some held) and random filters: every adapter's
    `due` is what the definition gives (`fair`)."""
    rnd = random.Random(seed)
    base = time.time() - 1000
    names = [f"r{i:02d}" for i in range(30)]
    for run_id in names:
        place = {"queue": rnd.choice([None, "a", "b"]), "partition": rnd.choice([None, None, "x", "y", "z"])}
        add(store, run_id, base + rnd.randint(0, 15), priority=rnd.choice([0, 0, 1, 5]), **place)
    held = set(rnd.sample(names, 3))
    leases = [store.claim(run_id, "w", LONG) for run_id in held]
    entries = [store.entry(run_id) for run_id in names]
    for _ in range(8):
        limit = rnd.randint(1, 32)
        skip = tuple(rnd.sample(names, rnd.randint(0, 3)))
        queues = rnd.choice([None, frozenset({"default"}), frozenset({"a", "b"})])
        full = rnd.choice([frozenset(), frozenset({"a"}), frozenset({"default/x", "b/y"}), frozenset({"a/z"})])
        assert store.due(limit, skip=skip, queues=queues, full=full) == fair(entries, limit, skip, queues, full,
                                                                             held)
    for lease in leases:
        store.release(lease)


def test_claim_due_from_two_adapters_at_once_shares_no_partitioned_run(store: Any, tmp_path: Path,
                                                                       request: pytest.FixtureRequest) -> None:
    other = store if isinstance(store, MemoryStorage) else storage_of(
        "file" if isinstance(store, FileStorage) else "sqlite" if isinstance(store, SqliteStorage) else "postgres",
        tmp_path, request)
    base = time.time() - 100
    store.create_bound([NewRun(f"r{i}", header(f"r{i}", partition=f"t{i % 4}"), f"id-{i}", at=base + i)
                        for i in range(40)])
    got: list[list[str]] = [[], []]

    def take(adapter: Any, slot: int) -> None:
        while leases := adapter.claim_due(f"w{slot}", LONG, 3, full=frozenset({"default/t3"})):
            got[slot].extend(lease.run_id for lease in leases)

    threads = [threading.Thread(target=take, args=(adapter, i)) for i, adapter in enumerate((store, other))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(got[0] + got[1]) == sorted(f"r{i}" for i in range(40) if i % 4 != 3)
    assert not set(got[0]) & set(got[1])


# ---- queue_stats ---------------------------------------------------------------------------------------------

def test_queue_stats_counts_due_later_running_and_parked_per_queue_and_partition(store: Any) -> None:
    assert store.queue_stats() == []
    now = time.time()
    add(store, "d1", now - 100)
    add(store, "d2", now - 40)
    add(store, "later", now + 600)
    add(store, "parked", now - 10)
    store.schedule("parked", None, wait=("approval",))
    add(store, "run", now - 500)
    lease = store.claim("run", "w", LONG)
    add(store, "ea1", now - 30, queue="emails", partition="a")
    add(store, "ea2", now + 60, queue="emails", partition="a")
    add(store, "eb1", now - 20, queue="emails", partition="b")
    add(store, "e", now - 5, queue="emails")
    add(store, "ended", now - 1, queue="reports")
    store.unschedule("ended")  # out of the queue: counted nowhere
    stats = store.queue_stats()
    assert [(s.queue, s.partition) for s in stats] == [("default", None), ("emails", None), ("emails", "a"),
                                                       ("emails", "b")]
    assert stats[0] == QueueStats("default", None, due=2, later=1, running=1, parked=1,
                                  oldest=pytest.approx(now - 100, abs=0.01))
    assert stats[1] == QueueStats("emails", None, 1, 0, 0, 0, pytest.approx(now - 5, abs=0.01))
    assert stats[2] == QueueStats("emails", "a", 1, 1, 0, 0, pytest.approx(now - 30, abs=0.01))
    assert stats[3] == QueueStats("emails", "b", 1, 0, 0, 0, pytest.approx(now - 20, abs=0.01))
    later = store.queue_stats(now + 3600)  # at a later time: what was later is due, the oldest wait unchanged
    assert later[0] == QueueStats("default", None, 3, 0, 1, 1, pytest.approx(now - 100, abs=0.01))
    store.release(lease)
    assert store.queue_stats()[0].running == 0 and store.queue_stats()[0].due == 3
    assert store.queue_stats()[0].oldest == pytest.approx(now - 500, abs=0.01)
    with pytest.raises(ValidationError):
        store.queue_stats("now")


def test_queue_stats_of_a_queue_with_nothing_due(store: Any) -> None:
    add(store, "p", time.time(), queue="q", partition="x")
    store.schedule("p", None)
    assert store.queue_stats() == [QueueStats("q", "x", 0, 0, 0, 1, None)]


# ---- upgrades of stores from before named queues ---------------------------------------------------------------

def test_a_sqlite_database_from_before_named_queues_gets_their_columns(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    first = SqliteStorage(path)
    now = time.time()
    add(first, "old1", now - 20)
    add(first, "old2", now - 10)
    first.close()
    with sqlite3.connect(path) as db:  # the queue table as schema 7 made it, its rows kept
        db.execute("DROP INDEX queue_parts")
        db.execute("ALTER TABLE queue RENAME TO queue_new")
        db.execute("CREATE TABLE queue (run_id TEXT PRIMARY KEY, due REAL, priority INTEGER NOT NULL DEFAULT 0,"
                   " created REAL NOT NULL, wait TEXT NOT NULL DEFAULT '[]')")
        db.execute("INSERT INTO queue SELECT run_id, due, priority, created, wait FROM queue_new")
        db.execute("DROP TABLE queue_new")
        db.execute("CREATE INDEX queue_by_due ON queue (priority DESC, due, created) WHERE due IS NOT NULL")
        db.execute("CREATE INDEX queue_next ON queue (due) WHERE due IS NOT NULL")
        db.execute("PRAGMA user_version=7")
    upgraded = SqliteStorage(path)
    assert (upgraded.entry("old1").queue, upgraded.entry("old1").partition) == ("default", None)
    add(upgraded, "new", now - 5, queue="emails", partition="t")
    assert upgraded.due(10) == ["old1", "old2", "new"]
    assert upgraded.due(10, full=frozenset({"emails/t"})) == ["old1", "old2"]
    assert [(s.queue, s.partition, s.due) for s in upgraded.queue_stats()] == [("default", None, 2),
                                                                                ("emails", "t", 1)]
    upgraded.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] >= 8
        assert {"queue_name", "partition_name"} <= {row[1] for row in db.execute("PRAGMA table_info(queue)")}
    again = SqliteStorage(path)  # reopened: nothing left to upgrade
    assert again.due(10) == ["old1", "old2", "new"]
    again.close()


def test_a_postgres_schema_from_before_named_queues_gets_their_columns(postgres_storage: Any) -> None:
    import psycopg

    first = postgres_storage()
    now = time.time()
    add(first, "old1", now - 20)
    queue = f'"{first.schema}".queue'
    with psycopg.connect(first.dsn, autocommit=True) as conn:
        conn.execute(f'DROP INDEX "{first.schema}".queue_parts')
        conn.execute(f"ALTER TABLE {queue} DROP COLUMN queue_name, DROP COLUMN partition_name")
    first.close()
    upgraded = postgres_storage()
    assert (upgraded.entry("old1").queue, upgraded.entry("old1").partition) == ("default", None)
    add(upgraded, "new", now - 5, queue="emails", partition="t")
    assert upgraded.due(10) == ["old1", "new"] and upgraded.due(10, queues=frozenset({"emails"})) == ["new"]
    assert ids(upgraded.claim_due("w", LONG, 10, full=frozenset({"default"}))) == ["new"]
