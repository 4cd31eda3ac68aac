"""`ctx.transaction`: a step's writes to the run's own SQLite or PostgreSQL database commit in the transaction
that records the step, so the application's rows and the step records always agree: sync and async functions,
rollback and retry, compensation, replay, the lease's fence inside the transaction, the storage that cannot, and
real processes SIGKILLed before, inside and after the commit and resumed (and a `durably worker` killed inside
one), on both databases."""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import storage_url, wait_until

from durably_py import (
    ArgumentError,
    Engine,
    LeaseLostError,
    NotSupportedError,
    Retry,
    ValidationError,
    attempt,
    create_engine,
    records,
    workflow,
)
from durably_py.storage import FileStorage, Lease, MemoryStorage, SqliteStorage
from durably_py.testing import TestEngine

SHOP = Path(__file__).resolve().parent / "tx_shop.py"


# ---- one store per test: the runs and the application's tables in one database ---------------------------------

@dataclass
class Db:
    """A store for the runs and the application's `ledger` table in the same database (PostgreSQL: in a schema of
    its own beside durably's)."""

    storage: Any
    kind: str
    table: str
    mark: str
    connect: Any

    def rows(self) -> list[tuple[str, int]]:
        conn = self.connect()
        try:
            return [tuple(r) for r in conn.execute(f"SELECT op, amount FROM {self.table} ORDER BY op").fetchall()]
        finally:
            conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    if request.param == "sqlite":
        path = tmp_path / "app.db"

        def connect() -> Any:
            return sqlite3.connect(path, isolation_level=None)

        conn = connect()
        conn.execute("CREATE TABLE ledger (op TEXT NOT NULL, amount INT NOT NULL)")
        conn.close()
        yield Db(SqliteStorage(path), "sqlite", "ledger", "?", connect)
        return
    import psycopg

    dsn = request.getfixturevalue("postgres_dsn")
    storage = request.getfixturevalue("postgres_storage")()
    app = f"{storage.schema}_app"

    def pg() -> Any:
        return psycopg.connect(dsn, autocommit=True)

    with pg() as conn:
        conn.execute(f"CREATE SCHEMA {app}")
        conn.execute(f"CREATE TABLE {app}.ledger (op TEXT NOT NULL, amount INT NOT NULL)")
    yield Db(storage, "postgres", f"{app}.ledger", "%s", pg)
    with pg() as conn:
        conn.execute(f"DROP SCHEMA {app} CASCADE")


def book(db: Db, conn: Any, amount: int) -> dict[str, Any]:
    conn.execute(f"INSERT INTO {db.table} (op, amount) VALUES ({db.mark}, {db.mark})",
                 (attempt().operation_id, amount))
    return {"op": attempt().operation_id, "amount": amount}


def oks(storage: Any, run_id: str) -> list[records.Ok]:
    log = storage.read(run_id)
    assert log is not None
    return [r for r in log.records if isinstance(r, records.Ok)]


# ---- the API, in this process ----------------------------------------------------------------------------------

def test_sync_and_async_functions_commit_with_their_records_and_replay_from_the_log(db: Db) -> None:
    ran: list[str] = []
    interrupted = ["the workflow fails after its steps, the first time"]

    def sync_book(conn: Any, amount: int) -> dict[str, Any]:
        ran.append("sync")
        return book(db, conn, amount)

    async def async_book(conn: Any, amount: int) -> dict[str, Any]:
        ran.append("async")
        await asyncio.sleep(0.01)
        return book(db, conn, amount)

    @workflow(name=f"tx_both_{db.kind}")
    async def both(ctx: Any, amount: int) -> list[Any]:
        first = await ctx.transaction(sync_book, amount, name="sync book")
        second = await ctx.transaction(async_book, amount * 2)
        if interrupted:
            raise RuntimeError(interrupted.pop())
        return [first, second]

    engine = Engine(db.storage)
    with pytest.raises(RuntimeError, match="the first time"):
        asyncio.run(engine.run(both, 5, key="both"))
    assert ran == ["sync", "async"]
    # the failed run again: its steps answered from its log, the functions not called, nothing written twice
    result = asyncio.run(engine.run(both, 5, key="both"))
    run_id = result[0]["op"].split("/")[0]
    assert result == [{"op": f"{run_id}/0", "amount": 5}, {"op": f"{run_id}/1", "amount": 10}]
    assert db.rows() == [(f"{run_id}/0", 5), (f"{run_id}/1", 10)]
    assert [(r.path, r.label, r.value) for r in oks(db.storage, run_id)] == [
        ("0", "sync book", result[0]), ("1", "async_book", result[1])]
    assert ran == ["sync", "async"]


def test_transactions_gathered_with_plain_steps_each_commit_once(db: Db) -> None:
    def slow(n: int) -> int:
        time.sleep(0.02 * (n % 3))
        return n

    @workflow(name=f"tx_gather_{db.kind}")
    async def gathered(ctx: Any) -> Any:
        calls = []
        for n in range(6):
            calls.append(ctx.transaction(functools.partial(book, db), n, name=f"book {n}"))
            calls.append(ctx.step(slow, n))
        return await asyncio.gather(*calls)

    engine = Engine(db.storage)
    result = asyncio.run(engine.run(gathered, key="gathered"))
    run_id = result[0]["op"].split("/")[0]
    assert [r["amount"] for r in result[::2]] == list(range(6)) and result[1::2] == list(range(6))
    assert sorted(db.rows()) == sorted((r["op"], r["amount"]) for r in result[::2])
    assert len(oks(db.storage, run_id)) == 12


def test_on_postgres_the_run_goes_on_while_a_transaction_runs_and_on_sqlite_it_waits(db: Db) -> None:
    """A PostgreSQL transaction locks only its rows: its function runs on a worker thread and the run's other
    steps go on meanwhile, its commit waiting for the step's turn. SQLite's holds the database's one write lock:
    the attempt runs whole at its turn, and the run's other steps wait for its commit."""
    seen: dict[str, float] = {}

    def long(conn: Any) -> dict[str, Any]:
        seen["began"] = time.monotonic()
        out = book(db, conn, 1)
        time.sleep(0.8)
        seen["ended"] = time.monotonic()
        return out

    async def tick() -> float:
        await asyncio.sleep(0.05)
        seen["ticked"] = time.monotonic()
        return seen["ticked"]

    @workflow(name=f"tx_beside_{db.kind}")
    async def beside(ctx: Any) -> Any:
        booked, _ = await asyncio.gather(ctx.transaction(long), ctx.step(tick))
        return booked

    asyncio.run(Engine(db.storage).run(beside, key="beside"))
    if db.kind == "postgres":
        assert seen["ticked"] < seen["ended"], seen  # the run's other step ended while the transaction ran
    else:
        assert seen["ticked"] > seen["ended"] or seen["ticked"] < seen["began"], seen
    assert len(db.rows()) == 1


def test_an_exception_rolls_the_transaction_back_and_a_retry_runs_it_again(db: Db) -> None:
    tries: list[int] = []

    def flaky(conn: Any, amount: int) -> dict[str, Any]:
        out = book(db, conn, amount)
        tries.append(attempt().number)
        if len(tries) < 3:
            raise ConnectionError(f"the payment service is down (attempt {attempt().number})")
        return out

    @workflow(name=f"tx_retry_{db.kind}")
    async def retried(ctx: Any, amount: int) -> Any:
        return await ctx.transaction(flaky, amount, retry=Retry(3, base=0.01))

    engine = Engine(db.storage)
    result = asyncio.run(engine.run(retried, 7, key="retried"))
    run_id = result["op"].split("/")[0]
    assert tries == [1, 2, 3] and db.rows() == [(f"{run_id}/0", 7)]  # two attempts rolled back, one committed
    log = db.storage.read(run_id)
    assert [type(r).__name__ for r in log.records if isinstance(r, records.Fail | records.Ok)] == ["Fail", "Fail", "Ok"]
    assert oks(db.storage, run_id)[0].attempt == 3

    @workflow(name=f"tx_fails_{db.kind}")
    async def fails(ctx: Any) -> Any:
        return await ctx.transaction(lambda conn: (book(db, conn, 1), 1 / 0))

    with pytest.raises(ZeroDivisionError):
        asyncio.run(engine.run(fails, key="fails"))
    assert len(db.rows()) == 1  # without retry= the step fails and its write is gone with it


def test_compensate_undoes_a_committed_transaction_when_a_later_step_fails(db: Db) -> None:
    def unbook(done: dict[str, Any]) -> None:
        conn = db.connect()
        try:
            conn.execute(f"DELETE FROM {db.table} WHERE op = {db.mark}", (done["op"],))
        finally:
            conn.close()

    def ship(order: str) -> None:
        raise RuntimeError(f"no courier for {order}")

    @workflow(name=f"tx_saga_{db.kind}")
    async def saga(ctx: Any, amount: int) -> Any:
        booked = await ctx.transaction(functools.partial(book, db), amount, compensate=unbook)
        assert db.rows() == [(booked["op"], amount)]
        await ctx.step(ship, booked["op"])

    with pytest.raises(RuntimeError, match="no courier"):
        asyncio.run(Engine(db.storage).run(saga, 3, key="saga"))
    assert db.rows() == []


def test_schema_converts_the_result_as_a_step_does(db: Db) -> None:
    @dataclass
    class Booked:
        op: str
        amount: int

    def typed(conn: Any) -> Booked:
        return Booked(**book(db, conn, 4))

    @workflow(name=f"tx_schema_{db.kind}")
    async def schema(ctx: Any) -> Any:
        first = await ctx.transaction(typed, schema=Booked)
        assert isinstance(first, Booked)
        return first.amount

    assert asyncio.run(Engine(db.storage).run(schema, key="schema")) == 4


def test_a_run_whose_lease_was_taken_commits_nothing(db: Db) -> None:
    """The fence holds inside the transaction: another owner claiming the run (simulated by bumping its epoch
    where a claim would) makes the step's commit fail with LeaseLostError, and the application's write goes
    with it."""
    runs = f'"{db.storage.schema}".runs' if db.kind == "postgres" else "runs"

    def stolen(conn: Any) -> None:
        book(db, conn, 9)
        bump = f"UPDATE {runs} SET epoch = epoch + 1 WHERE run_id = {db.mark}"
        if db.kind == "sqlite":  # SQLite: no other connection may write while the transaction holds the lock
            conn.execute(bump, (ctx_run[0],))
        else:  # PostgreSQL: another connection commits a new epoch, as a claim would
            other = db.connect()
            other.execute(bump, (ctx_run[0],))
            other.close()

    ctx_run: list[str] = []

    @workflow(name=f"tx_stolen_{db.kind}")
    async def taken(ctx: Any) -> Any:
        ctx_run.append(ctx.run_id)
        return await ctx.transaction(stolen)

    with pytest.raises(LeaseLostError):
        asyncio.run(Engine(db.storage).run(taken, key="stolen"))
    assert db.rows() == [] and oks(db.storage, ctx_run[0]) == []


def test_a_function_that_commits_itself_is_told(db: Db) -> None:
    def commits(conn: Any) -> None:
        book(db, conn, 1)
        conn.execute("COMMIT")

    @workflow(name=f"tx_commits_{db.kind}")
    async def own(ctx: Any) -> Any:
        return await ctx.transaction(commits)

    with pytest.raises(ValidationError, match="committed or rolled back by its function") as caught:
        asyncio.run(Engine(db.storage).run(own, key="own"))
    assert "Leave commit and rollback to ctx.transaction" in caught.value.hint


def test_bad_arguments_are_refused_before_anything_runs(tmp_path: Path) -> None:
    engine = Engine(SqliteStorage(tmp_path / "runs.db"))

    @workflow(name="tx_bad")
    async def bad(ctx: Any, which: str) -> Any:
        if which == "timeout":
            return await ctx.transaction(lambda conn: 1, timeout=5)
        if which == "callable":
            return await ctx.transaction("not a function")
        return await ctx.transaction(lambda conn: 1, retry=3)

    with pytest.raises(ArgumentError, match="unknown keyword argument") as caught:
        asyncio.run(engine.run(bad, "timeout"))
    assert "statement timeout" in caught.value.hint
    with pytest.raises(ValidationError, match="needs a callable"):
        asyncio.run(engine.run(bad, "callable"))
    with pytest.raises(ValidationError, match="must be a Retry"):
        asyncio.run(engine.run(bad, "retry"))


@workflow(name="tx_elsewhere")
async def elsewhere(ctx: Any) -> Any:
    return await ctx.transaction(lambda conn: 1)


@pytest.mark.parametrize("where", ["file", "memory", "testengine"])
def test_storage_that_cannot_commit_with_the_application_names_the_alternative(tmp_path: Path, where: str) -> None:
    if where == "testengine":
        outcome = asyncio.run(TestEngine().run(elsewhere))
        assert outcome.status == "failed"
        error = outcome.error
    else:
        storage = FileStorage(tmp_path / "state") if where == "file" else MemoryStorage()
        with pytest.raises(NotSupportedError) as caught:
            asyncio.run(Engine(storage).run(elsewhere))
        error = caught.value
    assert isinstance(error, NotSupportedError)
    assert "SQLite or PostgreSQL storage" in error.message
    assert "durably_py.once(conn)" in error.hint and "attempt().operation_id" in error.hint
    assert error.docs == "docs/policies.md#transactional-steps"


def test_testengine_over_sqlite_storage_runs_transactions(tmp_path: Path) -> None:
    storage = SqliteStorage(tmp_path / "test.db")
    conn = sqlite3.connect(tmp_path / "test.db")
    conn.execute("CREATE TABLE ledger (op TEXT NOT NULL, amount INT NOT NULL)")
    conn.close()

    def write(conn: Any) -> str:
        conn.execute("INSERT INTO ledger VALUES (?, 1)", (attempt().operation_id,))
        return attempt().operation_id

    @workflow(name="tx_testengine")
    async def tested(ctx: Any) -> Any:
        return [await ctx.transaction(write), await ctx.transaction(write, concurrency_key="ledger",
                                                                    concurrency_limit=1)]

    async def main() -> tuple[Any, Any]:
        engine = TestEngine(storage=storage)
        crashed = await engine.run(tested, crash_in_step=(1,))  # after its function returned: committed already
        return crashed, await engine.resume(crashed.run_id)

    crashed, outcome = asyncio.run(main())
    assert crashed.status == "crashed" and outcome.status == "completed", outcome.error
    assert outcome.executions == {"write": 2}  # the second step was not run again by the resume
    rows = sqlite3.connect(tmp_path / "test.db").execute("SELECT op FROM ledger ORDER BY op").fetchall()
    assert rows == [(outcome.result[0],), (outcome.result[1],)]


def test_restate_mode_names_the_alternative() -> None:
    from durably_py.restate.context import RestateKernel

    with pytest.raises(NotSupportedError, match="is not supported in Restate mode") as caught:
        RestateKernel.transaction(None, lambda conn: 1)  # type: ignore[arg-type]
    assert "durably_py.once(conn)" in caught.value.hint and "attempt().operation_id" in caught.value.hint


# ---- real processes, SIGKILLed and resumed ---------------------------------------------------------------------

class Shop:
    """tests/tx_shop.py on one store: its processes, and whether the application's rows and the step records
    agree."""

    def __init__(self, url: str, db: str, tmp_path: Path) -> None:
        self.url, self.db, self.tmp_path = url, db, tmp_path
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "DURABLY_STORAGE": url, "TX_DB": db}
        subprocess.run([sys.executable, "-c", "import tx_shop; tx_shop.setup()"], env=self.env, check=True,
                       cwd=SHOP.parent, timeout=60)
        self.storage = create_engine(url).storage
        self.keys: list[str] = []

    def start(self, *args: str, **env: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, *args], env={**self.env, **env}, cwd=SHOP.parent,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def lapse(self, key: str) -> None:
        """End the lease a killed process held on the run of `key` now rather than when it times out (what the
        next process would wait for): the dead owner's lease, released as that owner would release it."""
        found = self.storage.list_runs(key=key)
        held = self.storage.lease_of(found[0].run_id) if found else None
        if held is not None:
            adapter = "sqlite" if self.url.startswith("sqlite:") else "postgres"
            info = self.storage.info(found[0].run_id)
            self.storage.release(Lease(info.run_id, held[0], info.epoch, state={adapter: self.storage}))
            assert not self.storage.held(info.run_id)

    def run_ids(self) -> list[str]:
        ids = []
        for key in self.keys:
            found = self.storage.list_runs(key=key)
            ids += [info.run_id for info in found]
        return ids

    def done(self, key: str) -> int:
        """How many steps of the run of `key` committed (0 before it exists)."""
        found = self.storage.list_runs(key=key)
        return sum(1 for r in oks(self.storage, found[0].run_id) if r.label == "take") if found else 0

    def committed(self) -> list[str]:
        """The operation id of every `take` step the logs hold a result of."""
        return [f"{run_id}/{r.path}" for run_id in self.run_ids() for r in oks(self.storage, run_id)
                if r.label == "take"]

    def check(self) -> tuple[int, int, int]:
        """The application's rows against the step records: (orders, double effects, lost effects)."""
        import tx_shop

        tx_shop.DB = self.db
        left, ops = tx_shop.state()
        committed = collections.Counter(self.committed())
        counts = collections.Counter(ops)
        doubles = sum(n - 1 for n in counts.values() if n > 1) + sum(n - 1 for n in committed.values() if n > 1) \
            + sum(1 for op in counts if op not in committed)  # a row twice, a record twice, a row with no record
        lost = sum(1 for op in committed if op not in counts)  # a record with no row
        assert left == tx_shop.STOCK - len(ops), (left, len(ops))  # every order took exactly one widget
        return len(ops), doubles, lost


def killed_at(proc: subprocess.Popen[bytes], needle: bytes | None, delay: float) -> bool:
    """SIGKILL `proc` once its stderr shows `needle` (or after `delay` seconds); False when it ended first."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    seen = b""
    deadline = time.monotonic() + (delay if needle is None else 60)
    while time.monotonic() < deadline:
        if needle is not None and needle in seen:
            break
        ready, _, _ = select.select([fd], [], [], 0.02)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk
    ended = proc.poll() is not None
    proc.kill()
    out, err = proc.communicate(timeout=60)
    assert not (needle is not None and needle not in seen and not ended), (seen + err).decode()[-3000:]
    return not ended


def soak(shop: Shop, kills: int, seed: int, steps: int = 40) -> dict[str, int]:
    """`kills` SIGKILLs at seeded points (a random moment, inside a step's transaction, right after a commit),
    each process resumed by the next; a run that completes is followed by a new one. The rows and records are
    checked after every kill, and after a last process runs the current order to its end."""
    rng = random.Random(seed)
    figures = {"kills": 0, "double": 0, "lost": 0, "runs": 1, "moment": 0, "inside": 0, "after": 0}
    key = f"order-{seed}-1"
    shop.keys.append(key)
    while figures["kills"] < kills:
        done = shop.done(key)
        if done >= steps:  # every step of this order committed: the next order
            figures["runs"] += 1
            key = f"order-{seed}-{figures['runs']}"
            shop.keys.append(key)
            done = 0
        point = ("moment", "inside", "after")[figures["kills"] % 3]
        at = rng.randrange(done, steps)
        env = {"inside": {"TX_SLEEP_AT": str(at)}, "after": {"TX_PAUSE_AFTER": str(at)}, "moment": {}}[point]
        needle = {"inside": f"inside {at}".encode(), "after": f"committed {at}".encode(), "moment": None}[point]
        proc = shop.start(str(SHOP), key, str(steps), **env)
        if killed_at(proc, needle, rng.uniform(0.2, 1.2)):
            figures["kills"] += 1
            figures[point] += 1
            shop.lapse(key)
        else:  # the order completed before the kill point: the next one starts
            figures["runs"] += 1
            key = f"order-{seed}-{figures['runs']}"
            shop.keys.append(key)
        _, doubles, lost = shop.check()
        figures["double"] += doubles
        figures["lost"] += lost
        assert (doubles, lost) == (0, 0), (point, at, figures)
    final = shop.start(str(SHOP), key, str(steps))
    out, err = final.communicate(timeout=120)
    assert final.returncode == 0, err.decode()[-3000:]
    left = json.loads(out)
    assert len(left) == steps and left == sorted(left, reverse=True)
    _, doubles, lost = shop.check()
    assert (doubles, lost) == (0, 0)
    return figures


@pytest.fixture(params=["sqlite", "postgres"])
def shop(request: pytest.FixtureRequest, tmp_path: Path) -> Shop:
    return make_shop(request.param, tmp_path, request)


def report(shop: Shop, figures: dict[str, int]) -> None:
    orders, _, _ = shop.check()
    print(f"\n{shop.url.split(':')[0]}: {figures['kills']} kills, {figures['double']} double effects, "
          f"{figures['lost']} lost ({figures['moment']} at a random moment, {figures['inside']} inside a "
          f"transaction, {figures['after']} right after a commit; {orders} orders over {len(shop.run_ids())} runs)")


def test_killed_before_inside_and_after_the_commit_rows_and_records_agree(shop: Shop) -> None:
    figures = soak(shop, kills=8, seed=1)
    report(shop, figures)
    assert figures["kills"] == 8 and figures["double"] == figures["lost"] == 0


@pytest.mark.slow
def test_a_hundred_seeded_kills(shop: Shop) -> None:
    figures = soak(shop, kills=100, seed=100)
    report(shop, figures)
    assert figures["kills"] == 100 and figures["double"] == figures["lost"] == 0


def make_shop(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Shop:
    url = storage_url(kind, tmp_path, request)
    if kind == "sqlite":
        return Shop(url, url, tmp_path)
    dsn = request.getfixturevalue("postgres_dsn")
    return Shop(url, f"postgresql:{url.rsplit('schema=', 1)[1]}_app:{dsn}", tmp_path)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def test_a_worker_killed_inside_a_transaction_leaves_the_next_worker_to_run_it_once(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    shop = make_shop(kind, tmp_path, request)
    cli = [sys.executable, "-m", "durably_py.cli"]
    enqueued = subprocess.run([*cli, "enqueue", str(SHOP), "-w", "orders", "-i", "4", "--key", "by-worker"],
                              env=shop.env, cwd=SHOP.parent, capture_output=True, text=True, timeout=60)
    assert enqueued.returncode == 0, enqueued.stderr
    shop.keys.append("by-worker")
    worker = shop.start("-m", "durably_py.cli", "worker", "--import", str(SHOP), "--poll", "0.1", "--lease", "2",
                        TX_SLEEP_AT="2")
    assert killed_at(worker, b"inside 2", 0)
    assert shop.check() == (2, 0, 0)  # steps 0 and 1 committed; step 2's write died with its transaction
    second = shop.start("-m", "durably_py.cli", "worker", "--import", str(SHOP), "--poll", "0.1", "--lease", "2")
    try:
        run_id = shop.run_ids()[0]
        wait_until(lambda: shop.storage.info(run_id).kind == "end", seconds=60)
    finally:
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=60)
    assert shop.check() == (4, 0, 0)
