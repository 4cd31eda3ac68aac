"""PostgresStorage as engines on several machines use it: each "machine" is its own adapter and connection.

The conformance suite in test_storage.py runs against PostgreSQL too; these tests cover what only a shared
database server promises. They run on the throwaway server of the `postgres_dsn` fixture (see conftest.py).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from helpers import PgServer, Stop

from durably_py import LeaseLostError, RunNotFoundError, ValidationError, create_engine, workflow
from durably_py.storage import Lease, PostgresStorage, Storage

LONG = 3600.0
Machines = Callable[..., Any]


def header(run_id: str) -> bytes:
    return msgspec.json.encode({"t": "run", "v": 1, "run_id": run_id, "workflow": "wf", "key": None}) + b"\n"


def line(**record: Any) -> bytes:
    return msgspec.json.encode(record) + b"\n"


def kinds(store: Any, run_id: str = "r1") -> list[str]:
    return [r["t"] for r in store.read(run_id).records]


def test_importing_durably_does_not_import_psycopg() -> None:
    code = (
        "import sys\n"
        "import durably_py, durably_py.storage\n"
        "assert 'psycopg' not in sys.modules, 'psycopg imported eagerly'\n"
        "sys.modules['psycopg'] = None\n"
        "from durably_py.storage import PostgresStorage\n"
        "from durably_py import ValidationError\n"
        "try:\n"
        "    PostgresStorage('dbname=x')\n"
        "except ValidationError as exc:\n"
        "    print(exc.hint)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "durably-py[postgres]" in done.stdout


def test_options_are_validated(postgres_dsn: str) -> None:
    for schema in ["", "Durably", "1x", "a-b", 'x"; drop', "durably\n", "a" * 64, None]:
        with pytest.raises(ValidationError, match="schema"):
            PostgresStorage(postgres_dsn, schema=schema)  # type: ignore[arg-type]
    for bad in [0, -1, 1.5, True]:
        with pytest.raises(ValidationError, match="compact_above_bytes"):
            PostgresStorage(postgres_dsn, compact_above_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="dsn"):
        PostgresStorage(None)  # type: ignore[arg-type]
    store = PostgresStorage(postgres_dsn, compact_above_bytes=4096)
    assert isinstance(store, Storage) and store.compact_above_bytes == 4096 and store.schema == "durably"
    assert PostgresStorage(postgres_dsn).compact_above_bytes is None


def test_tables_live_in_their_own_schema(postgres_storage: Machines, postgres_dsn: str) -> None:
    import psycopg

    machines = [postgres_storage() for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(machines))

    def first_use(store: PostgresStorage) -> None:
        barrier.wait()
        try:
            store.list_runs()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=first_use, args=(m,)) for m in machines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with psycopg.connect(postgres_dsn) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s ORDER BY 1",
            (machines[0].schema,),
        ).fetchall()
    assert [t[0] for t in tables] == ["blobs", "identities", "joins", "limits", "queue", "records", "run_blobs", "runs",
                                      "signals", "workers"]


def test_concurrent_claims_from_many_machines_get_distinct_epochs(postgres_storage: Machines) -> None:
    machines = [postgres_storage() for _ in range(6)]
    machines[0].create("r1", header("r1"))

    def race(ttl: float) -> list[Lease]:
        results: list[Lease | None] = []
        barrier = threading.Barrier(len(machines))

        def claim(n: int) -> None:
            barrier.wait()
            results.append(machines[n].claim("r1", f"m{n}", ttl))

        threads = [threading.Thread(target=claim, args=(n,)) for n in range(len(machines))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [r for r in results if r is not None]

    # Leases that lapse at once: every machine wins in turn, each with an epoch of its own.
    winners = race(0)
    assert sorted(w.epoch for w in winners) == list(range(1, len(machines) + 1))
    claims = machines[1].read("r1").records[1:]
    assert [c["epoch"] for c in claims] == list(range(1, len(machines) + 1))
    assert sorted(c["owner"] for c in claims) == sorted(w.owner for w in winners)
    # Long leases: exactly one machine wins; the others see the run held.
    (winner,) = race(LONG)
    assert winner.epoch == len(machines) + 1
    assert all(m.held("r1") for m in machines)
    assert kinds(machines[2]).count("claim") == len(machines) + 1


def test_a_lapsed_owner_is_fenced_once_another_machine_claims(postgres_storage: Machines) -> None:
    a, b = postgres_storage(), postgres_storage()
    a.create("r1", header("r1"))
    old = a.claim("r1", "laptop", 1.0)  # long enough for the two checks below on a loaded machine
    assert old is not None and b.held("r1") is True and b.claim("r1", "server", LONG) is None
    time.sleep(1.1)
    assert b.held("r1") is False
    a.append(old, line(t="step", i=1))  # lapsed, but nobody claimed yet: still the current epoch
    new = b.claim("r1", "server", LONG)
    assert new is not None and new.epoch == 2
    with pytest.raises(LeaseLostError):
        a.append(old, line(t="step", i=2))
    with pytest.raises(LeaseLostError):
        a.sync(old)
    with pytest.raises(LeaseLostError):
        a.rewrite(old, header("r1"))
    assert a.heartbeat(old, LONG) is False
    a.release(old)
    assert a.held("r1") is True
    b.append(new, line(t="step", i=3))
    assert b.heartbeat(new, LONG) is True
    records = a.read("r1").records
    assert [(r["t"], r.get("i"), r.get("owner")) for r in records[1:]] == [
        ("claim", None, "laptop"), ("step", 1, None), ("claim", None, "server"), ("step", 3, None)
    ]
    (info,) = a.list_runs()
    assert info.held and info.epoch == 2 and info.last == {"t": "step", "i": 3}


def test_leases_follow_the_database_clock(postgres_storage: Machines, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = postgres_storage(), postgres_storage()
    a.create("r1", header("r1"))
    lease = a.claim("r1", "me", 30)
    monkeypatch.setattr(time, "time", lambda: 4_000_000_000.0)  # this machine's clock runs decades ahead
    assert b.held("r1") is True and b.claim("r1", "other", 30) is None
    assert a.heartbeat(lease, 30) is True


def test_a_broken_connection_is_reopened(postgres_storage: Machines, postgres_dsn: str) -> None:
    import psycopg

    store = postgres_storage()
    store.create("r1", header("r1"))
    lease = store.claim("r1", "me", LONG)
    assert lease is not None
    store.sync(lease)  # the group committer's connection is open too

    def kill_connections() -> None:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )

    kill_connections()
    assert kinds(store) == ["run", "claim"]  # a read retries once on a new connection
    kill_connections()
    with pytest.raises(psycopg.OperationalError):
        store.append(lease, line(t="step", i=1))  # a write may or may not have committed: it is not retried
    store.append(lease, line(t="step", i=2))
    assert kinds(store) == ["run", "claim", "step"]
    assert store.read("r1").records[-1]["i"] == 2


def test_interrupted_run_resumes_on_another_machine(postgres_storage: Machines) -> None:
    calls: dict[str, int] = {}
    state = {"interrupt": True}

    def work(name: str) -> str:
        calls[name] = calls.get(name, 0) + 1
        return name.upper()

    @workflow(name="pg-resume")
    async def wf(ctx: Any, names: list[str]) -> list[str]:
        out = [await ctx.step(work, names[0])]
        out += [r.value for r in await ctx.parallel([lambda n=n: ctx.step(work, n) for n in names[1:]])]
        if state["interrupt"]:
            state["interrupt"] = False
            raise Stop()
        out.append(await ctx.step(work, "last"))
        return out

    first = create_engine(postgres_storage())
    with pytest.raises(Stop):
        asyncio.run(first.run(wf, ["a", "b", "c"], key="job"))
    assert calls == {"a": 1, "b": 1, "c": 1}
    second = create_engine(postgres_storage())
    assert asyncio.run(second.run(wf, ["a", "b", "c"], key="job")) == ["A", "B", "C", "LAST"]
    assert calls == {"a": 1, "b": 1, "c": 1, "last": 1}
    seen = asyncio.run(first.inspect("job"))
    assert seen.status == "completed" and seen.attempt == 2
    assert [s.output for s in seen.steps] == ["A", "B", "C", "LAST"]
    (listed,) = asyncio.run(first.list())
    assert (listed.run_id, listed.status, listed.attempt) == (seen.run_id, "completed", 2)


def test_a_signal_from_one_machine_reaches_a_wait_on_another(postgres_storage: Machines) -> None:
    drafted: list[str] = []

    @workflow(name="pg-approval")
    async def approval(ctx: Any, amount: int) -> str:
        await ctx.step(drafted.append, "draft")
        decision = await ctx.wait_for("approval", timeout=60)
        return f"{amount} approved by {decision['by']}"

    worker, operator = create_engine(postgres_storage()), create_engine(postgres_storage())

    async def main() -> str:
        running = asyncio.ensure_future(worker.run(approval, 40, key="invoice-7"))
        for _ in range(500):
            await asyncio.sleep(0.01)
            try:
                if (await operator.inspect("invoice-7")).status == "waiting":
                    break
            except RunNotFoundError:
                pass
        assert not running.done()
        await operator.signal("invoice-7", "approval", {"by": "ana"})
        return await asyncio.wait_for(running, 10)

    assert asyncio.run(main()) == "40 approved by ana"
    assert drafted == ["draft"]
    run_id = operator.resolve("invoice-7")
    assert operator.storage.inbox(run_id) == []
    assert asyncio.run(operator.inspect("invoice-7")).status == "completed"


def test_create_bound_binds_and_creates_a_batch_in_one_transaction(postgres_storage: Machines,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A spawn_all's batch of children is one transaction (one durable commit), not a commit per bind and per
    create; a batch naming a run that exists already is made one bind and create at a time, which says which."""
    from contextlib import contextmanager

    from durably_py.storage.base import NewRun

    store = postgres_storage()
    store.create("warm", header("warm"))  # the schema exists before counting
    opened: list[bool] = []
    cursor = store._cursor

    @contextmanager
    def counted(transaction: bool = False, **kwargs: Any) -> Any:
        opened.append(transaction)
        with cursor(transaction, **kwargs) as cur:
            yield cur

    monkeypatch.setattr(store, "_cursor", counted)
    runs = [NewRun(f"k{i}", header(f"k{i}"), f"child:p:{i}") for i in range(50)]
    fsyncs = store.fsyncs
    assert store.create_bound(runs) is None
    assert opened == [True] and store.fsyncs == fsyncs + 1
    monkeypatch.undo()
    assert [store.lookup(f"child:p:{i}") for i in range(50)] == [f"k{i}" for i in range(50)]
    assert all(store.read(f"k{i}").records[0]["run_id"] == f"k{i}" for i in range(50))
    assert {f"k{i}" for i in range(50)} <= set(store.due(100))
    with pytest.raises(ValidationError, match="already exists"):
        store.create_bound([NewRun("k50", header("k50"), "child:p:50"), NewRun("warm", header("warm"), "child:p:51")])
    assert store.lookup("child:p:50") == "k50" and store.read("k50") is not None


def test_lookup_many_is_one_round_trip_and_none_for_no_identities(postgres_storage: Machines,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of a parent's children is looked up in one query, not one per child (each a network round trip)."""
    from contextlib import contextmanager

    store = postgres_storage()
    assert store.bind("child:p:3", "c3") is True
    statements: list[str] = []
    cursor = store._cursor

    class Counted:
        """A cursor that notes each statement it sends."""

        def __init__(self, cur: Any) -> None:
            self.cur = cur

        def execute(self, query: str, *args: Any) -> Any:
            statements.append(query)
            return self.cur.execute(query, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.cur, name)

    @contextmanager
    def counted(transaction: bool = False, **kwargs: Any) -> Any:
        with cursor(transaction, **kwargs) as cur:
            yield Counted(cur)

    monkeypatch.setattr(store, "_cursor", counted)
    asked = [f"child:p:{i}" for i in range(1024)]
    assert store.lookup_many(asked) == [None] * 3 + ["c3"] + [None] * 1020
    assert len(statements) == 1
    assert store.lookup_many([]) == [] and len(statements) == 1
    assert PostgresStorage("host=/nonexistent dbname=none").lookup_many([]) == []  # never connects


@workflow
async def pg_crashed(ctx: Any, n: int) -> int:
    return await ctx.step(int, n)


def test_every_write_survives_a_crash_of_a_server_that_commits_asynchronously_by_default() -> None:
    """A server whose default is ``synchronous_commit = off`` (and a WAL writer that flushes only every 10 s)
    is stopped as a crash stops it, at once, right after writes return; after its restart each write is there:
    the adapter commits durably whatever the server's default (a step, a claim, an enqueue, a signal, a queue
    move, a group commit of ends)."""
    server = PgServer("-c fsync=off -c synchronous_commit=off -c wal_writer_delay=10000ms")
    server.start()
    try:
        store = PostgresStorage(server.dsn, schema="crash")
        ids = [h.run_id for h in asyncio.run(create_engine(store).enqueue_many([(pg_crashed, n) for n in range(3)]))]
        store.send(ids[0], msgspec.json.encode({"id": "s1", "name": "go"}) + b"\n")
        lease = store.claim(ids[0], "me", LONG)
        assert lease is not None
        for i in range(10):
            store.append(lease, line(t="step", i=i))
        server.crash()  # the steps were the last writes
        server.start()
        store = PostgresStorage(server.dsn, schema="crash")
        records = store.read(ids[0]).records
        assert [r["t"] for r in records] == ["run", "claim"] + ["step"] * 10, records
        assert [s["id"] for s in store.inbox(ids[0])] == ["s1"]
        assert all(store.entry(run_id) is not None for run_id in ids)
        lease = store.claim(ids[1], "me", LONG)
        assert lease is not None
        store.append(lease, line(t="end", status="completed"))
        assert store.finish_all([lease]) == [None]
        store.schedule(ids[2], 4e9)
        server.crash()  # a group commit of ends, then a queue move
        server.start()
        store = PostgresStorage(server.dsn, schema="crash")
        assert [r["t"] for r in store.read(ids[1]).records] == ["run", "claim", "end"]
        assert store.entry(ids[1]) is None and not store.held(ids[1])
        assert store.entry(ids[2]).at == 4e9
        print("\n  3 enqueued, 1 signal, 10 steps, 1 group commit, 1 queue move: all there after two server crashes")
    finally:
        server.remove()
