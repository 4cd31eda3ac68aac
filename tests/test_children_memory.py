"""What a parent keeps per child: its handle and its result, not its spawn and join records (the log keeps
those), whatever its storage; and the log, compacted or killed mid-way, still holds every one of them."""

import asyncio
import random
import subprocess
import sys

import pytest
from helpers import FAN_OUT, Stop, fan_out_sum

from durably_py import (
    FileStorage,
    MemoryStorage,
    RunCancelledError,
    SqliteStorage,
    create_engine,
    is_ok,
    workflow,
)
from durably_py._replay import children as _kernel

done: list[int] = []


def mark(n: int) -> int:
    done.append(n)
    return n


@workflow
async def kid(ctx, n):
    return await ctx.step(mark, n)


def per_child_records(kernel) -> list[str]:
    return [p for p, r in kernel.history.done.items() if r.label in ("ctx.spawn", "ctx.join")]


@workflow
async def wide(ctx, count):
    handles = await ctx.spawn_all([(kid, n) for n in range(count)])
    spawned = per_child_records(ctx._kernel)
    results = await ctx.join_all(handles)
    return {"sum": sum(r.value for r in results), "after spawn": spawned, "after join": per_child_records(ctx._kernel)}


def test_a_parent_keeps_no_spawn_or_join_record_per_child_in_memory(tmp_path) -> None:
    """The parent forgets each child's spawn and join records once written, and once replayed; the log has
    them all, so a rerun of the ended parent answers from them."""
    done.clear()
    engine = create_engine(SqliteStorage(tmp_path / "runs.db"))
    out = asyncio.run(engine.run(wide, 300, key="wide"))
    assert out == {"sum": sum(range(300)), "after spawn": [], "after join": []}
    assert sorted(done) == list(range(300))
    log = asyncio.run(engine.records("wide"))
    assert [r.get("l") for r in log].count("ctx.spawn") == 300
    assert [r.get("l") for r in log].count("ctx.join") == 300


def test_a_resumed_parent_forgets_the_records_it_replays(tmp_path) -> None:
    done.clear()
    state = {"stop": True}

    @workflow
    async def resumed(ctx, count):
        handles = await ctx.spawn_all([(kid, n) for n in range(count)])
        results = await ctx.join_all(handles)
        if state["stop"]:
            state["stop"] = False
            raise Stop()
        return [sum(r.value for r in results), per_child_records(ctx._kernel)]

    engine = create_engine(SqliteStorage(tmp_path / "runs.db"))
    with pytest.raises(Stop):
        asyncio.run(engine.run(resumed, 40, key="resumed"))
    assert asyncio.run(engine.run(resumed, 40, key="resumed")) == [sum(range(40)), []]
    assert sorted(done) == list(range(40))  # replayed: no child ran twice


def test_a_loop_compaction_after_a_wide_join_keeps_every_spawn_and_join(tmp_path) -> None:
    """Compaction rewrites the log from the run's history; the forgotten spawn and join records are read back
    from the log first, so the rewritten log still names every child and its result."""
    done.clear()
    state = {"stop": 700}

    def work(i: int) -> int:
        return i

    @workflow
    async def then_loop(ctx, count):
        handles = await ctx.spawn_all([(kid, n) for n in range(count)])
        total = sum(r.value for r in await ctx.join_all(handles))

        async def reducer(acc, it):
            if it.number == state["stop"]:
                state["stop"] = None
                raise Stop()
            if it.number == 800:
                return it.done(acc)
            return acc + await it.step(work, it.number, name="work")

        return [total, await ctx.loop(0, reducer, snapshot_every=10)]

    engine = create_engine(FileStorage(tmp_path, compact_above_bytes=4096))
    with pytest.raises(Stop):
        asyncio.run(engine.run(then_loop, 60, key="loop", advisories="silent"))
    log = asyncio.run(engine.records("loop"))
    assert sum(1 for r in log if r.get("l") == "work") < 700  # compacted while the loop ran
    assert [r.get("l") for r in log].count("ctx.spawn") == 60
    assert [r.get("l") for r in log].count("ctx.join") == 60
    assert asyncio.run(engine.run(then_loop, 60, key="loop", advisories="silent")) == [sum(range(60)), sum(range(800))]
    assert sorted(done) == list(range(60))


KILL_SCRIPT = """
import asyncio, os, signal, sys
from durably_py import SqliteStorage, create_engine, workflow
from durably_py._engine import children as _children
from durably_py._replay import children as _kernel

_children.CREATE_BATCH = _kernel.SPAWN_BATCH = 5
state, effects, where, at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
storage = SqliteStorage(os.path.join(state, "runs.db"))
seen = {"create_bound": 0, "join": 0}
create_bound, append = storage.create_bound, storage.append


def created(runs):
    if where == "create_bound" and seen["create_bound"] == at:
        os.kill(os.getpid(), signal.SIGKILL)
    seen["create_bound"] += 1
    return create_bound(runs)


def appended(lease, data):
    if where == "join" and b'"ctx.join"' in data:
        if seen["join"] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        seen["join"] += 1
    return append(lease, data)


storage.create_bound, storage.append = created, appended

""" + FAN_OUT + """

print(asyncio.run(create_engine(storage, lease=2).run(mom, 23, key="mom")))
"""


@pytest.mark.parametrize(("where", "at"), [("create_bound", 2), ("join", 1)])
def test_a_parent_killed_in_a_wide_spawn_all_or_join_all_resumes_with_each_child_once(tmp_path, where, at) -> None:
    """SQLite, a spawn_all created and recorded 5 children at a time (a batch's spawn records one append):
    SIGKILL before its third batch is created (two batches created and recorded), or at the second append of
    join records (recorded in order; those of children ended by then go together). The resumed parent finds
    every child created before the kill, creates the others, runs each child once (a step cut off mid-way by
    the kill runs again), records one spawn and one join per child, and its result is right."""
    script = tmp_path / "mom.py"
    script.write_text(KILL_SCRIPT)
    state, effects = tmp_path / "state", tmp_path / "effects.txt"
    state.mkdir()
    killed = subprocess.run([sys.executable, str(script), str(state), str(effects), where, str(at)],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    resumed = subprocess.run([sys.executable, str(script), str(state), str(effects), "none", "0"],
                             capture_output=True, text=True, timeout=60)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip() == fan_out_sum(23)
    ran = [int(n) for n in effects.read_text().split()]
    if where == "create_bound":  # no child had started: each ran exactly once
        assert sorted(ran) == list(range(23))
    else:  # a child killed inside its step runs that step again (at most the 4 running at the kill)
        assert set(ran) == set(range(23)) and len(ran) - 23 <= 4
    engine = create_engine(SqliteStorage(state / "runs.db"))
    log = asyncio.run(engine.records("mom"))
    named = [r["v"]["run_id"] for r in log if r.get("l") == "ctx.spawn"]
    assert len(named) == len(set(named)) == 23
    assert [r.get("l") for r in log].count("ctx.join") == 23
    kids = [r.run_id for r in asyncio.run(engine.list()) if r.workflow == "kid"]
    assert sorted(kids) == sorted(named)


def test_spawned_children_wait_with_no_future_each(tmp_path) -> None:
    """A child waiting for its turn is a slot in its spawn's list of handles: right after a spawn_all of 2,000
    only the children started hold an outcome future, and a join_all holds those of `JOIN_AHEAD` at most."""
    done.clear()
    engine = create_engine(MemoryStorage(), concurrency=2)
    held: list[int] = []

    def note(n: int) -> int:
        held.append(len(engine.children.pool.outcomes))
        return mark(n)

    @workflow
    async def noted(ctx, n):
        return await ctx.step(note, n)

    @workflow
    async def wide_spawn(ctx, count):
        handles = await ctx.spawn_all([(noted, n) for n in range(count)])
        pool = engine.children.pool  # the pool of this run's event loop
        after_spawn = [len(pool.outcomes), len(pool.running), len(ctx._kernel.children)]
        results = await ctx.join_all(handles)
        return [sum(r.value for r in results), after_spawn]

    total, after_spawn = asyncio.run(engine.run(wide_spawn, 2_000, advisories="silent"))
    assert total == sum(range(2_000))
    assert sorted(done) == list(range(2_000))
    assert after_spawn[0] <= 2 and after_spawn[1] <= 2 and after_spawn[2] <= 3, after_spawn
    assert max(held) <= _kernel.JOIN_AHEAD + 2, max(held)
    pool = engine.children.pool
    assert not pool.outcomes and not pool.running and not pool.asked and not pool.queued


def test_a_child_joined_before_its_turn_starts_first_and_runs_once() -> None:
    """`ctx.join` of a child still waiting in its spawn's queue starts it next, ahead of its siblings; the
    spawn's queue passes over it when its turn comes."""
    done.clear()
    engine = create_engine(MemoryStorage(), concurrency=1)

    @workflow
    async def backwards(ctx, count):
        handles = await ctx.spawn_all([(kid, n) for n in range(count)])
        return [await ctx.join(h) for h in reversed(handles)]

    assert asyncio.run(engine.run(backwards, 30, advisories="silent")) == list(reversed(range(30)))
    assert done[:2] == [0, 29], done  # the first child was started by the spawn; the joined one went next
    assert sorted(done) == list(range(30))


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_a_join_all_in_another_order_than_spawned_joins_each_child_once(tmp_path, monkeypatch, order) -> None:
    """A join_all asks for `JOIN_AHEAD` children at a time in its own order; the spawn's queue runs the rest in
    spawn order meanwhile, and those that ended before the join came to them are read back from the store."""
    done.clear()
    monkeypatch.setattr(_kernel, "JOIN_AHEAD", 3)
    engine = create_engine(SqliteStorage(tmp_path / "runs.db"), concurrency=2)

    @workflow
    async def reordered(ctx, count):
        handles = await ctx.spawn_all([(kid, n) for n in range(count)])
        picked = list(reversed(handles)) if order == "reversed" else random.Random(7).sample(handles, len(handles))
        results = await ctx.join_all(picked)
        return [[h.run_id for h in picked], [r.value for r in results]]

    run_ids, values = asyncio.run(engine.run(reordered, 40, key="reordered", advisories="silent"))
    assert sorted(done) == list(range(40))
    by_id = {r.run_id: r.input for r in asyncio.run(engine.list()) if r.workflow.endswith("kid")}
    assert values == [by_id[run_id] for run_id in run_ids]


def test_a_parent_waits_at_its_end_for_spawned_children_it_never_joined(tmp_path) -> None:
    """Children still waiting for their turn when the workflow returns run before the parent ends."""
    done.clear()
    engine = create_engine(SqliteStorage(tmp_path / "runs.db"), concurrency=2)

    @workflow
    async def fire_and_forget(ctx, count):
        await ctx.spawn_all([(kid, n) for n in range(count)])
        await ctx.spawn(kid, count)
        return "parent done"

    assert asyncio.run(engine.run(fire_and_forget, 300, advisories="silent")) == "parent done"
    assert sorted(done) == list(range(301))
    assert {r.status for r in asyncio.run(engine.list())} == {"completed"}


def test_cancelling_a_parent_starts_none_of_its_waiting_children(tmp_path) -> None:
    """A cancelled parent's children that were still waiting for their turn never start in its process."""
    started: list[str] = []

    def begin(name: str) -> str:
        started.append(name)
        return name

    @workflow
    async def held(ctx, name):
        await ctx.step(begin, name)
        return await ctx.wait_for(f"go-{name}", timeout=3600)

    @workflow
    async def many(ctx):
        return await ctx.join_all(await ctx.spawn_all([(held, str(n)) for n in range(6)]))

    runner = create_engine(FileStorage(tmp_path), concurrency=2)
    operator = create_engine(FileStorage(tmp_path))

    async def scenario():
        parent = asyncio.ensure_future(runner.run(many))
        while len(started) < 2:
            await asyncio.sleep(0.02)
        parent_id = next(r.run_id for r in await operator.list() if r.workflow.endswith("many"))
        await operator.cancel(parent_id, timeout=10)
        with pytest.raises(RunCancelledError):
            await asyncio.wait_for(parent, 10)
        await asyncio.sleep(0.3)

    asyncio.run(scenario())
    assert sorted(started) == ["0", "1"]
    after = {r.input: r.status for r in asyncio.run(operator.list()) if r.workflow.endswith("held")}
    assert after == {str(n): "cancelled" for n in range(6)}, after


def test_rounds_of_spawn_all_and_join_all_leave_nothing_behind(tmp_path) -> None:
    """A parent that spawns and joins its children a round at a time holds nothing of a finished round: its
    spawn's place in the pool's queue, the outcomes and the children attached to it all go with the round; a
    join_all in spawn order takes each child out of its spawn's queue in turn (nothing noted per child), and
    no child is started twice."""
    engine = create_engine(SqliteStorage(tmp_path / "runs.db"), concurrency=3)
    left: list[tuple[int, int, int, int]] = []
    early: list[int] = []

    def noted(n: int) -> int:
        early.append(len(engine.children.pool.early))
        return n

    @workflow
    async def counted(ctx, n):
        return await ctx.step(noted, n)

    @workflow
    async def rounds(ctx, count):
        total = 0
        for first in range(0, count, 100):
            results = await ctx.join_all(await ctx.spawn_all([(counted, n) for n in range(first, first + 100)]))
            total += sum(r.value for r in results)
            pool = engine.children.pool
            left.append((len(pool.queued), len(pool.early), len(pool.outcomes), len(ctx._kernel.children)))
        return total

    assert asyncio.run(engine.run(rounds, 1_500, advisories="silent")) == sum(range(1_500))
    assert len(early) == 1_500 and max(early) == 0
    assert set(left) == {(0, 0, 0, 0)}, left
    kids = [r.run_id for r in asyncio.run(engine.list()) if r.workflow.endswith("counted")]
    claims = [sum(1 for rec in asyncio.run(engine.records(k)) if rec["t"] == "claim") for k in kids]
    assert len(kids) == 1_500 and set(claims) == {1}


OUT_OF_ORDER_SCRIPT = """
import asyncio, os, random, signal, sys, threading
from durably_py import SqliteStorage, create_engine, workflow
from durably_py._replay import children as _kernel

_kernel.JOIN_AHEAD = 3
state, effects, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
if seed:
    timer = threading.Timer(random.Random(seed).uniform(0.05, 0.4), lambda: os.kill(os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()

""" + FAN_OUT.replace("def mark", "async def mark").replace("    return n\n", "    await asyncio.sleep(0.01)\n    return n\n") + """

@workflow
async def picky(ctx, count):
    handles = await ctx.spawn_all([(kid, n) for n in range(count)])
    first = await ctx.join(handles[count // 2])
    rest = await ctx.join_all(list(reversed(handles)))
    return first + sum(r.value * (i + 1) for i, r in enumerate(rest))


print(asyncio.run(create_engine(SqliteStorage(os.path.join(state, "runs.db")), concurrency=3, lease=2).run(
    picky, 60, key="picky", advisories="silent")))
"""


@pytest.mark.parametrize("seed", [1, pytest.param(5, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow)])
def test_a_parent_joining_out_of_spawn_order_killed_at_random_resumes_with_each_child_once(tmp_path, seed) -> None:
    """A real parent process joins one child ahead of its turn, then all of them backwards, three at a time
    ahead of the one it records; SIGKILL at a random moment and a resume: every child is created once, its
    step runs once (or twice when the kill cut it off: at most the three running), and the result is right."""
    script = tmp_path / "picky.py"
    script.write_text(OUT_OF_ORDER_SCRIPT)
    state, effects = tmp_path / "state", tmp_path / "effects.txt"
    state.mkdir()
    effects.touch()
    expected = str(30 + sum(n * (60 - n) for n in range(60)))
    killed = subprocess.run([sys.executable, str(script), str(state), str(effects), str(seed)],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode in (-9, 0), killed.stderr
    if killed.returncode == -9:
        resumed = subprocess.run([sys.executable, str(script), str(state), str(effects), "0"],
                                 capture_output=True, text=True, timeout=60)
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.strip() == expected
    else:
        assert killed.stdout.strip() == expected
    ran = [int(n) for n in effects.read_text().split()]
    assert set(ran) == set(range(60)) and len(ran) - 60 <= 3, sorted(ran)
    engine = create_engine(SqliteStorage(state / "runs.db"))
    named = [r["v"]["run_id"] for r in asyncio.run(engine.records("picky")) if r.get("l") == "ctx.spawn"]
    kids = [r for r in asyncio.run(engine.list()) if r.workflow == "kid"]
    assert len(set(named)) == 60 and sorted(k.run_id for k in kids) == sorted(named)
    assert {k.status for k in kids} == {"completed"}


def test_a_retry_resumes_each_failed_child_once_even_when_it_ended_before_its_join(tmp_path) -> None:
    """Retrying a failed parent resumes its failed children at their failed step once: a child that failed
    again while the parent was busy before its join is not resumed a second time by that join."""
    attempts: list[int] = []
    state = {"parent fails": True}

    def flaky(n: int) -> int:
        attempts.append(n)
        raise ValueError(f"child {n} fails")

    async def busy() -> str:
        await asyncio.sleep(0.3)  # the children run, and fail, meanwhile
        if state["parent fails"]:
            raise RuntimeError("the parent fails before its join")
        return "busy"

    @workflow
    async def failing_kid(ctx, n):
        return await ctx.step(flaky, n)

    @workflow
    async def busy_parent(ctx, count):
        handles = await ctx.spawn_all([(failing_kid, n) for n in range(count)])
        await ctx.step(busy)
        return [is_ok(r) for r in await ctx.join_all(handles)]

    engine = create_engine(SqliteStorage(tmp_path / "runs.db"), concurrency=2)
    with pytest.raises(RuntimeError, match="before its join"):
        asyncio.run(engine.run(busy_parent, 3, key="busy", advisories="silent"))
    assert sorted(attempts) == [0, 1, 2]
    state["parent fails"] = False
    assert asyncio.run(engine.run(busy_parent, 3, key="busy", advisories="silent")) == [False, False, False]
    assert sorted(attempts) == [0, 0, 1, 1, 2, 2]  # one resume of each failed child in the retry
