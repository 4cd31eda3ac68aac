"""The durable queue: enqueue records a pending run, workers (engine.start) run due work in priority order,
parked runs come back when due, a graceful stop keeps every step, statuses agree everywhere."""

import asyncio
import re
import time

import pytest

from durably_py import (
    FileStorage,
    KeyConflictError,
    MemoryStorage,
    SqliteStorage,
    ValidationError,
    create_engine,
    workflow,
)
from durably_py._ids import new_run_id

order: list[str] = []
calls: dict[str, int] = {}


async def note(name: str) -> str:
    order.append(name)
    calls[name] = calls.get(name, 0) + 1
    await asyncio.sleep(0.02)
    return name


@workflow
async def job(ctx, name):
    return await ctx.step(note, name)


@workflow
async def napper(ctx, name):
    first = await ctx.step(note, f"{name}:before")
    await ctx.sleep(0.3)
    return [first, await ctx.step(note, f"{name}:after")]


@workflow
async def asker(ctx, name):
    await ctx.step(note, f"{name}:asked")
    answer = await ctx.wait_for("answer", timeout=60)
    return await ctx.step(note, f"{name}:{answer}")


def storages(tmp_path):
    return {"file": FileStorage(tmp_path / "state"), "sqlite": SqliteStorage(tmp_path / "q.db"),
            "memory": MemoryStorage()}


@pytest.fixture(params=["file", "sqlite", "memory"])
def storage(request, tmp_path):
    return storages(tmp_path)[request.param]


def test_enqueue_records_a_pending_run_and_runs_nothing_by_itself(tmp_path) -> None:
    order.clear()
    engine = create_engine(FileStorage(tmp_path / "state"))

    async def main():
        handle = await engine.enqueue(job, "parked-in-queue")
        await asyncio.sleep(0.2)
        return handle

    handle = asyncio.run(main())
    assert order == []
    other = create_engine(FileStorage(tmp_path / "state"))  # another process's view of the same dir
    [state] = asyncio.run(other.list())
    assert (state.run_id, state.status) == (handle.run_id, "pending")
    assert asyncio.run(other.inspect(handle.run_id)).status == "pending"
    entry = other.storage.entry(handle.run_id)
    assert entry is not None and entry.at <= time.time()
    assert asyncio.run(other.join(handle)) == "parked-in-queue"  # no worker here: join runs it in place
    assert asyncio.run(other.inspect(handle.run_id)).status == "completed"
    assert other.storage.entry(handle.run_id) is None


def test_a_started_engine_runs_due_work_by_priority_then_age(storage) -> None:
    order.clear()
    engine = create_engine(storage, concurrency=1)

    async def main():
        handles = [await engine.enqueue(job, "first", priority=9)]
        handles.append(await engine.enqueue(job, "low", priority=-5))
        handles.append(await engine.enqueue(job, "mid-old"))
        handles.append(await engine.enqueue(job, "mid-new"))
        handles.append(await engine.enqueue(job, "high", priority=5))
        await engine.start()
        values = [await engine.join(h) for h in handles]
        await engine.stop()
        return values

    assert asyncio.run(main()) == ["first", "low", "mid-old", "mid-new", "high"]
    assert order == ["first", "high", "mid-old", "mid-new", "low"]


def test_delay_makes_a_run_due_later(storage) -> None:
    order.clear()
    engine = create_engine(storage, concurrency=2)

    async def main():
        started = time.monotonic()
        later = await engine.enqueue(job, "later", delay=1.5)
        now = await engine.enqueue(job, "now")
        await engine.start()
        assert await engine.join(now) == "now"
        assert await engine.join(later) == "later"
        await engine.stop()
        return time.monotonic() - started

    assert asyncio.run(main()) >= 1.5
    assert order == ["now", "later"]


def test_enqueue_follows_the_identity_rules_and_join_raises_the_error(tmp_path) -> None:
    def boom(x):
        raise ValueError(f"bad {x}")

    @workflow
    async def failing(ctx, x):
        return await ctx.step(boom, x)

    engine = create_engine(FileStorage(tmp_path))

    async def main():
        a = await engine.enqueue(job, "same", key="k1")
        b = await engine.enqueue(job, "same", key="k1")
        assert a.run_id == b.run_id
        with pytest.raises(KeyConflictError):
            await engine.enqueue(job, "other", key="k1")
        bad = await engine.enqueue(failing, 3)
        await engine.drain()
        with pytest.raises(ValueError, match="bad 3"):
            await engine.join(bad)
        return a, bad

    handle, bad = asyncio.run(main())
    assert asyncio.run(engine.inspect("k1")).status == "completed"
    assert asyncio.run(engine.inspect(handle.run_id)).result == "same"
    assert asyncio.run(engine.inspect(bad.run_id)).status == "failed"
    assert engine.storage.entry(bad.run_id) is None and engine.storage.due(10) == []


def test_parked_runs_come_back_when_due_and_a_signal_wakes_a_wait(storage) -> None:
    order.clear()
    calls.clear()
    engine = create_engine(storage, concurrency=4)
    outside = create_engine(storage)

    async def main():
        nap = await engine.enqueue(napper, "n")
        ask = await engine.enqueue(asker, "a")
        await engine.start(poll=0.05)
        while (await engine.inspect(ask.run_id)).status != "waiting":
            await asyncio.sleep(0.02)
        # a parked run holds no slot and no lease: the lease goes just after the park record is written
        for _ in range(250):
            if not engine.storage.held(ask.run_id):
                break
            await asyncio.sleep(0.02)
        assert not engine.storage.held(ask.run_id)
        assert engine.storage.due(10) == []
        await outside.signal(ask.run_id, "answer", "yes")
        values = [await engine.join(nap), await engine.join(ask)]
        await engine.stop()
        return values

    assert asyncio.run(main()) == [["n:before", "n:after"], "a:yes"]
    assert all(count == 1 for count in calls.values()), calls


def test_stop_is_graceful_and_another_worker_finishes_the_runs(tmp_path) -> None:
    calls.clear()

    @workflow
    async def steps(ctx, name):
        out = []
        for i in range(6):
            out.append(await ctx.step(note, f"{name}.{i}"))
        return out

    first = create_engine(FileStorage(tmp_path), concurrency=2)
    second = create_engine(FileStorage(tmp_path), concurrency=2)

    async def main():
        handles = [await first.enqueue(steps, n) for n in ("a", "b")]
        await first.start(poll=0.02)
        while sum(calls.values()) < 3:
            await asyncio.sleep(0.005)
        stopped = await first.stop()
        assert sorted(stopped) == sorted(h.run_id for h in handles)
        for h in handles:
            assert not first.storage.held(h.run_id)
            assert (await first.inspect(h.run_id)).status == "interrupted"
        assert sorted(first.storage.due(10)) == sorted(h.run_id for h in handles)
        await second.start(poll=0.02)
        values = [await second.join(h) for h in handles]
        await second.stop()
        return values

    assert asyncio.run(main()) == [[f"{n}.{i}" for i in range(6)] for n in ("a", "b")]
    assert all(count == 1 for count in calls.values()), calls


def test_list_and_inspect_agree_on_a_reparked_run(tmp_path) -> None:
    engine = create_engine(FileStorage(tmp_path))

    @workflow
    async def long_nap(ctx, x):
        await ctx.sleep(3600)
        return x

    async def main():
        for _ in range(2):  # the second run re-parks without writing a new wake record
            with pytest.raises(Exception, match="sleeping"):
                await engine.run(long_nap, 1, wait=False)
        [listed] = await engine.list()
        return listed.status, (await engine.inspect(listed.run_id)).status, listed.run_id

    listed, inspected, run_id = asyncio.run(main())
    assert listed == inspected == "sleeping"
    entry = engine.storage.entry(run_id)
    assert entry is not None and entry.at > time.time() + 3000


@pytest.mark.parametrize("kwargs", [{"priority": "high"}, {"priority": True}, {"delay": -1}, {"delay": "soon"},
                                    {"budget": {"euro": 1}}, {"key": ""}])
def test_bad_enqueue_arguments(kwargs) -> None:
    engine = create_engine(MemoryStorage())
    with pytest.raises(ValidationError) as info:
        asyncio.run(engine.enqueue(job, "x", **kwargs))
    assert info.value.hint


def test_run_ids_carry_80_random_bits_and_a_collision_is_loud(tmp_path) -> None:
    ids = [new_run_id("my wf") for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"my-wf-[0-9a-hjkmnp-tv-z]{16}", i) for i in ids)  # 16 x 5 = 80 bits
    storage = FileStorage(tmp_path)
    engine = create_engine(storage)
    asyncio.run(engine.run(job, "one"))
    [existing] = storage.list_runs()
    import durably_py._ids as engine_module

    real = engine_module.new_run_id
    engine_module.new_run_id = lambda name: existing.run_id
    try:
        with pytest.raises(ValidationError, match="already exists"):
            asyncio.run(engine.run(job, "two"))
    finally:
        engine_module.new_run_id = real
    assert asyncio.run(engine.inspect(existing.run_id)).result == "one"


def test_pause_resume_and_cancel_of_a_parked_run_keep_the_queue_true(tmp_path) -> None:
    order.clear()
    calls.clear()
    engine = create_engine(FileStorage(tmp_path), concurrency=2)

    async def main():
        nap = await engine.enqueue(napper, "p")
        doomed = await engine.enqueue(napper, "c")
        await engine.start(poll=0.05)
        while {(await engine.inspect(h.run_id)).status for h in (nap, doomed)} != {"sleeping"}:
            await asyncio.sleep(0.02)
        await engine.stop()
        assert (await engine.pause(nap.run_id)).status == "paused"
        assert engine.storage.entry(nap.run_id).at is None  # due only once resumed
        assert (await engine.cancel(doomed.run_id)).status == "cancelled"
        assert engine.storage.entry(doomed.run_id) is None  # an ended run leaves the queue
        await asyncio.sleep(0.4)  # past the sleep's wake time: still not due while paused
        assert engine.storage.due(10) == []
        await engine.resume(nap.run_id)
        assert engine.storage.due(10) == [nap.run_id]
        await engine.start(poll=0.05)
        value = await engine.join(nap)
        await engine.stop()
        return value

    assert asyncio.run(main()) == ["p:before", "p:after"]
    assert calls == {"p:before": 1, "c:before": 1, "p:after": 1}
