"""The engine's background queue: enqueue, priority, delay, concurrency, join, drain, stop."""

import asyncio
import time

import pytest

from durably_py import FileStorage, MemoryStorage, ValidationError, create_engine, workflow

order: list[str] = []


async def note(name: str) -> str:
    order.append(name)
    await asyncio.sleep(0.02)
    return name


@workflow
async def job(ctx, name):
    return await ctx.step(note, name)


def test_priority_orders_pending_work_and_concurrency_caps_it() -> None:
    order.clear()
    engine = create_engine(MemoryStorage(), concurrency=1)

    async def main():
        first = await engine.enqueue(job, "first")
        while not order:  # the only worker has taken "first"; the next two wait in the queue
            await asyncio.sleep(0.001)
        low = await engine.enqueue(job, "low", priority=-5)
        high = await engine.enqueue(job, "high", priority=5)
        await engine.drain()
        return [await engine.join(h) for h in (first, low, high)]

    assert asyncio.run(main()) == ["first", "low", "high"]
    assert order == ["first", "high", "low"]


def test_delay_makes_a_run_eligible_later() -> None:
    order.clear()
    engine = create_engine(MemoryStorage(), concurrency=2)

    async def main():
        started = time.monotonic()
        later = await engine.enqueue(job, "later", delay=0.3)
        now = await engine.enqueue(job, "now")
        assert await engine.join(now) == "now"
        assert await engine.join(later) == "later"
        return time.monotonic() - started

    assert asyncio.run(main()) >= 0.3
    assert order == ["now", "later"]


def test_enqueue_uses_the_identity_rules_and_join_raises_the_error(tmp_path) -> None:
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
        bad = await engine.enqueue(failing, 3)
        await engine.drain()
        with pytest.raises(ValueError, match="bad 3"):
            await engine.join(bad)
        return a

    handle = asyncio.run(main())
    assert asyncio.run(engine.inspect("k1")).status == "completed"
    assert asyncio.run(engine.inspect(handle.run_id)).result == "same"


def test_stop_leaves_unstarted_runs_resumable(tmp_path) -> None:
    order.clear()
    engine = create_engine(FileStorage(tmp_path), concurrency=1)

    async def main():
        await engine.enqueue(job, "a")
        await engine.enqueue(job, "b", delay=30)
        await asyncio.sleep(0.1)
        return await engine.stop()

    stopped = asyncio.run(main())
    assert len(stopped) == 1
    assert asyncio.run(engine.inspect(stopped[0])).status == "interrupted"
    assert asyncio.run(engine.run(job, "b")) == "b"
    assert order == ["a", "b"]


@pytest.mark.parametrize("kwargs", [{"priority": "high"}, {"delay": -1}, {"budget": {"euro": 1}}, {"key": ""}])
def test_bad_enqueue_arguments(kwargs) -> None:
    engine = create_engine(MemoryStorage())
    with pytest.raises(ValidationError) as info:
        asyncio.run(engine.enqueue(job, "x", **kwargs))
    assert info.value.hint
