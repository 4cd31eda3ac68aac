"""PostgreSQL group commits of the appends, syncs and ends of the runs one process holds: each write fenced by
its own lease, a run's writes in order, nothing acknowledged before its commit returned; and `durably worker`
processes SIGKILLed while group commits are in flight lose no run and record no step twice."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import drain_while_killing, records_of, wait_until

from durably_py import create_engine, workflow
from durably_py._authoring.workflow import REGISTRY, load_script
from durably_py.errors import LeaseLostError

JOBS = '''
import os
from durably_py import workflow

LEDGER = os.environ.get("JOBS_LEDGER", os.devnull)


async def mark(key):
    """The step's side effect: one line in the ledger (O_APPEND, so every process's lines keep their order)."""
    fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{key}\\n".encode())
    os.close(fd)
    return key


@workflow
async def gc_three(ctx, n):
    for k in range(3):
        await ctx.step(mark, f"{n}.{k}")
    return n
'''


def line(**fields: Any) -> bytes:
    return msgspec.json.encode(fields) + b"\n"


def header(run_id: str) -> bytes:
    return line(t="run", v=1, run_id=run_id, workflow="w", input=None)


def kinds(store: Any, run_id: str) -> list[str]:
    return [r["t"] for r in records_of(store, run_id)]


def test_a_group_commit_fails_only_the_writes_of_a_lost_lease_and_keeps_each_runs_order(
        postgres_storage: Any) -> None:
    a, b = postgres_storage(), postgres_storage()
    for run_id in ("r1", "r2"):
        a.create(run_id, header(run_id))
    one, two = a.claim("r1", "me", 0.2), a.claim("r2", "me", 3600)
    assert one is not None and two is not None
    wait_until(lambda: not a.held("r1"))
    assert b.claim("r1", "other", 3600) is not None  # another machine took r1 over
    futures = []
    for i in range(20):  # handed in without waiting: they go into a few group commits between them
        futures.append(a.append_soon(one, line(t="step", i=i)))
        futures.append(a.append_soon(two, line(t="step", i=i)))
    outcomes = [f.exception(timeout=30) for f in futures]
    assert all(isinstance(e, LeaseLostError) for e in outcomes[0::2])
    assert outcomes[1::2] == [None] * 20
    assert [r["i"] for r in a.read("r2").records[2:]] == list(range(20))  # in the order handed in
    assert kinds(a, "r1") == ["run", "claim", "claim"]  # nothing of the lost lease
    with pytest.raises(LeaseLostError):
        a.sync(one)
    a.sync(two)
    assert a.finish_all([one, two])[1] is None and a.entry("r2") is None and not a.held("r2")
    assert a.entry("r1") is not None and b.held("r1")  # the lost lease's end touched nothing


def test_appends_and_ends_handed_in_in_one_pass_are_each_fenced_and_kept_in_order(postgres_storage: Any) -> None:
    """Records and ends of several leases handed in during one pass of a loop go into one group commit: each
    lease's end after its records, a lost lease's writes refused alone, a record after its lease's end refused."""
    a, b = postgres_storage(), postgres_storage()
    for run_id in ("e1", "e2", "e3"):
        a.create(run_id, header(run_id))
    one, two, three = a.claim("e1", "me", 0.2), a.claim("e2", "me", 3600), a.claim("e3", "me", 3600)
    assert one is not None and two is not None and three is not None
    wait_until(lambda: not a.held("e1"))
    assert b.claim("e1", "other", 3600) is not None  # another machine took e1 over

    async def hand_in() -> list[Any]:
        futures = [a.append_soon(lease, line(t="step", i=0)) for lease in (one, two, three)]
        futures += a.finish_soon([one, two])
        futures.append(a.append_soon(two, line(t="step", i=1)))  # after its lease ended
        futures.append(a.append_soon(three, line(t="step", i=1)))
        return await asyncio.gather(*futures, return_exceptions=True)

    outcomes = asyncio.run(hand_in())
    assert [type(o).__name__ for o in outcomes] == ["LeaseLostError", "NoneType", "NoneType", "LeaseLostError",
                                                    "NoneType", "LeaseLostError", "NoneType"]
    assert kinds(a, "e1") == ["run", "claim", "claim"] and b.held("e1") and a.entry("e1") is not None
    assert kinds(a, "e2") == ["run", "claim", "step"] and not a.held("e2") and a.entry("e2") is None
    assert [r["i"] for r in a.read("e3").records[2:]] == [0, 1] and a.held("e3") and a.entry("e3") is not None


def test_a_step_leaves_the_catalogs_updated_time_alone_and_a_release_moves_it(postgres_storage: Any) -> None:
    """As on SQLite: the catalog's indexed `updated` moves at a claim, a park or end (the lease released) and a
    record that changes the run's state, not at each step (whose row update then touches no index)."""
    store = postgres_storage()
    store.create("u1", header("u1"))
    lease = store.claim("u1", "me", 3600)
    assert lease is not None
    claimed = store.info("u1").updated_at
    time.sleep(0.01)
    store.append(lease, line(t="step", i=0))
    info = store.info("u1")
    assert info.updated_at == claimed and info.last["t"] == "step"  # the last record is current all the same
    time.sleep(0.01)
    store.release(lease)
    assert store.info("u1").updated_at > claimed


def test_a_worker_claims_ahead_on_postgres_and_a_stop_lets_those_runs_go(postgres_storage: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """While its slots are busy, a worker on PostgreSQL claims the next runs on a thread; stopped, it releases the
    runs it claimed ahead (due again at once), and another worker finishes every run once."""
    store = postgres_storage()

    async def plus(i: int) -> int:
        return i + 1

    @workflow
    async def gc_quick(ctx: Any, n: int) -> int:
        return await ctx.step(plus, await ctx.step(plus, n))

    claims_on: list[str] = []
    claim_due = store.claim_due

    def spied(*args: Any, **kwargs: Any) -> Any:
        claims_on.append(threading.current_thread().name)
        return claim_due(*args, **kwargs)

    monkeypatch.setattr(store, "claim_due", spied)
    engine = create_engine(store, concurrency=2)
    handles = asyncio.run(engine.enqueue_many([(gc_quick, i, f"ahead-{i}") for i in range(80)]))

    async def part_way() -> None:
        await engine.start(poll=0.02)
        deadline = time.monotonic() + 60
        while sum(1 for h in handles if (i := store.info(h.run_id)) is not None and i.ended) < 30:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await engine.stop()

    asyncio.run(part_way())
    assert any(name != threading.main_thread().name for name in claims_on)  # some claims were made ahead
    now = time.time()
    for h in handles:
        assert not store.held(h.run_id)  # nothing left claimed by the stopped worker
        info, entry = store.info(h.run_id), store.entry(h.run_id)
        assert info is not None and (info.ended or (entry is not None and entry.at is not None and entry.at <= now))
    other = create_engine(postgres_storage(), concurrency=3)
    asyncio.run(other.drain())
    for i, h in enumerate(handles):
        records = records_of(store, h.run_id)
        assert [r["t"] for r in records].count("ok") == 2 and records[-1]["result"] == i + 2


def test_runs_claimed_ahead_behind_a_long_run_are_let_go_within_a_second(postgres_storage: Any,
                                                                          tmp_path: Path) -> None:
    """Runs claimed ahead wait for a slot a second at most: behind a run that holds the only slot for long, they
    are released, due again for any worker, instead of held unrenewed; afterwards every run ends once."""
    store = postgres_storage()
    gate = tmp_path / "go"

    async def quick(i: int) -> int:
        return i

    async def hold(i: int) -> int:
        while not gate.exists():
            await asyncio.sleep(0.02)
        return i

    @workflow
    async def gc_mixed(ctx: Any, n: int) -> int:
        return await ctx.step(hold if n == 20 else quick, n)

    engine = create_engine(store, concurrency=1)
    handles = asyncio.run(engine.enqueue_many([(gc_mixed, i, f"mixed-{i}") for i in range(40)]))
    slow = handles[20].run_id

    def held_behind_the_long_run() -> int | None:
        """How many other runs are held while the long run is, or None while it is not."""
        return sum(store.held(h.run_id) for h in handles if h.run_id != slow) if store.held(slow) else None

    async def main() -> None:
        await engine.start(poll=0.02)
        deadline = time.monotonic() + 60
        while not held_behind_the_long_run():  # it starts, with runs claimed ahead behind it
            assert time.monotonic() < deadline, "no run was claimed ahead behind the long one"
            await asyncio.sleep(0.01)
        while held_behind_the_long_run() != 0:  # and they are let go while it holds the only slot
            assert time.monotonic() < deadline, "the runs claimed ahead were not let go"
            await asyncio.sleep(0.05)
        gate.write_text("")
        await engine.drain()
        await engine.stop()

    asyncio.run(main())
    let_go = 0
    for i, h in enumerate(handles):
        records = records_of(store, h.run_id)
        assert [r["t"] for r in records].count("ok") == 1 and records[-1]["result"] == i
        let_go += [r["t"] for r in records].count("claim") > 1  # claimed ahead, released, claimed again
    assert let_go >= 1


def test_a_step_is_handed_back_only_once_its_record_is_durable(postgres_storage: Any) -> None:
    """Each step's `ok` is in the database (read on another connection) before the workflow gets its result."""
    store = postgres_storage()
    other = postgres_storage()
    seen: list[int] = []

    async def count(i: int) -> int:
        return i

    @workflow
    async def gc_checked(ctx: Any, n: int) -> int:
        for i in range(n):
            await ctx.step(count, i)
            seen.append(kinds(other, ctx.run_id).count("ok"))
        return n

    assert asyncio.run(create_engine(store).run(gc_checked, 5)) == 5
    assert seen == [1, 2, 3, 4, 5]


def _kill_workers(tmp_path: Path, request: pytest.FixtureRequest, runs: int, most: int) -> dict[str, int]:
    """Three `durably worker -c 8` processes drain `runs` three-step runs while one is SIGKILLed every 0.05-0.25 s
    (they spend most of their time waiting for group commits) and replaced, `most` times; then one worker
    finishes. Returns the figures, after checking every run."""
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS)
    ledger = tmp_path / "ledger.txt"
    env = {**os.environ, "JOBS_LEDGER": str(ledger), "PYTHONPATH": str(tmp_path)}
    store = request.getfixturevalue("postgres_storage")()
    dsn = dict(part.split("=", 1) for part in store.dsn.split())
    url = f"postgresql://{dsn['user']}@localhost/{dsn['dbname']}?host={dsn['host']}&schema={store.schema}"
    engine = create_engine(store)
    REGISTRY.pop("gc_three", None)
    load_script(jobs)
    args = [sys.executable, "-m", "durably_py.cli", "worker", "--storage", url, "--import", str(jobs), "-c", "8",
            "--lease", "2", "-q"]
    ids = [h.run_id for h in asyncio.run(engine.enqueue_many([(REGISTRY["gc_three"], n) for n in range(runs)]))]
    seen_ended: set[str] = set()

    def drained() -> bool:
        ended = {r.run_id for r in engine.storage.list_runs(state="completed")}
        seen_ended.update(ended)
        return len(ended) == len(ids)

    kills = drain_while_killing(lambda: subprocess.Popen(args, env=env, stderr=subprocess.DEVNULL), drained,
                                kills=most, pause=(0.05, 0.25), rng=random.Random(26), seconds=180)
    order = ledger.read_text().split()
    last_seen: dict[str, int] = {}
    for position, key in enumerate(order):
        last_seen[key] = position
    first_seen: dict[str, int] = {}
    for position, key in reversed(list(enumerate(order))):
        first_seen[key] = position
    doubles = again_after_next = 0
    for n, run_id in enumerate(ids):
        records = records_of(engine.storage, run_id)
        assert records[-1]["t"] == "end" and records[-1]["status"] == "completed", (run_id, records[-1])
        paths = [r["p"] for r in records if r["t"] == "ok"]
        doubles += (len(paths) - len(set(paths))) + sum(1 for r in records if r["t"] == "end") - 1
        for k in range(2):  # a step whose next step started was recorded: it never ran again after that
            if f"{n}.{k + 1}" in first_seen and last_seen[f"{n}.{k}"] > first_seen[f"{n}.{k + 1}"]:
                again_after_next += 1
    lost = len(seen_ended - {r.run_id for r in engine.storage.list_runs(state="completed")})
    figures = {"runs": runs, "kills": kills, "executions": len(order), "steps": 3 * runs, "doubles": doubles,
               "ran again after the next step": again_after_next, "ended then lost": lost}
    print("\n  postgres group commits, workers SIGKILLed: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    assert doubles == 0 and again_after_next == 0 and lost == 0
    assert engine.storage.due(10) == []
    return figures


def test_workers_killed_during_group_commits_on_postgres_lose_no_run_and_record_no_step_twice(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    figures = _kill_workers(tmp_path, request, runs=400, most=8)
    assert figures["kills"] >= 4


@pytest.mark.slow
def test_many_workers_killed_during_group_commits_on_postgres_lose_no_run_and_record_no_step_twice(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    figures = _kill_workers(tmp_path, request, runs=3000, most=40)
    assert figures["kills"] >= 20
