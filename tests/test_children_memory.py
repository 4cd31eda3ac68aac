"""What a parent keeps per child: its handle and its result, not its spawn and join records (the log keeps
those), whatever its storage; and the log, compacted or killed mid-way, still holds every one of them."""

import asyncio
import subprocess
import sys

import pytest
from helpers import FAN_OUT, Stop, fan_out_sum

from durably_py import FileStorage, SqliteStorage, create_engine, workflow

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
from durably_py import _children, _kernel

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
