"""ctx.loop: reducer iterations with snapshots, so a resumed loop starts from its latest snapshot."""

import asyncio

import pytest
from helpers import Stop

from durably_py import (
    FileStorage,
    LoopLimitError,
    MemoryStorage,
    SerializationError,
    ValidationError,
    create_engine,
    workflow,
)


def make(stop_at=None, snapshot_every=None, max_iterations=None, log=None):
    calls = {"reducer": [], "step": []}
    state = {"stop_at": stop_at}

    def work(i):
        calls["step"].append(i)
        return i * 10

    @workflow
    async def summing(ctx, n):
        async def reducer(total, it):
            calls["reducer"].append(it.number)
            if it.number == state["stop_at"]:
                state["stop_at"] = None
                raise Stop()
            if it.number == n:
                return it.done(total)
            return total + await it.step(work, it.number, name="work")

        return await ctx.loop(0, reducer, snapshot_every=snapshot_every, max_iterations=max_iterations)

    return summing, calls


def run(engine, wf, *args, **kwargs):
    return asyncio.run(engine.run(wf, *args, **kwargs))


def test_loop_runs_to_done() -> None:
    wf, calls = make()
    assert run(create_engine(MemoryStorage()), wf, 5) == sum(i * 10 for i in range(5))
    assert calls["reducer"] == [0, 1, 2, 3, 4, 5]
    assert calls["step"] == [0, 1, 2, 3, 4]


def test_resume_starts_after_the_latest_snapshot() -> None:
    wf, calls = make(stop_at=6)
    engine = create_engine(MemoryStorage())
    with pytest.raises(Stop):
        run(engine, wf, 8)
    calls["reducer"].clear()
    assert run(engine, wf, 8) == sum(i * 10 for i in range(8))
    assert calls["reducer"] == [6, 7, 8]
    assert calls["step"] == [0, 1, 2, 3, 4, 5, 6, 7]


def test_iterations_after_a_sparse_snapshot_replay_their_steps() -> None:
    wf, calls = make(stop_at=5, snapshot_every=3)
    engine = create_engine(MemoryStorage())
    with pytest.raises(Stop):
        run(engine, wf, 7)
    calls["reducer"].clear()
    assert run(engine, wf, 7) == sum(i * 10 for i in range(7))
    assert calls["reducer"] == [3, 4, 5, 6, 7]
    assert calls["step"] == [0, 1, 2, 3, 4, 5, 6]


def test_a_finished_loop_replays_its_result_without_iterating() -> None:
    calls = {"n": 0}
    stop = {"on": True}

    @workflow
    async def wf(ctx):
        async def reducer(i, it):
            calls["n"] += 1
            return it.done(i) if i == 3 else i + 1

        value = await ctx.loop(0, reducer)
        if stop["on"]:
            stop["on"] = False
            raise Stop()
        return value

    engine = create_engine(MemoryStorage())
    with pytest.raises(Stop):
        run(engine, wf)
    assert calls["n"] == 4
    assert run(engine, wf) == 3
    assert calls["n"] == 4


def test_max_iterations_and_bad_options() -> None:
    wf, _ = make(max_iterations=3)
    with pytest.raises(LoopLimitError) as info:
        run(create_engine(MemoryStorage()), wf, 10)
    assert info.value.hint and "max_iterations=3" in str(info.value)

    @workflow
    async def bad(ctx):
        return await ctx.loop(0, lambda s, it: it.done(s), snapshot_every=0)

    with pytest.raises(ValidationError):
        run(create_engine(MemoryStorage()), bad)


def test_complete_from_a_reducer_ends_the_workflow() -> None:
    @workflow
    async def wf(ctx):
        await ctx.loop(0, lambda s, it: ctx.complete("early") if s == 2 else s + 1)
        return "late"

    assert run(create_engine(MemoryStorage()), wf) == "early"


def test_state_must_serialize() -> None:
    @workflow
    async def wf(ctx):
        return await ctx.loop(0, lambda s, it: {1, 2} if s == 2 else s + 1)

    with pytest.raises(SerializationError) as info:
        run(create_engine(MemoryStorage()), wf)
    assert "iteration 2" in info.value.path


def test_compaction_drops_iterations_a_snapshot_covers(tmp_path) -> None:
    wf, calls = make(stop_at=150)
    storage = FileStorage(tmp_path, compact_above_bytes=4096)
    engine = create_engine(storage)
    with pytest.raises(Stop):
        run(engine, wf, 160, advisories="silent")
    (log,) = tmp_path.glob("runs/*.jsonl")
    before = log.stat().st_size
    calls["reducer"].clear()
    assert run(engine, wf, 160, advisories="silent") == sum(i * 10 for i in range(160))
    assert calls["reducer"] == list(range(150, 161))
    assert len(calls["step"]) == 160
    assert log.stat().st_size < before


def test_heavy_snapshots_are_advised() -> None:
    seen = []

    @workflow
    async def wf(ctx):
        return await ctx.loop("", lambda s, it: it.done(len(s)) if it.number == 2 else "x" * 300_000)

    assert run(create_engine(MemoryStorage()), wf, advisories="silent", on_advisory=seen.append) == 300_000
    assert [a.code for a in seen] == ["SNAPSHOT_HEAVY"]


def stopped_loop_log(tmp_path, iterations, **storage_options):
    """The log of a loop (one step per iteration, snapshot every 10) stopped like a killed process."""
    wf, calls = make(stop_at=iterations, snapshot_every=10)
    engine = create_engine(FileStorage(tmp_path, **storage_options))
    with pytest.raises(Stop):
        run(engine, wf, iterations + 100, advisories="silent")
    (log,) = tmp_path.glob("runs/*.jsonl")
    return engine, wf, calls, log


def test_a_long_loop_keeps_its_log_bounded_while_it_runs(tmp_path) -> None:
    engine, wf, calls, log = stopped_loop_log(tmp_path / "long", 4000)
    _, _, _, short = stopped_loop_log(tmp_path / "short", 1500)
    # whatever the 1 MiB threshold, snapshotted iterations are compacted away as the loop goes
    assert log.stat().st_size < 2 * 64 * 1024 and short.stat().st_size < 2 * 64 * 1024
    calls["reducer"].clear()
    calls["step"].clear()
    assert run(engine, wf, 4100, advisories="silent") == sum(i * 10 for i in range(4100))
    assert calls["reducer"] == list(range(4000, 4101))  # resumed from the snapshot of iteration 3999
    assert calls["step"] == list(range(4000, 4100))


def test_no_compaction_while_the_loop_runs_when_the_storage_does_not_compact(tmp_path) -> None:
    _, _, _, log = stopped_loop_log(tmp_path, 1500, compact_above_bytes=None)
    assert sum(1 for line in log.read_text().splitlines() if '"t":"ok"' in line) == 1500


def test_compensations_of_compacted_iterations_still_run_when_the_workflow_fails() -> None:
    undone = []

    def charge(i):
        return i

    @workflow
    async def loop_saga(ctx):
        async def turn(total, it):
            if it.number == 1500:
                raise RuntimeError("boom")
            return total + await it.step(charge, it.number, compensate=undone.append)

        return await ctx.loop(0, turn, snapshot_every=10)

    storage = MemoryStorage()
    storage.compact_above_bytes = 1 << 20
    with pytest.raises(RuntimeError):
        run(create_engine(storage), loop_saga, advisories="silent")
    assert undone == list(range(1499, -1, -1))
