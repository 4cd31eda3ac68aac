"""Shared resources and concurrency keys: limits that hold across every run of one engine."""

import asyncio
import time

import pytest

from durably_py import (
    Breaker,
    CircuitOpenError,
    MemoryStorage,
    RateLimit,
    Retry,
    ValidationError,
    create_engine,
    resource,
    workflow,
)


class Probe:
    """Counts how many calls overlap."""

    def __init__(self) -> None:
        self.active = 0
        self.peak = 0
        self.calls = 0

    async def __call__(self, i: int) -> int:
        self.calls += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(0.01)
        self.active -= 1
        return i


def test_resource_concurrency_holds_across_runs() -> None:
    probe = Probe()
    engine = create_engine(MemoryStorage(), resources=[resource("api", concurrency=2)])

    @workflow
    async def fan(ctx, n):
        results = await ctx.parallel([ctx.step(probe, i, name="call", uses="api") for i in range(n)])
        return [r.value for r in results]

    async def main():
        return await asyncio.gather(engine.run(fan, 5), engine.run(fan, 6))

    first, second = asyncio.run(main())
    assert first == list(range(5)) and second == list(range(6))
    assert probe.calls == 11
    assert probe.peak == 2


def test_concurrency_key_caps_steps_across_runs() -> None:
    probe = Probe()
    engine = create_engine(MemoryStorage())

    @workflow
    async def fan(ctx, n):
        await ctx.parallel([ctx.step(probe, i, concurrency_key="host", concurrency_limit=3) for i in range(n)])

    async def main():
        await asyncio.gather(engine.run(fan, 4), engine.run(fan, 5))

    asyncio.run(main())
    assert probe.calls == 9
    assert probe.peak == 3


def test_rate_limit_spaces_attempts() -> None:
    starts: list[float] = []
    engine = create_engine(MemoryStorage(), resources=[resource("slow", rate_limit=RateLimit(2, 0.2))])

    async def call(i):
        starts.append(time.monotonic())
        return i

    @workflow
    async def wf(ctx):
        await ctx.parallel([ctx.step(call, i, uses="slow") for i in range(5)])

    asyncio.run(engine.run(wf))
    assert len(starts) == 5
    # at most two starts in any 0.2 s window
    for i in range(len(starts) - 2):
        assert starts[i + 2] - starts[i] >= 0.19


def test_breaker_opens_and_fails_fast_with_a_retryable_error() -> None:
    calls = {"n": 0}
    engine = create_engine(
        MemoryStorage(), resources=[resource("flaky", breaker=Breaker(0.5, window=10, cooldown=60, min_calls=2))]
    )

    def broken():
        calls["n"] += 1
        raise ConnectionError("down")

    @workflow
    async def wf(ctx):
        results = []
        for i in range(4):
            try:
                await ctx.step(broken, name=f"call {i}", uses="flaky")
            except Exception as exc:  # noqa: BLE001
                results.append(type(exc).__name__)
        return results

    assert asyncio.run(engine.run(wf)) == ["ConnectionError", "ConnectionError", "CircuitOpenError", "CircuitOpenError"]
    assert calls["n"] == 2


def test_open_breaker_error_is_retried() -> None:
    engine = create_engine(
        MemoryStorage(), resources=[resource("api", breaker=Breaker(1.0, window=10, cooldown=0.05, min_calls=1))]
    )
    calls = {"n": 0}

    def sometimes():
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("blip")
        return "ok"

    @workflow
    async def wf(ctx):
        return await ctx.step(sometimes, uses="api", retry=Retry(5, backoff="linear", base=0.03))

    assert asyncio.run(engine.run(wf)) == "ok"
    assert calls["n"] == 2


def test_unknown_resource_is_a_validation_error() -> None:
    engine = create_engine(MemoryStorage())

    @workflow
    async def wf(ctx):
        return await ctx.step(lambda: 1, uses="nope")

    with pytest.raises(ValidationError) as info:
        asyncio.run(engine.run(wf))
    assert "nope" in str(info.value) and info.value.hint


@pytest.mark.parametrize(
    "make",
    [
        lambda: RateLimit(0, 1),
        lambda: RateLimit(1, -1),
        lambda: Breaker(0, 1, 1),
        lambda: Breaker(1.5, 1, 1),
        lambda: resource(""),
        lambda: resource("x", concurrency=0),
        lambda: create_engine(MemoryStorage(), resources=["api"]),
    ],
)
def test_bad_resource_options(make) -> None:
    with pytest.raises(ValidationError) as info:
        make()
    assert info.value.hint and info.value.docs


def test_circuit_open_error_carries_hint() -> None:
    err = CircuitOpenError("x")
    assert err.hint and err.docs
