"""replay="unsafe": only an attempt that started and never finished is reported as interrupted."""

import asyncio

import pytest

from durably_py import FakeClock, MemoryStorage, Retry, StepInterruptedError, create_engine, workflow


def test_an_interruption_during_the_backoff_after_a_failed_attempt_runs_the_next_attempt() -> None:
    calls: list[int] = []

    def charge():
        calls.append(len(calls) + 1)
        if len(calls) == 1:
            raise ConnectionError("gateway down")
        return "charged"

    @workflow
    async def pay(ctx):
        try:
            return await ctx.step(charge, replay="unsafe", on_interrupt="raise",
                                  retry=Retry(3, backoff="linear", base=60))
        except StepInterruptedError:
            return "interrupted"

    clock = FakeClock(auto=False)
    engine = create_engine(MemoryStorage(), clock=clock)

    async def die_in_backoff():
        task = asyncio.ensure_future(engine.run(pay))
        while not calls:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # attempt 1 failed and is waiting out its 60 s backoff
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(die_in_backoff())
    clock.advance(61)
    assert asyncio.run(engine.run(pay)) == "charged"
    assert calls == [1, 2]


def test_an_interruption_inside_the_attempt_is_reported_once() -> None:
    calls: list[str] = []

    async def charge():
        calls.append("charge")
        await asyncio.sleep(10)
        return "charged"

    @workflow
    async def pay(ctx):
        try:
            return await ctx.step(charge, replay="unsafe", on_interrupt="raise")
        except StepInterruptedError as exc:
            return f"reconcile {exc.operation_id}"

    engine = create_engine(MemoryStorage())

    async def die_inside():
        task = asyncio.ensure_future(engine.run(pay))
        while not calls:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(die_inside())
    result = asyncio.run(engine.run(pay))
    assert result.startswith("reconcile ") and result.endswith("/0")
    assert calls == ["charge"]
