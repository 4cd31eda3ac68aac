"""`durably_py.once`: a step's writes to the user's own database commit once per operation, however often the step
runs. The widget store (a step that decrements inventory, SIGKILLed around its commit and resumed) on SQLite and
PostgreSQL, the same store without the guard (where the kill does double the effect), and the helper's own rules."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import durably_py
from durably_py import DurablyError, Once, Retry, ValidationError, attempt, once, workflow
from durably_py.testing import TestEngine

SHOP = Path(__file__).resolve().parent / "idem_shop.py"


# ---- the widget store, killed and resumed ---------------------------------------------------------------------

class Store:
    """The shop's own database (not durably's): one inventory row of 100 widgets per order."""

    def __init__(self, spec: str, connect: Callable[[], Any], mark: str) -> None:
        self.spec, self.connect, self.mark = spec, connect, mark
        with self.connect() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS inventory (sku TEXT PRIMARY KEY, n INTEGER NOT NULL)")

    def stock(self, sku: str, n: int = 100) -> None:
        with self.connect() as conn:
            conn.execute(f"INSERT INTO inventory (sku, n) VALUES ({self.mark}, {self.mark})", (sku, n))

    def level(self, sku: str) -> int:
        with self.connect() as conn:
            return int(conn.execute(f"SELECT n FROM inventory WHERE sku = {self.mark}", (sku,)).fetchone()[0])


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Store:
    path = tmp_path / "shop.db"

    def connect() -> Any:
        return _closing_sqlite(path)

    return Store(str(path), connect, "?")


class _closing_sqlite:
    """`with` a sqlite3 connection that commits and closes at the end of the block, like psycopg's."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, timeout=30)

    def __enter__(self) -> sqlite3.Connection:
        return self.conn

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.conn.commit()
        self.conn.close()


@pytest.fixture
def pg_schema(postgres_dsn: str) -> Iterator[tuple[str, str]]:
    import uuid

    import psycopg

    schema = f"shop_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    yield postgres_dsn, schema
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def pg_store(pg_schema: tuple[str, str]) -> Store:
    import psycopg

    dsn, schema = pg_schema

    def connect() -> Any:
        return psycopg.connect(dsn, options=f"-c search_path={schema}")

    return Store(f"postgresql:{schema}:{dsn}", connect, "%s")


def place_order(state: Path, store: Store, mode: str, kill_at: str = "") -> dict[str, Any] | None:
    """Run the order in a child process; with `kill_at`, SIGKILL it once its step gets there and return None."""
    flag = state.parent / f"{state.name}.flag"
    args = [sys.executable, str(SHOP), str(state), store.spec, mode] + ([kill_at, str(flag)] if kill_at else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not kill_at:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        return dict(json.loads(out.strip().splitlines()[-1]))
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the step never reached its kill point"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
        flag.unlink(missing_ok=True)
    return None


def kill_and_resume(tmp_path: Path, store: Store, mode: str, seeds: range) -> list[tuple[int, str, int]]:
    """For each seed, a new order killed at a seeded point and resumed: (seed, point, widgets taken) for each."""
    taken = []
    for seed in seeds:
        point = random.Random(seed).choice(["before-commit", "after-commit", "after-commit"])
        sku = f"order{seed}"
        state = tmp_path / sku
        store.stock(sku)
        assert place_order(state, store, mode, point) is None
        result = place_order(state, store, mode)
        assert result is not None and result["shipped"] == sku
        taken.append((seed, point, 100 - store.level(sku)))
    return taken


def test_the_widget_store_killed_around_its_commit_ships_each_order_once(tmp_path: Path, sqlite_store: Store) -> None:
    taken = kill_and_resume(tmp_path, sqlite_store, "once", range(4))
    assert [n for _, _, n in taken] == [1] * len(taken), taken
    assert {point for _, point, _ in taken} == {"before-commit", "after-commit"}


def test_a_resumed_step_returns_what_the_killed_execution_committed(tmp_path: Path, sqlite_store: Store) -> None:
    """Killed after the commit: the second execution returns the first one's result (its pid), not its own."""
    state = tmp_path / "order-a"
    sqlite_store.stock("order-a")
    assert place_order(state, sqlite_store, "once-async", "after-commit") is None
    with sqlite3.connect(sqlite_store.spec) as conn:
        (first,) = conn.execute("SELECT result FROM durably_done").fetchone()
    result = place_order(state, sqlite_store, "once-async")
    assert result == json.loads(first)
    assert result is not None and result["by"] != os.getpid()
    assert sqlite_store.level("order-a") == 99


def test_without_the_guard_the_kill_after_the_commit_takes_a_second_widget(tmp_path: Path,
                                                                           sqlite_store: Store) -> None:
    """The failure `once` exists for: the store's own transaction committed, the step's record did not."""
    state = tmp_path / "order-b"
    sqlite_store.stock("order-b")
    assert place_order(state, sqlite_store, "plain", "after-commit") is None
    result = place_order(state, sqlite_store, "plain")
    assert result is not None and result["shipped"] == "order-b"
    assert sqlite_store.level("order-b") == 98


@pytest.mark.slow
def test_the_widget_store_soak(tmp_path: Path, sqlite_store: Store) -> None:
    taken = kill_and_resume(tmp_path, sqlite_store, "once", range(100, 130))
    assert [n for _, _, n in taken] == [1] * len(taken), taken


def test_the_widget_store_on_postgres_ships_each_order_once(tmp_path: Path, pg_store: Store) -> None:
    taken = kill_and_resume(tmp_path, pg_store, "once", range(4))
    taken += kill_and_resume(tmp_path, pg_store, "once-async", range(10, 12))
    assert [n for _, _, n in taken] == [1] * len(taken), taken
    with pg_store.connect() as conn:
        assert conn.execute("SELECT count(*) FROM durably_done").fetchone()[0] == len(taken)


def test_without_the_guard_postgres_takes_a_second_widget(tmp_path: Path, pg_store: Store) -> None:
    state = tmp_path / "order-c"
    pg_store.stock("order-c")
    assert place_order(state, pg_store, "plain", "after-commit") is None
    place_order(state, pg_store, "plain")
    assert pg_store.level("order-c") == 98


# ---- the helper in one process --------------------------------------------------------------------------------

@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(tmp_path / "shop.db", timeout=30, check_same_thread=False)  # steps run on threads
    conn.execute("CREATE TABLE inventory (sku TEXT PRIMARY KEY, n INTEGER NOT NULL)")
    conn.execute("INSERT INTO inventory VALUES ('w', 100)")
    conn.commit()
    yield conn
    conn.close()


def take(conn: sqlite3.Connection, key: str | None = None, value: Any = "taken", **options: Any) -> Any:
    with once(conn, key, **options) as op:
        if op.done:
            return op.result
        conn.execute("UPDATE inventory SET n = n - 1 WHERE sku = 'w'")
        return op.record(value)


def tables(conn: sqlite3.Connection) -> set[str]:
    return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def level(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT n FROM inventory WHERE sku = 'w'").fetchone()[0])


def test_the_operation_id_is_the_key_inside_a_step_and_the_result_round_trips(db: sqlite3.Connection) -> None:
    engine = TestEngine()
    seen: list[str] = []
    runs = [0]

    def ship(order: str) -> Any:
        seen.append(attempt().operation_id)
        runs[0] += 1
        value = take(db, value={"order": order, "at": durably_py.__version__, "n": [1, 2.5, None]})
        if runs[0] == 1:
            raise ConnectionError("the reply was lost after the commit")
        return value

    @workflow
    async def shop(ctx: Any, order: str) -> Any:
        return await ctx.step(ship, order, retry=Retry(2, backoff="none"))

    done = engine.sync.run(shop, "o1")
    assert done.result == {"order": "o1", "at": durably_py.__version__, "n": [1, 2.5, None]}
    assert level(db) == 99 and runs[0] == 2
    assert seen == [f"{done.run_id}/0"] * 2
    assert db.execute("SELECT operation_id FROM durably_done").fetchall() == [(f"{done.run_id}/0",)]
    other = engine.sync.run(shop, "o2")  # another run: another operation
    assert other.run_id != done.run_id and level(db) == 98


def test_an_operation_id_names_one_step_of_one_run_however_often_it_runs() -> None:
    engine = TestEngine()
    seen: list[tuple[str, str]] = []
    failing = [True]

    def note(tag: str) -> str:
        seen.append((tag, attempt().operation_id))
        return tag

    def pay() -> str:
        seen.append(("pay", attempt().operation_id))
        if failing[0]:
            raise durably_py.NonRetryableError("declined")
        return "paid"

    async def turn(state: int, it: Any) -> Any:
        await it.step(note, f"turn{state}")
        return it.done(state) if state == 1 else state + 1

    @workflow
    async def checkout(ctx: Any) -> str:
        await ctx.parallel([ctx.step(note, "left"), ctx.step(note, "right")])
        await ctx.loop(0, turn)
        return await ctx.step(pay)

    failed = engine.sync.run(checkout)
    assert failed.status == "failed"
    failing[0] = False
    done = engine.sync.resume(failed.run_id)  # the failed run retried: its failed step runs again, same id
    assert done.result == "paid" and done.run_id == failed.run_id
    again = engine.sync.run(checkout)  # a completed run started again is a new run
    assert again.run_id != failed.run_id
    first = dict(seen[:5])
    assert len(set(first.values())) == 5 and all(op.startswith(f"{failed.run_id}/") for op in first.values())
    assert seen[5] == ("pay", first["pay"])
    assert [op.rpartition("/")[0] for _, op in seen[6:]] == [again.run_id] * 5


def test_a_repeat_discards_the_writes_of_its_block_and_an_error_rolls_the_block_back(db: sqlite3.Connection) -> None:
    assert take(db, "k") == "taken"
    with once(db, "k") as op:
        assert op.done and op.result == "taken" and op.key == "k"
        db.execute("UPDATE inventory SET n = 0")  # written anyway: a repeat keeps nothing
    assert level(db) == 99 and not db.in_transaction
    with pytest.raises(ZeroDivisionError), once(db, "k2"):
        db.execute("UPDATE inventory SET n = n - 1")
        raise ZeroDivisionError("the step failed after its write")
    assert level(db) == 99
    assert db.execute("SELECT count(*) FROM durably_done WHERE operation_id = 'k2'").fetchone() == (0,)
    assert take(db, "k2") == "taken" and level(db) == 98


def test_inside_the_callers_transaction_the_commit_stays_the_callers(db: sqlite3.Connection) -> None:
    with pytest.raises(RuntimeError), db:
        db.execute("INSERT INTO inventory VALUES ('x', 1)")
        assert take(db, "k", "first") == "first"
        assert db.in_transaction
        raise RuntimeError("the caller rolls back")
    assert level(db) == 100 and not tables(db) & {"durably_done"}  # the marker table was made in that transaction
    with db:
        db.execute("INSERT INTO inventory VALUES ('x', 1)")
        assert take(db, "k", "second") == "second"
        assert take(db, "k", "third") == "second"  # its savepoint rolled back, the caller's writes kept
    assert level(db) == 99 and db.execute("SELECT n FROM inventory WHERE sku = 'x'").fetchone() == (1,)


def test_an_autocommit_connection_still_gets_one_transaction(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "auto.db", isolation_level=None)
    conn.execute("CREATE TABLE t (x INTEGER)")
    with pytest.raises(RuntimeError), once(conn, "k"):
        conn.execute("INSERT INTO t VALUES (1)")
        raise RuntimeError("killed half way")
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,) and tables(conn) == {"t"}
    with once(conn, "k") as op:
        conn.execute("INSERT INTO t VALUES (1)")
        op.record(1)
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (1,) and not conn.in_transaction


def test_a_custom_table(db: sqlite3.Connection) -> None:
    assert take(db, "k", table="shop_done") == "taken"
    assert take(db, "k", "again", table="shop_done") == "taken"
    assert take(db, "k", "other table", table="main.shop_done2") == "other table"
    assert db.execute("SELECT operation_id FROM shop_done").fetchall() == [("k",)]
    assert tables(db) == {"inventory", "shop_done", "shop_done2"}
    assert level(db) == 98


def test_forget_lets_an_undone_operation_write_again(db: sqlite3.Connection) -> None:
    assert take(db, "k", "first") == "first"
    with db:
        db.execute("UPDATE inventory SET n = n + 1 WHERE sku = 'w'")  # a compensation undoes it...
        assert Once.forget(db, "k") is True  # ...and forgets the marker in the same transaction
    assert Once.forget(db, "k") is False and Once.forget(db, "k", table="never_made") is False
    assert take(db, "k", "again") == "again" and level(db) == 99


def test_called_outside_a_step_without_a_key(db: sqlite3.Connection) -> None:
    with pytest.raises(ValidationError) as info:
        once(db)
    assert isinstance(info.value, DurablyError)
    assert "ctx.step" in info.value.hint and "key=" in info.value.hint
    assert info.value.docs == "docs/policies.md#idempotency"


@pytest.mark.parametrize(("conn", "options", "words"), [
    (object(), {"key": "k"}, "sqlite3.Connection or a psycopg 3 Connection"),
    (None, {"key": ""}, "non-empty"),
    (None, {"key": "k", "table": "done; DROP TABLE inventory"}, "plain table name"),
])
def test_bad_arguments(db: sqlite3.Connection, conn: Any, options: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words) as info:
        once(db if conn is None else conn, **options)
    assert info.value.hint and info.value.docs.endswith("#idempotency")


def test_record_belongs_to_a_first_execution_inside_its_block(db: sqlite3.Connection) -> None:
    take(db, "k")
    with once(db, "k") as op, pytest.raises(ValidationError, match="committed before"):
        op.record("again")
    with pytest.raises(ValidationError, match="outside"):
        op.record("late")
    with pytest.raises(durably_py.SerializationError), once(db, "k3") as op:
        op.record(object())
    assert db.execute("SELECT count(*) FROM durably_done WHERE operation_id = 'k3'").fetchone() == (0,)


def run_together(n: int, body: Callable[[], Any]) -> list[Any]:
    results: list[Any] = [None] * n
    start = threading.Barrier(n)

    def go(i: int) -> None:
        start.wait()
        results[i] = body()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_executions_of_one_operation_commit_once(tmp_path: Path, db: sqlite3.Connection) -> None:
    path = tmp_path / "shop.db"

    def execution() -> Any:
        conn = sqlite3.connect(path, timeout=30)
        try:
            with once(conn, "run-1/3") as op:
                if op.done:
                    return ("repeat", op.result)
                conn.execute("UPDATE inventory SET n = n - 1 WHERE sku = 'w'")
                time.sleep(0.2)  # the others wait on the marker meanwhile
                return ("first", op.record(threading.get_ident()))
        finally:
            conn.close()

    results = run_together(4, execution)
    firsts = [value for kind, value in results if kind == "first"]
    assert len(firsts) == 1 and sorted(results) == [("first", firsts[0])] + [("repeat", firsts[0])] * 3
    assert level(db) == 99


def test_concurrent_executions_on_postgres_commit_once(pg_schema: tuple[str, str]) -> None:
    import psycopg

    dsn, schema = pg_schema
    with psycopg.connect(dsn, options=f"-c search_path={schema}") as conn:
        conn.execute("CREATE TABLE inventory (sku TEXT PRIMARY KEY, n INTEGER NOT NULL)")
        conn.execute("INSERT INTO inventory VALUES ('w', 100)")

    def execution() -> Any:
        with psycopg.connect(dsn, options=f"-c search_path={schema}") as conn:
            with once(conn, "run-1/3", table="pg_done") as op:  # the table is made by whichever comes first
                if op.done:
                    return ("repeat", op.result)
                conn.execute("UPDATE inventory SET n = n - 1 WHERE sku = 'w'")
                time.sleep(0.2)
                return ("first", op.record({"by": threading.get_ident()}))

    results = run_together(4, execution)
    firsts = [value for kind, value in results if kind == "first"]
    assert len(firsts) == 1 and sorted(results, key=str) == sorted([("first", firsts[0])] + [("repeat", firsts[0])] * 3,
                                                                   key=str)
    with psycopg.connect(dsn, options=f"-c search_path={schema}") as conn:
        assert conn.execute("SELECT n FROM inventory").fetchone() == (99,)
        # inside the caller's transaction: a savepoint, the commit the caller's; a repeat leaves it usable
        with conn.transaction():
            with once(conn, "run-1/3", table="pg_done") as op:
                assert op.done
                conn.execute("UPDATE inventory SET n = 0")
            conn.execute("UPDATE inventory SET n = n - 1")
        assert conn.execute("SELECT n FROM inventory").fetchone() == (98,)
        assert Once.forget(conn, "run-1/3", table="pg_done") and not Once.forget(conn, "x", table="nothing_here")
        conn.commit()
