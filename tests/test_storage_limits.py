"""The `Limits` role on every adapter: one JSON document per limit key, changed atomically against every thread
and process sharing the store, with `live(run_id, epoch)` telling inside the same step whether a lease still
holds (the ground rate limits, concurrency permits and breakers stand on)."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import storage_of

from durably_py.errors import CorruptLogError, ValidationError
from durably_py.storage import LOG_VERSION, FileStorage, Limits, MemoryStorage, SqliteStorage, Storage

LONG = 3600.0
DOCS = "docs/policies.md#resources"
KINDS = ["file", "memory", "sqlite", "postgres"]


def header(run_id: str) -> bytes:
    """A run header line as the kernel writes it."""
    record = {"t": "run", "v": LOG_VERSION, "run_id": run_id, "workflow": "wf", "key": None, "created_at": "2024"}
    return msgspec.json.encode(record) + b"\n"


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    adapter = storage_of(request.param, tmp_path, request)
    yield adapter
    adapter.close()


def another(store: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """A second adapter on the same store (another connection, or another process's view); memory: itself."""
    if isinstance(store, MemoryStorage):
        return store
    kind = "file" if isinstance(store, FileStorage) else "sqlite" if isinstance(store, SqliteStorage) else "postgres"
    return storage_of(kind, tmp_path, request)


def read(store: Any, key: str) -> Any:
    """The document stored under `key`, read through `limit` itself (None: none)."""
    return store.limit(key, lambda doc, now, live: (doc, doc))


def bump(doc: Any, now: float, live: Callable[[str, int], bool]) -> tuple[Any, Any]:
    """One increment of a counter document; returns the count it reached."""
    count = (doc or {}).get("n", 0) + 1
    return {"n": count}, count


def probe_live(store: Any, run_id: str, epoch: int) -> bool:
    """`live(run_id, epoch)` as an update sees it (nothing stored)."""
    return bool(store.limit("probe", lambda doc, now, live: (doc, live(run_id, epoch))))


# -- documents ------------------------------------------------------------------------------------------------


def test_every_adapter_is_a_limits_store(store: Any) -> None:
    assert isinstance(store, Limits) and isinstance(store, Storage)


def test_a_document_round_trips(store: Any) -> None:
    doc = {"starts": [1.5, 2.0, 3], "name": "é ☃", "ok": True, "none": None, "big": 2**40, "nested": {"a": [[], {}]}}
    assert store.limit("rate:openai", lambda old, now, live: (doc, old)) is None
    assert read(store, "rate:openai") == doc
    assert store.limits() == {"rate:openai": doc}
    store.limit("pairs", lambda old, now, live: ([("r1", 1), ("r2", 2)], None))  # a tuple is stored as a list
    assert read(store, "pairs") == [["r1", 1], ["r2", 2]]
    values: list[Any] = ["text", 7, 2.5, False, []]
    for value in values:
        store.limit("scalar", lambda old, now, live, value=value: (value, None))
        assert read(store, "scalar") == value


def test_now_is_the_stores_clock_in_epoch_seconds(store: Any) -> None:
    seen = store.limit("clock", lambda doc, now, live: (None, now))
    assert isinstance(seen, float) and abs(seen - time.time()) < 5


def test_returning_none_removes_the_document(store: Any) -> None:
    store.limit("conc:a", lambda doc, now, live: ({"permits": {}}, None))
    assert "conc:a" in store.limits()
    assert store.limit("conc:a", lambda doc, now, live: (None, "gone")) == "gone"
    assert store.limits() == {} and read(store, "conc:a") is None
    assert store.limit("conc:a", lambda doc, now, live: (None, doc)) is None  # removing nothing is fine


def test_limits_lists_documents_by_key_prefix(store: Any) -> None:
    for key in ("rate:a", "rate:b", "conc:a", "ratex", "rate:ü/../x", "r"):
        store.limit(key, lambda doc, now, live, key=key: ({"key": key}, None))
    assert list(store.limits("rate:")) == ["rate:a", "rate:b", "rate:ü/../x"]
    assert store.limits("rate:b") == {"rate:b": {"key": "rate:b"}}
    assert store.limits("rate:ü") == {"rate:ü/../x": {"key": "rate:ü/../x"}}
    assert set(store.limits()) == {"rate:a", "rate:b", "conc:a", "ratex", "rate:ü/../x", "r"}
    assert store.limits("%") == {} and store.limits("rate_") == {} and store.limits("zzz") == {}


def test_another_adapter_on_the_same_store_sees_the_documents(store: Any, tmp_path: Path,
                                                              request: pytest.FixtureRequest) -> None:
    other = another(store, tmp_path, request)
    store.limit("shared", bump)
    assert other.limit("shared", bump) == 2
    assert store.limits() == other.limits() == {"shared": {"n": 2}}


# -- atomicity ------------------------------------------------------------------------------------------------


def test_threads_incrementing_one_counter_lose_no_increment(store: Any, tmp_path: Path,
                                                            request: pytest.FixtureRequest) -> None:
    adapters = [store, another(store, tmp_path, request)]  # two connections (or views) at once
    errors: list[BaseException] = []

    def work(adapter: Any) -> None:
        try:
            for _ in range(200):
                adapter.limit("counter", bump)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(adapters[i % 2],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert read(store, "counter") == {"n": 1600}


CHILD = """
import os, signal, sys, time
from durably_py.storage import FileStorage, SqliteStorage
kind, path, what = sys.argv[1], sys.argv[2], sys.argv[3]
store = FileStorage(path) if kind == "file" else SqliteStorage(path)
if what == "count":
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(200):
        store.limit("counter", lambda doc, now, live: ((doc or 0) + 1, None))
elif what == "kill-after-limit":
    store.limit("kept", lambda doc, now, live: ({"by": os.getpid()}, None))
    os.kill(os.getpid(), signal.SIGKILL)
elif what == "hold":
    lease = store.claim("r1", "child", 3600)
    store.limit("conc:k", lambda doc, now, live: ({"permits": [["r1", lease.epoch]]}, None))
    print(lease.epoch, flush=True)
    time.sleep(60)
"""


def child(kind: str, path: Path, what: str) -> subprocess.Popen[str]:
    """A fresh interpreter opening its own adapter on `path` and doing `what` (see `CHILD`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", CHILD, kind, str(path), what], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def path_of(kind: str, tmp_path: Path) -> Path:
    return tmp_path / "state" if kind == "file" else tmp_path / "state" / "durably.db"


def adapter_on(kind: str, path: Path) -> Any:
    return FileStorage(path) if kind == "file" else SqliteStorage(path)


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_processes_incrementing_one_counter_lose_no_increment(kind: str, tmp_path: Path) -> None:
    path = path_of(kind, tmp_path)
    store = adapter_on(kind, path)
    store.limits()  # the database exists before four processes open it at once
    procs = [child(kind, path, "count") for _ in range(4)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:  # all four loops start together
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert store.limits() == {"counter": 800}
    store.close()


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_a_change_survives_the_kill_of_its_process_once_limit_returned(kind: str, tmp_path: Path) -> None:
    path = path_of(kind, tmp_path)
    proc = child(kind, path, "kill-after-limit")
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert set(adapter_on(kind, path).limits()["kept"]) == {"by"}


def test_an_update_that_raises_changes_nothing(store: Any) -> None:
    store.limit("k", lambda doc, now, live: ({"n": 1}, None))

    def boom(doc: Any, now: float, live: Callable[[str, int], bool]) -> tuple[Any, Any]:
        doc["n"] = 99  # even a document changed in place before the raise is not stored
        raise KeyError("from the update")

    with pytest.raises(KeyError, match="from the update"):
        store.limit("k", boom)
    with pytest.raises(TypeError):
        store.limit("new", boom)  # no document: the update fails on None
    assert store.limits() == {"k": {"n": 1}}
    assert store.limit("k", bump) == 2  # the store is usable afterwards (the transaction was rolled back)


def test_an_update_may_decline_to_change_anything(store: Any) -> None:
    store.limit("k", lambda doc, now, live: ({"n": 1}, None))
    assert store.limit("k", lambda doc, now, live: ({"n": 1}, "same")) == "same"
    assert store.limits() == {"k": {"n": 1}}


# -- live -----------------------------------------------------------------------------------------------------


def test_live_follows_the_lease_it_names(store: Any) -> None:
    store.create("r1", header("r1"))
    assert probe_live(store, "r1", 0) is False  # never claimed
    first = store.claim("r1", "w1", LONG)
    assert first is not None
    assert probe_live(store, "r1", first.epoch) is True
    assert probe_live(store, "r1", first.epoch + 1) is False
    assert probe_live(store, "unknown", first.epoch) is False
    store.release(first)
    assert probe_live(store, "r1", first.epoch) is False
    second = store.claim("r1", "w2", LONG)
    assert second is not None and second.epoch > first.epoch
    assert probe_live(store, "r1", first.epoch) is False  # an older epoch after a re-claim
    assert probe_live(store, "r1", second.epoch) is True
    store.release(second)


def test_a_permit_is_taken_and_given_back_with_its_lease(store: Any) -> None:
    """What a concurrency key does with `live`: permits whose lease lapsed are dropped in the same step."""
    def acquire(run_id: str, epoch: int) -> Callable[..., tuple[Any, Any]]:
        def update(doc: Any, now: float, live: Callable[[str, int], bool]) -> tuple[Any, Any]:
            permits = [p for p in (doc or {}).get("permits", []) if live(p[0], p[1])]
            if len(permits) >= 1:
                return {"permits": permits}, False
            return {"permits": [*permits, [run_id, epoch]]}, True
        return update

    for run_id in ("a", "b"):
        store.create(run_id, header(run_id))
    a = store.claim("a", "w", LONG)
    b = store.claim("b", "w", LONG)
    assert store.limit("conc:k", acquire("a", a.epoch)) is True
    assert store.limit("conc:k", acquire("b", b.epoch)) is False
    store.release(a)
    assert store.limit("conc:k", acquire("b", b.epoch)) is True
    assert store.limits("conc:") == {"conc:k": {"permits": [["b", b.epoch]]}}


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
def test_live_is_false_once_the_leases_ttl_lapsed(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store = storage_of(kind, tmp_path, request)
    store.create("r1", header("r1"))
    lease = store.claim("r1", "w1", 0.5)
    assert probe_live(store, "r1", lease.epoch) is True
    time.sleep(0.8)
    assert probe_live(store, "r1", lease.epoch) is False
    store.close()


def test_on_files_live_is_false_once_the_holding_process_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "state"
    store = FileStorage(path)
    store.create("r1", header("r1"))
    proc = child("file", path, "hold")
    try:
        assert proc.stdout is not None
        epoch = int(proc.stdout.readline())
        assert probe_live(store, "r1", epoch) is True
        assert probe_live(store, "r1", epoch - 1) is False
        assert store.limits() == {"conc:k": {"permits": [["r1", epoch]]}}
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert probe_live(store, "r1", epoch) is False  # the OS dropped its lock: its permit is free at once
    dropped = store.limit("conc:k", lambda doc, now, live: (
        {"permits": [p for p in doc["permits"] if live(*p)]}, len(doc["permits"])))
    assert dropped == 1 and store.limits() == {"conc:k": {"permits": []}}


def test_live_checks_its_arguments_and_answers_only_inside_the_update(store: Any) -> None:
    kept: list[Callable[[str, int], bool]] = []
    for run_id, epoch in (("../x", 1), ("r1", "1"), ("r1", True), (None, 1)):
        with pytest.raises(ValidationError):
            store.limit("k", lambda doc, now, live, r=run_id, e=epoch: (doc, live(r, e)))
    assert probe_live(store, "r1", 2**70) is False  # an epoch no store could hold

    def keep(doc: Any, now: float, live: Callable[[str, int], bool]) -> tuple[Any, Any]:
        kept.append(live)
        return doc, None

    store.limit("k", keep)
    with pytest.raises(ValidationError, match="after its update returned") as caught:
        kept[0]("r1", 1)
    assert caught.value.hint and caught.value.docs == DOCS
    assert store.limits() == {}


# -- refused input --------------------------------------------------------------------------------------------

BAD_KEYS: list[Any] = ["", "x" * 201, "a\x00b", "lone \ud800", 7, None, b"key", ["k"]]
BAD_DOCS: list[Any] = [
    {1: "int key"}, {"s": {1, 2}}, b"bytes", float("nan"), [float("inf")], datetime.datetime(2024, 1, 1),
    object(), {"a": "lone \udc00"}, {"lone \udc00": 1}, Path("x"),
]


def refused(store: Any, call: Callable[[], Any]) -> ValidationError:
    """`call()` raises a `ValidationError` with a hint and the limits docs, and the stored documents are as they were."""
    before = store.limits()
    with pytest.raises(ValidationError) as caught:
        call()
    assert caught.value.hint and caught.value.docs == DOCS
    assert store.limits() == before
    return caught.value


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_a_bad_key_is_refused(store: Any, key: Any) -> None:
    store.limit("ok", bump)
    calls: list[str] = []

    def update(doc: Any, now: float, live: Callable[[str, int], bool]) -> tuple[Any, Any]:
        calls.append("called")
        return doc, None

    refused(store, lambda: store.limit(key, update))
    assert calls == []  # refused before the update ran
    assert store.limit("x" * 200, bump) == 1  # 200 characters is the longest key


@pytest.mark.parametrize("update", [None, "update", 3, {"n": 1}], ids=repr)
def test_an_update_that_is_not_callable_is_refused(store: Any, update: Any) -> None:
    refused(store, lambda: store.limit("k", update))


@pytest.mark.parametrize("doc", BAD_DOCS, ids=[type(doc).__name__ for doc in BAD_DOCS])
def test_a_document_that_is_not_plain_json_is_refused_and_nothing_is_written(store: Any, doc: Any) -> None:
    store.limit("k", lambda old, now, live: ({"n": 1}, None))
    error = refused(store, lambda: store.limit("k", lambda old, now, live: (doc, "result")))
    assert "not plain JSON" in error.message
    refused(store, lambda: store.limit("new", lambda old, now, live: ({"x": doc}, None)))
    assert store.limits() == {"k": {"n": 1}}


@pytest.mark.parametrize("answer", [None, {"n": 1}, ({"n": 1},), ({"n": 1}, 1, 2), [{"n": 1}, 1]], ids=repr)
def test_an_update_that_returns_no_pair_is_refused(store: Any, answer: Any) -> None:
    refused(store, lambda: store.limit("k", lambda doc, now, live: answer))


@pytest.mark.parametrize("prefix", [None, 1, b"rate:"], ids=repr)
def test_a_prefix_that_is_not_a_str_is_refused(store: Any, prefix: Any) -> None:
    refused(store, lambda: store.limits(prefix))


# -- what each adapter adds -----------------------------------------------------------------------------------


def test_postgres_now_is_the_database_clock(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    import psycopg

    store = storage_of("postgres", tmp_path, request)
    seen = store.limit("clock", lambda doc, now, live: (None, now))
    with psycopg.connect(request.getfixturevalue("postgres_dsn"), autocommit=True) as conn:
        row = conn.execute("SELECT extract(epoch from clock_timestamp())::float8").fetchone()
    assert row is not None and abs(row[0] - seen) < 1.0


def test_postgres_schema_from_before_limits_gets_the_table(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    import psycopg

    old = storage_of("postgres", tmp_path, request)
    old.create("r1", header("r1"))
    old.close()
    with psycopg.connect(request.getfixturevalue("postgres_dsn"), autocommit=True) as conn:
        conn.execute(f'DROP TABLE "{old.schema}".limits')
    upgraded = storage_of("postgres", tmp_path, request)
    assert upgraded.limit("k", bump) == 1 and upgraded.info("r1") is not None


def test_a_sqlite_database_from_before_limits_gets_the_table(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = SqliteStorage(path)
    old.create("r1", header("r1"))
    old.close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE limits")
        db.execute("PRAGMA user_version=6")
    db.close()
    upgraded = SqliteStorage(path)
    assert upgraded.limit("k", bump) == 1 and upgraded.info("r1") is not None
    upgraded.close()


def test_on_files_a_document_is_named_by_its_keys_digest_and_holds_its_key(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "state")
    key = "conc:../../etc/passwd ☃"
    store.limit(key, bump)
    digest = hashlib.sha256(key.encode()).hexdigest()
    stored = json.loads((tmp_path / "state" / "limits" / f"{digest}.json").read_bytes())
    assert stored == {"key": key, "doc": {"n": 1}}
    assert not [p for p in (tmp_path / "state" / "limits").iterdir() if p.name.endswith(".tmp")]


def test_on_files_a_damaged_document_is_named_and_left_out_of_listings(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "state")
    store.limit("good", bump)
    store.limit("bad", bump)
    digest = hashlib.sha256(b"bad").hexdigest()
    (tmp_path / "state" / "limits" / f"{digest}.json").write_bytes(b'{"key": "bad", "doc": {"n": \n')
    with pytest.raises(CorruptLogError, match="bad"):
        store.limit("bad", bump)
    assert store.limits() == {"good": {"n": 1}}


def test_on_files_a_version_torn_by_a_kill_is_passed_over_and_cut_before_the_next(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "state")
    store.limit("torn", bump)
    path = tmp_path / "state" / "limits" / f"{hashlib.sha256(b'torn').hexdigest()}.json"
    with path.open("ab") as f:
        f.write(b'{"key": "torn", "doc": {"n": 9')  # a kill in the middle of an append
    assert store.limits() == {"torn": {"n": 1}}
    store.limit("torn", bump)
    assert store.limits() == {"torn": {"n": 2}}
    assert [json.loads(line)["doc"] for line in path.read_bytes().splitlines()] == [{"n": 1}, {"n": 2}]


def test_on_files_a_document_file_is_rewritten_to_its_current_version_as_it_grows(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "state")
    for _ in range(2000):
        store.limit("busy", bump)
    path = tmp_path / "state" / "limits" / f"{hashlib.sha256(b'busy').hexdigest()}.json"
    assert store.limits() == {"busy": {"n": 2000}} and path.stat().st_size <= 16 * 1024
