"""The clock rule: deadlines are recorded wall-clock instants, waited out on the monotonic clock."""

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest

from durably_py import Clock, FakeClock, MemoryStorage, WaitTimeoutError, create_engine, workflow


class JumpyClock(Clock):
    """The real clock whose wall time an operator (or NTP) can set while runs wait."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.offset)


@workflow
async def waits_for_answer(ctx, seconds):
    try:
        return await ctx.wait_for("answer", timeout=seconds)
    except WaitTimeoutError:
        return "timed out"


@workflow
async def naps(ctx, seconds):
    await ctx.sleep(seconds)
    return "woke"


async def timed(engine, wf, seconds, jump):
    async def operator():
        await asyncio.sleep(0.15)
        engine.clock.offset += jump

    started = time.monotonic()
    result, _ = await asyncio.gather(asyncio.wait_for(engine.run(wf, seconds, fresh=True), 5), operator())
    return result, time.monotonic() - started


@pytest.mark.parametrize("wf, expected", [(waits_for_answer, "timed out"), (naps, "woke")])
@pytest.mark.parametrize("jump", [3600.0, -3600.0])
def test_a_wall_clock_jump_ends_no_wait_early_or_late(wf, expected, jump) -> None:
    engine = create_engine(MemoryStorage(), clock=JumpyClock())
    result, elapsed = asyncio.run(timed(engine, wf, 0.8, jump))
    assert result == expected
    assert 0.75 <= elapsed < 4.0, elapsed  # a jump back would make it an hour late


def test_the_recorded_deadline_is_a_wall_clock_instant() -> None:
    clock = JumpyClock()
    engine = create_engine(MemoryStorage(), clock=clock)
    before = datetime.now(UTC)

    async def go():
        return await engine.run(waits_for_answer, 30, wait=False)

    with pytest.raises(Exception, match="waiting"):
        asyncio.run(go())
    run = asyncio.run(engine.list())[0]
    wait = next(r for r in engine.storage.read(run.run_id).records if r["t"] == "wait")
    recorded = datetime.fromisoformat(wait["deadline"])
    assert timedelta(seconds=29) < recorded - before < timedelta(seconds=32)
    clock.offset = 31  # the wall clock passed the instant while no process waited: the next resume times out
    assert asyncio.run(engine.run(waits_for_answer, 30)) == "timed out"


def test_fake_clock_jump_moves_wall_time_but_wakes_nothing() -> None:
    clock = FakeClock(auto=False)
    engine = create_engine(MemoryStorage(), clock=clock)

    async def go():
        task = asyncio.ensure_future(engine.run(waits_for_answer, 60))
        sleeper = asyncio.ensure_future(engine.run(naps, 60))
        await asyncio.sleep(0.05)
        clock.jump(7200)
        await asyncio.sleep(0.4)
        assert not task.done() and not sleeper.done()
        clock.jump(-9000)
        clock.advance(59)
        await asyncio.sleep(0.4)
        assert not task.done() and not sleeper.done()
        clock.advance(1.5)
        return await asyncio.wait_for(asyncio.gather(task, sleeper), 5)

    assert asyncio.run(go()) == ["timed out", "woke"]
    assert clock.monotonic() == 60.5
